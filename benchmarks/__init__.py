"""pimlayers benchmarks: `python -m benchmarks.run` (see docs/benchmarks.md)."""
