"""The CPU handlers' vector kernels against each other, side by side in one process.

``PIMLAYERS_CPU_ISA`` caps the kernels a native CPU call runs ("generic": the portable kernels,
"avx2", "avx512"; csrc/cpu_isa.h) and is read on every call, so one process can alternate them.
Per shape and column block, in rounds (the order reversed every other round, so drift falls on all
alike): the plain XLA GEMM, then the protected GEMM under each cap, each timed over a batch of calls,
after a warm-up of all of them (`benchmarks._harness.time_pair` says why it lasts 0.25 s).
``ratio_<cap>`` is the median over the rounds of plain / protected (the matmul suite's ``ratio``);
``<cap>_ms`` the median time. On a CPU without AVX-512 the "avx512" cap runs the AVX2 kernels
(``cpu_has`` names what this CPU has).

python -m benchmarks.run --suite cpu-kernels --m 256 --dtype float32 --shapes small
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pimlayers import FaultPolicy, ops

from ._harness import _batch

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
                for op in ("fwd", "fwd+bwd"):
                    rows.append(_case(op, m, k, n, dtype, policy, rounds, iters))
    finally:
        if before is None:
            os.environ.pop("PIMLAYERS_CPU_ISA", None)
        else:
            os.environ["PIMLAYERS_CPU_ISA"] = before
    return rows


def _case(op: str, m: int, k: int, n: int, dtype, policy: FaultPolicy, rounds: int, iters: int) -> dict:
    kx, kw = jax.random.split(jax.random.key(k + n))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    g = jax.random.normal(jax.random.key(7), (m, n), jnp.float32).astype(dtype)
    enc = ops.abft_encode(w, policy.block_n)
    if op == "fwd":
        plain = jax.jit(jnp.matmul)
        prot = jax.jit(lambda a, b, e: ops.protected_matmul(a, b, e, policy=policy))
        args_p, args_q = (x, w), (x, w, enc)
    else:  # as the matmul suite: value and gradient of sum(y * g)

        def loss_plain(a, b, c):
            return jnp.sum((jnp.matmul(a, b) * c).astype(jnp.float32))

        def loss_prot(a, b, e, c):
            return jnp.sum((ops.protected_matmul(a, b, e, policy=policy)[0] * c).astype(jnp.float32))

        plain = jax.jit(jax.value_and_grad(loss_plain, argnums=(0, 1)))
        prot = jax.jit(jax.value_and_grad(loss_prot, argnums=(0, 1)))
        args_p, args_q = (x, w, g), (x, w, enc, g)
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
    start = time.perf_counter()  # warm, as time_pair: at least 3 calls each and 0.25 s in all
    for calls in itertools.count():
        if calls >= 3 and time.perf_counter() - start >= 0.25:
            break
        for _, f, a in fns:
            jax.block_until_ready(f(*a))
    times = {name: [] for name, _, _ in fns}
    for r in range(rounds):
        for name, f, a in fns if r % 2 == 0 else fns[::-1]:
            times[name].append(_batch(f, a, iters))
    row = dict(op=f"{op} {k}->{n}", m=m, block_n=policy.block_n or "row", cpu_has=cpu_has(), rounds=rounds)
    row["plain_ms"] = statistics.median(times["plain"]) * 1e3
    for cap in CAPS:
        row[f"{cap}_ms"] = statistics.median(times[cap]) * 1e3
    for cap in CAPS:
        row[f"ratio_{cap}"] = statistics.median(
            p / q for p, q in zip(times["plain"], times[cap], strict=True)
        )
    return row
