"""The verified flash attention's forward tilings against cuDNN's flash attention, one card.

``python -m benchmarks.run --suite flash-tiling`` (Hopper GPUs) times ``ops.flash_attention`` (the
protected attention core's forward kernel: both GEMMs' checksums verified inside it) under each
tiling of :func:`configs` at goal 2's shape (B = 1, T = 8192, 32 query / 8 KV heads, D = 128,
causal, bf16) against ``jax.nn.dot_product_attention(..., implementation="cudnn")``, the two in
alternating batches (``_harness.time_pair``); and the same kernel without its checks
(``checks=False``) under each tiling where the checks' own layout (``fuse_e``, ``fuse_v``) does not
matter.
Before it is timed each tiling's output is checked against XLA's attention (within 2^-6 of its
largest value, and on average of its mean) and its checks against the bound (clean inputs: no
row's ratio above 1); a wrong tiling raises, a tiling that does not build (its buffers past the
shared memory, say) gets a row with its error and no time.

Rows: ``kernel`` (verified or checks off), the ``FlashConfig`` fields, ``default`` (the library's
tiling), ``cudnn_ms``, ``ms`` and ``ratio`` = cuDNN's time / the kernel's (goal 2 asks >= 0.93 of
the protected core), ``vs_default`` = the default verified kernel's time / this one's, timed
against each other in alternating batches (> 1: faster than the default; from 2026-12-07's
sixty-fifth session), ``max_err`` against XLA and ``max_check`` (the largest clean ratio). The
default is jax's own tuning for its forward at D = 128 (``attention_mgpu``: 64 / 128 / 2), not
swept for this kernel before; the backward's tilings were (``FlashBwdConfig``'s docstring).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ._harness import time_pair
from .peers import ATTN

__all__ = ["configs", "run"]


def configs() -> list:
    """The grid: the default first, then 64 or 128 keys a step, two to four stages in flight, the
    scores' checksum product inside the scores' wgmma or apart (``fuse_e``), and with it inside, the
    output check's inside the output's wgmma (``fuse_v``, the default since 2026-12-07's
    sixty-sixth session) or apart (``fuse_v=False``). Tilings whose buffers do not fit
    the shared memory are in it too: they get an error row (what does not build is measured as
    such, not assumed)."""
    from pimlayers.ops._flash import FlashConfig

    out = [FlashConfig()]
    for block_kv, stages, (fuse_e, fuse_v) in itertools.product(
        (128, 64), (2, 3, 4), ((True, None), (False, None), (True, False))
    ):
        c = FlashConfig(block_kv=block_kv, stages=stages, fuse_e=fuse_e, fuse_v=fuse_v)
        if c not in out:
            out.append(c)
    return out


def _inputs(b: int, t: int, h: int, kv: int, d: int):
    ks = jax.random.split(jax.random.key(1), 3)
    mk = lambda key, n: jax.random.normal(key, (b, t, n, d), jnp.float32).astype(jnp.bfloat16)
    return mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv)


def run(b=ATTN["b"], t=ATTN["t"], h=ATTN["h"], kv=ATTN["kv"], d=ATTN["d"]) -> list[dict]:
    """The rows above; none where the kernel does not run (not a Hopper GPU)."""
    from pimlayers import ops
    from pimlayers.ops._flash import FlashConfig, flash_supported, fused_value_check, hopper

    if not hopper():
        return []
    q, k, v = _inputs(b, t, h, kv, d)
    xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    ref = np.asarray(jax.jit(xla)(q, k, v), np.float32)
    cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"))
    shape = f"B={b} T={t} H={h} KV={kv} D={d} bfloat16 causal"
    rows, default = [], None  # (the default verified kernel, once it has built and passed)
    for cfg, checks in itertools.product(configs(), (True, False)):
        if not checks and (not cfg.fuse_e or cfg.fuse_v is not None):
            continue  # without the checks fuse_e and fuse_v change nothing: each tiling once
        if not flash_supported(q.shape, k.shape, q.dtype, True, cfg):
            continue
        what = f"{'verified' if checks else 'checks off'} {cfg}"
        row = dict(kernel="verified" if checks else "checks off", shape=shape)
        row |= {f: getattr(cfg, f) for f in ("block_q", "block_kv", "stages", "fuse_e")}
        # As the kernel takes it: the default's as this process resolves it, none without the checks.
        row["fuse_v"] = checks and fused_value_check(cfg.fuse_v)
        row["default"] = cfg == FlashConfig()
        fn = jax.jit(
            lambda q, k, v, cfg=cfg, checks=checks: ops.flash_attention(q, k, v, checks=checks, config=cfg)
        )
        try:
            out, _, ratios = fn(q, k, v)
        except Exception as e:  # a tiling that does not build: its error is the row
            rows.append(row | dict(error=f"{type(e).__name__}: {e}"[:200]))
            print(f"  {what}: {rows[-1]['error']}", flush=True)
            continue
        # Within a few bf16 roundings of XLA's, at the largest value and on average (a kernel that
        # loses rows or their mask is off by the values themselves).
        diff = np.abs(np.asarray(out, np.float32) - ref)
        err, mean = float(np.max(diff)), float(np.mean(diff))
        if not (err <= 2.0**-6 * np.max(np.abs(ref)) and mean <= 2.0**-6 * np.mean(np.abs(ref))):
            raise AssertionError(f"flash-tiling: {what}: max |out - XLA| = {err:.3g}, mean {mean:.3g}")
        worst = max(float(jnp.max(r)) for r in ratios) if checks else None
        if checks and not worst <= 1.0:
            raise AssertionError(f"flash-tiling: {what}: clean inputs flagged (largest ratio {worst:.3g})")
        t_cudnn, t_ours, ratio = time_pair(cudnn, (q, k, v), fn, (q, k, v), repeats=5)
        row |= dict(cudnn_ms=t_cudnn * 1e3, ms=t_ours * 1e3, ratio=ratio, max_err=err, max_check=worst)
        if row["default"] and checks:
            default = fn
        elif default is not None:
            # Against the default verified kernel directly, in alternating batches: two tilings'
            # ratios to cuDNN differ by less than cuDNN's own time moved between their pairs (0.981
            # to 1.030 ms in one sweep, H100, 2026-12-07), so their difference is read here.
            row["vs_default"] = time_pair(default, (q, k, v), fn, (q, k, v), repeats=7)[2]
        rows.append(row)
        vs = f", {row['vs_default']:.3f}x the default's speed" if "vs_default" in row else ""
        print(
            f"  {what}: cuDNN {t_cudnn * 1e3:.3f} ms, ours {t_ours * 1e3:.3f} ms ({ratio:.3f}x{vs})",
            flush=True,
        )
    return rows
