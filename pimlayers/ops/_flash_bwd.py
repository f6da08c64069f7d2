"""flash_attention_bwd: attention's backward on Hopper, from the forward's output and logsumexp, with
all of its GEMMs verified inside the kernels.

Two Pallas Mosaic-GPU kernels, as JAX's ``attention_mgpu`` splits its (non-causal, f16) backward:
one per block of query rows for dq, one per block of key rows for dk and dv. Each has one TMA
warpgroup streaming the other side's blocks and two compute warpgroups of 64 rows; this one adds
causal masking, grouped-query heads (the dk/dv kernel walks the group's query heads itself, so dk
and dv are summed in f32 inside the kernel), bf16, and the checksums. With p = exp(s·scale - lse),
δ = rowsum(do ∘ out) and ds = p ∘ (dp - δ):

dq kernel (per query row r, over key blocks j of ``block_kv``):

* s = q·kᵀ and dp = do·vᵀ: each block's row sums against q·ksum_j and do·vsum_j, from the GEMMs'
  own wgmma (the key and value tiles extended by an 8-row tile [hi, lo, 0 x 6] of their row sums,
  N = block_kv + 8, as the forward's scores check). Each row keeps the largest |difference| over
  its steps, divided by the row's bound once after the loop, as the forward does (the largest
  ratio is the largest difference over one bound, bit for bit; NaN survives the maximum, which
  propagates it). Dividing at every step took the verified backward 3.997 ms against 3.929 on an
  H100 (B = 1, T = 8192, 32/8 heads; ``python -m benchmarks.rev_ab --case flash``, rev-ab-s49).
  One row sum over the product and its check columns together (the tile holding minus the sums),
  in place of two, measured no faster (3.951 ms, rev-ab-s49neg) and was not kept;
* dq = ds·k: at the end, dq's row sums against Σ_j ds_j·kd_j (kd = each key row summed over D),
  accumulated by a small wgmma (N = 8) beside dq's; a second one, of |ds| against the same tile's
  third row ‖k_c‖₁, measures the magnitude the bound scales with.

dk/dv kernel (per key row c, over the group's query heads and query blocks i of ``block_q``):

* sᵀ = k·qᵀ and dpᵀ = v·doᵀ: row sums against k·qsum_i and v·dosum_i, fused as above;
* dv = pᵀ·do and dk = dsᵀ·q: at the end, row sums against Σ pᵀ·dod and Σ dsᵀ·qd (dod, qd: each
  row of do, q summed over D), from two small wgmmas into one accumulator (N = 8: the dod tile's
  rows are [hi, lo, ‖do_q‖₁, 0 x 5], the qd tile's [0 x 3, hi, lo, 0 x 3]), whose third column is
  the magnitude Σ p·‖do‖₁ (p >= 0). dk's magnitude Σ |ds|·‖q‖₁ is bounded per query block by
  Σ |ds| times the block's largest ‖q‖₁ (for Gaussian q about 1.2 times the block's mean, so about
  that much looser), on the tensor cores: a third small wgmma into the same accumulator, |ds16|
  against the ``qm`` tile (row 5: each query block's largest ‖q‖₁, rounded up to bf16). It replaced
  an f32 sum of |ds| per element per step beside the softmax (and an earlier third wgmma with an
  accumulator of its own, which kept another register operand live: 5.13 ms against 4.57 on an
  H200): on an H100 (2026-12-05, T = 8192, 32/8 heads, B = 1, two rounds in alternating
  processes) the verified backward took 4.11-4.12 ms against 4.32-4.34 (its two Mosaic kernels 3.85
  against 4.08; without checks 3.09 either way).

Bounds (``lam`` as :class:`pimlayers.FaultPolicy`'s; u = 2^-24):

    block checks (s, dp, sᵀ, dpᵀ): u (lam (2 sqrt(D) + sqrt(block) + 2) + 64) |a row|·bmax
    dq:     c(S)     Σ_c |ds[r, c]| ‖k_c‖₁
    dv, dk: c(G T)   Σ_q p[q, c] ‖do_q‖₁,  Σ_i (Σ_{q in i} |ds[q, c]|) max_{q in i} ‖q_q‖₁
    c(n) = u (lam (sqrt(n) + sqrt(D) + 2) + 64) (1 + 2^-6)

bmax is the elementwise maximum over blocks of the block's summed |rows| (so one bound per row serves
every block); the accumulated checks' magnitudes are the rounding error's own scale (an f32 sum of
n products errs by about u sqrt(n) times the sum of their magnitudes), measured on the tensor cores
from the bf16 p and ds the GEMMs multiply, the norms rounded up to bf16 (dk's from the f32 ds, its
block maxima scaled by 1 + 2^-7 to cover ds's rounding to bf16). The 64
covers the hi/lo split of the checksums (2^-18 relative). A first version bounded Σ |ds| a priori
(Cauchy-Schwarz on dp, maxima over rows) and missed a flipped exponent bit in dk: its bound was
about 10^4 times the rounding.

Each kernel writes, per row, |difference| / bound of each of its GEMMs (NaN or Inf: _BAD): a row
above 1 was hit by a fault. :func:`pimlayers.layers.attention_core`'s backward reruns the kernels
when a row fails and reports it: by default :func:`flash_attention_bwd_with_redo`, both kernels
launched again over every CTA with a flag each (a CTA whose rows passed exits at once, one whose
rows failed recomputes them over the first pass's results, in place), so no branch and no host
round trip; otherwise a loop over both. Bit flips can be injected inside the kernels
(``FlashBwdFaults``).
Reference: ``flash_attention_bwd_reference`` (the same quantities from XLA, materialised).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int32

from ._common import config_resolved
from ._flash import (
    _U,
    CS,
    _block_sums,
    _c_block,
    _flip,
    _fold_vmap,
    _in_place,
    _load,
    _ratio,
    _split,
    _stream,
    _tile,
    _tile_sum,
    _xla_bounds_unless_asked,
    bounds_kernel,
)
from ._fused_gemm import hopper
from ._vma import typed_like, vary_as

__all__ = [
    "FlashBwdChecks",
    "FlashBwdConfig",
    "FlashBwdFaults",
    "flash_attention_bwd",
    "flash_attention_bwd_reference",
    "flash_attention_bwd_with_redo",
    "flash_attention_bwd_with_redo_reference",
    "flash_bwd_supported",
    "redo_flags_bwd",
]

_LN2 = math.log(2.0)
# The dk/dv kernel's check accumulator (keys x CS), shared by four small wgmmas per step: p16 against
# [dod hi, dod lo, ‖do‖₁] (columns 0-2), ds16 against qd's rows 3 and 4, and |ds16| against qm's
# row 5 (dk's magnitude, Σ |ds|·max ‖q‖₁ on the tensor cores).
_QM_ROW = 5


@dataclasses.dataclass(frozen=True)
class FlashBwdConfig:
    """Tiling: ``block_q`` query rows per compute warpgroup in the dq kernel and per streamed block in
    the dk/dv kernel, ``block_kv`` key rows the other way round; ``stages`` blocks in flight. On an
    H200 (B = 1, T = 8192, 32/8 heads, D = 128, causal) 64/64/2 took 5.07 ms with the checks, 64/128
    22.1, 128/64 9.3, three stages 5.26; JAX's non-causal Pallas backward also ran fastest at 64.
    ``fused``: one kernel instead of two (below)."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2
    # One kernel for dq, dk and dv at D = 128 (:mod:`._flash_bwd_kv`): five GEMMs per block pair
    # instead of seven, but slower on the H200 (2026-12-04, B = 1, T = 8192, 32/8 heads): 8.17 ms
    # against 4.51 with the checks, 3.72 against 3.34 without. Opt-in until it wins.
    fused: bool = False
    # The checksum tiles and bounds from three Pallas (Triton) kernels that read q, do and out once,
    # k and v twice (``_flash_bwd_bounds``), instead of XLA's passes. None (the default): the Triton
    # kernels on a GPU, XLA's elsewhere and in the reference; True: the kernels everywhere (Pallas'
    # interpreter off a GPU, for tests); False: XLA's everywhere. On an H100 (2026-12-05, B = 1,
    # T = 8192, 32/8 heads, D = 128) 0.165 ms against XLA's 0.263 (``python -m benchmarks.run
    # --suite bounds``), the verified backward 4.015 ms against 4.152 (``python -m
    # benchmarks.rev_ab``).
    bounds_kernel: bool | None = None


def resolved_bwd(config: FlashBwdConfig | None) -> FlashBwdConfig:
    """``config`` (None: the default) with ``bounds_kernel`` as the environment decides it
    (:func:`pimlayers.ops._flash.bounds_kernel`), before the kernels' jit sees it."""
    cfg = config or FlashBwdConfig()
    return dataclasses.replace(cfg, bounds_kernel=bounds_kernel(cfg.bounds_kernel))


def bwd_gemms(d: int, config: FlashBwdConfig | None = None) -> tuple[str, ...]:
    """The GEMMs the backward runs and checks at head dimension d: all seven of the two kernels, or
    the fused kernel's five (no query-row s and dp: it forms them once, as sᵀ and dpᵀ)."""
    return ("dq", *_K_GEMMS) if _fused(d, config) else _Q_GEMMS + _K_GEMMS


def _fused(d: int, config: FlashBwdConfig | None) -> bool:
    # Each warpgroup forms one 64-column half of dq: at D = 64 a half would split a swizzled tile.
    return (config or FlashBwdConfig()).fused and d == 128


class FlashBwdChecks(NamedTuple):
    """|checksum difference| / bound per row of each GEMM (> 1: a fault). Query rows (B, H, T) for the
    dq kernel's GEMMs, key rows (B, KV, S) for the dk/dv kernel's. The fused kernel runs no query-row
    s and dp: ``scores`` and ``dp`` are None there (:func:`bwd_gemms` names the GEMMs run)."""

    scores: Float[Array, "b h t"]
    dp: Float[Array, "b h t"]
    dq: Float[Array, "b h t"]
    scores_t: Float[Array, "b kv s"]
    dp_t: Float[Array, "b kv s"]
    dv: Float[Array, "b kv s"]
    dk: Float[Array, "b kv s"]


# (dq, dk, dv, the first pass's checks, the final checks): what the backward with its redo returns.
_Redone = tuple[
    Float[Array, "b t h d"],
    Float[Array, "b s kv d"],
    Float[Array, "b s kv d"],
    FlashBwdChecks,
    FlashBwdChecks,
]


class FlashBwdFaults(NamedTuple):
    """In-kernel bit flips: per GEMM None (none) or a pair ``(bit, col)`` of int32 arrays, one site per
    row (bit -1: none). Query-row GEMMs take (B, H, T) arrays, key-row GEMMs (B, KV, S). ``col`` is a
    key index for ``scores``/``dp``, a query index for ``scores_t``/``dp_t`` (flipped in each query
    head of the group, as one faulty lane would be reused), a column of D for ``dq``/``dk``/``dv``
    (flipped in the accumulator after the last step, before the check and the scaling)."""

    scores: tuple | None = None
    dp: tuple | None = None
    dq: tuple | None = None
    scores_t: tuple | None = None
    dp_t: tuple | None = None
    dv: tuple | None = None
    dk: tuple | None = None


_Q_GEMMS = ("scores", "dp", "dq")
_K_GEMMS = ("scores_t", "dp_t", "dv", "dk")


def flash_bwd_supported(q_shape, k_shape, dtype, causal: bool, config: FlashBwdConfig | None = None) -> bool:
    """Whether the kernels take these shapes and dtype (they run on a Hopper GPU only)."""
    cfg = config or FlashBwdConfig()
    if len(q_shape) != 4 or len(k_shape) != 4:
        return False
    b, t, h, d = q_shape
    b2, s, kv, d2 = k_shape
    return (
        jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
        and b == b2
        and d == d2
        and d in (64, 128)
        and kv > 0
        and h % kv == 0
        and t > 0
        and t % (2 * cfg.block_q) == 0
        and s % (2 * cfg.block_kv) == 0
        and (not causal or (t == s and (2 * cfg.block_kv) % cfg.block_q == 0))
    )


def _row_sums(x, vec, other=None, norms: bool = True):
    """(B, L, H, D) -> (B, L, H) f32 each: with ``norms`` every row's sum and L1 norm, then |row|·vec
    (vec (B, H, D): the blocks' bound factor) and, given ``other`` (x's shape), the row's dot with it.
    All reduce over D from one read of x, which XLA fuses into one kernel (an einsum for |row|·vec, a
    dot at HIGHEST, read x again). f32 products summed in f32: that dot's value to a relative 2^-17
    at D = 128, far inside the bounds' slack."""
    xf = x.astype(jnp.float32)
    out = (jnp.sum(xf, axis=-1), jnp.sum(jnp.abs(xf), axis=-1)) if norms else ()
    out += (jnp.sum(jnp.abs(xf) * vec[:, None], axis=-1),)
    return out if other is None else (*out, jnp.sum(xf * other.astype(jnp.float32), axis=-1))


def _c_sum(lam: float, d: int, n: int) -> float:
    # 64: the checksums' hi/lo split (2^-18 relative); 1 + 2^-6: slack for the measured magnitude's
    # own f32 accumulation (its bf16 norms are already rounded up, _tile_mag).
    return _U * (lam * (math.sqrt(n) + math.sqrt(d) + 2) + 64) * (1 + 2.0**-6)


def _tile_at(hi, lo, row: int):
    """(..., n) -> (..., CS, n): hi and lo in rows ``row`` and ``row + 1``, zeros elsewhere."""
    z = jnp.zeros((*hi.shape[:-1], 1, hi.shape[-1]), hi.dtype)
    rows = [z] * row + [hi[..., None, :], lo[..., None, :]] + [z] * (CS - row - 2)
    return jnp.concatenate(rows, axis=-2)


def _tile_mag(hi, lo, mag):
    """(..., n) -> (..., CS, n): rows hi, lo, then ``mag`` rounded to bf16 upwards (x (1 + 2^-7), then
    to nearest, is at least mag), then zeros."""
    up = (mag * (1 + 2.0**-7)).astype(hi.dtype)
    rows = [hi[..., None, :], lo[..., None, :], up[..., None, :]]
    return jnp.concatenate([*rows, jnp.zeros((*hi.shape[:-1], CS - 3, hi.shape[-1]), hi.dtype)], axis=-2)


def _with_qm(bounds: dict, q1max, bq: int, dtype) -> dict:
    """``bounds`` with the ``qm`` tile from each query block's largest ‖q‖₁ (B, H, T/bq)."""
    # Rounded up: x (1 + 2^-7), then to the nearest bf16 (within 2^-8), is at least the maximum.
    qm = (q1max * (1 + 2.0**-7)).astype(dtype)
    rows = [jnp.zeros((*qm.shape, 1, bq), dtype)] * CS
    rows[_QM_ROW] = jnp.broadcast_to(qm[..., None, None], (*qm.shape, 1, bq))
    return bounds | dict(qm=jnp.concatenate(rows, axis=-2))


def flash_bwd_bounds(q, k, v, do, *, lam: float, config: FlashBwdConfig | None = None, out=None) -> dict:
    """The checksum tiles and per-row bounds the kernels read (all small next to q, k, v): from three
    Triton kernels on a GPU, from XLA elsewhere (``FlashBwdConfig.bounds_kernel`` chooses otherwise).

    Tiles (operands' dtype): ``ks``, ``vs`` (B, KV, S/bk, CS, D) and ``qs``, ``dos`` (B, H, T/bq, CS, D)
    hi/lo rows of each block's row sum; ``kd`` (B, KV, S/bk, CS, bk) and ``dod`` (B, H, T/bq, CS, bq)
    hi/lo rows of each row summed over D, then its L1 norm; ``qd`` (B, H, T/bq, CS, bq) the same sums
    in rows 3 and 4 (dk's check shares dv's accumulator), no norm; ``qm`` (B, H, T/bq, CS, bq) each
    query block's largest ‖q‖₁ rounded up to bf16 in row 5 of every query's column, zeros elsewhere
    (the kernel's |ds|·qm in that accumulator's column 5). Rows (f32): the block
    checks' bounds ``tol_s``, ``tol_dp`` (B, H, T) and ``tol_st``, ``tol_dpt`` (B, KV, S). Scalars:
    ``c_dq``, ``c_kv``, the accumulated checks' factors (times the kernel's measured magnitudes). Given
    ``out`` (q's shape), also ``delta`` (B, H, T) f32: rowsum(do ∘ out), from do's same read.

    Every operand is read twice: once for its blocks' sums (over rows), once for its rows' sums (over
    D), whose bound factors come from the other side's blocks (k's from q's, q's from k's), so that
    order is fixed: all the block sums first (XLA's). The Triton kernels form the same arrays reading
    q, do and out once, k and v twice (:mod:`._flash_bwd_bounds`; sums in another order, to f32
    rounding).
    """
    cfg = config or FlashBwdConfig()
    _, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g, bq, bk = h // kvh, cfg.block_q, cfg.block_kv
    c_b, c_q = _c_block(lam, d, bk), _c_block(lam, d, bq)
    xla = functools.partial(_xla_bwd_bounds, bq=bq, bk=bk, c_b=c_b, c_q=c_q)
    choice = bounds_kernel(cfg.bounds_kernel)  # PIMLAYERS_BOUNDS_KERNEL=0: None means False
    if choice is False:
        res = xla(q, k, v, do, out)
    else:
        from ._flash_bwd_bounds import flash_bwd_bounds_kernel

        kernel = functools.partial(flash_bwd_bounds_kernel, bq=bq, bk=bk, cs=CS, c_b=c_b, c_q=c_q)
        # Triton on a GPU; elsewhere XLA's, or (True) the kernels in Pallas' interpreter (tests).
        other = functools.partial(kernel, interpret=True) if choice else xla
        res = lax.platform_dependent(q, k, v, do, out, cuda=kernel, default=other)
    consts = dict(c_dq=_c_sum(lam, d, s), c_kv=_c_sum(lam, d, g * t))
    return _with_qm(res, res.pop("q1max"), bq, q.dtype) | consts


def _xla_bwd_bounds(q, k, v, do, out, *, bq: int, bk: int, c_b: float, c_q: float) -> dict:
    """:func:`flash_bwd_bounds`' arrays from XLA, each query block's largest ‖q‖₁ as ``q1max`` (B, H,
    T/bq) in place of the ``qm`` tile, no scalars."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    # Block sums and |block| sums (B, L/n, heads, D), materialised before the tiles are built (XLA
    # fused into the concatenation recomputed them per element in the forward's bounds).
    blk = lax.optimization_barrier(
        (_block_sums(k, bk), _block_sums(v, bk), _block_sums(q, bq), _block_sums(do, bq))
    )
    (ksum, kabs), (vsum, vabs), (qsum, qabs), (dosum, doabs) = blk
    # Largest |block| sum per head and D: k's and v's over key blocks, repeated for the group's query
    # heads; q's and do's over query blocks and the group's heads.
    rep = lambda x: jnp.repeat(jnp.max(x, axis=1), g, axis=1)  # (B, L/n, KV, D) -> (B, H, D)
    grp = lambda x: jnp.max(x.reshape(b, t // bq, kvh, g, d), axis=(1, 3))  # (B, T/bq, H, D) -> (B, KV, D)
    rows = lax.optimization_barrier(
        (
            _row_sums(k, grp(qabs)),
            _row_sums(v, grp(doabs), norms=False),
            _row_sums(q, rep(kabs)),
            _row_sums(do, rep(vabs), out),
        )
    )
    (kd, k1, kt), (vt,), (qd, q1, qt), (dod, do1, dot, *delta) = rows

    def blocks(x, n):  # (B, L, heads) -> (B, heads, L/n, n)
        return x.transpose(0, 2, 1).reshape(x.shape[0], x.shape[2], -1, n)

    head_major = lambda x: x.transpose(0, 2, 1, 3)  # (B, L/n, heads, D) -> (B, heads, L/n, D)
    tiles = dict(
        ks=_tile(*_split(head_major(ksum))),
        vs=_tile(*_split(head_major(vsum))),
        kd=_tile_mag(*_split(blocks(kd, bk)), blocks(k1, bk)),
        qs=_tile(*_split(head_major(qsum))),
        dos=_tile(*_split(head_major(dosum))),
        qd=_tile_at(*_split(blocks(qd, bq)), 3),
        dod=_tile_mag(*_split(blocks(dod, bq)), blocks(do1, bq)),
    )
    rows_t = lambda x: x.transpose(0, 2, 1)  # (B, L, heads) -> (B, heads, L)
    return (
        tiles
        | dict(
            q1max=jnp.max(blocks(q1, bq), axis=-1),
            tol_s=c_b * rows_t(qt),
            tol_dp=c_b * rows_t(dot),
            tol_st=c_q * rows_t(kt),
            tol_dpt=c_q * rows_t(vt),
        )
        | (dict(delta=rows_t(delta[0])) if delta else {})
    )


def _hilo(plgpu, acc8, cols: tuple[int, ...] = (0, 1)):
    """The sum of an (R, CS) accumulator's given columns, per row."""
    col = plgpu.broadcasted_iota(jnp.int32, acc8.shape, 1, layout=plgpu.Layout.WGMMA)
    keep = functools.reduce(lambda a, c: a | (col == c), cols[1:], col == cols[0])
    return jnp.where(keep, acc8, 0.0).sum(axis=1)


def _own_inputs(pl, plgpu, wg, tiles, in_bar, rows, row_refs, flip_refs, names, scratch):
    """A compute warpgroup's own inputs: its two operand tiles (``tiles``: (gmem, smem) pairs) on
    ``in_bar``, then its rows (``rows``: the index into (B, heads, L) arrays) of the per-row f32
    inputs and of the int32 flip sites, loaded into registers in the row layout. Returns (the f32
    rows, {gemm: (bit, col)})."""
    rows_f, rows_i, row_bar = scratch
    n_rows, n_in = len(row_refs), len(row_refs) + len(flip_refs)
    for src, dst in tiles:
        plgpu.copy_gmem_to_smem(src, dst, in_bar.at[wg])
    dsts = [rows_f.at[wg, i] for i in range(n_rows)] + [rows_i.at[wg, i] for i in range(len(flip_refs))]
    for i, (src, dst) in enumerate(zip([*row_refs, *flip_refs], dsts, strict=True)):
        plgpu.copy_gmem_to_smem(src.at[rows], dst, row_bar.at[wg * n_in + i])
    plgpu.barrier_wait(in_bar.at[wg])
    for i in range(n_in):
        plgpu.barrier_wait(row_bar.at[wg * n_in + i])
    rl = plgpu.Layout.WGMMA.reduce(1)
    rv = [_load(plgpu, rows_f.at[wg, i], rl) for i in range(n_rows)]
    fl = {
        n: (_load(plgpu, rows_i.at[wg, 2 * i], rl), _load(plgpu, rows_i.at[wg, 2 * i + 1], rl))
        for i, n in enumerate(names)
    }
    return rv, fl


def _zeros(plgpu, n: int):
    """Zero f32 accumulators of any shape (WGMMA layout) and a zero row vector of n rows."""
    wl, rl = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    return (
        lambda shape: plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), wl),
        lambda: plgpu.layout_cast(jnp.full((n,), 0, jnp.float32), rl),
    )


def _scoped(pl, plgpu, kernel, refs, smem, bars, stages: int, flag_at: int | None = None, seq_axis: str = ""):
    """``kernel(refs, (smem, bars, consumed))`` with its scratch allocated: two consumed barriers per
    stage, each expecting both compute warpgroups. ``flag_at`` (a redo): ``refs[flag_at]`` is the
    flags (batch, heads, ``seq_axis``) int32; a CTA whose flag is 0 does nothing (every warpgroup
    reads it, so all three skip together), the others run ``kernel`` on the refs without it."""

    def run(refs, scoped):
        if flag_at is None:
            kernel(refs, scoped)
            return
        at = (lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index(seq_axis))
        pl.when(refs[flag_at][at] != 0)(lambda: kernel(refs[:flag_at] + refs[flag_at + 1 :], scoped))

    pl.run_scoped(
        lambda *scoped: run(refs, scoped),
        smem,
        bars,
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        collective_axes="wg",
    )


def _launch(plgpu, entry, out_type, grid, seq_axis: str, redo: tuple | None = None):
    """The kernel over (heads, blocks of two warpgroups' rows, batch), three warpgroups per CTA.
    ``redo``: (flags, then a ref per output): the kernel returns nothing and updates the
    refs in place (aliased in and out), after its inputs and the flags (``_scoped``'s flag_at)."""
    if redo is not None:
        import jax.experimental.pallas as pl

        mesh = plgpu.Mesh(grid=grid, grid_names=("heads", seq_axis, "batch"), num_threads=3, thread_name="wg")
        params = plgpu.CompilerParams(approx_math=True)
        kernel = pl.kernel(entry, out_type=(), mesh=mesh, compiler_params=params)
        return lambda *args: kernel(*args, *redo)
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=("heads", seq_axis, "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _dq_call(
    q, k, v, do, rows, tiles, flips, *, causal: bool, c: float, scale: float, checks: bool, c_sum, cfg,
    redo: tuple | None = None,
):  # fmt: skip
    """dq (and the query-row checks). rows: lse2, δ, then with checks tol_s, tol_dp, all (B, H, T)
    f32; tiles: ks, vs, kd; flips: {gemm: (bit, col)} for scores, dp, dq; c_sum: the dq check's
    factor (times Σ |ds|·‖k‖₁, measured). ``redo``: (flags (B, H, T / (2 block_q)) int32, then
    refs of dq and the three ratio rows): only flagged CTAs run, writing over the refs;
    returns None."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g, dtype = h // kvh, q.dtype
    bq, bk = cfg.block_q, cfg.block_kv
    nb = s // bk
    stages = min(cfg.stages, nb)
    kn = bk + CS if checks else bk
    n_rows = len(rows)
    names = [n for n in _Q_GEMMS if n in flips]
    n_in = n_rows + 2 * len(names)
    wl = plgpu.Layout.WGMMA
    n_t = 3 if checks else 0

    def kernel(refs, scoped):
        q_ref, k_ref, v_ref, do_ref = refs[:4]
        row_refs = refs[4 : 4 + n_rows]
        tile_refs = refs[4 + n_rows : 4 + n_rows + n_t]
        flip_refs = refs[4 + n_rows + n_t : 4 + n_rows + n_t + 2 * len(names)]
        dq_ref, *r_refs = refs[4 + n_rows + n_t + 2 * len(names) :]
        (q2, do2, k_smem, v_smem, kd_smem, rows_f, rows_i), (k_bar, v_bar, in_bar, row_bar), consumed = scoped
        k_done, v_done = consumed
        batch, q_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_base = lax.axis_index("q_seq") * (2 * bq)
        cta_steps = pl.cdiv(cta_base + 2 * bq, jnp.array(bk, jnp.int32)) if causal else nb

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qs, dos = q2.at[wg], do2.at[wg]
            base = cta_base + wg * bq
            sl = (batch, pl.ds(base, bq), q_head)
            rv, fl = _own_inputs(
                pl, plgpu, wg, [(q_ref.at[sl], qs), (do_ref.at[sl], dos)], in_bar,
                (batch, q_head, pl.ds(base, bq)), row_refs, flip_refs, names, (rows_f, rows_i, row_bar),
            )  # fmt: skip
            lse2, delta = rv[:2]
            zeros, row0 = _zeros(plgpu, bq)

            bcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

            def step(j, carry, masked: bool):
                dq_acc, cacc, aacc, r_s, r_dp = carry
                slot = lax.rem(j, jnp.array(stages, j.dtype))
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])

                def gemms(s_ref, p_ref):
                    plgpu.wgmma(s_ref, qs, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(p_ref, dos, v_smem.at[slot].transpose((1, 0)))
                    return s_ref[...], p_ref[...]

                s_all, dp_all = pl.run_scoped(
                    gemms, plgpu.ACC((bq, kn), jnp.float32), plgpu.ACC((bq, kn), jnp.float32)
                )
                plgpu.barrier_arrive(v_done.at[slot])
                sc, dp = s_all[:, :bk], dp_all[:, :bk]
                kv_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wl) + j * bk
                for n, x in (("scores", "sc"), ("dp", "dp")):
                    if n in fl:
                        bit, col = fl[n]
                        hit = (kv_ids == bcast(col, (bq, bk))) & (bcast(bit, (bq, bk)) >= 0)
                        if x == "sc":
                            sc = _flip(sc, bcast(bit, (bq, bk)), hit)
                        else:
                            dp = _flip(dp, bcast(bit, (bq, bk)), hit)
                if checks:  # |difference|, the largest over the steps; the bounds divide it once
                    r_s = jnp.maximum(r_s, jnp.abs(sc.sum(axis=1) - _tile_sum(s_all[:, bk:])))
                    r_dp = jnp.maximum(r_dp, jnp.abs(dp.sum(axis=1) - _tile_sum(dp_all[:, bk:])))
                p = jnp.exp2(sc * c - bcast(lse2, (bq, bk)))
                if masked:
                    q_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wl) + base
                    p = jnp.where(q_ids >= kv_ids, p, 0.0)
                ds16 = (p * (dp - bcast(delta, (bq, bk)))).astype(dtype)

                def dq_mm(refs):
                    q_ref_, c_ref, a_ref = refs
                    plgpu.wgmma(q_ref_, ds16, k_smem.at[slot, pl.ds(0, bk)])
                    if checks:
                        # [kd hi, kd lo, ‖k‖₁] per key: ds·kd for the check, |ds|·‖k‖₁ for its bound.
                        plgpu.wgmma(c_ref, ds16, kd_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(a_ref, jnp.abs(ds16), kd_smem.at[slot].transpose((1, 0)))

                init = lambda x: plgpu.ACC.init(x) if x is not None else None
                dq_acc, cacc, aacc = pl.run_state(dq_mm)((init(dq_acc), init(cacc), init(aacc)))
                plgpu.barrier_arrive(k_done.at[slot])
                return dq_acc, cacc, aacc, r_s, r_dp

            c8 = zeros((bq, CS)) if checks else None
            carry = (zeros((bq, d)), c8, c8, row0(), row0())
            if causal:
                full = lax.div(cta_base, jnp.array(bk, jnp.int32))
                carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(full, cta_steps, functools.partial(step, masked=True), carry)
            else:
                carry = lax.fori_loop(0, nb, functools.partial(step, masked=False), carry)
            dq_acc, cacc, aacc, r_s, r_dp = carry
            if "dq" in fl:
                bit, col = fl["dq"]
                d_ids = plgpu.broadcasted_iota(jnp.int32, (bq, d), 1, layout=wl)
                dq_acc = _flip(
                    dq_acc, bcast(bit, (bq, d)), (d_ids == bcast(col, (bq, d))) & (bcast(bit, (bq, d)) >= 0)
                )
            if checks:
                r_dq = _ratio(dq_acc.sum(axis=1) - _hilo(plgpu, cacc), c_sum * _hilo(plgpu, aacc, (2,)))
            qs[...] = (dq_acc * scale).astype(dtype)
            outs = [_ratio(r_s, rv[2]), _ratio(r_dp, rv[3]), r_dq] if checks else []
            for i, r in enumerate(outs):
                rows_f.at[wg, i][...] = r
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qs, dq_ref.at[sl])
            for i in range(len(outs)):
                plgpu.copy_smem_to_gmem(rows_f.at[wg, i], r_refs[i].at[batch, q_head, pl.ds(base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(q_head, jnp.array(g, q_head.dtype))

            def load_v(j, slot):
                plgpu.copy_gmem_to_smem(
                    v_ref.at[batch, pl.ds(j * bk, bk), kv_head], v_smem.at[slot, pl.ds(0, bk)], v_bar.at[slot]
                )
                if checks:
                    plgpu.copy_gmem_to_smem(
                        tile_refs[1].at[batch, kv_head, j], v_smem.at[slot, pl.ds(bk, CS)], v_bar.at[slot]
                    )

            def load_k(j, slot):
                plgpu.copy_gmem_to_smem(
                    k_ref.at[batch, pl.ds(j * bk, bk), kv_head], k_smem.at[slot, pl.ds(0, bk)], k_bar.at[slot]
                )
                if checks:
                    plgpu.copy_gmem_to_smem(
                        tile_refs[0].at[batch, kv_head, j], k_smem.at[slot, pl.ds(bk, CS)], k_bar.at[slot]
                    )
                    plgpu.copy_gmem_to_smem(
                        tile_refs[2].at[batch, kv_head, j], kd_smem.at[slot], k_bar.at[slot]
                    )

            # v first: its slot is released after the step's first two GEMMs, k's after the last.
            _stream(pl, plgpu, cta_steps, stages, [(v_done, load_v), (k_done, load_k)])

    def entry(*refs):
        tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((2, bq, d), dtype, transforms=tf),  # q in, dq staged on its way back
            plgpu.SMEM((2, bq, d), dtype, transforms=tf),
            plgpu.SMEM((stages, kn, d), dtype, transforms=tf),
            plgpu.SMEM((stages, kn, d), dtype, transforms=tf),
            plgpu.SMEM((stages, CS, bk), dtype, transforms=tf) if checks else None,
            plgpu.SMEM((2, n_rows, bq), jnp.float32),
            plgpu.SMEM((2, max(2 * len(names), 1), bq), jnp.int32),
        )
        bars = (
            plgpu.Barrier(num_arrivals=3 if checks else 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2 if checks else 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),
            plgpu.Barrier(num_barriers=2 * n_in),
        )
        _scoped(pl, plgpu, kernel, refs, smem, bars, stages, len(args) if redo else None, "q_seq")

    row = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
    flat_flips = [a for n in names for a in flips[n]]
    args = (q, k, v, do, *rows, *tiles, *flat_flips)
    out_type = typed_like([jax.ShapeDtypeStruct(q.shape, dtype)] + [row] * n_t, *args)
    out = _launch(plgpu, entry, out_type, (h, t // (2 * bq), b), "q_seq", redo)(*args)
    return None if redo is not None else vary_as(out, *args)  # inside shard_map: ops._vma


def _check_inputs(q, k, v, out, lse, do, causal: bool, cfg: FlashBwdConfig, name: str) -> None:
    b, t, h = q.shape[:3] if q.ndim == 4 else (None,) * 3
    if (
        q.ndim != 4
        or k.ndim != 4
        or v.shape != k.shape
        or k.shape[0] != q.shape[0]
        or k.shape[3] != q.shape[3]
        or out.shape != q.shape
        or do.shape != q.shape
        or lse.shape != (b, h, t)
    ):
        raise ValueError(
            f"pimlayers.{name}: q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape}, lse {lse.shape}, "
            f"dout {do.shape}; expected q, out, dout (B, T, H, D), k, v (B, S, KV, D) and lse (B, H, T)"
        )
    if not all(x.dtype == jnp.bfloat16 for x in (q, k, v, out, do)):
        raise TypeError(
            f"pimlayers.{name}: q, k, v, out, dout have dtypes {q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}, "
            f"{do.dtype}; expected bfloat16 (the checksum tiles are bf16 hi/lo pairs)"
        )
    if not flash_bwd_supported(q.shape, k.shape, q.dtype, causal, cfg):
        raise ValueError(
            f"pimlayers.{name}: q {q.shape}, k {k.shape} (causal={causal}) is outside the kernels' shapes: "
            f"D 64 or 128, H a multiple of KV, T a multiple of {2 * cfg.block_q}, S of {2 * cfg.block_kv}, "
            "and T == S when causal"
        )


def _check_faults(q, k, faults, config: FlashBwdConfig | None = None) -> None:
    if not isinstance(faults, FlashBwdFaults):
        raise TypeError(
            f"pimlayers.flash_attention_bwd: faults is a {type(faults).__name__}; expected FlashBwdFaults"
        )
    gemms = bwd_gemms(q.shape[-1], config)
    for name, site in zip(FlashBwdFaults._fields, faults, strict=True):
        if site is None:
            continue
        if name not in gemms:
            raise ValueError(
                f"pimlayers.flash_attention_bwd: faults.{name} names a GEMM the fused backward does not run "
                f"(it runs {', '.join(gemms)}); use FlashBwdConfig(fused=False) to inject it"
            )
        want = (
            (q.shape[0], q.shape[2], q.shape[1]) if name in _Q_GEMMS else (k.shape[0], k.shape[2], k.shape[1])
        )
        if not (isinstance(site, tuple) and len(site) == 2) or any(
            a.shape != want or not jnp.issubdtype(a.dtype, jnp.integer) for a in site
        ):
            got = (
                [f"{a.dtype}{list(a.shape)}" for a in site]
                if isinstance(site, tuple)
                else type(site).__name__
            )
            raise ValueError(
                f"pimlayers.flash_attention_bwd: faults.{name} is {got}; expected a pair (bit, col) of "
                f"int32{list(want)} arrays"
            )


def _prepare(q, k, v, out, lse, do, causal, scale, lam, cfg, name, with_bounds: bool):
    cfg = cfg or FlashBwdConfig()
    _check_inputs(q, k, v, out, lse, do, causal, cfg, name)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    # The checksums must be of the bf16 values the kernels read: without the barrier XLA may fuse
    # an operand's producer into the sums and elide its rounding to bf16 (as flash_bounds says).
    q, k, v, out, do = lax.optimization_barrier((q, k, v, out, do))
    # δ = rowsum(do ∘ out) = rowsum(p ∘ dp) (FlashAttention's identity), in f32 from the bf16 values.
    # With the bounds, it comes from their read of do.
    if with_bounds:
        bounds = flash_bwd_bounds(q, k, v, do, lam=lam, config=cfg, out=out)
        delta = bounds.pop("delta")
    else:
        bounds = None
        delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    return cfg, scale, delta, bounds, (q, k, v, out, do)


@config_resolved(resolved_bwd)
@functools.partial(jax.jit, static_argnames=("causal", "scale", "lam", "checks", "config"))
def flash_attention_bwd(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b h t"],
    dout: Float[Array, "b t h d"],
    faults: FlashBwdFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    checks: bool = True,
    config: FlashBwdConfig | None = None,
) -> tuple[
    Float[Array, "b t h d"], Float[Array, "b s kv d"], Float[Array, "b s kv d"], FlashBwdChecks | None
]:
    """The gradients (dq, dk, dv) of softmax(q·kᵀ·scale, causal)·v for a cotangent ``dout``, from the
    forward's ``out`` and natural-log ``lse`` (:func:`flash_attention`'s), on Hopper's tensor cores.

    Returns ``(dq, dk, dv, checks)``: the seven per-row ratios (None when ``checks=False``, the kernels
    without checksums: the peer that says what they cost). Raises NotImplementedError off a Hopper GPU.
    """
    return _bwd(q, k, v, out, lse, dout, faults, causal, scale, lam, checks, config, redo=False)


@config_resolved(resolved_bwd)
@functools.partial(jax.jit, static_argnames=("causal", "scale", "lam", "config"))
def flash_attention_bwd_with_redo(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b h t"],
    dout: Float[Array, "b t h d"],
    faults: FlashBwdFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    config: FlashBwdConfig | None = None,
) -> _Redone:
    """:func:`flash_attention_bwd` (``faults`` injected there), then both kernels again on the device,
    with no branch, over the CTAs whose rows failed a check: one launch per kernel over every CTA, of
    which a clean one reads its flag and exits and a flagged one computes its rows afresh (no
    injected faults: they model transient errors) and writes them over the first pass's gradients
    and ratios, in place. The dq kernel's CTAs are flagged by its three query-row checks, the dk/dv
    kernel's by its four key-row checks (:func:`redo_flags_bwd`); the two passes share the bounds
    (one read of q, k, v, do and out). Returns ``(dq, dk, dv, first, checks)``: the first pass's
    ratios and the final ones (a redone row that fails again says so there). The two kernels only
    (not ``FlashBwdConfig(fused=True)``); Hopper only. :func:`flash_attention_bwd_with_redo_reference`
    is the same through XLA."""
    if _fused(q.shape[-1], config):
        raise ValueError(
            "pimlayers.flash_attention_bwd_with_redo: the fused kernel (FlashBwdConfig(fused=True)) has no "
            "device redo; use the two kernels"
        )
    return _bwd(q, k, v, out, lse, dout, faults, causal, scale, lam, True, config, redo=True)


def redo_flags_bwd(
    checks: FlashBwdChecks, config: FlashBwdConfig | None = None
) -> tuple[Int32[Array, "b h nq"], Int32[Array, "b kv nk"]]:
    """Which CTAs of the two backward kernels hold a row that failed a check: the dq kernel's (B, H,
    T / (2 block_q)) from the scores, dp and dq ratios, the dk/dv kernel's (B, KV, S / (2 block_kv))
    from the scores_t, dp_t, dv and dk ratios; int32, 1 where a ratio is above 1 or NaN."""
    cfg = config or FlashBwdConfig()

    def flags(rows, n):
        b, h, t = rows[0].shape
        bad = functools.reduce(jnp.logical_or, [~(r <= 1.0) for r in rows])
        return jnp.any(bad.reshape(b, h, t // n, n), axis=-1).astype(jnp.int32)

    q_rows = [checks.scores, checks.dp, checks.dq]
    k_rows = [checks.scores_t, checks.dp_t, checks.dv, checks.dk]
    return flags(q_rows, 2 * cfg.block_q), flags(k_rows, 2 * cfg.block_kv)


def _bwd(q, k, v, out, lse, dout, faults, causal, scale, lam, checks: bool, config, redo: bool):
    """:func:`flash_attention_bwd` and, with ``redo``, :func:`flash_attention_bwd_with_redo`."""
    if faults is not None and not checks:
        raise ValueError(
            "pimlayers.flash_attention_bwd: faults are injected before the checks; pass checks=True"
        )
    if faults is not None:
        _check_faults(q, k, faults, config)
    cfg, scale, delta, bd, (q, k, v, out, dout) = _prepare(
        q, k, v, out, lse, dout, causal, scale, lam, config, "flash_attention_bwd", checks
    )
    if not hopper():
        raise NotImplementedError(
            "pimlayers.flash_attention_bwd runs on a Hopper GPU (sm_90) only; "
            "flash_attention_bwd_reference is the same computation through XLA"
        )
    c = scale * (1.0 / _LN2)  # base 2: exp(x·scale - lse) = exp2(x·c - lse/ln 2)
    lse2 = lse.astype(jnp.float32) * jnp.float32(1.0 / _LN2)
    fl = (
        {}
        if faults is None
        else {n: tuple(a.astype(jnp.int32) for a in f) for n, f in faults._asdict().items() if f is not None}
    )
    q_rows = [lse2, delta] + ([bd["tol_s"], bd["tol_dp"]] if checks else [])
    q_tiles = [bd["ks"], bd["vs"], bd["kd"]] if checks else []
    kw = dict(causal=causal, c=c, scale=scale, checks=checks, cfg=cfg)
    c_dq, c_kv = (bd["c_dq"], bd["c_kv"]) if checks else (0.0, 0.0)
    k_rows = [bd["tol_st"], bd["tol_dpt"]] if checks else []
    k_tiles = [bd["qs"], bd["dos"], bd["qd"], bd["dod"], bd["qm"]] if checks else []
    from ._flash_bwd_kv import dkv_call  # it builds on this module's kernel helpers

    fused = _fused(q.shape[-1], cfg)
    rq = []
    if not fused:
        dq, *rq = _dq_call(
            q, k, v, dout, q_rows, q_tiles, {n: fl[n] for n in _Q_GEMMS if n in fl}, c_sum=c_dq, **kw
        )
    gemms = bwd_gemms(q.shape[-1], cfg) if fused else _K_GEMMS  # the dk/dv kernel's
    dq_f, dk, dv, rk, r_dq = dkv_call(
        q, k, v, dout, lse2, delta, k_rows, k_tiles + ([bd["kd"]] if fused and checks else []),
        {n: fl[n] for n in gemms if n in fl}, c_sum=c_kv, fused=fused, c_dq=c_dq, **kw,
    )  # fmt: skip
    if fused:
        dq, rq = dq_f, [None, None, r_dq]
    first = FlashBwdChecks(*rq, *rk) if checks else None
    if not redo:
        return dq, dk, dv, first
    flags_q, flags_k = redo_flags_bwd(first, cfg)
    q_in, k_in = (q_rows, q_tiles), (k_rows, k_tiles)

    def again(q, k, v, dout, lse2, delta, flags_q, flags_k, *rest):
        """The redo's two launches on refs of the first pass's results (batch on axis 0 everywhere,
        so a vmap folds into the batch: ``_fold_vmap``)."""
        ins, res = rest[: len(q_in_flat)], rest[len(q_in_flat) :]
        (q_rows, q_tiles), (k_rows, k_tiles) = jax.tree.unflatten(in_tree, ins)

        def kernels(dq_r, dk_r, dv_r, rs, rdp, rdq, rst, rdpt, rdv, rdk):
            _dq_call(q, k, v, dout, q_rows, q_tiles, {}, c_sum=c_dq, redo=(flags_q, dq_r, rs, rdp, rdq), **kw)
            dkv_call(
                q, k, v, dout, lse2, delta, k_rows, k_tiles, {}, c_sum=c_kv, c_dq=c_dq,
                redo=(flags_k, dk_r, dv_r, rst, rdpt, rdv, rdk), **kw,
            )  # fmt: skip

        return _in_place(kernels, res)  # dq, dk, dv, then the seven ratio rows

    q_in_flat, in_tree = jax.tree.flatten((q_in, k_in))
    dq, dk, dv, *final = _fold_vmap(again)(
        q, k, v, dout, lse2, delta, flags_q, flags_k, *q_in_flat, dq, dk, dv, *first
    )
    return dq, dk, dv, first, FlashBwdChecks(*final)


def flash_attention_bwd_with_redo_reference(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b h t"],
    dout: Float[Array, "b t h d"],
    faults: FlashBwdFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    config: FlashBwdConfig | None = None,
) -> _Redone:
    """:func:`flash_attention_bwd_with_redo` through XLA (any backend): the reference with ``faults``,
    then its fault-free results on the flagged CTAs' rows. For tests and the layers' reference
    path."""
    cfg = config or FlashBwdConfig()
    if _fused(q.shape[-1], cfg):
        raise ValueError(
            "pimlayers.flash_attention_bwd_with_redo_reference: the fused kernel has no device redo"
        )
    kw = dict(causal=causal, scale=scale, lam=lam, config=cfg)
    dq, dk, dv, first = flash_attention_bwd_reference(q, k, v, out, lse, dout, faults, **kw)
    dq2, dk2, dv2, again = flash_attention_bwd_reference(q, k, v, out, lse, dout, **kw)
    flags_q, flags_k = redo_flags_bwd(first, cfg)
    rows_q = jnp.repeat(flags_q != 0, 2 * cfg.block_q, axis=-1)  # (B, H, T)
    rows_k = jnp.repeat(flags_k != 0, 2 * cfg.block_kv, axis=-1)  # (B, KV, S)
    pick = lambda rows, new, old: jnp.where(rows.transpose(0, 2, 1)[..., None], new, old)
    pairs = enumerate(zip(again, first, strict=True))
    final = [jnp.where(rows_q if i < 3 else rows_k, a, b) for i, (a, b) in pairs]
    return (
        pick(rows_q, dq2, dq),
        pick(rows_k, dk2, dk),
        pick(rows_k, dv2, dv),
        first,
        FlashBwdChecks(*final),
    )


def flash_attention_bwd_reference(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b h t"],
    dout: Float[Array, "b t h d"],
    faults: FlashBwdFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    config: FlashBwdConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b s kv d"], Float[Array, "b s kv d"], FlashBwdChecks]:
    """The kernels' results through XLA, every product materialised in f32: the same checksums, bounds,
    injected flips and bf16 roundings of p and ds. Any backend; for tests. Its bounds are XLA's on
    every platform unless ``config.bounds_kernel`` is True."""
    if faults is not None:
        _check_faults(q, k, faults, config)
    config = _xla_bounds_unless_asked(config or FlashBwdConfig())
    cfg, scale, delta, bd, (q, k, v, out, dout) = _prepare(
        q, k, v, out, lse, dout, causal, scale, lam, config, "flash_attention_bwd_reference", True
    )
    fl = {} if faults is None else {n: f for n, f in faults._asdict().items() if f is not None}
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g, bq, bk = h // kvh, cfg.block_q, cfg.block_kv
    hi = lax.Precision.HIGHEST
    f32 = lambda x: x.astype(jnp.float32)
    kh, vh = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    mm = lambda spec, a, c: jnp.einsum(spec, a, c, preferred_element_type=jnp.float32, precision=hi)
    sc = mm("bthd,bshd->bhts", q, kh)  # (B, H, T, S)
    dp = mm("bthd,bshd->bhts", dout, vh)
    hilo = lambda tile, i=(0, 1): sum(f32(tile[..., j, :]) for j in i)
    visible = jnp.ones((t, s), bool) if not causal else jnp.arange(s)[None, :] <= jnp.arange(t)[:, None]
    keys = jnp.arange(s, dtype=jnp.int32)
    quer = jnp.arange(t, dtype=jnp.int32)

    def flip_at(x, site, idx):  # per-row site (bit, col) on x (..., rows, last)
        bit, col = site
        hit = (idx[None, None, None, :] == col[..., None]) & (bit >= 0)[..., None]
        return _flip(x, bit[..., None], hit)

    # dq kernel: per query row, over key blocks.
    sc_q = flip_at(sc, fl["scores"], keys) if "scores" in fl else sc
    dp_q = flip_at(dp, fl["dp"], keys) if "dp" in fl else dp
    rep = lambda x: jnp.repeat(x, g, axis=1)
    e_s = jnp.einsum("bthd,bhjd->bhtj", f32(q), rep(hilo(bd["ks"])), precision=hi)
    e_dp = jnp.einsum("bthd,bhjd->bhtj", f32(dout), rep(hilo(bd["vs"])), precision=hi)
    blk = lambda x: jnp.sum(x.reshape(*x.shape[:-1], s // bk, bk), axis=-1)
    r_s = jnp.max(_ratio(blk(sc_q) - e_s, bd["tol_s"][..., None]), axis=-1)
    r_dp = jnp.max(_ratio(blk(dp_q) - e_dp, bd["tol_dp"][..., None]), axis=-1)
    lse2 = f32(lse)[..., None] / _LN2
    c = scale / _LN2
    p_q = jnp.where(visible, jnp.exp2(sc_q * c - lse2), 0.0)
    ds_q = (p_q * (dp_q - delta[..., None])).astype(q.dtype)
    dq_acc = mm("bhts,bshd->bhtd", ds_q, kh)
    if "dq" in fl:
        dq_acc = flip_at(dq_acc, fl["dq"], jnp.arange(d, dtype=jnp.int32))
    kd = rep(hilo(bd["kd"]).reshape(b, kvh, s))  # (B, H, S)
    k1 = rep(hilo(bd["kd"], (2,)).reshape(b, kvh, s))  # ‖k‖₁, rounded up to bf16 as the kernel reads it
    tol_dq = bd["c_dq"] * jnp.einsum("bhts,bhs->bht", jnp.abs(f32(ds_q)), k1, precision=hi)
    r_dq = _ratio(jnp.sum(dq_acc, -1) - jnp.einsum("bhts,bhs->bht", f32(ds_q), kd, precision=hi), tol_dq)
    dq = (dq_acc * scale).astype(q.dtype).transpose(0, 2, 1, 3)

    # dk/dv kernel: per key row, over the group's heads and query blocks. Grouped (B, KV, G, ...).
    grp = lambda x: x.reshape(b, kvh, g, *x.shape[2:])
    st, dpt = grp(sc).swapaxes(-1, -2), grp(dp).swapaxes(-1, -2)  # (B, KV, G, S, T)

    def flip_k(x, site):
        bit, col = site  # (B, KV, S)
        hit = (quer[None, None, None, None, :] == col[:, :, None, :, None]) & (bit >= 0)[:, :, None, :, None]
        return _flip(x, bit[:, :, None, :, None], hit)

    st = flip_k(st, fl["scores_t"]) if "scores_t" in fl else st
    dpt = flip_k(dpt, fl["dp_t"]) if "dp_t" in fl else dpt
    qblk = lambda x: jnp.sum(x.reshape(*x.shape[:-1], t // bq, bq), axis=-1)  # (..., T) -> (..., T/bq)
    e_st = jnp.einsum("bskd,bkgjd->bkgsj", f32(k), grp(hilo(bd["qs"])), precision=hi)
    e_dpt = jnp.einsum("bskd,bkgjd->bkgsj", f32(v), grp(hilo(bd["dos"])), precision=hi)
    r_st = jnp.max(_ratio(qblk(st) - e_st, bd["tol_st"][:, :, None, :, None]), axis=(2, 4))
    r_dpt = jnp.max(_ratio(qblk(dpt) - e_dpt, bd["tol_dpt"][:, :, None, :, None]), axis=(2, 4))
    lse2t = grp(lse2[..., 0])[:, :, :, None, :]
    dlt = grp(delta)[:, :, :, None, :]
    pt = jnp.where(visible.T, jnp.exp2(st * c - lse2t), 0.0)
    p16 = pt.astype(q.dtype)
    ds = pt * (dpt - dlt)
    ds16 = ds.astype(q.dtype)
    qg = grp(q.transpose(0, 2, 1, 3))  # (B, KV, G, T, D)
    dog = grp(dout.transpose(0, 2, 1, 3))
    dv_acc = mm("bkgst,bkgtd->bksd", p16, dog)
    dk_acc = mm("bkgst,bkgtd->bksd", ds16, qg)
    if "dv" in fl:
        dv_acc = flip_at(dv_acc, fl["dv"], jnp.arange(d, dtype=jnp.int32))
    if "dk" in fl:
        dk_acc = flip_at(dk_acc, fl["dk"], jnp.arange(d, dtype=jnp.int32))
    dod = grp(hilo(bd["dod"]).reshape(b, h, t))
    qd = grp(hilo(bd["qd"], (3, 4)).reshape(b, h, t))
    do1 = grp(hilo(bd["dod"], (2,)).reshape(b, h, t))
    qm = grp(hilo(bd["qm"], (_QM_ROW,)).reshape(b, h, t))  # each query's block's largest ‖q‖₁, rounded up
    tol_dv = bd["c_kv"] * jnp.einsum("bkgst,bkgt->bks", f32(p16), do1, precision=hi)
    tol_dk = bd["c_kv"] * jnp.einsum("bkgst,bkgt->bks", jnp.abs(f32(ds16)), qm, precision=hi)
    cv = jnp.einsum("bkgst,bkgt->bks", f32(p16), dod, precision=hi)
    ck = jnp.einsum("bkgst,bkgt->bks", f32(ds16), qd, precision=hi)
    r_dv = _ratio(jnp.sum(dv_acc, -1) - cv, tol_dv)
    r_dk = _ratio(jnp.sum(dk_acc, -1) - ck, tol_dk)
    dk = (dk_acc * scale).astype(q.dtype).transpose(0, 2, 1, 3)
    dv = dv_acc.astype(q.dtype).transpose(0, 2, 1, 3)
    if _fused(d, cfg):  # the fused kernel forms no query-row s and dp (nor checks them)
        r_s = r_dp = None
    return dq, dk, dv, FlashBwdChecks(r_s, r_dp, r_dq, r_st, r_dpt, r_dv, r_dk)
