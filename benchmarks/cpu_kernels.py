"""The CPU handlers' vector kernels against each other, side by side in one process.

``PIMLAYERS_CPU_ISA`` caps the kernels a native CPU call runs ("generic": the portable kernels,
"avx2", "avx512"; csrc/cpu_isa.h) and is read on every call, so one process can alternate them.
Per shape and column block, in rounds (the order reversed every other round, so drift falls on all
alike), each timed over a batch of calls after a warm-up of all of them
(`benchmarks._harness.time_pair` says why it lasts 0.25 s):

- "fwd", "fwd+bwd" (the matmul suite's cases, ``matmul.pairs``): the plain XLA GEMM, then the
  protected GEMM under each cap. ``ratio_<cap>`` is the median over the rounds of plain /
  protected (the matmul suite's ``ratio``), ``<cap>_ms`` the median time.
- the native ops alone under each cap (``<cap>_ms``): "checks" (``abft_checks`` of x),
  "finish" (``abft_finish`` of the product in place, per call of 50 in a loop, y in cache) and
  "encode wT" (``abft_encode(transposed=True)``, the backward's checksums of wᵀ).

On a CPU without AVX-512 the "avx512" cap runs the AVX2 kernels (``cpu_has`` names what this CPU
has).

python -m benchmarks.run --suite cpu-kernels --m 256 --dtype float32 --shapes small
"""

from __future__ import annotations

import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pimlayers import FaultPolicy, ops

from . import matmul
from ._harness import _batch, warm_up

CAPS = ("generic", "avx2", "avx512")


def cpu_has() -> str:
    """The widest of AVX-512 / AVX2 this CPU reports (Linux), as the caps name them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= set(flags):
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= set(flags) else "generic"


def _under(cap: str, fn):
    def call(*args):
        os.environ["PIMLAYERS_CPU_ISA"] = cap
        return fn(*args)

    return call


def run(
    m: int = 256,
    shapes=((256, 1024), (1024, 256), (512, 512)),
    dtype=jnp.float32,
    rounds: int = 15,
    iters: int = 20,
    block_ns=(None, 128),
) -> list[dict]:
    if jax.default_backend() != "cpu":
        return []
    before = os.environ.get("PIMLAYERS_CPU_ISA")
    rows = []
    try:
        for block_n in block_ns:
            policy = FaultPolicy(block_n=block_n)
            for k, n in shapes:
                cases = matmul.pairs(m, k, n, dtype, policy)
                base = dict(m=m, block_n=block_n or "row", cpu_has=cpu_has(), rounds=rounds)
                for op, case in cases.items():
                    rows.append(dict(op=f"{op} {k}->{n}", **base) | _gemms(op, k, n, case, rounds, iters))
                for op, (fn, args, per) in _ops(k, block_n, *cases["fwd"][3]).items():
                    times = _rounds([(cap, _under(cap, fn), args) for cap in CAPS], rounds, iters)
                    ms = {f"{c}_ms": statistics.median(t) * 1e3 / per for c, t in times.items()}
                    rows.append(dict(op=f"{op} {k}->{n}", **base) | ms)
    finally:
        if before is None:
            os.environ.pop("PIMLAYERS_CPU_ISA", None)
        else:
            os.environ["PIMLAYERS_CPU_ISA"] = before
    return rows


_LOOP = 50  # finishes per timed call: in a loop, each in place on the last one's output


def _ops(k: int, block_n, x, w, enc) -> dict:
    """The native ops of a protected forward alone: (fn, its args, ops per call)."""
    c, mag = ops.abft_checks(x, enc)
    y = x @ w

    def finishes(y, c, mag):
        one = lambda i, v: ops.abft_finish(v, c, mag, k=k, block_n=block_n, out_dtype=v.dtype)[0]
        return lax.fori_loop(0, _LOOP, one, y)

    return {
        "checks": (jax.jit(lambda v, e: ops.abft_checks(v, e, impl="native")), (x, enc), 1),
        "finish": (jax.jit(finishes), (y, c, mag), _LOOP),
        "encode wT": (
            jax.jit(lambda v: ops.abft_encode(v, block_n, transposed=True, impl="native")),
            (w,),
            1,
        ),
    }


def _rounds(fns, rounds: int, iters: int) -> dict:
    """Seconds per call of each (name, fn, args), one per round: batches in rounds, the order
    reversed every other round, after a warm-up of all of them."""
    warm_up([(f, a) for _, f, a in fns])
    times = {name: [] for name, _, _ in fns}
    for r in range(rounds):
        for name, f, a in fns if r % 2 == 0 else fns[::-1]:
            times[name].append(_batch(f, a, iters))
    return times


def _gemms(op: str, k: int, n: int, case, rounds: int, iters: int) -> dict:
    plain, prot, args_p, args_q = case
    fns = [("plain", plain, args_p)] + [(cap, _under(cap, prot), args_q) for cap in CAPS]
    want = jax.tree.map(np.asarray, plain(*args_p))
    for cap, f, a in fns[1:]:  # every kernel's result first: the plain one's, no detection
        out = f(*a)
        got = out[0] if op == "fwd" else out[1]
        ref = want if op == "fwd" else want[1]
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(
                np.asarray(u, np.float32), np.asarray(v, np.float32), rtol=1e-4, atol=1e-3
            )
        if op == "fwd" and out[1].to_dict()["gemm_detected"]:
            raise AssertionError(f"{cap}: false detection at {k}->{n}: {out[1].to_dict()}")
    times = _rounds(fns, rounds, iters)
    row = dict(plain_ms=statistics.median(times["plain"]) * 1e3)
    for cap in CAPS:
        row[f"{cap}_ms"] = statistics.median(times[cap]) * 1e3
    for cap in CAPS:
        row[f"ratio_{cap}"] = statistics.median(
            p / q for p, q in zip(times["plain"], times[cap], strict=True)
        )
    return row
