"""redo_detected: recompute a protected GEMM's detected blocks on the device, with no branch.

What a check detects but cannot locate is recomputed. The default slow path
(``_protected_matmul._checked_gemm``) is a loop of 0 or 1 trips that recomputes the whole GEMM;
on a GPU XLA reads every loop's predicate on the host, so each protected GEMM pays a device-to-host
copy and a wait whether anything was detected or not: on an H200 at 8192 x 4096 -> 1024 (bf16,
matmul-parts, 2026-12-02) 0.334 ms protected against 0.186 ms without the recompute.
``FaultPolicy.recompute_blocks`` has no branch but always gathers and multiplies its fixed number
of blocks (0.278 ms there) and redoes no more than that.

Here one Pallas (Triton) kernel is launched over every (row tile of 128, group of column blocks)
of the product. Each program reads its rows' flags for its blocks; only one holding a detected
block computes, block by block: each tile's K-long dot products in f32, the block's sums

    s1 = sum_j acc_ij,    s2 = sum_j (j + 1) acc_ij     (j: the column's place in its block)

and the values, cast to y's dtype and gated (non-finite, or beyond the gate's limit, replaced by
``fill`` and counted), written over the detected rows alone (y is aliased: every other value stays
as the first pass left it, corrections in place included). The sums are checked in the kernel
against the GEMM's own checks (c, mag, read in place) by the fused GEMM's test
(``_fused_check.sums_flags``: the f32 accumulator's bound, no rounding term); each program writes
four counts per row of its tile (blocks still failing, values gated, the first pass's gated count
there, blocks redone), zeros on a clean product, whose programs exit after reading their flags, and
four more: the first pass's own tally of its blocks (corrected in place, detected, flagged, values
gated), counted from the flags it reads anyway and the counts beside them, which spares the
protected GEMM a reduction of its own over them. One launch, a few KiB per program, and XLA sums
the counts. Counts per row, not per program, so that
on several devices each device's rows carry their own (``_redo_sharding``). Every detected block
is redone (no capacity); a redone block that fails again is reported uncorrectable, never silent.
Unlike the loop's second pass nothing is located in the recompute (a second fault in the same
block's recompute) and margins are not recorded for it.

The default on the GPUs that run it (``FaultPolicy.recompute_kernel=None``: NVIDIA, compute
capability 8.0 or newer; :func:`redo_kernel_chosen`), where it was timed against the loop: on an
H100 (2026-12-05) the 4-layer Llama-3-8B-dims training step took 116.1 ms with it, 132.0 with the
loop and 117.1 recomputing nothing; the forward GEMM at 8192 x 4096 -> 1024 (128-column blocks)
0.190 ms against 0.433 with the loop. bf16 and f16 operands (an f32 GEMM keeps the loop: Triton's
f32 dot would need its slow IEEE mode to stay inside the bound). On a CPU the loop stays the
default; there the kernel runs under Pallas' interpreter (``recompute_kernel=True``: tests; slow),
which jax (0.10.2, 0.11.2) cannot lower inside ``shard_map`` with its varying-axes checks on (it
refuses a ``pad`` of operands that vary over different mesh axes, and names ``check_vma=False`` as
the way round); a GPU's compiled kernel lowers there (``tests/test_flash.py``, ``tests/test_fused.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Pallas' Triton backend (deprecated in jax 0.11): without it the loop recomputes
    from jax.experimental.pallas import triton as plt
except ImportError:  # pragma: no cover - a jax that has dropped it
    plt = None
from jaxtyping import Array, Float, Int32

from ._abft import ABFT_CLEAN, ABFT_DETECTED
from ._dispatch import compute_device
from ._fused_check import sums_flags
from ._redo_sharding import REDO_STATS as _REDO_STATS
from ._redo_sharding import STATS as _STATS
from ._redo_sharding import partitioned, tally_parts
from ._vma import typed_like, vary_as

__all__ = ["redo_detected", "redo_kernel_applies", "redo_kernel_chosen", "redo_kernel_wanted"]

_BM = 128  # rows per program
_BN = 128  # columns per tile (the block width where that is narrower)
_BK = 64  # K per step of the dot loop (two bf16 operand tiles of 16 KiB per pipeline stage)
# Column tiles per program. Each program reserves the dot loop's shared memory (~64 KiB with two
# stages), so few fit an SM at once: a clean product's programs, which only read flags, come in
# waves. 16 tiles: 448 programs at 8192 x 14336, 64 at 8192 x 1024. A program holds whole blocks
# (it checks them), so a whole-row block is one program per row tile; a program holding a detected
# block recomputes its tiles one after another.
_TPP = 16


def _tile_n(width: int) -> int | None:
    """Columns per tile for blocks ``width`` wide, or None where no power-of-two tile of at least 16
    divides the block (Triton's tiles are powers of two)."""
    if width % _BN == 0:
        return _BN
    if 16 <= width < _BN and width & (width - 1) == 0:
        return width
    return None


def _tiling(block_n: int | None, n: int) -> tuple[int, int, int]:
    """``(bw, bn, bpp)``: the block's width, the columns per tile and the blocks per program. A
    whole-row block (``block_n`` None, or at least N) is any width, in tiles of 128 columns."""
    if block_n is None or block_n >= n:
        return n, _BN, 1
    bn = _tile_n(block_n)
    return block_n, bn, max(1, _TPP // (block_n // bn)) if bn else 0


def redo_kernel_applies(a, b, out_dtype, block_n: int | None, r: int, k: int, n: int) -> bool:
    """Whether :func:`redo_detected` takes this GEMM: bf16 or f16 operands of one dtype, a bf16, f16
    or f32 product, a non-empty shape, whole-row blocks or blocks a power-of-two tile divides, and a
    device that runs the kernel (:func:`_device_runs_it`)."""
    if a.dtype != b.dtype or a.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return False
    if min(r, k, n) <= 0:
        return False
    return _tiling(block_n, n)[1] is not None and _device_runs_it()


def _first_device():
    """The device JAX computes on (``_dispatch.compute_device``), or None where there is none."""
    return compute_device()


def redo_kernel_chosen(policy) -> bool:
    """Whether ``FaultPolicy(recompute_kernel=None)`` (the default) picks the kernel: no
    ``recompute_blocks`` and the device JAX computes on a GPU that runs it (:func:`_device_runs_it`). Not a
    CPU: there the loop it replaces costs no host round trip, and the kernel would run under Pallas'
    interpreter. Measured on an H100 (docs/gpu-tests.md, 2026-12-05): the 4-layer Llama-3-8B-dims
    step 116.1 ms with it against 132.0 with the loop."""
    return policy.recompute_blocks is None and _gpu_runs_it()


def _gpu_runs_it() -> bool:
    """Whether the device JAX computes on is a GPU that runs the kernels (not a CPU: there they would
    run under Pallas' interpreter); the checks kernel's choice too."""
    d = _first_device()
    return d is not None and d.platform != "cpu" and _device_runs_it()


def redo_kernel_wanted(policy) -> bool:
    """Whether ``policy`` asks for the kernel here: ``recompute_kernel`` as given, or where it is None
    (the default), :func:`redo_kernel_chosen`'s answer. (The GEMM must still be one it takes:
    :func:`redo_kernel_applies`.)"""
    return policy.recompute_kernel if policy.recompute_kernel is not None else redo_kernel_chosen(policy)


def _device_runs_it() -> bool:
    """Whether the kernel runs on the device JAX computes on: an NVIDIA GPU of compute capability 8.0 or
    newer (Triton's bf16 / f16 dots), or a CPU (under Pallas' interpreter). Elsewhere (an older or
    a ROCm GPU, where the interpreter would stand in on the device) and in a jax without Pallas'
    Triton backend the loop recomputes."""
    d = _first_device()
    if plt is None:
        return False
    if d is None or d.platform == "cpu":
        return d is not None
    if d.platform not in ("gpu", "cuda") or "rocm" in str(getattr(d.client, "platform_version", "")).lower():
        return False
    try:
        return float(str(getattr(d, "compute_capability", "0"))) >= 8.0
    except ValueError:
        return False


def load_a_tile(ref, g, rows, rmask, k0, kmask, a_t: bool):
    """The GEMM operand's tile of ``rows`` (mask ``rmask``) and ``len(kmask)`` K from ``k0`` (mask
    ``kmask``), zeros outside: (BM, BK) as stored, or with ``a_t`` ((K, R) stored) the (BK, BM) tile
    that ``plt.dot(..., trans_a=True)`` contracts over its first axis."""
    bk = kmask.shape[0]
    if a_t:
        return plt.load(ref.at[g, pl.ds(k0, bk), rows], mask=kmask[:, None] & rmask[None, :], other=0.0)
    return plt.load(ref.at[g, rows, pl.ds(k0, bk)], mask=rmask[:, None] & kmask[None, :], other=0.0)


def _kernel(a_ref, b_ref, flags_ref, counts_ref, c_ref, mag_ref, y_in_ref, y_ref, stats_ref, *, r, **kw):
    """One (GEMM, row tile, group of blocks): nothing unless a row of the tile is detected in a
    block of the group; then each such block is recomputed, tile by tile, and checked again. The
    program also counts its blocks' first-pass flags and gated values per row (the stats' last four
    columns), from the flags it reads anyway and the counts beside them, so the protected GEMM needs
    no reduction of its own over them."""
    del y_in_ref  # aliased to y_ref: what is not stored keeps its value
    g, i, jj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nb, bpp = kw["nb"], kw["bpp"]
    rows = pl.ds(i * _BM, _BM)
    rmask = i * _BM + jnp.arange(_BM) < r

    def flags_of(blk):  # (BM,) int32: the rows' flags in this block (clean past the last block)
        return plt.load(flags_ref.at[g, rows, blk], mask=rmask & (blk < nb), other=ABFT_CLEAN)

    def detected(blk):  # (BM,) bool: the rows detected in this block
        return flags_of(blk) == ABFT_DETECTED

    def block(t, stats):
        blk = jj * bpp + t
        redo = detected(blk)
        go = jnp.max(redo.astype(jnp.int32)) > 0
        return lax.cond(
            go, lambda st: st + _redo_block(refs, g, i, blk, rmask, redo, **kw), lambda st: st, stats
        )

    refs = (a_ref, b_ref, counts_ref, c_ref, mag_ref, y_ref)
    # The clean path: a few small gathers of flags and counts, then their tally written and exit.
    z = jnp.zeros((_BM,), jnp.int32)
    tally = (z,) * (_STATS - _REDO_STATS)  # corrected, detected, flagged, gated: per row
    for t in range(bpp):
        blk = jj * bpp + t
        cnt = plt.load(counts_ref.at[g, rows, blk], mask=rmask & (blk < nb), other=0)
        tally = tuple(s + p for s, p in zip(tally, tally_parts(flags_of(blk), cnt), strict=True))
    first = _columns(*(z,) * _REDO_STATS, *tally)
    anyd = jnp.max(tally[1]) > 0  # a row of the program's blocks detected
    stats = lax.cond(anyd, lambda st: lax.fori_loop(0, bpp, block, st), lambda st: st, first)
    plt.store(stats_ref.at[g, rows, jj, pl.ds(0, _STATS)], stats, mask=rmask[:, None])


def _redo_block(
    refs, g, i, blk, rmask, redo, *, k, n, nb, bw, bn, bpp, off, a_t, b_t, gate, fill, limit, lam, weighted
):
    """Block ``blk`` of row tile i: its tiles' K-long dot products, the detected rows stored, the
    block's sums checked against (c, mag) again. Returns this block's stats per row (BM, _STATS)."""
    del nb, bpp
    a_ref, b_ref, counts_ref, c_ref, mag_ref, y_ref = refs
    rows = pl.ds(i * _BM, _BM)
    tiles = pl.cdiv(bw, bn)  # a whole row: ragged; a block: bn divides it

    def tile(t, sums):
        j = blk * (bw // bn) + t  # the column tile (a whole row: blk = 0, t itself)
        cols = j * bn + jnp.arange(bn)
        cmask = (cols < n) & (cols < (blk + 1) * bw)

        def step(s, acc):
            ks = s * _BK + jnp.arange(_BK)
            kmask = ks < k
            x = load_a_tile(a_ref, g, rows, rmask, s * _BK, kmask, a_t)
            if b_t:  # (N, K) stored: a (BN, BK) tile
                w = plt.load(
                    b_ref.at[g, pl.ds(j * bn, bn), pl.ds(s * _BK, _BK)],
                    mask=cmask[:, None] & kmask[None, :],
                    other=0.0,
                )
            else:
                w = plt.load(
                    b_ref.at[g, pl.ds(s * _BK, _BK), pl.ds(j * bn, bn)],
                    mask=kmask[:, None] & cmask[None, :],
                    other=0.0,
                )
            # bf16 / f16 products are exact in f32; the accumulation is f32 (the check's bound).
            return acc + plt.dot(x, w, trans_a=a_t, trans_b=b_t).astype(jnp.float32)

        acc = lax.fori_loop(0, pl.cdiv(k, _BK), step, jnp.zeros((_BM, bn), jnp.float32))
        # Masked loads gave zeros past N, so those columns add nothing to the sums.
        place = (cols - blk * bw + 1).astype(jnp.float32)  # the column's place in its block
        v = acc.astype(y_ref.dtype)
        if gate:  # judged on the stored value, as the finish's gate is (gate_keep)
            # |v| <= min(limit, FLT_MAX) keeps exactly the finite values within the limit.
            bad = ~(jnp.abs(v.astype(jnp.float32)) <= limit) & cmask[None, :]
            v = jnp.where(bad, jnp.asarray(fill, y_ref.dtype), v)
            cnt = jnp.sum(bad.astype(jnp.int32), axis=1)
        else:
            cnt = jnp.zeros((_BM,), jnp.int32)
        plt.store(y_ref.at[g, rows, pl.ds(j * bn, bn)], v, mask=redo[:, None] & cmask[None, :])
        s1, s2, c0 = sums
        return s1 + jnp.sum(acc, axis=1), s2 + jnp.sum(acc * place[None, :], axis=1), c0 + cnt

    z = jnp.zeros((_BM,), jnp.float32)
    s1, s2, cnt = lax.fori_loop(0, tiles, tile, (z, z, jnp.zeros((_BM,), jnp.int32)))
    c1 = plt.load(c_ref.at[g, rows, off + blk, jnp.int32(0)], mask=rmask, other=0.0)
    c2 = plt.load(c_ref.at[g, rows, off + blk, jnp.int32(1)], mask=rmask, other=0.0) if weighted else c1
    mag = plt.load(mag_ref.at[g, rows, off + blk], mask=rmask, other=0.0)
    width = jnp.minimum(bw, n - blk * bw).astype(jnp.float32)
    again = sums_flags(s1, s2, c1, c2, mag, k, width, lam, weighted) != ABFT_CLEAN
    first = plt.load(counts_ref.at[g, rows, blk], mask=rmask, other=0)
    zero = jnp.zeros_like(cnt)
    redone = (redo & again, jnp.where(redo, cnt, zero), jnp.where(redo, first, zero), redo)
    return _columns(*redone, *(zero,) * (_STATS - _REDO_STATS))  # the tally's columns: added outside


def _columns(*rows):
    """(BM,) vectors as the columns of one (BM, len) int32 array, by selects (a Triton kernel has
    no concatenation)."""
    idx = jnp.arange(len(rows))[None, :]
    out = jnp.zeros((_BM, len(rows)), jnp.int32)
    for q, v in enumerate(rows):
        out = jnp.where(idx == q, v.astype(jnp.int32)[:, None], out)
    return out


@functools.partial(
    jax.jit,
    static_argnames=("block_n", "off", "a_t", "b_t", "gate", "fill", "limit", "lam", "weighted", "interpret"),
)
def _redo_call(
    a,
    b,
    flags,
    counts,
    c,
    mag,
    y,
    *,
    block_n,
    off,
    a_t,
    b_t,
    gate,
    fill,
    limit,
    lam,
    weighted=True,
    interpret=False,
):
    """``(y, stats)``: y with its detected rows' blocks recomputed, and per row and program (G, R,
    groups of blocks, 8) int32: blocks still failing, values the redo gated, the first pass's gated
    count in the redone blocks, blocks redone; then the first pass's blocks corrected, detected and
    flagged, and its values gated, in the program's blocks (``_redo_sharding.tally_columns``)."""
    g, r, n = y.shape
    k = a.shape[1] if a_t else a.shape[2]
    nb = flags.shape[-1]
    bw, bn, bpp = _tiling(block_n, n)
    kern = functools.partial(
        _kernel, r=r, k=k, n=n, nb=nb, bw=bw, bn=bn, bpp=bpp, off=off, a_t=a_t, b_t=b_t,
        gate=gate, fill=fill, limit=limit, lam=lam, weighted=weighted,
    )  # fmt: skip
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=8, num_stages=2))
    grid = (g, pl.cdiv(r, _BM), pl.cdiv(nb, bpp))
    operands = (a, b, flags, counts, c, mag, y)
    out = pl.pallas_call(
        kern,
        out_shape=(y, typed_like(jax.ShapeDtypeStruct((g, r, grid[2], _STATS), jnp.int32), *operands)),
        grid=grid,
        in_specs=[any_spec] * 7,
        out_specs=(any_spec, any_spec),
        input_output_aliases={6: 0},
        interpret=interpret,
        name="pimlayers_redo_detected",
        **params,
    )(*operands)
    return vary_as(out, *operands)  # inside shard_map: the results vary as the operands do (ops._vma)


def redo_detected(
    a: Float[Array, "g r k"],
    b: Float[Array, "g k n"],
    c: Float[Array, "g r nb2 2"],
    mag: Float[Array, "g r nb2"],
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
    block_offset: int = 0,
    weighted: bool = True,
    tally: bool = False,
) -> tuple:
    """Recompute every (row, block) of ``out`` flagged ``ABFT_DETECTED``, in place, and check it again.

    ``a`` is (G, K, R) with ``a_t``, ``b`` (G, N, K) with ``b_t`` (read in place); ``c``, ``mag``
    the GEMM's checks, this product's nb blocks from ``block_offset`` on (a check GEMM shared by
    several products, read in place); ``flags`` and ``counts`` the first pass's per block.
    Returns ``(out, gated, still, recomputed)`` as ``_protected_matmul._redo_blocks`` does: ``gated``
    corrects the first pass's gated count (each redone block's new count replaces its first one),
    ``still`` counts redone blocks whose sums still disagree with their checks (uncorrectable),
    ``recomputed`` the GEMMs of the G that had anything redone. ``weighted=False``: the checks hold
    no c2 (not read); a redone block is judged on its plain sums alone.

    ``tally=True`` also returns, fifth, ``_protected_matmul._tally``'s four (G,) counts of the first
    pass (blocks corrected in place, detected, flagged at all; values gated), counted by the kernel's
    programs from the flags they read anyway: the protected GEMM then needs no reduction of its own
    over flags and counts (on an H100, 0.40 ms of small kernels in a 4-layer Llama-3-8B step,
    profile-sources-s49).
    """
    lim = min(math.inf if limit is None else float(limit), float(jnp.finfo(jnp.float32).max))
    kw = dict(
        block_n=block_n, off=int(block_offset), a_t=a_t, b_t=b_t, gate=gate, fill=float(fill), limit=lim,
        lam=float(lam), weighted=bool(weighted),
    )  # fmt: skip

    def call(*args):  # Triton on a GPU; Pallas' interpreter elsewhere (a CPU: tests)
        return lax.platform_dependent(
            *args,
            cuda=functools.partial(_redo_call, **kw),
            default=functools.partial(_redo_call, **kw, interpret=True),
        )

    # Each device redoes its own rows (``_redo_sharding``); on one device the plain call.
    out, stats = partitioned(call, a_t, b_t)(a, b, flags, counts, c, mag, out)
    # Every program wrote its rows' stats (zeros where it redid nothing): XLA adds them up.
    total = jnp.sum(stats, axis=(1, 2), dtype=jnp.int32)  # (G, 8)
    still = jnp.sum(total[:, 0], dtype=jnp.int32)
    gated = jnp.sum(total[:, 1] - total[:, 2], dtype=jnp.int32)
    recomputed = jnp.sum(total[:, 3] > 0, dtype=jnp.int32)
    if tally:
        return out, gated, still, recomputed, tuple(total[:, _REDO_STATS + q] for q in range(4))
    return out, gated, still, recomputed
