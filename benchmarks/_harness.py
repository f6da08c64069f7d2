"""Timing and result bookkeeping shared by the benchmark suites."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def time_fn(fn: Callable[..., Any], *args, warmup: int = 3, iters: int = 20, repeats: int = 5) -> float:
    """Median seconds per call of a jitted fn, over `repeats` batches of `iters` back-to-back calls.

    Calls are dispatched asynchronously and the batch is closed by block_until_ready, so per-call
    host overhead overlaps device work for kernels longer than a dispatch (tens of microseconds).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', 'unknown')}"


def write_result(suite: str, rows: list[dict[str, Any]], command: str) -> pathlib.Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    dev = device_name().replace(":", "-").replace(" ", "_")
    path = RESULTS / f"{now:%Y-%m-%d}-{suite}-{dev}.json"
    payload = {
        "suite": suite,
        "date": now.isoformat(timespec="seconds"),
        "device": device_name(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "command": command,
        "rows": rows,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def command_line() -> str:
    flags = os.environ.get("XLA_FLAGS", "")
    env = f"XLA_FLAGS={shlex.quote(flags.strip())} " if flags.strip() else ""
    return env + "python -m benchmarks.run " + " ".join(sys.argv[1:])
