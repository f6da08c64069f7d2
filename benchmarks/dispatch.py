"""What a jitted call costs the host: a plain and a protected GEMM at a shape too small to matter.

At 8 x 128 -> 128 the GEMM's own work is a few microseconds, so a call's time is its dispatch: the
host flattening the arguments, launching the program and wrapping each output in an array. A
protected call returns its FaultReport besides the product; since 2026-12-04 the report is one
array (the counters on its last axis) rather than twelve. The ``twelve outputs`` row returns the
same report's counters as twelve separate arrays, the host's side of the layout before, so the
run measures what the change saved. ``us_per_call``: the median over ``repeats`` batches of
``calls`` back-to-back calls closed by one block_until_ready; ``vs_plain`` = that / the plain
GEMM's. On a CPU of two cores the dispatch runs on the cores the GEMM computes on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pimlayers import ops
from pimlayers.faults import FaultPolicy

from ._harness import time_fn


def run(m: int = 8, k: int = 128, n: int = 128, calls: int = 2000, repeats: int = 5) -> list[dict]:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / k**0.5
    pol = FaultPolicy(block_n=128)
    enc = ops.abft_encode(w, pol.block_n)
    protect = lambda a, b, e: ops.protected_matmul(a, b, e, policy=pol)
    fns = {
        "plain GEMM": jax.jit(lambda a, b, e: a @ b),
        "protected GEMM (product and report)": jax.jit(protect),
        "protected GEMM, product only": jax.jit(lambda a, b, e: protect(a, b, e)[0]),
        "protected GEMM, report as twelve outputs": jax.jit(
            lambda a, b, e: (lambda y, r: (y, *(r.counts[..., i] for i in range(len(r.FIELDS)))))(
                *protect(a, b, e)
            )
        ),
    }
    shape = f"{m}x{k}->{n} float32"
    times = {name: time_fn(fn, x, w, enc, warmup=1, iters=calls, repeats=repeats) for name, fn in fns.items()}
    plain = times["plain GEMM"]
    return [
        dict(op=name, shape=shape, calls=calls, us_per_call=t * 1e6, vs_plain=t / plain)
        for name, t in times.items()
    ]
