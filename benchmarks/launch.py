"""What one more kernel costs a step: chains of tiny dependent kernels in one jitted program.

On an H200 the protected 4-layer training step launched ~1720 kernels per step against the
unprotected step's ~640, and its step time exceeded its kernels' own time by 12.3 ms against 7.4
(profiles and the llama3 suite of 2026-12-04): kernels that do little may cost more between them
than inside them. Each chain here is ``n`` elementwise updates of a small array, each the next one's
input with an optimization barrier between them (XLA cannot fuse them into one kernel), optionally
with one of the project's native custom calls (``ops.gate``, one CUDA kernel) after every ``every``
of them: XLA records runs of its own kernels into CUDA graphs, and a custom call it cannot record
ends a graph.

``kernels`` are counted in a profiler trace of one call where there is a device timeline (on a CPU,
by construction: one per update and per native call); a native gate call is one kernel after a
memset of its count, and memsets are not counted as kernels (their time falls in the gaps). Per
kernel: ``wall_us`` (the program's wall time over its kernels: launch gaps and the host's
enqueueing included) and ``kernel_us`` (their own device time; NaN on a CPU), so ``gap_us`` = wall -
kernel is what a kernel costs beyond its work. ``per_call_us`` is the wall time per update (and
native call, where there is one): the chains' difference is what a native call adds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pimlayers import ops

from ._harness import time_fn
from .profile import kernel_events


def _chain(n: int, every: int):
    def f(x):
        for i in range(n):
            x = lax.optimization_barrier(x * jnp.float32(0.5) + jnp.float32(1.0))
            if every and (i + 1) % every == 0:
                x, _ = ops.gate(x)
        return x

    return jax.jit(f)


def run(n: int = 1000, size: int = 1024) -> list[dict]:
    """Chains of ``n`` XLA kernels on a float32 array of ``size`` values: alone, and with a native call
    after every 10th and after every one."""
    x = jnp.arange(size, dtype=jnp.float32)
    rows = []
    for every, what in ((0, "XLA fusions"), (10, "XLA fusions, a native call after every 10th"),
                        (1, "XLA fusions, a native call after each")):  # fmt: skip
        f = _chain(n, every)
        want = jnp.full_like(x, 2.0)  # x -> x/2 + 1 converges to 2 (exactly, within n = 1000 steps)
        got = f(x)
        if n >= 200 and not bool(jnp.all(got == want)):
            raise AssertionError(f"launch chain ({what}) computed {got[:4]}, expected 2.0")
        us, launched = kernel_events(f, x)
        kernels = sum(launched.values()) or n + (n // every if every else 0)
        wall = time_fn(f, x, iters=5)
        dev = sum(us.values()) / 1e6 or float("nan")
        rows.append(
            dict(
                chain=what,
                kernels=kernels,
                wall_ms=wall * 1e3,
                per_call_us=wall / n * 1e6,
                wall_us=wall / kernels * 1e6,
                kernel_us=dev / kernels * 1e6,
                gap_us=(wall - dev) / kernels * 1e6,
            )
        )
    return rows
