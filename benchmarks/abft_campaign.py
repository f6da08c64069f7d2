"""The ABFT acceptance campaign: false positives over clean GEMMs, coverage over injected bit flips.

* False positives: clean protected GEMMs at the Llama-3-8B shapes (and random ragged ones), inputs
  at scales 1e-3..1e3, bf16 and f32 — any detection is a false positive.
* Coverage: seeded single-bit flips of the f32 accumulator (any of the 32 bits) over ragged shapes,
  dtypes and scales. Every error larger than the bound must be detected; no output may end further
  than the bound from the clean product; nothing may be left uncorrectable (one fault per GEMM).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pimlayers import ops
from pimlayers.faults import GemmFaults

LLAMA = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)]


def _bound(mag, k, n, lam=8.0):
    return lam * 2.0**-24 * (np.sqrt(k) + np.sqrt(n) + 2) * mag


def false_positives(rng, per_shape=2500, batch=50) -> dict:
    """bf16 at the Llama-3 shapes (M = 64), f32 at HIGHEST precision on ragged shapes (M = 16)."""
    gemms = detected = 0
    ragged = [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(4)]
    cases = [(k, n, jnp.bfloat16, 64) for k, n in LLAMA] + [(k, n, jnp.float32, 16) for k, n in ragged]
    for k, n, dtype, m in cases:
        w = (jax.random.normal(jax.random.key(k * n), (k, n)) / np.sqrt(k)).astype(dtype)
        enc = ops.abft_encode(w)
        f = jax.jit(jax.vmap(lambda a, w=w, enc=enc: ops.protected_matmul(a, w, enc)[1].gemm_detected))
        for b in range(per_shape // batch):
            scale = 10.0 ** rng.uniform(-3, 3)
            x = (jax.random.normal(jax.random.key(b), (batch, m, k)) * scale).astype(dtype)
            detected += int(jnp.sum(f(x)))
            gemms += batch
    return dict(test="false positives (clean GEMMs)", gemms=gemms, shapes=len(cases), detected=detected)


def coverage(rng, trials=40, per_trial=256) -> dict:
    total = above = caught = uncorrectable = 0
    worst = 0.0
    for t in range(trials):
        m, k, n = (int(v) for v in (rng.integers(1, 129), rng.integers(1, 1100), rng.integers(1, 1100)))
        dtype = [jnp.float32, jnp.bfloat16, jnp.float16][t % 3]
        scale = 10.0 ** rng.uniform(-3, 3) if dtype != jnp.float16 else 10.0 ** rng.uniform(-2, 1)
        x = (jax.random.normal(jax.random.key(t), (m, k)) * scale).astype(dtype)
        w = (jax.random.normal(jax.random.key(t + 999), (k, n)) / np.sqrt(k)).astype(dtype)
        enc = ops.abft_encode(w)
        _, mag = ops.abft_checks(x, enc)
        bound = _bound(np.asarray(mag)[:, 0], k, n)
        clean = np.asarray(jnp.matmul(x, w, preferred_element_type=jnp.float32))
        faults = jax.vmap(lambda kk, m=m, n=n: GemmFaults.random(kk, (m, n), 1, 1.0))(
            jax.random.split(jax.random.key(10_000 + t), per_trial)
        )
        run = jax.jit(jax.vmap(lambda fl, x=x, w=w, enc=enc: ops.protected_matmul(x, w, enc, faults=fl)))
        ys, rs = run(faults)
        rows, cols = np.asarray(faults.rows[:, 0]), np.asarray(faults.cols[:, 0])
        bits = np.asarray(faults.bits[:, 0]).astype(np.uint32)
        hit = (clean[rows, cols].view(np.uint32) ^ (np.uint32(1) << bits)).view(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.abs(hit.astype(np.float64) - clean[rows, cols])
        big = ~np.isfinite(err) | (err > bound[rows])
        det = np.asarray(rs.gemm_detected) == 1
        total += per_trial
        above += int(big.sum())
        caught += int((big & det).sum())
        uncorrectable += int(np.asarray(rs.gemm_uncorrectable).sum())
        # Distance from the clean product, relative to the row's bound (rounding of y to dtype aside).
        out = np.asarray(ys.astype(jnp.float32))
        tol = bound[None, :, None] + 2 * float(jnp.finfo(dtype).eps) * np.abs(clean)[None]
        worst = max(worst, float(np.max(np.abs(out - clean[None]) / tol)))
    return dict(
        test="coverage (single-bit flips)",
        injections=total,
        above_bound=above,
        detected_above=caught,
        uncorrectable=uncorrectable,
        worst_error_over_bound=worst,
    )


def run() -> list[dict]:
    rng = np.random.default_rng(2026)
    return [false_positives(rng), coverage(rng)]
