"""Routed attention: the routing machinery against its local kernel run alone (one device), the
local kernel against pimlayers' other protected attention and the stock kernels, and the
PhotonicMesh simulator's estimates against measured times on simulated CPU devices.

python -m benchmarks.run --suite routing                                     # one device (H200)
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.run --suite routing-sim
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pimlayers.layers import attention_core
from pimlayers.routing import PhotonicMesh, local_attention, routed_attention, simulate
from pimlayers.routing._transfer import Ctx, send

from ._harness import time_fn


def _qkv(b, t, h, kv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda key, heads: jax.random.normal(key, (b, t, heads, d), jnp.float32).astype(dtype)
    return mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv), mk(ks[3], h)


def _grad(f):
    """fwd+bwd of sum(out * g) with respect to q, k, v."""
    return jax.jit(
        jax.grad(lambda q, k, v, g: jnp.sum(f(q, k, v).astype(jnp.float32) * g), argnums=(0, 1, 2))
    )


def run_local(
    b: int = 1, t: int = 8192, h: int = 32, kv: int = 8, d: int = 128, dtype=jnp.bfloat16
) -> list[dict]:
    """One device: routed_attention (1-device mesh) vs its local kernel alone vs attention_core vs stock."""
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("seq",))
    q, k, v, g = _qkv(b, t, h, kv, d, dtype)
    gpu = dev.platform == "gpu"
    fns = {
        "routed_attention (1-device mesh)": lambda q, k, v: routed_attention(q, k, v, mesh=mesh, axis="seq")[
            0
        ],
        "local kernel alone": lambda q, k, v: local_attention(q, k, v)[0],
        "attention_core (layers, protected)": lambda q, k, v: attention_core(q, k, v)[0],
        "stock XLA attention (unprotected)": functools.partial(
            jax.nn.dot_product_attention, is_causal=True, implementation="xla"
        ),
    }
    if gpu:
        fns["cuDNN flash attention (unprotected)"] = functools.partial(
            jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"
        )
    ref = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"), np.float32)
    flops = 4.0 * b * h * t * t * d / 2  # causal: half of the two GEMMs
    rows: list[dict] = []
    base: dict[str, float] = {}
    for mode in ("fwd", "fwd+bwd"):
        for name, f in fns.items():
            fn = jax.jit(f) if mode == "fwd" else _grad(f)
            args = (q, k, v) if mode == "fwd" else (q, k, v, g)
            if mode == "fwd":  # checked against the reference before timing
                err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - ref)))
                if err > 0.05:
                    raise AssertionError(f"{name}: max |out - reference| = {err}")
            try:
                s = time_fn(fn, *args, warmup=2, iters=5, repeats=5)
            except Exception as e:
                rows.append({"mode": mode, "op": name, "error": type(e).__name__})
                continue
            base.setdefault(mode, s)
            mult = 1.0 if mode == "fwd" else 3.0  # backward: ~2x the forward GEMM work
            rows.append(
                {
                    "mode": mode,
                    "op": name,
                    "shape": f"B={b} T={t} H={h} KV={kv} D={d} {jnp.dtype(dtype).name}",
                    "ms": s * 1e3,
                    "tflops": mult * flops / s / 1e12,
                    "vs_routed": base[mode] / s,
                }
            )
    local = {r["mode"]: r for r in rows if r["op"] == "local kernel alone"}
    for r in rows:
        if r["op"].startswith("routed") and r["mode"] in local and "ms" in r:
            r["routing_overhead"] = r["ms"] / local[r["mode"]]["ms"] - 1.0
    return rows


def _timed(fn, *args, iters: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


SIM_SCHEDULES = (("ring", (0.0, 0.5, 0.88)), ("bidir", (0.0, 0.5)), ("allgather", (0.0,)))


def run_sim(
    b: int = 1,
    t: int = 4096,
    h: int = 8,
    kv: int = 4,
    d: int = 64,
    devices=None,
    dtype=jnp.float32,
    schedules=SIM_SCHEDULES,
) -> list[dict]:
    """Every device (simulated CPU devices or GPUs): measured routed_attention times vs the simulator,
    calibrated by microbenchmarks run here (one round of half-block compute; one transfer with 1 and
    with 17 attempts, giving the fixed cost per transfer and the marginal cost per attempt).
    ``schedules``: (schedule, fault rates) pairs to measure (each schedule compiles once)."""
    devs = jax.devices() if devices is None else list(devices)
    n = len(devs)
    if n < 2:
        return []
    mesh = Mesh(np.array(devs), ("seq",))
    q, k, v, _ = _qkv(b, t, h, kv, d, dtype)
    pm = PhotonicMesh((n,))
    spec = P(None, "seq")
    tl = t // n
    half = jax.jit(  # one off-diagonal zigzag round: every device attends half a block, unmasked
        jax.shard_map(
            lambda q, k, v: local_attention(q, k[:, : tl // 2], v[:, : tl // 2], causal=False)[0],
            mesh=mesh,
            in_specs=(spec,) * 3,
            out_specs=spec,
            check_vma=False,
        )
    )
    t_half = _timed(half, q, k, v)

    def transfer(attempts):  # every link into device 0 dead: exactly `attempts` direct attempts
        cut = PhotonicMesh((n,), max_attempts=attempts)
        links = cut.state(dead=[cut.link_id(n - 1, 0, 1), cut.link_id(1, 0, -1)])
        f = jax.jit(
            jax.shard_map(
                lambda k, v, links: send((k, v), jnp.zeros((), bool), (0, 1), links, Ctx(cut, ("seq",)), 0)[
                    0
                ],
                mesh=mesh,
                in_specs=(spec, spec, P()),
                out_specs=(spec, spec),
                check_vma=False,
            )
        )
        return _timed(f, k, v, links)

    t1, t17 = transfer(1), transfer(17)
    t_attempt = (t17 - t1) / 16  # the marginal cost of one more attempt
    t_fixed = max(t1 - t_attempt, 0.0)  # per transfer: the sender's checksums, loop entry, dispatch share
    device_flops = 4.0 * b * h * tl * (tl / 2) * d / t_half  # CPU: all devices share the host's cores
    model = PhotonicMesh((n,), latency_s=t_attempt, bandwidth_bytes_per_s=1e30, jitter_s=1e-12)
    rows = []
    for schedule, rates in schedules:
        f = jax.jit(
            lambda q, k, v, links, s=schedule: routed_attention(
                q, k, v, mesh=mesh, axis="seq", links=links, schedule=s
            )
        )
        for rate in rates:
            samples, attempts = [], []
            for it in range(5):
                links = pm.state(fault_rate=rate, step=it)
                jax.block_until_ready(f(q, k, v, links))  # compile once, then one warm call per draw
                t0 = time.perf_counter()
                _, rep = jax.block_until_ready(f(q, k, v, links))
                samples.append(time.perf_counter() - t0)
                attempts.append(int(rep.rounds))
            est = simulate.estimate(
                model,
                schedule=schedule,
                batch=b,
                seq_len=t,
                heads=h,
                kv_heads=kv,
                head_dim=d,
                dtype_bytes=jnp.dtype(dtype).itemsize,
                fault_rate=rate,
                device_flops=device_flops,
                attempt_overhead_s=0.0,
                transfer_overhead_s=t_fixed,
                overlap=False,
                draws=100,
            )
            measured = float(np.median(samples))
            rows.append(
                {
                    "schedule": schedule,
                    "devices": n,
                    "shape": f"B={b} T={t} H={h} KV={kv} D={d} {jnp.dtype(dtype).name}",
                    "fault_rate": rate,
                    "measured_ms": measured * 1e3,
                    "estimate_ms": est.mean_s * 1e3,
                    "estimate_over_measured": est.mean_s / measured,
                    "attempts_measured": float(np.mean(attempts)),
                    "attempts_estimate": est.attempts,
                    "calib_half_block_ms": t_half * 1e3,
                    "calib_attempt_ms": t_attempt * 1e3,
                    "calib_transfer_ms": t_fixed * 1e3,
                }
            )
    return rows


def run_stress(
    devices=None,
    iters: int = 50,
    rate: float = 0.88,
    schedules=("ring", "bidir"),
    b: int = 1,
    t: int = 4096,
    h: int = 8,
    kv: int = 2,
    d: int = 64,
) -> list[dict]:
    """Every device on one axis, f32: `iters` calls per schedule at a `rate` link-fault rate, each
    with a fresh fault pattern, against the fault-free routed output (bit-level) and the unsharded
    reference (`jax.nn.dot_product_attention` at HIGHEST precision); retries, corrupted and lost
    receipts counted; the compiled program must serve every call (no recompile)."""
    devs = jax.devices() if devices is None else list(devices)
    n = len(devs)
    if n < 2:
        return []
    mesh = Mesh(np.array(devs), ("seq",))
    q, k, v, _ = _qkv(b, t, h, kv, d, jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
    pm = PhotonicMesh((n,))
    rows = []
    for schedule in schedules:
        f = jax.jit(
            lambda q, k, v, links, s=schedule: routed_attention(
                q, k, v, mesh=mesh, axis="seq", links=links, schedule=s
            )
        )
        clean = np.asarray(f(q, k, v, pm.state(fault_rate=0.0))[0])
        worst_rel, worst_ref = 0.0, 0.0
        retries = corrupted = dropped = incomplete = failures = 0
        t0 = time.perf_counter()
        with jax.no_tracing():  # a recompile would raise here
            for it in range(iters):
                out, rep = f(q, k, v, pm.state(fault_rate=rate, seed=1, step=it))
                out = np.asarray(out)
                worst_rel = max(worst_rel, float(np.max(np.abs(out - clean)) / np.max(np.abs(clean))))
                worst_ref = max(worst_ref, float(np.max(np.abs(out - ref))))
                retries += int(rep.faults.link_retries)
                failures += int(rep.faults.link_failures)
                corrupted += int(rep.corrupted)
                dropped += int(rep.dropped)
                incomplete += int(np.sum(np.asarray(rep.incomplete)))
        rows.append(
            {
                "schedule": schedule,
                "devices": n,
                "shape": f"B={b} T={t} H={h} KV={kv} D={d} float32",
                "fault_rate": rate,
                "iterations": iters,
                "max_rel_err_vs_fault_free": worst_rel,
                "max_abs_err_vs_reference": worst_ref,
                "retries": retries,
                "corrupted_detected": corrupted,
                "lost_detected": dropped,
                "link_failures": failures,
                "incomplete_rows": incomplete,
                "compiles": f._cache_size(),
                "seconds": time.perf_counter() - t0,
            }
        )
    return rows


def run_multi(devices=None) -> list[dict]:
    """Routed attention over every device: the stress run, then measured times vs the simulator
    (GPUs at Llama-3-8B head shapes in bf16, T = 8192 per device; simulated CPU devices small)."""
    devs = jax.devices() if devices is None else list(devices)
    if len(devs) < 2:
        return []
    rows = run_stress(devs)
    if devs[0].platform == "gpu":
        rows += run_sim(b=1, t=8192 * len(devs), h=32, kv=8, d=128, devices=devs, dtype=jnp.bfloat16)
    else:
        rows += run_sim(devices=devs)
    return rows


def run(quick: bool = False) -> list[dict]:
    """Small sizes for the test suite."""
    if quick:
        return run_local(b=1, t=256, h=4, kv=2, d=32, dtype=jnp.float32)
    return run_local()
