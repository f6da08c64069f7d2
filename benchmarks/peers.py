"""The peers a fused protected kernel would be built on, timed against what XLA and cuDNN already do.

Issue-level question: can a custom Hopper kernel with the checksums in its epilogue pay for its own
protection? It can only if the unprotected custom kernel is faster than the library kernel it would
replace. This suite times, side by side on one GPU (Hopper only; nothing to run elsewhere):

- GEMM, M = 8192 bf16 at the Llama-3-8B shapes: XLA (cuBLAS) against JAX's Pallas Mosaic-GPU Hopper
  matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``), best of a small tuning grid;
- causal GQA attention, B = 1, T = 8192, 32/8 heads, D = 128 bf16: cuDNN flash attention against
  Pallas's Mosaic-GPU flash attention (``attention_mgpu``), XLA's materialised attention, and
  pimlayers' own: ``ops.flash_attention`` with its in-kernel checks (and without, the same kernel's
  cost without them), and the protected attention core (``layers.attention_core``: the verified
  kernel forward, its detected rows redone by the default device redo (no branch), by the
  recompute loop (``FaultPolicy(recompute_kernel=False)``, the default before 2026-12-05, "protected
  (flash)" in earlier results files), or not at all, as the training step runs it
  (``FaultPolicy(recompute=False)``); or the verified materialised path with ``flash=False``) — goal 2 of the
  performance issue, protected attention at >= 0.93x cuDNN — and the backward kernels alone
  (``ops.flash_attention_bwd``, with and without their checks; verified, also with XLA's bounds,
  ``FlashBwdConfig(bounds_kernel=False)``: the Triton bounds kernels are the default on a GPU since
  2026-12-05, and rows named "bounds kernel" in earlier results files are those kernels, opt-in then).

Every kernel's output is checked against XLA's before it is timed. Each attention row has two
times: ``ms``, the wall clock per call of back-to-back calls (what ``vs_cudnn`` compares), and
``dev_ms``, the device kernels' own time in one call (median of three profiled calls), with
``dev_vs_cudnn`` its ratio: free of the host's dispatch and of the clock drift between rounds of
wall-clock timing (on an H200 the flash forward's wall clock moved by ~10% between rounds on
2026-12-04 where two profiled calls agreed to 0.1 µs in 994 µs).
"""

from __future__ import annotations

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ._harness import time_fn
from .matmul import SHAPES, _device_timeline
from .profile import call_idle, device_ms

ATTN = dict(b=1, t=8192, h=32, kv=8, d=128)


def _hopper() -> bool:
    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


def run_gemm(m: int = 8192, shapes=SHAPES) -> list[dict]:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dims = hm.MatmulDimension
    grid = list(itertools.product((dims.M, dims.N), (8, 16), (dims.M, dims.N)))
    rows = []
    for k, n in shapes:
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        xla = jax.jit(lambda a, b: a @ b)
        ref = np.asarray(xla(a, b), np.float32)
        t_xla = time_fn(xla, a, b, iters=10)
        best, tried = None, 0
        for minor, width, wg in grid:
            cfg = hm.TuningConfig(
                tile_m=128,
                tile_n=128,
                tile_k=64,
                max_concurrent_steps=4,
                grid_minor_dim=minor,
                grid_tile_width=width,
                wg_dimension=wg,
            )
            f = jax.jit(functools.partial(hm.matmul, c=None, config=cfg))
            try:
                err = float(np.max(np.abs(np.asarray(f(a, b), np.float32) - ref)))
            except ValueError as e:  # a tile that does not fit shared memory
                print(f"  pallas {cfg}: {e}")
                continue
            if err > 0.05 * float(np.max(np.abs(ref))):
                raise AssertionError(f"pallas matmul {k}->{n} {cfg}: max |out - XLA| = {err}")
            tried += 1
            t = time_fn(f, a, b, iters=10)
            if best is None or t < best[0]:
                best = (t, cfg, err)
        flops = 2.0 * m * k * n
        row = dict(op=f"gemm {k}->{n}", m=m, xla_ms=t_xla * 1e3, xla_tflops=flops / t_xla / 1e12)
        if best is not None:
            t, cfg, err = best
            row.update(
                pallas_ms=t * 1e3,
                pallas_tflops=flops / t / 1e12,
                pallas_speed_vs_xla=t_xla / t,
                configs_tried=tried,
                pallas_config=f"{cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} minor={cfg.grid_minor_dim} "
                f"width={cfg.grid_tile_width} wg={cfg.wg_dimension}",
                max_abs_diff=err,
            )
        rows.append(row)
    return rows


def _idle_cols(name: str, fn, args) -> dict:
    """For the attention core's rows on a GPU: the device's span and idle time inside one call
    (``span_ms``, ``idle_ms``, medians over back-to-back calls), between calls (``between_ms``), and the three
    longest waits inside a call (``idle_top``: "kernel before > kernel after µs"): whether a row's
    wall clock over its kernels' time is the device waiting inside the program (a loop's predicate
    read on the host) or not. On an H100 (2026-12-05) the core's forward+backward with the device
    redo took 0.24 ms more wall clock than recomputing nothing, where six back-to-back calls showed
    4 µs idle in a 5.097 ms span against 2 µs in 5.042. Empty elsewhere, or (with a warning) where
    the profiler fails."""
    if "attention_core" not in name or not _device_timeline():
        return {}
    try:
        idle = call_idle(fn, *args)
    except RuntimeError as e:
        warnings.warn(f"peers: no idle time ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
        return {}
    if idle is None:
        return {}
    top = "; ".join(f"{a[:40]} > {b[:40]} {us:.0f}" for (a, b), us in idle.gaps.most_common(3))
    return dict(
        span_ms=idle.span_us / 1e3, idle_ms=idle.idle_us / 1e3, between_ms=idle.between_us / 1e3, idle_top=top
    )


def run_attention(b=ATTN["b"], t=ATTN["t"], h=ATTN["h"], kv=ATTN["kv"], d=ATTN["d"]) -> list[dict]:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    from pimlayers import layers, ops
    from pimlayers.faults import FaultPolicy

    ks = jax.random.split(jax.random.key(1), 4)
    mk = lambda key, heads: jax.random.normal(key, (b, t, heads, d), jnp.float32).astype(jnp.bfloat16)
    q, k, v, g = mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv), mk(ks[3], h)
    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    fns = {
        "cuDNN flash attention": functools.partial(
            jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"
        ),
        # jax 0.11.2's kernel fails on bf16 inputs (an f16 staging buffer), so it gets f16 copies of
        # the same values (made before timing, q scaled by 1/sqrt(D): the kernel has no softmax
        # scale): same tensor-core rate.
        "Pallas Mosaic-GPU flash attention (f16)": functools.partial(am.attention, config=cfg),
        "XLA attention (materialised)": functools.partial(
            jax.nn.dot_product_attention, is_causal=True, implementation="xla"
        ),
        "pimlayers flash_attention, checks off": lambda q, k, v: ops.flash_attention(q, k, v, checks=False)[
            0
        ],
        "pimlayers flash_attention, verified": lambda q, k, v: ops.flash_attention(q, k, v),
        # Its checksum and bound tiles from XLA (before 2026-12-05 the default; since then the
        # one-pass Pallas kernels are, and this row is the other way).
        "pimlayers flash_attention, verified, XLA bounds": lambda q, k, v: ops.flash_attention(
            q, k, v, config=ops.FlashConfig(bounds_kernel=False)
        ),
        "pimlayers attention_core, protected (flash)": lambda q, k, v: layers.attention_core(
            q, k, v, policy=FaultPolicy()
        )[0],
        # The forward's rerun as a loop of 0 or 1 trips over the whole kernel (the default until
        # 2026-12-05; since then the device redo, which needs no branch): its predicate goes
        # through the host on every call.
        "pimlayers attention_core, protected (flash, recompute loop)": lambda q, k, v: layers.attention_core(
            q, k, v, policy=FaultPolicy(recompute_kernel=False)
        )[0],
        # The training step's policy: no recompute loop (nothing waits for a predicate on the host;
        # what a check cannot correct skips the step).
        "pimlayers attention_core, protected (flash, no recompute)": lambda q, k, v: layers.attention_core(
            q, k, v, policy=FaultPolicy(recompute=False)
        )[0],
        "pimlayers attention_core, protected (materialised)": lambda q, k, v: layers.attention_core(
            q, k, v, policy=FaultPolicy(), flash=False
        )[0],
    }
    first = lambda out: out[0] if isinstance(out, tuple) else out
    ref = np.asarray(jax.jit(fns["XLA attention (materialised)"])(q, k, v), np.float32)
    flops = 4.0 * b * h * t * t * d / 2  # causal: half of the two GEMMs
    shape = f"B={b} T={t} H={h} KV={kv} D={d} bfloat16"
    rows: list[dict] = []
    peer: dict[str, float] = {}
    peer_dev: dict[str, float] = {}
    wrong: set[str] = set()
    for mode in ("fwd", "fwd+bwd"):
        for name, f in fns.items():
            qkv = (q, k, v)
            if "(f16)" in name:
                # attention_mgpu applies no softmax scale: q comes pre-scaled by 1/sqrt(D) (f32, then f16).
                q16 = (q.astype(jnp.float32) * (1.0 / np.sqrt(d))).astype(jnp.float16)
                qkv = (q16, k.astype(jnp.float16), v.astype(jnp.float16))
            if mode == "fwd":
                fn, args = jax.jit(f), qkv
            elif name.startswith("pimlayers flash_attention, verified") or "checks off" in name:
                continue  # the kernel alone has no backward; attention_core's rows time it
            else:
                loss = lambda q, k, v, g, f=f: jnp.sum(first(f(q, k, v)).astype(jnp.float32) * g)
                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                args = (*qkv, g)
            try:
                if name in wrong:
                    raise ValueError("its forward output failed validation: not timed")
                out = fn(*args)
                if mode == "fwd":
                    err = float(np.max(np.abs(np.asarray(first(out), np.float32) - ref)))
                    if err > 0.05:  # checked before timing: a wrong kernel gets an error row, no time
                        wrong.add(name)
                        raise ValueError(f"output differs from XLA's: max |out - XLA| = {err:.3g}")
                s = time_fn(fn, *args, warmup=2, iters=10, repeats=5)
                dev = device_ms(fn, args)
            except (NotImplementedError, ValueError) as e:  # no causal backward in Pallas; a wrong output
                rows.append(dict(mode=mode, op=name, shape=shape, error=f"{type(e).__name__}: {e}"[:160]))
                continue
            mult = 1.0 if mode == "fwd" else 3.0  # backward: ~2x the forward GEMM work
            peer.setdefault(mode, s)
            peer_dev.setdefault(mode, dev)
            tflops = mult * flops / s / 1e12
            row = dict(mode=mode, op=name, shape=shape, ms=s * 1e3, tflops=tflops, vs_cudnn=peer[mode] / s)
            row |= dict(dev_ms=dev, dev_vs_cudnn=peer_dev[mode] / dev)
            rows.append(row | _idle_cols(name, fn, args))
    rows += _backward_kernels(q, k, v, g, flops, shape, rows, fns["cuDNN flash attention"])
    return rows


def _backward_kernels(q, k, v, g, flops, shape, rows, cudnn) -> list[dict]:
    """The backward kernels alone (``ops.flash_attention_bwd`` from the forward's output and
    logsumexp: the two kernels, then the fused one), with and without their checks, against cuDNN's
    backward: its forward+backward less its forward, both timed above. Each build's gradients are
    checked against cuDNN's first."""
    from pimlayers import ops

    ms = {r["mode"]: r["ms"] for r in rows if r["op"] == "cuDNN flash attention" and "ms" in r}
    dev = {r["mode"]: r["dev_ms"] for r in rows if r["op"] == "cuDNN flash attention" and "ms" in r}
    if set(ms) != {"fwd", "fwd+bwd"}:
        return []
    cudnn_bwd = (ms["fwd+bwd"] - ms["fwd"]) / 1e3
    cudnn_bwd_dev = dev["fwd+bwd"] - dev["fwd"]
    loss = lambda q, k, v: jnp.sum(cudnn(q, k, v).astype(jnp.float32) * g)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    scale = max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in want)
    out, lse, _ = ops.flash_attention(q, k, v)
    found = [
        dict(
            mode="bwd",
            op="cuDNN (forward+backward less forward)",
            shape=shape,
            ms=cudnn_bwd * 1e3,
            vs_cudnn=1.0,
            dev_ms=cudnn_bwd_dev,
            dev_vs_cudnn=1.0,
        )
    ]
    # The two kernels (the Triton bounds, the default), then with XLA's bounds, then the fused kernel.
    builds = (
        (False, False, None),
        (False, True, None),
        (False, True, False),
        (True, False, None),
        (True, True, None),
    )
    for fused, checks, bounds_kernel in builds:
        cfg = ops.FlashBwdConfig(fused=fused, bounds_kernel=bounds_kernel)
        fn = jax.jit(functools.partial(ops.flash_attention_bwd, checks=checks, config=cfg))
        got = fn(q, k, v, out, lse, g)
        err = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(got[:3], want, strict=True)
        )
        kernels = ", fused kernel" if fused else ""  # FlashBwdConfig(fused=True): one kernel, opt-in
        name = f"pimlayers flash_attention_bwd{kernels}, {'verified' if checks else 'checks off'}"
        name += ", XLA bounds" if bounds_kernel is False else ""  # the Triton bounds are the default
        if err > 0.05 * scale:  # checked before timing: a wrong build gets an error row, no time
            found.append(
                dict(mode="bwd", op=name, shape=shape, error=f"gradients differ from cuDNN's: {err:.3g}")
            )
            continue
        s = time_fn(fn, q, k, v, out, lse, g, warmup=2, iters=10, repeats=5)
        t_dev = device_ms(fn, (q, k, v, out, lse, g))
        tflops = 2.0 * flops / s / 1e12
        row = dict(mode="bwd", op=name, shape=shape, ms=s * 1e3, tflops=tflops, vs_cudnn=cudnn_bwd / s)
        found.append(row | dict(dev_ms=t_dev, dev_vs_cudnn=cudnn_bwd_dev / t_dev))
    return found


def run(which: str = "all") -> list[dict]:
    if not _hopper():
        return []
    return (run_gemm() if which in ("all", "gemm") else []) + (
        run_attention() if which in ("all", "attention") else []
    )
