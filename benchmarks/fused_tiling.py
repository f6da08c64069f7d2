"""The fused GEMM's tilings against XLA's GEMM, one card: which ``FusedConfig`` to use where.

``python -m benchmarks.run --suite fused-tiling`` (Hopper GPUs) times ``ops._fused_gemm.fused_gemm``
(the opt-in ``FaultPolicy(fused=True)`` forward: y and its block sums from one Pallas kernel) under
each tiling of :func:`configs` at the Llama-3-8B shapes (M = 8192, bf16) against ``a @ b`` from
XLA (cuBLAS), the two in alternating batches (``_harness.time_pair``). Each config's y and block
sums are checked against the reference (``fused_gemm_reference``) before it is timed. Rows: shape,
the config's fields, ``default`` (the config ``_protected_matmul._fused_config`` picks),
``xla_ms``, ``fused_ms`` and ``ratio`` = XLA's time / the fused kernel's (> 1: the fused GEMM,
sums and all, is faster than the plain GEMM).

One tiling serves every shape and both Hopper cards so far; this suite is how a per-device choice
would be made. On an H100 (2026-12-06, fused-tiling-s50) none of the 13 tilings reached XLA at
4096 -> 14336 (0.918-0.947x; the default 0.933x), where on an H200 the default beat it
(docs/gpu-tests.md).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ._harness import time_pair
from .matmul import SHAPES

__all__ = ["configs", "run"]


def configs() -> list:
    """The grid: the default tiling, its four-stage variant (four TMA buffers fit shared memory only
    beside a 64 x 32 epilogue tile), and with three stages each warpgroup layout (side by side along N,
    or stacked along M) x tile order (minor along M or N) x snake width 8, 16, 32."""
    from pimlayers.ops._fused_gemm import FusedConfig

    out = [FusedConfig(), FusedConfig(stages=4, epi_n=32)]
    for wg_m, minor_m, width in itertools.product((False, True), (True, False), (8, 16, 32)):
        c = FusedConfig(wg_m=wg_m, minor_m=minor_m, width=width)
        if c not in out:
            out.append(c)
    return out


def _same(got, want, what: str) -> None:
    """y within one bf16 rounding of the reference's largest value, the sums within f32 summation
    order (another order of the same f32 products: 2^-16 of the largest, generously)."""
    (y, s), (yr, sr) = got, want
    y, yr = np.asarray(y, np.float32), np.asarray(yr, np.float32)
    if not np.max(np.abs(y - yr)) <= 2.0**-7 * np.max(np.abs(yr)):
        raise AssertionError(f"fused-tiling: {what}: y differs from the reference")
    s, sr = np.asarray(s, np.float64), np.asarray(sr, np.float64)
    if s.shape != sr.shape or not np.max(np.abs(s - sr)) <= 2.0**-16 * np.max(np.abs(sr)):
        raise AssertionError(f"fused-tiling: {what}: block sums differ from the reference")


def run(m: int = 8192, shapes=SHAPES) -> list[dict]:
    """The rows above; none where the fused kernel does not run (not a Hopper GPU)."""
    from pimlayers.ops._fused_gemm import fused_gemm, fused_gemm_reference, fused_gemm_supported, hopper
    from pimlayers.ops._protected_matmul import _fused_config

    if not hopper():
        return []
    rows = []
    plain = jax.jit(lambda a, b: a @ b)
    for k, n in shapes:
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        want = jax.jit(fused_gemm_reference)(a, b)
        default = _fused_config(k, n)
        for cfg in configs():
            if not fused_gemm_supported(m, k, n, a.dtype, cfg):
                continue
            fn = jax.jit(lambda a, b, cfg=cfg: fused_gemm(a, b, cfg))
            _same(fn(a, b), want, f"{k}->{n} {cfg}")
            t_xla, t_fused, ratio = time_pair(plain, (a, b), fn, (a, b), repeats=5)
            rows.append(
                dict(op=f"gemm {k}->{n}", m=m)
                | dataclasses.asdict(cfg)
                | dict(default=cfg == default, xla_ms=t_xla * 1e3, fused_ms=t_fused * 1e3, ratio=ratio)
            )
            print(f"  {k}->{n} {cfg}: xla {t_xla * 1e3:.3f} ms, fused {t_fused * 1e3:.3f} ms", flush=True)
    return rows
