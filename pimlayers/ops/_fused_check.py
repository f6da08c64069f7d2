"""The check of a fused GEMM (``_fused_gemm``): ABFT flags from the block sums its epilogue wrote.

The unfused check (``abft_check_reference``) sums each 128-column block of y itself; here the GEMM
already did, from its f32 accumulator before rounding it to y, so the check is elementwise on
(M, N / 128) arrays and y is not read. The test is the unfused one's (csrc/abft.h) without the bf16
term, since the sums are of the accumulator:

    B1 = lam * u * (sqrt(K) + sqrt(128) + 2) * mag,   detected: |r1| > B1 or |r2| > 128 B1

with r1 = s1 - c1, r2 = s2 - c2, u = 2^-24. A non-finite accumulator value makes s1 non-finite:
detected. Nothing is located in place (that needs y); detected blocks are redone from the operands
(``redo_tiles``).

Fault injection for tests and demos (``inject_fused``) models what a flipped accumulator bit does to
a fused kernel: y and its sums change together (the sums are formed from the corrupted accumulator),
and only the independent checks c disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, BFloat16, Float, Int32

from ..faults._inject import GemmFaults, flip_sites
from ._abft import ABFT_CLEAN, ABFT_DETECTED, F32_ROUNDOFF, abft_bound
from ._fused_gemm import TILE, block_sums

__all__ = ["REDO_TILES", "fused_flags", "inject_fused", "redo_tiles", "sums_flags"]

# What the fused path redoes without a branch: up to REDO_TILES tiles of 128 rows x 128 columns (one
# warpgroup's accumulator tile in the kernel) holding a detected block. A fault that corrupts a whole
# tile is repaired, and scattered faults in up to two tiles. Each costs contiguous slices of 128 rows
# of x and 128 columns of w, always (fixed shapes): ~2 x 3.7 MB at K = 14336.
REDO_TILES = 2


def fused_flags(
    sums: Float[Array, "2 nb m"],
    c: Float[Array, "m nb 2"],
    mag: Float[Array, "m nb"],
    k: int,
    lam: float,
    weighted: bool = True,
) -> Int32[Array, "m nb"]:
    """ABFT_DETECTED where a block's sums disagree with its checks beyond the bound, else ABFT_CLEAN
    (``weighted=False``: c2 was not formed, s1 against c1 alone decides)."""
    return sums_flags(sums[0].T, sums[1].T, c[..., 0], c[..., 1], mag, k, float(TILE), lam, weighted)


def sums_flags(
    s1: Float[Array, "*m nb"],
    s2: Float[Array, "*m nb"],
    c1: Float[Array, "*m nb"],
    c2: Float[Array, "*m nb"],
    mag: Float[Array, "*m nb"],
    k: int,
    width,
    lam: float,
    weighted: bool = True,
) -> Int32[Array, "*m nb"]:
    """The check of an f32 accumulator's block sums s1 = Σ acc, s2 = Σ (j + 1) acc (blocks ``width``
    columns wide: a float, or an array over nb for a ragged last block) against the checks c1, c2
    and mag: ABFT_DETECTED or ABFT_CLEAN. Also the device redo's, inside its kernel
    (``_redo_kernel``). ``weighted=False``: c2 was not formed (not read); s1 against c1 decides."""
    b1 = abft_bound(mag, 0.0, k, width, lam, F32_ROUNDOFF)  # the f32 accumulator: no u_y term
    if not weighted:
        finite = jnp.isfinite(c1) & jnp.isfinite(mag) & jnp.isfinite(s1)
        detected = ~finite | ~(jnp.abs(s1 - c1) <= b1)
        return jnp.where(detected, ABFT_DETECTED, ABFT_CLEAN).astype(jnp.int32)
    finite = jnp.isfinite(c1) & jnp.isfinite(c2) & jnp.isfinite(mag) & jnp.isfinite(s1) & jnp.isfinite(s2)
    # Written so a NaN anywhere (sums, checks, bound) lands on "detected".
    detected = ~finite | ~(jnp.abs(s1 - c1) <= b1) | ~(jnp.abs(s2 - c2) <= width * b1)
    return jnp.where(detected, ABFT_DETECTED, ABFT_CLEAN).astype(jnp.int32)


def inject_fused(
    y: BFloat16[Array, "m n"], sums: Float[Array, "2 nb m"], faults: GemmFaults | None
) -> tuple[BFloat16[Array, "m n"], Float[Array, "2 nb m"]]:
    """Flip the sites' accumulator bits in y (as ``inject_gemm_faults`` does) and carry each change into the
    block sums, as the kernel's epilogue would have summed the corrupted accumulator. The
    accumulator's value is known here only as stored (bf16, widened exactly): the flip is applied
    to that, so the sums move by the flip of the stored value, and y by its rounding — a flip below
    bf16's precision moves the sums by a little and y not at all, as in the kernel. Touches only
    the F sites (gathers and scatters), never the whole product."""
    if faults is None:
        return y, sums
    m, n = y.shape
    rows, cols = faults.rows, faults.cols
    f = rows.shape[0]
    idx = jnp.arange(f)
    # A site drawn twice flips once (its last draw wins): count each (row, column) once.
    same = (rows[:, None] == rows[None, :]) & (cols[:, None] == cols[None, :]) & (idx[None, :] > idx[:, None])
    counted = ~jnp.any(same, axis=1) & (rows >= 0) & (rows < m) & (cols >= 0) & (cols < n)
    r, cc = jnp.clip(rows, 0, m - 1), jnp.clip(cols, 0, n - 1)
    # inject_gemm_faults' flip, with the old values read before y is written: y's last use is then
    # the scatter, which XLA can do in place (reading y's old values after it needs a copy of y).
    old = y[r, cc].astype(jnp.float32)
    new = flip_sites(old, faults)
    y2 = y.at[rows, cols].set(new.astype(y.dtype), mode="drop")
    d1 = jnp.where(counted, new - old, 0.0)  # inf or NaN when the flip made one: the sums follow
    blk, j1 = cc // TILE, (cc % TILE + 1).astype(jnp.float32)
    sums = sums.at[0, blk, r].add(d1).at[1, blk, r].add(j1 * d1)
    return y2, sums


def redo_tiles(
    a: BFloat16[Array, "m k"],
    b: BFloat16[Array, "k n"],
    c: Float[Array, "m nb 2"],
    mag: Float[Array, "m nb"],
    y: BFloat16[Array, "m n"],
    flags: Int32[Array, "m nb"],
    *,
    lam: float,
    precision,
    gate: bool,
    fill: float,
    tiles: int = REDO_TILES,
    weighted: bool = True,
):
    """Recompute the detected blocks of y from the operands, without a branch, in place.

    The first ``tiles`` 128 x 128 tiles (in row-major tile order) holding a detected block are
    recomputed from contiguous slices of the operands, checked again on their own block sums
    (``fused_flags``), gated (non-finite values replaced by ``fill`` and counted) and written over
    the detected rows of the tile; its other rows keep the first product bit for bit. Detected
    blocks beyond that capacity, and redone ones that still fail, are counted as uncorrectable —
    never silent.

    Returns ``(y, pending, still, gated, redone)``: detected blocks, those still uncorrectable,
    values the gate replaced, and whether anything was redone (0 or 1, the report's GEMM count).
    """
    m, kk = a.shape
    nb = flags.shape[1]
    pend = flags == ABFT_DETECTED
    pending = jnp.sum(pend, dtype=jnp.int32)
    flat = jnp.any(pend.reshape(m // TILE, TILE, nb), axis=1).reshape(-1)  # (tiles of y,)
    idx = jnp.arange(flat.shape[0], dtype=jnp.int32)
    chosen, live, last = [], [], jnp.int32(-1)
    for _ in range(min(tiles, flat.shape[0])):
        avail = flat & (idx > last)
        t = jnp.argmax(avail).astype(jnp.int32)
        chosen.append(t)
        live.append(avail[t])
        last = jnp.where(avail[t], t, flat.shape[0])
    t, live = jnp.stack(chosen), jnp.stack(live)
    r0, bi = (t // nb) * TILE, t % nb
    xr = jax.vmap(lambda r: lax.dynamic_slice_in_dim(a, r, TILE, axis=0))(r0)  # (T, 128, K)
    wb = jax.vmap(lambda c0: lax.dynamic_slice_in_dim(b, c0, TILE, axis=1))(bi * TILE)  # (T, K, 128)
    # The barrier keeps XLA from folding this into the first product: a real recompute.
    xr, wb = lax.optimization_barrier((xr, wb))
    acc = _split_k_dot(xr, wb, precision)  # (T, 128, 128) f32
    handled = failed = gated = jnp.int32(0)
    for i in range(t.shape[0]):
        ct = lax.dynamic_slice(c, (r0[i], bi[i], 0), (TILE, 1, 2))
        mt = lax.dynamic_slice(mag, (r0[i], bi[i]), (TILE, 1))
        again = fused_flags(block_sums(acc[i]), ct, mt, kk, lam, weighted)[:, 0] != ABFT_CLEAN
        yq = acc[i].astype(y.dtype)
        rows = lax.dynamic_slice(pend, (r0[i], bi[i]), (TILE, 1))[:, 0] & live[i]
        gone = ~jnp.isfinite(yq) & gate
        yq = jnp.where(gone, jnp.asarray(fill, y.dtype), yq)
        old = lax.dynamic_slice(y, (r0[i], bi[i] * TILE), (TILE, TILE))
        y = lax.dynamic_update_slice(y, jnp.where(rows[:, None], yq, old), (r0[i], bi[i] * TILE))
        handled = handled + jnp.sum(rows, dtype=jnp.int32)
        failed = failed + jnp.sum(rows & again, dtype=jnp.int32)
        gated = gated + jnp.sum(gone & rows[:, None], dtype=jnp.int32)
    still = pending - handled + failed
    return y, pending, still, gated, (handled > 0).astype(jnp.int32)


def _split_k_dot(
    xr: BFloat16[Array, "t r k"], wb: BFloat16[Array, "t k c"], precision
) -> Float[Array, "t r c"]:
    """Batched (T, 128, K) @ (T, K, 128) in f32, with K cut into up to 16 slices summed afterwards.

    A 128 x 128 output tile is one or a few thread blocks' work, walking all of K (14336 for the
    MLP's down projection) on as many SMs, and the redo runs on every fused GEMM (fixed shapes);
    sliced, the pieces run side by side. The slices' f32 sum is another summation order, inside
    the check's bound.
    """
    t, r, k = xr.shape
    split = 1
    while split < 16 and k % (2 * split) == 0 and k // (2 * split) >= 512:
        split *= 2
    xs = xr.reshape(t, r, split, k // split)
    ws = wb.reshape(t, split, k // split, wb.shape[2])
    part = jnp.einsum("tisk,tskj->tsij", xs, ws, precision=precision, preferred_element_type=jnp.float32)
    return jnp.sum(part, axis=1)
