"""XLA settings that protected computation is known to misbehave under: checked at import.

On an H200 (jax 0.11.2, 2026-12-01) the protected Llama-3 training step run with
``XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`` reported, for one injected GEMM
fault in 6 steps, 1129 detections, 128228 corrections and 44 million uncorrectable values, and
skipped 5 of its steps (benchmarks/results/2026-12-01-llama3-1dev-4layers-cmdbuf-while-*); the
unprotected steps were unaffected. With those command types XLA records loops and branches into
CUDA graphs (their predicates stay on the device). The cause is not known yet, so the library warns
rather than refusing.
"""

from __future__ import annotations

import os
import re
import warnings

__all__ = ["command_buffer_hazards", "warn_if_hazardous"]

_HAZARDS = ("WHILE", "CONDITIONAL")
_FLAG = re.compile(r"--xla_gpu_enable_command_buffer=(\S*)")


def command_buffer_hazards(xla_flags: str) -> tuple[str, ...]:
    """The command types of ``xla_flags`` (an ``XLA_FLAGS`` string) that protected GEMMs were seen
    to misbehave under, as its ``--xla_gpu_enable_command_buffer`` settings leave them enabled.

    Each setting, in order, either lists the types (``FUSION,WHILE``: exactly those) or changes the
    set so far (``+WHILE,-FUSION``); names are case-insensitive. XLA's defaults hold neither WHILE
    nor CONDITIONAL, so the set starts empty here.
    """
    enabled: set[str] = set()
    for value in _FLAG.findall(xla_flags):
        items = [i for i in value.split(",") if i]
        if not items or not all(i.startswith(("+", "-")) for i in items):
            enabled = set()  # a plain list replaces the set (an empty one: no command buffers)
        for item in items:
            name = item.lstrip("+-").upper()
            if item.startswith("-"):
                enabled.discard(name)
            else:
                enabled.add(name)
    return tuple(h for h in _HAZARDS if h in enabled)


def warn_if_hazardous(xla_flags: str | None = None) -> None:
    """Warn (RuntimeWarning) when ``xla_flags`` (default: the environment's XLA_FLAGS) enables a
    command type of :func:`command_buffer_hazards`."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    found = command_buffer_hazards(flags)
    if found:
        warnings.warn(
            f"pimlayers: XLA_FLAGS enables command buffers for {', '.join(found)} "
            "(--xla_gpu_enable_command_buffer). Under +WHILE,+CONDITIONAL protected GEMMs on an H200 "
            "reported false detections and changed training (pimlayers/_xla_flags.py); protected runs "
            "should leave these command types at XLA's defaults until the cause is found.",
            RuntimeWarning,
            stacklevel=3,
        )
