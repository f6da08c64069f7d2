"""redo_detected: recompute a protected GEMM's detected blocks on the device, with no branch.

What a check detects but cannot locate is recomputed. The default slow path
(``_protected_matmul._checked_gemm``) is a loop of 0 or 1 trips that recomputes the whole GEMM;
on a GPU XLA reads every loop's predicate on the host, so each protected GEMM pays a device-to-host
copy and a wait whether anything was detected or not: on an H200 at 8192 x 4096 -> 1024 (bf16,
matmul-parts, 2026-12-02) 0.334 ms protected against 0.186 ms without the recompute.
``FaultPolicy.recompute_blocks`` has no branch but always gathers and multiplies its fixed number
of blocks (0.278 ms there) and redoes no more than that.

Here one Pallas (Triton) kernel is launched over every (row tile, column tile) of the product. Each
program reads its rows' flags for its column block; only one holding a detected block computes:
the tile's K-long dot products in f32, their partial block sums

    s1 = sum_j acc_ij,    s2 = sum_j (j + 1) acc_ij     (j: the column's place in its block)

and the values, cast to y's dtype and gated (non-finite, or beyond the gate's limit, replaced by
``fill`` and counted), written over the detected rows alone (y is aliased: every other value stays
as the first pass left it, corrections in place included). On a clean product every program exits
after reading its flags: one launch and 4 bytes per row and column tile. Every detected block is
redone (no capacity).

The sums are checked against the GEMM's own checks (c, mag) as the fused GEMM's are
(``_fused_check.sums_flags``: the f32 accumulator's bound, no rounding term): a redone block that
fails again is reported uncorrectable, never silent. Unlike the loop's second pass nothing is
located in the recompute (a second fault in the same block's recompute) and margins are not
recorded for it.

Opt-in (``FaultPolicy(recompute_kernel=True)``) until timed against the loop on a GPU; bf16 and f16
operands (an f32 GEMM keeps the loop: Triton's f32 dot would need its slow IEEE mode to stay inside
the bound). On a CPU the kernel runs under Pallas' interpreter (tests; slow).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int32

from ._abft import ABFT_CLEAN, ABFT_DETECTED
from ._fused_check import sums_flags

__all__ = ["redo_detected", "redo_kernel_applies"]

_BM = 128  # rows per program
_BN = 128  # columns per program (the block width where that is narrower)
_BK = 64  # K per step of the dot loop (two bf16 operand tiles of 16 KiB per pipeline stage)
# Column tiles per program. Each program reserves the dot loop's shared memory (~64 KiB with two
# stages), so few fit an SM at once: a clean product's programs, which only read flags, come in
# waves. 16 tiles: 448 programs at 8192 x 14336, 64 at 8192 x 1024; a program holding a detected
# block recomputes its detected tiles one after another (at most 16 x 128 columns).
_TPP = 16


def _tile_n(width: int) -> int | None:
    """Columns per program for blocks ``width`` wide, or None where no power-of-two tile of at
    least 16 divides the block (Triton's tiles are powers of two)."""
    if width % _BN == 0:
        return _BN
    if 16 <= width < _BN and width & (width - 1) == 0:
        return width
    return None


def _tiling(block_n: int | None, n: int) -> tuple[int, int]:
    """``(bw, bn)``: the block's width and the columns per program. A whole-row block (``block_n``
    None, or at least N) is any width: its tiles of 128 columns add up to the row's sums."""
    if block_n is None or block_n >= n:
        return n, _BN
    return block_n, _tile_n(block_n)


def redo_kernel_applies(a, b, out_dtype, block_n: int | None, r: int, k: int, n: int) -> bool:
    """Whether :func:`redo_detected` takes this GEMM: bf16 or f16 operands of one dtype, a bf16, f16
    or f32 product, a non-empty shape, and whole-row blocks or blocks a power-of-two tile divides."""
    if a.dtype != b.dtype or a.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return False
    if min(r, k, n) <= 0:
        return False
    return _tiling(block_n, n)[1] is not None


def _kernel(a_ref, b_ref, flags_ref, y_in_ref, y_ref, s1_ref, s2_ref, cnt_ref, *, r, **kw):
    """One (GEMM, row tile, group of column tiles): nothing unless a row of the tile is detected in
    a block of the group; then each column tile holding one is recomputed, one after another."""
    del y_in_ref  # aliased to y_ref: what is not stored keeps its value
    g, i, jj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n, bn, bw = kw["n"], kw["bn"], kw["bw"]
    nt = pl.cdiv(n, bn)
    rmask = i * _BM + jnp.arange(_BM) < r

    def detected(j):  # (BM,) bool: the tile's rows detected in its block (none past the last tile)
        flags = plt.load(
            flags_ref.at[g, pl.ds(i * _BM, _BM), (j * bn) // bw], mask=rmask & (j < nt), other=ABFT_CLEAN
        )
        return flags == ABFT_DETECTED

    # The clean path: TPP small gathers of flags, then exit. (A program per column tile was ~7000
    # programs at 8192 x 14336, each reserving the K loop's shared memory for its few loads.)
    anyd = jnp.int32(0)
    for t in range(_TPP):
        anyd = jnp.maximum(anyd, jnp.max(detected(jj * _TPP + t).astype(jnp.int32)))

    @pl.when(anyd > 0)
    def _():
        def tile(t, carry):
            j = jj * _TPP + t
            redo = detected(j)

            @pl.when(jnp.max(redo.astype(jnp.int32)) > 0)
            def _():
                _redo_tile(a_ref, b_ref, (y_ref, s1_ref, s2_ref, cnt_ref), g, i, j, rmask, redo, **kw)

            return carry

        lax.fori_loop(0, _TPP, tile, 0)


def _redo_tile(a_ref, b_ref, outs, g, i, j, rmask, redo, *, k, n, bw, bn, a_t, b_t, gate, fill, limit):
    """Column tile j of row tile i: its K-long dot products, the detected rows stored, the sums."""
    y_ref, s1_ref, s2_ref, cnt_ref = outs
    cols = j * bn + jnp.arange(bn)
    cmask = cols < n

    def step(t, acc):
        ks = t * _BK + jnp.arange(_BK)
        kmask = ks < k
        if a_t:  # (K, R) stored: a (BK, BM) tile, contracted over its first axis
            x = plt.load(
                a_ref.at[g, pl.ds(t * _BK, _BK), pl.ds(i * _BM, _BM)],
                mask=kmask[:, None] & rmask[None, :],
                other=0.0,
            )
        else:
            x = plt.load(
                a_ref.at[g, pl.ds(i * _BM, _BM), pl.ds(t * _BK, _BK)],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            )
        if b_t:  # (N, K) stored: a (BN, BK) tile
            w = plt.load(
                b_ref.at[g, pl.ds(j * bn, bn), pl.ds(t * _BK, _BK)],
                mask=cmask[:, None] & kmask[None, :],
                other=0.0,
            )
        else:
            w = plt.load(
                b_ref.at[g, pl.ds(t * _BK, _BK), pl.ds(j * bn, bn)],
                mask=kmask[:, None] & cmask[None, :],
                other=0.0,
            )
        # bf16 / f16 products are exact in f32; the accumulation is f32 (the check's bound).
        return acc + plt.dot(x, w, trans_a=a_t, trans_b=b_t).astype(jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(k, _BK), step, jnp.zeros((_BM, bn), jnp.float32))
    # Masked loads gave zeros past N, so those columns add nothing to the sums.
    place = (cols - (j * bn) // bw * bw + 1).astype(jnp.float32)  # the column's place in its block
    v = acc.astype(y_ref.dtype)
    if gate:  # judged on the stored value, as the finish's gate is (gate_keep)
        # |v| <= min(limit, FLT_MAX) keeps exactly the finite values within the limit.
        bad = ~(jnp.abs(v.astype(jnp.float32)) <= limit)
        v = jnp.where(bad, jnp.asarray(fill, y_ref.dtype), v)
        cnt = jnp.sum((bad & redo[:, None] & cmask[None, :]).astype(jnp.float32), axis=1)
    else:
        cnt = jnp.zeros((_BM,), jnp.float32)
    sums = (jnp.sum(acc, axis=1), jnp.sum(acc * place[None, :], axis=1), cnt)
    for ref, val in zip((s1_ref, s2_ref, cnt_ref), sums, strict=True):
        plt.store(ref.at[g, j, pl.ds(i * _BM, _BM)], val, mask=rmask)
    plt.store(y_ref.at[g, pl.ds(i * _BM, _BM), pl.ds(j * bn, bn)], v, mask=redo[:, None] & cmask[None, :])


@functools.partial(jax.jit, static_argnames=("block_n", "a_t", "b_t", "gate", "fill", "limit", "interpret"))
def _redo_call(a, b, flags, y, *, block_n, a_t, b_t, gate, fill, limit, interpret=False):
    """``(y, s1, s2, cnt)``: y with its detected rows' blocks recomputed; s1, s2 and the gated count,
    (G, tiles, R) f32 per column tile and row, written only where the tile was redone."""
    g, r, n = y.shape
    k = a.shape[1] if a_t else a.shape[2]
    bw, bn = _tiling(block_n, n)
    nt = pl.cdiv(n, bn)
    kern = functools.partial(
        _kernel, r=r, k=k, n=n, bw=bw, bn=bn, a_t=a_t, b_t=b_t, gate=gate, fill=fill, limit=limit
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=8, num_stages=2))
    return pl.pallas_call(
        kern,
        out_shape=(y, *[jax.ShapeDtypeStruct((g, nt, r), jnp.float32)] * 3),
        grid=(g, pl.cdiv(r, _BM), pl.cdiv(nt, _TPP)),
        in_specs=[any_spec] * 4,
        out_specs=(any_spec,) * 4,
        input_output_aliases={3: 0},
        interpret=interpret,
        name="pimlayers_redo_detected",
        **params,
    )(a, b, flags, y)


def redo_detected(
    a: Float[Array, "g r k"],
    b: Float[Array, "g k n"],
    c: Float[Array, "g r nb 2"],
    mag: Float[Array, "g r nb"],
    out: Float[Array, "g r n"],
    flags: Int32[Array, "g r nb"],
    counts: Int32[Array, "g r nb"],
    *,
    block_n: int | None,
    lam: float,
    gate: bool,
    fill: float,
    limit: float | None,
    a_t: bool = False,
    b_t: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Recompute every (row, block) of ``out`` flagged ``ABFT_DETECTED``, in place, and check it again.

    ``a`` is (G, K, R) with ``a_t``, ``b`` (G, N, K) with ``b_t`` (read in place); ``c``, ``mag`` are
    this product's own checks (its nb blocks); ``flags`` and ``counts`` the first pass's per block.
    Returns ``(out, gated, still, recomputed)`` as ``_protected_matmul._redo_blocks`` does: ``gated``
    corrects the first pass's gated count (each redone block's new count replaces its first one),
    ``still`` counts redone blocks whose sums still disagree with their checks (uncorrectable),
    ``recomputed`` the GEMMs of the G that had anything redone.
    """
    g, r, n = out.shape
    k = a.shape[1] if a_t else a.shape[2]
    nb = flags.shape[-1]
    lim = min(math.inf if limit is None else float(limit), float(jnp.finfo(jnp.float32).max))
    kw = dict(block_n=block_n, a_t=a_t, b_t=b_t, gate=gate, fill=float(fill), limit=lim)
    # Triton on a GPU; Pallas' interpreter elsewhere (a CPU: tests).
    out, *part = lax.platform_dependent(
        a,
        b,
        flags,
        out,
        cuda=functools.partial(_redo_call, **kw),
        default=functools.partial(_redo_call, **kw, interpret=True),
    )
    bw, bn = _tiling(block_n, n)
    nt = part[0].shape[1]
    per = nt if bw == n else bw // bn  # column tiles per block

    def per_block(v):  # (G, tiles, R) -> (G, R, nb): a block's tiles summed (tiles past N: zeros)
        v = jnp.pad(v, ((0, 0), (0, nb * per - nt), (0, 0)))
        return jnp.swapaxes(v.reshape(g, nb, per, r).sum(2), 1, 2)

    s1, s2, cnt = (per_block(v) for v in part)
    width = jnp.minimum(bw, n - jnp.arange(nb) * bw).astype(jnp.float32).reshape(1, 1, nb)
    pend = flags == ABFT_DETECTED
    # Where nothing was redone the sums were never written: only detected blocks read them.
    again = sums_flags(s1, s2, c, mag, k, width, lam) != ABFT_CLEAN
    still = jnp.sum(pend & again, dtype=jnp.int32)
    new = jnp.sum(jnp.where(pend, cnt.astype(jnp.int32), 0), dtype=jnp.int32)
    gated = new - jnp.sum(jnp.where(pend, counts, 0), dtype=jnp.int32)
    recomputed = jnp.sum(jnp.any(pend, axis=(1, 2)), dtype=jnp.int32)
    return out, gated, still, recomputed
