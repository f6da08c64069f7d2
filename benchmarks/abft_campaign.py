"""The ABFT acceptance campaign: false positives over clean GEMMs, coverage over injected bit flips.

* False positives: clean protected GEMMs at the Llama-3-8B shapes (and random ragged ones), inputs
  at scales 1e-3..1e3, bf16 and f32 — any detection is a false positive.
* Coverage: seeded single-bit flips of the f32 accumulator (any of the 32 bits) over ragged shapes,
  dtypes and scales. Every error larger than the bound must be detected; no output may end further
  than the bound from the clean product (``worst_error_over_bound`` <= 1, also per dtype); nothing
  may be left uncorrectable (one fault per GEMM).
  A bf16 GEMM's product is checked after its own rounding to bf16 (``protected_matmul``), so its
  bound carries that rounding (``2^-8 · Σ|y|`` of the row), its injected error is the change of the
  stored bf16 value (the flip of the widened f32 value, rounded back, as the injection does), and
  "above the bound" means above twice it (the rounding of the row's other values is part of the
  residual and can be as large as that term): twice it is then also the distance an undetected
  error may leave.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults

HI = jax.lax.Precision.HIGHEST
LLAMA = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)]
ROW = FaultPolicy(block_n=None)  # whole-row checksums: the campaign's bound (_bound) is per row


BF16_ROUNDOFF = 2.0**-8


def _bound(mag, k, n, lam=8.0, stored_abs_sum=None):
    """The check's bound per row: f32 accumulation, plus (bf16 products) the storage rounding."""
    b = lam * 2.0**-24 * (np.sqrt(k) + np.sqrt(n) + 2) * mag
    return b if stored_abs_sum is None else b + BF16_ROUNDOFF * stored_abs_sum


def _flip(v: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """f32 values with one bit flipped each."""
    return (v.astype(np.float32).view(np.uint32) ^ (np.uint32(1) << bits)).view(np.float32)


def false_positives(rng, per_shape=2500, batch=50, llama=LLAMA) -> dict:
    """bf16 at the Llama-3 shapes (M = 64), f32 at HIGHEST precision on ragged shapes (M = 16)."""
    gemms = detected = 0
    ragged = [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(4)]
    cases = [(k, n, jnp.bfloat16, 64) for k, n in llama] + [(k, n, jnp.float32, 16) for k, n in ragged]
    for k, n, dtype, m in tqdm(cases, desc="clean GEMMs", unit="shape"):
        w = (jax.random.normal(jax.random.key(k * n), (k, n)) / np.sqrt(k)).astype(dtype)
        enc = ops.abft_encode(w)
        f = jax.jit(
            jax.vmap(lambda a, w=w, enc=enc: ops.protected_matmul(a, w, enc, policy=ROW)[1].gemm_detected)
        )
        for b in range(per_shape // batch):
            scale = 10.0 ** rng.uniform(-3, 3)
            x = (jax.random.normal(jax.random.key(b), (batch, m, k)) * scale).astype(dtype)
            detected += int(jnp.sum(f(x)))
            gemms += batch
    return dict(test="false positives (clean GEMMs)", gemms=gemms, shapes=len(cases), detected=detected)


def coverage(rng, shapes=4, scales=4, per_run=256) -> dict:
    """Ragged (M, K, N) x {f32, bf16, f16} x input scales; one compile per (shape, dtype): x and the
    fault sites are arguments, so every scale and every batch of injections reuses it."""
    total = above = caught = uncorrectable = 0
    worst: dict[str, float] = {}
    dims = [
        tuple(int(v) for v in (rng.integers(1, 129), rng.integers(1, 1100), rng.integers(1, 1100)))
        for _ in range(shapes)
    ]
    cases = [(d, dtype) for d in dims for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)]
    for t, ((m, k, n), dtype) in enumerate(tqdm(cases, desc="bit flips", unit="case")):
        w = (jax.random.normal(jax.random.key(t + 999), (k, n)) / np.sqrt(k)).astype(dtype)
        enc = ops.abft_encode(w)
        run = jax.jit(
            jax.vmap(
                lambda a, fl, w=w, enc=enc: ops.protected_matmul(a, w, enc, policy=ROW, faults=fl), (None, 0)
            )
        )
        for s in range(scales):
            lo, hi = (-3, 3) if dtype != jnp.float16 else (-2, 1)  # f16 overflows past ~6e4
            scale = 10.0 ** rng.uniform(lo, hi)
            x = (jax.random.normal(jax.random.key(100 * t + s), (m, k)) * scale).astype(dtype)
            _, mag = ops.abft_checks(x, enc)
            # HIGHEST: on a GPU the default f32 matmul is TF32, far less exact than the product checked.
            clean = np.asarray(jnp.matmul(x, w, precision=HI, preferred_element_type=jnp.float32))
            bf16 = dtype == jnp.bfloat16
            stored = np.asarray(jnp.asarray(clean).astype(dtype).astype(jnp.float32)) if bf16 else clean
            bound = _bound(
                np.asarray(mag)[:, 0], k, n, stored_abs_sum=np.abs(stored).sum(1) if bf16 else None
            )
            faults = jax.vmap(lambda kk, m=m, n=n: GemmFaults.random(kk, (m, n), 1, 1.0))(
                jax.random.split(jax.random.key(10_000 + 100 * t + s), per_run)
            )
            ys, rs = run(x, faults)
            rows, cols = np.asarray(faults.rows[:, 0]), np.asarray(faults.cols[:, 0])
            bits = np.asarray(faults.bits[:, 0]).astype(np.uint32)
            with np.errstate(invalid="ignore", over="ignore"):
                hit = _flip(stored[rows, cols], bits)
                if bf16:  # the flipped accumulator, rounded to bf16 as the GEMM stores it
                    hit = np.asarray(jnp.asarray(hit).astype(jnp.bfloat16).astype(jnp.float32))
                err = np.abs(hit.astype(np.float64) - stored[rows, cols])
            # bf16: the other values' rounding in the row can reach the storage term itself (it is
            # not a random-sign sum when a row has few values), and the error's own |y| enlarges the
            # bound it is judged by, so detection is certain only above twice the bound (plus 4 u).
            margin = 2.0 * (1.0 + 4 * BF16_ROUNDOFF) if bf16 else 1.0
            big = ~np.isfinite(err) | (err * (1.0 - BF16_ROUNDOFF * bf16) > margin * bound[rows])
            det = np.asarray(rs.gemm_detected) == 1
            total += per_run
            above += int(big.sum())
            caught += int((big & det).sum())
            uncorrectable += int(np.asarray(rs.gemm_uncorrectable).sum())
            # Distance from the clean product, relative to the bound below which an error may pass
            # (bf16: the margin above), the rounding of y to its dtype aside.
            out = np.asarray(ys.astype(jnp.float32))
            tol = margin * bound[None, :, None] + 2 * float(jnp.finfo(dtype).eps) * np.abs(clean)[None]
            name = jnp.dtype(dtype).name
            worst[name] = max(worst.get(name, 0.0), float(np.max(np.abs(out - clean[None]) / tol)))
    return dict(
        test="coverage (single-bit flips)",
        injections=total,
        above_bound=above,
        detected_above=caught,
        uncorrectable=uncorrectable,
        worst_error_over_bound=max(worst.values(), default=0.0),
        **{f"worst_{name}": v for name, v in worst.items()},
    )


def run(quick: bool = False) -> list[dict]:
    """The acceptance campaign (>= 10^4 clean GEMMs, >= 10^4 injections); ``quick`` for a smoke run."""
    rng = np.random.default_rng(2026)
    if quick:  # one Llama-3 shape, the smallest (the three others cost the CPU ~70 s of encoding)
        fp = false_positives(rng, per_shape=4, batch=2, llama=LLAMA[-1:])
        return [fp, coverage(rng, shapes=1, scales=1, per_run=8)]
    return [false_positives(rng), coverage(rng)]
