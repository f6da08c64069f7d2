"""flash_attention: causal GQA flash attention on Hopper with both GEMMs verified inside the kernel.

The kernel is FlashAttention-3's schedule as JAX ships it for Mosaic GPU
(``jax.experimental.pallas.ops.gpu.attention_mgpu``: one TMA warpgroup streams K and V blocks, two
compute warpgroups each own 64 query rows, online softmax in f32) with checksums of its two GEMMs
verified per query row, EFTA-style (Xu et al., "EFTA: efficient fault-tolerant attention"):

* scores S = q·kᵀ, per key block j of ``block_kv`` keys: the row sums of the f32 accumulator are
  compared with q·ksum_j, where ksum_j = sum of the block's key rows. q·ksum_j comes from the
  scores' own wgmma: the key tile in shared memory is extended by an 8-row tile [hi(ksum_j),
  lo(ksum_j), 0 x 6] (hi + lo is ksum_j to 2^-18 relative), so N = block_kv + 8
  (``FlashConfig.fuse_e``; else a second wgmma with N = 8, the smallest).
* out = p·v: each step also multiplies the bf16 probabilities by [hi(vsum), lo(vsum), 1,
  hi(c vmax), lo(c vmax), 0 x 3]ᵀ (vsum = each key's value row summed over D) into a small
  accumulator rescaled with the output's; at the end the output accumulator's row sums must equal
  its first two columns. Its third column is the sum of the bf16 probabilities, which serves as the
  softmax's normaliser l (the softmax's own f32 row sum is skipped when checking): the output is
  then exactly sum p16·v / sum p16. Its fourth and fifth are the check's bound, c vmax l. By
  default (``FlashConfig.fuse_v``) those columns come from the output's own wgmma: the value tile
  is held transposed, (D, block_kv), and extended by the checksum tile's 8 rows, so N = D + 8;
  ``fuse_v=False`` forms them in a second wgmma of N = 8 into an accumulator of their own.

Both comparisons use a rounding-error bound (``lam`` as in :class:`pimlayers.FaultPolicy`):

    scores: |rowsum(S_j) - q·ksum_j| <= u (lam (2 sqrt(D) + sqrt(block_kv) + 2) + 64) |q|·kmax
    out:    |rowsum(acc) - p·vsum|    <= u (lam (sqrt(S) + sqrt(D) + 2) + 64 + 2 S/block_kv) l vmax

with kmax = elementwise max over blocks of sum |k rows| (so one bound per row serves every block),
vmax = max over keys of sum_d |v|, l = the sum of the bf16 probabilities (times 1 + 2^-7 for its
own f32 accumulation); the 64 covers the hi/lo split of the checksums, the S/block_kv term the
output's per-step rescaling. The kernel writes, per query row, the worse ratio |difference| / bound
of each check (NaN or Inf counts as infinitely bad); a row above 1 was hit by a fault.
:func:`pimlayers.layers.attention_core` turns that into a recompute and a FaultReport: by default
:func:`flash_attention_redo`, the same kernel launched again with a flag per CTA (one whose rows
passed reads its flag and exits; one whose rows failed recomputes them and writes them over the
first pass's arrays in place: no branch, so no host round trip on a GPU). The bounds'
inputs come from XLA (``flash_bounds``, from k and v alone): the checksum tiles, kmax and vmax. The
kernel forms |q|·kmax itself, once per warpgroup, on the tensor cores from the q tile it holds
(|q| in registers times an 8-row tile [hi(c kmax), lo(c kmax), 0 x 6]): XLA's pass over q for it
was the bounds' largest kernel (0.020 of 0.049 ms at B = 1, T = 8192, 32/8 heads on an H200).
A fault that inflated a bound (in those small products, or in the out check's columns 4 and 5)
could hide only a second, simultaneous fault in the same row, as the tensor cores' l could before.

Fault injection (tests, benchmarks): per query row, one bit of one scores value (at a key) and one
of one output accumulator value (at a column, after the last step) can be flipped inside the kernel,
as a transient error in the matrix unit's accumulator would appear, before the checks.

Hopper (sm_90) only: bf16 (f16 without the checks), D 64 or 128, T a multiple of
2 x block_q, S of block_kv, causal only with T == S (queries at the keys' positions).
``flash_supported`` says when. Reference: ``flash_attention_reference`` (the same quantities from
XLA, scores materialised). lse is the logsumexp of l = sum p16 (within 2^-9 of the f32 sum's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int32

from ._abft import _bf16_head
from ._common import config_resolved
from ._fused_gemm import hopper
from ._vma import typed_like, vary_as

__all__ = [
    "FlashChecks",
    "FlashConfig",
    "FlashFaults",
    "flash_attention",
    "flash_attention_redo",
    "flash_attention_redo_reference",
    "flash_attention_reference",
    "flash_attention_with_redo",
    "flash_attention_with_redo_reference",
    "flash_bounds",
    "flash_supported",
    "redo_flags",
]

CS = 8  # rows of a checksum tile: hi, lo (the value tile: then ones), zeros to wgmma's smallest N
_BAD = 3.0e38  # the ratio written for a NaN/Inf difference
_U = 2.0**-24  # f32's unit roundoff
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tiling: each compute warpgroup owns ``block_q`` query rows (a CTA two of them), each step
    reads ``block_kv`` keys; ``stages`` K/V buffers in flight. jax's own tuning for the forward at
    D = 128 (attention_mgpu's benchmark) is 64 / 128 / 2."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    # q·ksum from the scores' own wgmma (the key tile extended by the checksum tile's 8 rows, N =
    # block_kv + 8) instead of a second wgmma with N = 8.
    fuse_e: bool = True
    # The output check's columns (p16 against the value checksum tile) from the output's own wgmma,
    # as fuse_e does for the scores: the value tile held transposed, (D, block_kv), and extended by
    # the checksum tile's 8 rows, so N = D + 8, instead of a second wgmma with N = 8. The transposed
    # tile is K-major, as the key tile is; the (block_kv, D) tile the kernel reads otherwise is not,
    # and its 64-column swizzled pieces cannot take 8 more columns. Costs a transpose of v through
    # XLA before the kernel (one read and write of v, inside the timings below). None (the
    # default): on, unless the process's environment has ``PIMLAYERS_FLASH_FUSE_V=0``
    # (:func:`fused_value_check`), which reaches the layers' kernels without a config threaded
    # through them; False: the separate N = 8 wgmma.
    # The default since 2026-12-07: timed directly against the separate wgmma in alternating
    # batches (``python -m benchmarks.run --suite flash-tiling``, ``vs_default``) the kernel was
    # 1.006x and 1.009x as fast on an H200 (0.932x of cuDNN against 0.917x in the second sweep),
    # and three H100 sweeps put it 0.7 to 1.1 points of cuDNN's speed ahead. The attention core's
    # step with it against without it (``python -m benchmarks.step_ab --attention fwd+bwd --env
    # PIMLAYERS_FLASH_FUSE_V=1``) did not resolve a difference either way (H200 0.998x, H100
    # 1.004x forward and 1.015x forward+backward): a gain under 1% of the forward kernel is below
    # that tool's spread between processes.
    fuse_v: bool | None = None
    # The checksum and bound tiles from two Pallas (Triton) kernels, one pass over k and v
    # (``_flash_bounds``), instead of XLA's seven kernels. None (the default): the Triton kernels on
    # a GPU, XLA's elsewhere and in ``flash_attention_reference``; True: the kernels everywhere
    # (Pallas' interpreter off a GPU, for tests); False: XLA's everywhere. On an H100 (2026-12-05)
    # 0.017 ms against XLA's 0.024 at B = 1, T = 8192, 8 KV heads, D = 128 (``python -m
    # benchmarks.run --suite bounds``). ``PIMLAYERS_BOUNDS_KERNEL=0`` in the environment makes None
    # mean False (:func:`bounds_kernel`).
    bounds_kernel: bool | None = None
    # The redo's persistent CTAs (:func:`flash_attention_redo`): each runs the flagged units (CTAs
    # of the first pass) of its share, p, p + redo_ctas, ..., one after another, and a clean redo is
    # one wave of CTAs that read a flag each and exit. About one per SM of an H100 or H200 (132).
    # Launched a CTA per unit (2,048 at B = 1, T = 8192, 32 heads), as until 2026-12-08, the clean
    # redo was 16 waves of CTAs that took a whole SM's shared memory only to read their flag: 16 us
    # of kernel time beside the 962 us forward on an H100, no longer measurable on 128 CTAs
    # (docs/gpu-tests.md, sixty-eighth session).
    redo_ctas: int = 128


class FlashChecks(NamedTuple):
    """Per query row, |checksum difference| / bound of each of the two GEMMs (> 1: a fault)."""

    scores: Float[Array, "b h t"]
    out: Float[Array, "b h t"]


class FlashFaults(NamedTuple):
    """In-kernel bit flips, one candidate per (batch, head, query row); bit -1 flips nothing.

    ``score_bit`` of S[t, ``score_key``] (f32, 31 sign .. 0) and ``out_bit`` of the output
    accumulator at column ``out_col`` of row t, after the last step (before the division by l)."""

    score_bit: Int32[Array, "b h t"]
    score_key: Int32[Array, "b h t"]
    out_bit: Int32[Array, "b h t"]
    out_col: Int32[Array, "b h t"]

    @staticmethod
    def none(b: int, h: int, t: int) -> FlashFaults:
        z = jnp.zeros((b, h, t), jnp.int32)
        return FlashFaults(z - 1, z, z - 1, z)


def flash_supported(q_shape, k_shape, dtype, causal: bool, config: FlashConfig | None = None) -> bool:
    """Whether the kernel takes these shapes and dtype (it runs on a Hopper GPU only)."""
    cfg = config or FlashConfig()
    if len(q_shape) != 4 or len(k_shape) != 4:
        return False
    b, t, h, d = q_shape
    b2, s, kv, d2 = k_shape
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and b == b2
        and d == d2
        and d in (64, 128)  # tested sizes; D = 256's buffers would not fit the shared memory
        and kv > 0
        and h % kv == 0
        and t % (2 * cfg.block_q) == 0
        and s % cfg.block_kv == 0
        and t > 0
        and (not causal or t == s)
    )


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (f32) as hi + lo in bf16, carrying x to 2^-18 relative. The head by bit arithmetic
    (``_abft._bf16_head``): XLA may elide ``x.astype(bf16).astype(f32)`` inside jit and make lo 0."""
    head = _bf16_head(x)
    return head.astype(jnp.bfloat16), (x - head).astype(jnp.bfloat16)


def _tile_sum(acc8):
    """A block check's value per row: the sum of an (R, CS) accumulator's columns against a
    checksum tile [hi, lo, 0 x 6] (:func:`_tile` without ones). Its six zero rows give exact zeros,
    so the eight columns sum to hi + lo bit for bit, without a column mask formed every step."""
    return acc8.sum(axis=1)


def _tile(hi: jax.Array, lo: jax.Array, *more: jax.Array) -> jax.Array:
    """(..., n) hi, lo and any further rows -> (..., CS, n): those rows, then zeros."""
    rows = [r[..., None, :] for r in (hi, lo, *more)]
    rows.append(jnp.zeros((*hi.shape[:-1], CS - len(rows), hi.shape[-1]), hi.dtype))
    return jnp.concatenate(rows, axis=-2)


def _c_block(lam: float, d: int, n: int) -> float:
    """A block check's bound factor (times the row's magnitude): a product over D of the row
    against the sum of n rows, its hi/lo checksum split (the 64). The backward's block checks
    (``_flash_bwd``) share it."""
    return _U * (lam * (2 * math.sqrt(d) + math.sqrt(n) + 2) + 64)


def _bound_consts(d: int, s: int, bk: int, lam: float) -> tuple[float, float]:
    """The scores' and the output's bound factors (the module docstring's): times |q|·kmax and
    l·vmax."""
    c_pv = _U * (lam * (math.sqrt(s) + math.sqrt(d) + 2) + 64 + 2 * (s // bk)) * (1 + 2.0**-7)
    return _c_block(lam, d, bk), c_pv


def flash_bounds(k, v, *, lam: float, config: FlashConfig | None = None):
    """The checksum and bound tiles the kernel reads (all small next to k and v): from two Triton
    kernels on a GPU, from XLA elsewhere (``FlashConfig.bounds_kernel`` chooses otherwise).

    Returns ``(ks, vs, km)`` in the operands' dtype: ks (B, KV, S/bk, CS, D) each key block's sum
    (hi, lo); vs (B, KV, S/bk, CS, bk) each key's value row sum (hi, lo), ones, and the output
    bound's factor c_pv·vmax (hi, lo), the same in every column; km (B, KV, CS, D) the scores bound's
    c_qk·kmax (hi, lo), which the kernel multiplies by |q|.
    """
    cfg = config or FlashConfig()
    # The checksums must be of the bf16 values the kernel reads. Without the barrier XLA may fuse the
    # operands' producer (say RoPE in f32, then rounded) into these sums and elide the rounding: on
    # an H200, every remat-recomputed forward of a Llama step then failed its scores check.
    k, v = lax.optimization_barrier((k, v))
    bk = cfg.block_kv
    c_qk, c_pv = _bound_consts(k.shape[3], k.shape[1], bk, lam)
    xla = functools.partial(_xla_bounds, bk=bk, c_qk=c_qk, c_pv=c_pv)
    choice = bounds_kernel(cfg.bounds_kernel)
    if choice is False:
        return xla(k, v)
    from ._flash_bounds import flash_bounds_kernel

    kernel = functools.partial(flash_bounds_kernel, bk=bk, cs=CS, c_qk=c_qk, c_pv=c_pv)
    # Triton on a GPU; elsewhere XLA's, or (True) the kernels in Pallas' interpreter (tests).
    other = functools.partial(kernel, interpret=True) if choice else xla
    return lax.platform_dependent(k, v, cuda=kernel, default=other)


def bounds_kernel(flag: bool | None) -> bool | None:
    """``FlashConfig.bounds_kernel`` / ``FlashBwdConfig.bounds_kernel`` as the bounds take it: None
    (the Triton kernels on a GPU, XLA's elsewhere) becomes False (XLA's everywhere) where the
    process's environment has ``PIMLAYERS_BOUNDS_KERNEL=0``. Read at each call of the kernels'
    entry points (:func:`resolved`), before their jit: within a jit of the caller's own, when that
    is traced. For a process that cannot run Triton kernels on its GPU platform (jax's
    Mosaic-GPU interpreter on a CPU, ``tests/test_interpreted_kernels.py``), or to compare without
    threading a config through the layers."""
    if flag is None and os.environ.get("PIMLAYERS_BOUNDS_KERNEL", "1") == "0":
        return False
    return flag


def fused_value_check(flag: bool | None) -> bool:
    """``FlashConfig.fuse_v`` as the forward kernel takes it: None becomes False where the process's
    environment has ``PIMLAYERS_FLASH_FUSE_V=0``, True otherwise. Read as :func:`bounds_kernel`
    is (``python -m benchmarks.step_ab --env PIMLAYERS_FLASH_FUSE_V=0`` times a step or the
    attention core without it, each variant in processes of its own)."""
    if flag is None:
        return os.environ.get("PIMLAYERS_FLASH_FUSE_V", "1") != "0"
    return bool(flag)


def resolved(config: FlashConfig | None) -> FlashConfig:
    """``config`` (None: the default) with the fields the environment decides made explicit:
    ``fuse_v`` (:func:`fused_value_check`) and ``bounds_kernel`` (:func:`bounds_kernel`). The
    kernels' entry points take their config through this before their jit (``config_resolved``)."""
    cfg = config or FlashConfig()
    return dataclasses.replace(
        cfg, fuse_v=fused_value_check(cfg.fuse_v), bounds_kernel=bounds_kernel(cfg.bounds_kernel)
    )


def _xla_bounds_unless_asked(cfg):
    """``cfg`` (a FlashConfig or FlashBwdConfig) with the default bounds (None) made XLA's (False):
    what the references use, where the kernels' own paths keep the Triton kernels on a GPU."""
    return dataclasses.replace(cfg, bounds_kernel=False) if cfg.bounds_kernel is None else cfg


def _xla_bounds(k, v, *, bk: int, c_qk: float, c_pv: float):
    """:func:`flash_bounds`' tiles from XLA: block sums as a tree of adds, then the small tiles."""
    b, s, kvh, _ = k.shape
    nb = s // bk
    vf = v.astype(jnp.float32)
    # The sums, materialised before the tiles are built: fused into the tiles' concatenation, XLA
    # recomputed the value sums per output element (0.115 ms on an H200 at T = 8192, 8 KV heads).
    (ksum, kabs), vsum, vabs = lax.optimization_barrier(
        (_block_sums(k, bk), jnp.sum(vf, axis=-1), jnp.sum(jnp.abs(vf), axis=-1))
    )
    ks_hi, ks_lo = _split(ksum.transpose(0, 2, 1, 3))  # (B, KV, nb, D)
    km_hi, km_lo = _split(c_qk * jnp.max(kabs, axis=1))  # (B, KV, D)
    vs_hi, vs_lo = _split(vsum.reshape(b, nb, bk, kvh).transpose(0, 3, 1, 2))  # (B, KV, nb, bk)
    vm_hi, vm_lo = (
        jnp.broadcast_to(x[:, :, None, None], vs_hi.shape) for x in _split(c_pv * jnp.max(vabs, axis=1))
    )
    ones = jnp.ones_like(vs_hi)
    return _tile(ks_hi, ks_lo), _tile(vs_hi, vs_lo, ones, vm_hi, vm_lo), _tile(km_hi, km_lo)


def _block_sums(x, n: int):
    """(B, L, H, D) -> two (B, L/n, H, D) f32: each block of n rows' sum and its sum of |rows|, in
    x's own order (heads, then D, minor); callers transpose the small results.

    Written as a pairwise tree of elementwise adds over the block's n row slices, not a reduction:
    XLA's reduction over the middle axis read the operands at about 0.6 TB/s on the H200, the adds
    fuse into one elementwise kernel that reads each element once. At one Llama-3-8B attention layer
    (B = 1, T = 8192, 32/8 heads, D = 128, bf16) the backward's bounds took 0.238 ms against 0.329
    as reductions (``python -m benchmarks.run --suite bounds``, H200, jax 0.11.2, results files of
    2026-12-04 and 2026-12-03). The tree keeps f32 rounding ceil(log2 n) additions deep (6 at
    n = 64): its error is at most 6·2^-24 of the |block| sum, inside the checks' slack, where a
    left-to-right sum could reach 63·2^-24."""
    b, rows, h, d = x.shape
    xf = x.astype(jnp.float32).reshape(b, rows // n, n, h, d)
    parts = [xf[:, :, i] for i in range(n)]
    return _tree_sum(parts), _tree_sum([jnp.abs(p) for p in parts])


def _tree_sum(parts: list):
    """Pairwise sum of equal-shape arrays (an odd one out carries to the next level)."""
    while len(parts) > 1:
        pairs = [a + b for a, b in zip(parts[0::2], parts[1::2], strict=False)]
        parts = pairs + parts[len(pairs) * 2 :]
    return parts[0]


def _ratio(diff, tol):
    # |diff| / tol, kept for rows past the bound too (how far past is worth reporting). NaN and Inf
    # fail the `<=` and are written as _BAD, so a later max cannot drop them. A zero bound (a zero
    # row) passes only an exact zero difference.
    r = jnp.abs(diff) / jnp.maximum(tol, 1e-30)
    return jnp.where(r <= _BAD, r, _BAD)


def _flip(x, bit, sel):
    """x with ``bit`` of its f32 pattern flipped where ``sel``."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    flipped = lax.bitcast_convert_type(bits ^ jnp.left_shift(jnp.int32(1), jnp.maximum(bit, 0)), jnp.float32)
    return jnp.where(sel, flipped, x)


def _load(plgpu, ref, layout):
    """``plgpu.load`` of a whole ref: jax 0.11 takes the ref alone (an index is deprecated), 0.10
    requires the index."""
    try:
        return plgpu.load(ref, layout=layout)
    except TypeError:
        return plgpu.load(ref, (), layout=layout)


def _stream(pl, plgpu, steps, stages: int, pipes, guard: bool = True, drain: bool = False) -> None:
    """The TMA warpgroup's loop over ``steps`` blocks with ``stages`` in flight. ``pipes``: a list of
    (consumed barrier, load(step, slot)); block n + stages goes into slot n % stages once both
    compute warpgroups released that slot's block, each pipe on its own barrier (one operand can be
    refilled while the other is still read). ``guard``: skip first loads past ``steps``. ``drain``:
    then wait until the last ``stages`` blocks are released too, so that every slot is free and
    every consumed barrier's phase waited once per use (a CTA that runs this again, the persistent
    redo's, starts with the barriers as a fresh CTA finds them: the phases are counted per thread)."""
    for i in range(stages):

        def first(i=i):
            for _, load in pipes:
                load(i, i)

        if guard:
            pl.when(i < steps)(first)
        else:
            first()

    @pl.loop(0, steps - stages)
    def _(n):
        slot = lax.rem(n, jnp.array(stages, n.dtype))
        for done, load in pipes:
            plgpu.barrier_wait(done.at[slot])
            load(n + stages, slot)

    if drain:
        for i in range(stages):
            n = jnp.asarray(steps, jnp.int32) - (stages - i)

            @pl.when(n >= 0)
            def _(n=n):
                slot = lax.rem(n, jnp.array(stages, jnp.int32))
                for done, _ in pipes:
                    plgpu.barrier_wait(done.at[slot])


def _busy_ctas(flags: Int32[Array, "b h nq"], ctas: int) -> Int32[Array, " ctas"]:
    """Per persistent redo CTA p, whether any of its units (flat indices p, p + ctas, ...) is flagged."""
    flat = (flags.reshape(-1) != 0).astype(jnp.int32)
    flat = jnp.pad(flat, (0, -flat.size % ctas))
    return flat.reshape(-1, ctas).max(axis=0)


def _flagged_units(pl, flags_ref, busy_ref, ctas: int, run) -> None:
    """A persistent redo CTA's loop: ``run((batch, head, block))`` for each flagged unit of its share
    (the flat units p, p + ctas, ... of ``flags_ref``, (B, H, blocks) int32), one after another. A
    CTA whose share has none reads ``busy_ref[p]`` (:func:`_busy_ctas`) and exits."""
    p = lax.axis_index("cta")
    b, h, nq = flags_ref.shape

    @pl.when(busy_ref[p] != 0)
    def _():
        @pl.loop(0, pl.cdiv(b * h * nq - p, jnp.array(ctas, jnp.int32)))
        def _(i):
            u = p + i * ctas
            at = (lax.div(u, h * nq), lax.rem(lax.div(u, nq), h), lax.rem(u, nq))
            pl.when(flags_ref[at] != 0)(lambda: run(at))


def _kernel_call(
    q,
    k,
    v,
    extras,
    *,
    causal: bool,
    scale: float,
    checks: bool,
    inject: bool,
    cfg: FlashConfig,
    redo: tuple | None = None,
    gate: tuple[float, float] | None = None,
):
    """The pallas kernel. ``extras``: (ks, vs, km) (:func:`flash_bounds`) if ``checks``, then the
    four FlashFaults arrays if ``inject``. Returns out, lse (natural log, of the scaled scores) and, with
    checks, the two ratio rows.

    ``redo`` (with checks, no injection): (flags, out, lse, r_qk, r_pv, gated), flags (B, H,
    T / (2 block_q)) int32 and the rest refs (``_in_place``) the kernel updates in place:
    a CTA whose flag is 0 exits after reading it, one whose flag is set computes its rows afresh and
    writes them over the refs, with ``gate`` = (fill, limit) applied to its bf16 output values
    (non-finite or beyond the limit replaced by fill, counted per row into ``gated``). Returns
    nothing."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    dtype = q.dtype
    bq, bk = cfg.block_q, cfg.block_kv
    nb = s // bk
    stages = min(cfg.stages, nb)
    c = float(scale) * _LOG2E  # softmax in base 2: exp(x * scale) = exp2(x * c), one FMA per value
    n_out = 4 if checks else 2
    fuse_e = checks and cfg.fuse_e
    kn = bk + CS if fuse_e else bk  # rows of a key buffer: the keys, then (fused) the checksum tile
    fuse_v = checks and fused_value_check(cfg.fuse_v)  # v then arrives transposed, (B, KV, D, S)
    dn = d + CS if fuse_v else d  # the output accumulator's columns: out, then (fused) the check's
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    if redo is not None and (not isinstance(cfg.redo_ctas, int) or cfg.redo_ctas < 1):
        raise ValueError(
            f"pimlayers.flash_attention_redo: FlashConfig.redo_ctas is {cfg.redo_ctas!r}; "
            "expected an int >= 1"
        )
    redo_ctas = min(b * h * (t // (2 * bq)), cfg.redo_ctas)

    def kernel(refs, scoped):
        n_in = 3 + len(extras)
        if redo is None:
            own = refs
            units = lambda run: run(tuple(lax.axis_index(n) for n in ("batch", "heads", "q_seq")))
        else:
            # The redo: a few persistent CTAs, each running the flagged units of its share one after
            # another (:func:`_flagged_units`); every warpgroup reads the same flags, so all three
            # run or skip each unit together.
            own = refs[:n_in] + refs[n_in + 2 :]
            units = functools.partial(_flagged_units, pl, refs[n_in], refs[n_in + 1], redo_ctas)
        wg = lax.axis_index("wg")

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            units(lambda at: body(own, scoped, at)[0]())

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            units(lambda at: body(own, scoped, at)[1]())

    def body(refs, scoped, at):
        """The compute and memory warpgroups' work on one unit, ``at`` = (batch, head, block of
        2 block_q query rows): two functions, each run by its own warpgroups."""
        q_ref, k_ref, v_ref = refs[:3]
        ins = refs[3 : 3 + len(extras)]
        outs = refs[3 + len(extras) :]
        out_ref, lse_ref = outs[:2]
        if checks:
            ks_ref, vs_ref, km_ref = ins[:3]
            rqk_ref, rpv_ref = outs[2:4]
        flip_in = list(ins[3:7]) if inject else []
        smem, bars, consumed, schedule_barrier = scoped
        qo2, k_smem, v_smem, ks_smem, vs_smem, km_smem, rows_f, rows_i = smem
        k_bar, v_bar, ks_bar, vs_bar, q_bar, row_bar = bars
        k_done, v_done = consumed
        batch, q_head, q_seq = at
        wg = lax.axis_index("wg")

        def schedule():
            plgpu.barrier_arrive(schedule_barrier)
            plgpu.barrier_wait(schedule_barrier)

        cta_steps = pl.cdiv((q_seq + 1) * (2 * bq), jnp.array(bk, jnp.int32)) if causal else nb

        def compute():
            qo = qo2.at[wg]
            base = q_seq * (2 * bq) + wg * bq
            rows = pl.ds(base, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], qo, q_bar.at[wg])
            # The scores bound's tile (checks), then the per-row injection sites (int32).
            kv_head = lax.div(q_head, jnp.array(g, q_head.dtype))
            copies = [(km_ref.at[batch, kv_head], km_smem.at[wg])] if checks else []
            copies += [(src.at[batch, q_head, rows], rows_i.at[wg, i]) for i, src in enumerate(flip_in)]
            for i, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, row_bar.at[wg * 6 + i])
            plgpu.barrier_wait(q_bar.at[wg])
            for i in range(len(copies)):
                plgpu.barrier_wait(row_bar.at[wg * 6 + i])
            if checks:
                # The scores bound, |q|·(c_qk kmax) per row, while the first key block loads: the q
                # tile in registers (bf16 |x| is exact) against the bound's tile, as the output
                # check's p16 against the value tile.
                def compute_mag(m_ref):
                    plgpu.wgmma(m_ref, jnp.abs(qo[...]), km_smem.at[wg].transpose((1, 0)))
                    return m_ref[...]

                tol_qk = _tile_sum(pl.run_scoped(compute_mag, plgpu.ACC((bq, CS), jnp.float32)))
            if inject:
                sbit, skey, obit, ocol = (_load(plgpu, rows_i.at[wg, i], row_layout) for i in range(4))

            def row_const(x):
                return plgpu.layout_cast(jnp.full((bq,), x, jnp.float32), row_layout)

            acc = plgpu.layout_cast(jnp.full((bq, dn), 0, jnp.float32), wgmma_layout)
            cacc = None
            if checks and not fuse_v:
                cacc = plgpu.layout_cast(jnp.full((bq, CS), 0, jnp.float32), wgmma_layout)
            r_qk = row_const(0.0) if checks else None

            if causal:
                steps = pl.cdiv(base + bq, jnp.array(bk, jnp.int32))

                @pl.when(steps > 0)
                def _():
                    plgpu.barrier_wait(k_bar.at[0])
            else:
                steps = nb
                plgpu.barrier_wait(k_bar.at[0])

            pl.when(wg == 1)(schedule)

            def step(kv, carry, masked: bool = False):
                acc, cacc, m_i, l_i, r_qk = carry
                slot = lax.rem(kv, jnp.array(stages, kv.dtype))

                def compute_qk(s_ref, e_ref=None):
                    plgpu.wgmma(s_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    if checks and not fuse_e:
                        plgpu.barrier_wait(ks_bar.at[slot])
                        plgpu.wgmma(e_ref, qo, ks_smem.at[slot].transpose((1, 0)))
                    schedule()
                    if fuse_e:
                        s_all = s_ref[...]
                        return s_all[:, :bk], s_all[:, bk:]
                    return s_ref[...], (e_ref[...] if checks else None)

                accs = [plgpu.ACC((bq, kn), jnp.float32)] + (
                    [plgpu.ACC((bq, CS), jnp.float32)] if checks and not fuse_e else []
                )
                qk, e8 = pl.run_scoped(compute_qk, *accs)
                plgpu.barrier_arrive(k_done.at[slot])
                kv_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wgmma_layout) + kv * bk
                if inject:
                    hit = (kv_ids == lax.broadcast_in_dim(skey, qk.shape, [0])) & (
                        lax.broadcast_in_dim(sbit, qk.shape, [0]) >= 0
                    )
                    qk = _flip(qk, lax.broadcast_in_dim(sbit, qk.shape, [0]), hit)
                if checks:
                    # The worst |difference| over the row's key blocks, turned into the ratio once
                    # at the end: the row's bound is the same for every block and x -> x / tol is
                    # monotonic, so that is the largest ratio, bit for bit; max propagates NaN. The
                    # per-step ratio (a reciprocal, a product, NaN's select) took the kernel 2% longer
                    # (997-1004 against 960-982 us, H200, B = 1, T = 8192, 32/8 heads, 2026-12-04).
                    # The backward kernels keep their per-step ratios: deferred there, the dk/dv
                    # kernel spilled 364 bytes of registers instead of 260 and ran 0.6% slower.
                    r_qk = jnp.maximum(r_qk, jnp.abs(qk.sum(axis=1) - _tile_sum(e8)))
                if masked:
                    q_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wgmma_layout) + base
                    qk = jnp.where(q_ids >= kv_ids, qk, -jnp.inf)

                m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
                alpha = jnp.exp2(m_i - m_ij)
                m_i = m_ij
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                if checks and not fuse_v:
                    # l comes from the tensor cores: the checksum tile's row of ones sums p16 into
                    # cacc's column 2, rescaled with it, so the softmax's own row sum is not needed.
                    cacc *= lax.broadcast_in_dim(alpha, cacc.shape, [0])
                elif not checks:
                    l_i *= alpha
                    l_i += p.sum(axis=1)
                # (fuse_v: those columns are acc's last eight, rescaled with it above; l_i stays 0
                # through the loop and is read from them after it. Until 2026-12-07 this path also
                # summed p here, a row reduction per step whose result was overwritten.)
                acc, cacc, l_i, m_i, p16 = lax.optimization_barrier((acc, cacc, l_i, m_i, p16))
                plgpu.barrier_arrive(schedule_barrier)  # softmax done
                plgpu.barrier_wait(v_bar.at[slot])
                if checks and not fuse_v:
                    plgpu.barrier_wait(vs_bar.at[slot])
                plgpu.barrier_wait(schedule_barrier)  # the tensor cores are free

                def compute_pv(refs):
                    acc_ref, c_ref = refs
                    if fuse_v:  # [vᵀ; checksum tile] (D + 8, bk), K-major as the key tile is
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot].transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    if checks and not fuse_v:
                        plgpu.wgmma(c_ref, p16, vs_smem.at[slot].transpose((1, 0)))
                    nxt = kv + 1

                    @pl.when(nxt < steps)
                    def _():
                        plgpu.barrier_wait(k_bar.at[lax.rem(nxt, jnp.array(stages, kv.dtype))])

                acc, cacc = pl.run_state(compute_pv)(
                    (plgpu.ACC.init(acc), plgpu.ACC.init(cacc) if cacc is not None else None)
                )
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, cacc, m_i, l_i, r_qk

            carry = (acc, cacc, row_const(-jnp.inf), row_const(0.0), r_qk)
            if not causal:
                carry = lax.fori_loop(0, nb, step, carry)
            else:

                def flush(kv, _):
                    # Keep the TMA pipeline's barriers in step when this warpgroup needs fewer key
                    # blocks than the CTA's other one. A persistent redo CTA also waits for the
                    # blocks it skips: a barrier's phase is counted per thread, by its waits, and
                    # must be where a fresh CTA's is when the next unit starts.
                    slot = lax.rem(kv, jnp.array(stages, kv.dtype))
                    if redo is not None:
                        plgpu.barrier_wait(k_bar.at[slot])
                        plgpu.barrier_wait(v_bar.at[slot])
                        if checks and not fuse_e:
                            plgpu.barrier_wait(ks_bar.at[slot])
                        if checks and not fuse_v:
                            plgpu.barrier_wait(vs_bar.at[slot])
                    plgpu.barrier_arrive(k_done.at[slot])
                    plgpu.barrier_arrive(v_done.at[slot])
                    schedule()
                    schedule()

                full = lax.div(base, jnp.array(bk, jnp.int32))
                carry = lax.fori_loop(0, full, step, carry)
                carry = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
                lax.fori_loop(steps, cta_steps, flush, None)
            acc, cacc, m_i, l_i, r_qk = carry
            pl.when(wg == 0)(schedule)
            if fuse_v:
                acc, cacc = acc[:, :d], acc[:, d:]

            if inject:
                d_ids = plgpu.broadcasted_iota(jnp.int32, (bq, d), 1, layout=wgmma_layout)
                hit = (d_ids == lax.broadcast_in_dim(ocol, acc.shape, [0])) & (
                    lax.broadcast_in_dim(obit, acc.shape, [0]) >= 0
                )
                acc = _flip(acc, lax.broadcast_in_dim(obit, acc.shape, [0]), hit)
            if checks:
                col8 = plgpu.broadcasted_iota(jnp.int32, (bq, CS), 1, layout=wgmma_layout)
                cs = jnp.where(col8 < 2, cacc, 0.0).sum(axis=1)
                l_i = jnp.where(col8 == 2, cacc, 0.0).sum(axis=1)
                tol_pv = jnp.where((col8 == 3) | (col8 == 4), cacc, 0.0).sum(axis=1)  # c_pv vmax l
                r_pv = _ratio(acc.sum(axis=1) - cs, tol_pv)
            acc /= lax.broadcast_in_dim(l_i, (bq, d), [0])
            o16 = acc.astype(dtype)
            if gate is not None:
                # The insulation gate on the rounded values, as ``ops.gate`` compares them (in f32):
                # kept where |x| <= limit, or with no limit where |x| < inf (NaN fails both).
                fill, limit = gate
                mag = jnp.abs(o16.astype(jnp.float32))
                keep = (mag <= limit) if math.isfinite(limit) else (mag < jnp.inf)
                one = plgpu.layout_cast(jnp.full((bq, d), 1.0, jnp.float32), wgmma_layout)
                o16 = jnp.where(keep, o16, jnp.asarray(fill, jnp.float32).astype(dtype))
                rows_f.at[wg, 3][...] = jnp.where(keep, 0.0, one).sum(axis=1)
            qo[...] = o16
            lse_s = rows_f.at[wg, 0]
            # m_i is in base 2 (the softmax's exp2): the natural-log lse in the kernel, not by an
            # XLA multiply after it (a kernel of its own, 2.8 us at B = 1, T = 8192, 32 heads).
            lse_s[...] = m_i * math.log(2.0) + jnp.log(l_i)
            if checks:
                rows_f.at[wg, 1][...] = _ratio(r_qk, tol_qk)
                rows_f.at[wg, 2][...] = r_pv
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo, out_ref.at[batch, rows, q_head])
            plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[batch, q_head, rows])
            if checks:
                plgpu.copy_smem_to_gmem(rows_f.at[wg, 1], rqk_ref.at[batch, q_head, rows])
                plgpu.copy_smem_to_gmem(rows_f.at[wg, 2], rpv_ref.at[batch, q_head, rows])
            if gate is not None:
                plgpu.copy_smem_to_gmem(rows_f.at[wg, 3], outs[4].at[batch, q_head, rows])
            plgpu.wait_smem_to_gmem(0)

        def memory():
            kv_head = lax.div(q_head, jnp.array(g, q_head.dtype))

            def load_k(step, slot):
                sl = (batch, pl.ds(step * bk, bk), kv_head)
                if fuse_e:  # two copies, one barrier expecting both arrivals
                    plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot, pl.ds(0, bk)], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(
                        ks_ref.at[batch, kv_head, step], k_smem.at[slot, pl.ds(bk, CS)], k_bar.at[slot]
                    )
                    return
                plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_bar.at[slot])
                if checks:
                    plgpu.copy_gmem_to_smem(
                        ks_ref.at[batch, kv_head, step], ks_smem.at[slot], ks_bar.at[slot]
                    )

            def load_v(step, slot):
                if fuse_v:  # the transposed values, then the checksum tile: one barrier, both
                    vt = v_ref.at[batch, kv_head, :, pl.ds(step * bk, bk)]
                    plgpu.copy_gmem_to_smem(vt, v_smem.at[slot, pl.ds(0, d)], v_bar.at[slot])
                    plgpu.copy_gmem_to_smem(
                        vs_ref.at[batch, kv_head, step], v_smem.at[slot, pl.ds(d, CS)], v_bar.at[slot]
                    )
                    return
                sl = (batch, pl.ds(step * bk, bk), kv_head)
                plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_bar.at[slot])
                if checks:
                    plgpu.copy_gmem_to_smem(
                        vs_ref.at[batch, kv_head, step], vs_smem.at[slot], vs_bar.at[slot]
                    )

            # The redo's CTAs run several units: first loads only of blocks the unit has, and the
            # last blocks' release awaited, so the next unit finds every slot free.
            persistent = redo is not None
            pipes = [(k_done, load_k), (v_done, load_v)]
            _stream(pl, plgpu, cta_steps, stages, pipes, guard=persistent, drain=persistent)

        return compute, memory

    def entry(*refs):
        tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = [
            plgpu.SMEM((2, bq, d), dtype, transforms=tf),  # q in, out staged on its way back
            plgpu.SMEM((stages, kn, d), dtype, transforms=tf),
            plgpu.SMEM((stages, dn, bk) if fuse_v else (stages, bk, d), dtype, transforms=tf),
            plgpu.SMEM((stages, CS, d), dtype, transforms=tf) if checks and not fuse_e else None,
            plgpu.SMEM((stages, CS, bk), dtype, transforms=tf) if checks and not fuse_v else None,
            plgpu.SMEM((2, CS, d), dtype, transforms=tf) if checks else None,  # per warpgroup: km
            plgpu.SMEM((2, 4 if gate else 3, bq), jnp.float32),  # per warpgroup: lse, ratios (gated)
            plgpu.SMEM((2, 4, bq), jnp.int32) if inject else None,
        ]
        bars = (
            plgpu.Barrier(num_arrivals=2 if fuse_e else 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2 if fuse_v else 1, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=12),
        )
        pl.run_scoped(
            lambda *scoped: kernel(refs, scoped),
            smem,
            bars,
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    if fuse_v:
        # (B, S, KV, D) -> (B, KV, D, S): each step's value tile is then a TMA box of D rows of bk
        # keys. A forward with its redo asks for the transpose in both calls (the redo's inside its
        # own jit), which XLA's common-subexpression pass can merge into one
        # (tests/test_gpu_flash.py::test_a_forward_and_its_redo_transpose_v_once checks the
        # compiled program; docs/gpu-tests.md says where it has run).
        v = jnp.transpose(v, (0, 2, 3, 1))
    row = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
    grid, names = (h, t // (2 * bq), b), ("heads", "q_seq", "batch")
    params = plgpu.CompilerParams(approx_math=True)
    if redo is not None:
        # Refs are aliased in and out of the kernel: what a unit not redone does not write keeps
        # the first pass's values, with no copy.
        flags, *refs = redo
        mesh = plgpu.Mesh(grid=(redo_ctas,), grid_names=("cta",), num_threads=3, thread_name="wg")
        run = pl.kernel(entry, out_type=(), mesh=mesh, compiler_params=params)
        run(q, k, v, *extras, flags, _busy_ctas(flags, redo_ctas), *refs)
        return None
    operands = (q, k, v, *extras)
    out = plgpu.kernel(
        entry,
        out_type=typed_like([jax.ShapeDtypeStruct(q.shape, dtype)] + [row] * (n_out - 1), *operands),
        grid=grid,
        grid_names=names,
        num_threads=3,
        thread_name="wg",
        compiler_params=params,
    )(*operands)
    return vary_as(out, *operands)  # inside shard_map: the results vary as the operands do (ops._vma)


def _check_inputs(q, k, v, causal: bool, cfg: FlashConfig) -> None:
    if (
        q.ndim != 4
        or k.ndim != 4
        or v.shape != k.shape
        or k.shape[0] != q.shape[0]
        or k.shape[3] != q.shape[3]
    ):
        raise ValueError(
            f"pimlayers.flash_attention: q {q.shape}, k {k.shape}, v {v.shape}; expected q (B, T, H, D) "
            "and k, v (B, S, KV, D)"
        )
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in (
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        raise TypeError(
            f"pimlayers.flash_attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; expected one "
            "dtype, bfloat16 or float16"
        )
    if not flash_supported(q.shape, k.shape, q.dtype, causal, cfg):
        raise ValueError(
            f"pimlayers.flash_attention: q {q.shape}, k {k.shape} (causal={causal}) is outside the kernel's "
            f"shapes: D 64 or 128, H a multiple of KV, T a multiple of {2 * cfg.block_q}, "
            f"S of {cfg.block_kv}, and T == S when causal"
        )


def _check_faults(q, faults: FlashFaults) -> None:
    want = (q.shape[0], q.shape[2], q.shape[1])
    if not isinstance(faults, FlashFaults):
        raise TypeError(
            f"pimlayers.flash_attention: faults is a {type(faults).__name__}; expected FlashFaults"
        )
    for name, a in zip(FlashFaults._fields, faults, strict=True):
        if a.shape != want or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(
                f"pimlayers.flash_attention: faults.{name} is {a.dtype}{list(a.shape)}; "
                f"expected int32{list(want)} (batch, heads, query rows)"
            )


@config_resolved(resolved)
@functools.partial(jax.jit, static_argnames=("causal", "scale", "lam", "checks", "config"))
def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    faults: FlashFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    checks: bool = True,
    config: FlashConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b h t"], FlashChecks | None]:
    """softmax(q·kᵀ·scale, causal)·v on Hopper's tensor cores, H query heads over KV heads.

    Returns ``(out, lse, checks)``: lse is the natural-log logsumexp of each row's scaled scores
    (what a flash backward needs), ``checks`` the two ratios per row (None when ``checks=False``,
    the kernel without its checksums: the peer that says what they cost). ``faults`` flips bits
    inside the kernel (tests). Raises NotImplementedError off a Hopper GPU.
    """
    cfg = config or FlashConfig()
    _check_inputs(q, k, v, causal, cfg)
    if faults is not None and not checks:
        raise ValueError("pimlayers.flash_attention: faults are injected before the checks; pass checks=True")
    if checks and q.dtype != jnp.bfloat16:
        raise TypeError(
            f"pimlayers.flash_attention: checks=True needs bfloat16 q, k, v (the checksum tiles are bf16 "
            f"hi/lo pairs); got {q.dtype}. Use bfloat16, or checks=False for the unverified kernel"
        )
    if faults is not None:
        _check_faults(q, faults)
    if not hopper():
        raise NotImplementedError(
            "pimlayers.flash_attention runs on a Hopper GPU (sm_90) only; "
            "flash_attention_reference is the same computation through XLA"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    extras: tuple = ()
    if checks:
        extras = flash_bounds(k, v, lam=lam, config=cfg)
    if faults is not None:
        extras += tuple(a.astype(jnp.int32) for a in faults)
    res = _kernel_call(
        q, k, v, extras, causal=causal, scale=scale, checks=checks, inject=faults is not None, cfg=cfg
    )
    return res[0], res[1], (FlashChecks(res[2], res[3]) if checks else None)


def redo_flags(checks: FlashChecks, config: FlashConfig | None = None) -> Int32[Array, "b h nq"]:
    """Which of the kernel's CTAs (each 2 ``block_q`` query rows of one head) hold a row that failed a
    check: (B, H, T / (2 block_q)) int32, 1 where a ratio of either check is above 1 or NaN. What
    :func:`flash_attention_redo` takes."""
    cfg = config or FlashConfig()
    b, h, t = checks.scores.shape
    if t % (2 * cfg.block_q):
        raise ValueError(
            f"pimlayers.redo_flags: checks for {t} query rows; expected a multiple of {2 * cfg.block_q}"
        )
    bad = ~(checks.scores <= 1.0) | ~(checks.out <= 1.0)
    return jnp.any(bad.reshape(b, h, t // (2 * cfg.block_q), 2 * cfg.block_q), axis=-1).astype(jnp.int32)


def _check_redo(q, flags, out, lse, checks, cfg: FlashConfig, name: str) -> None:
    b, t, h, _ = q.shape
    rows, want_flags = (b, h, t), (b, h, t // (2 * cfg.block_q))
    if not isinstance(checks, FlashChecks):
        raise TypeError(f"{name}: checks is a {type(checks).__name__}; expected FlashChecks")
    if tuple(flags.shape) != want_flags or not jnp.issubdtype(flags.dtype, jnp.integer):
        raise ValueError(
            f"{name}: flags is {flags.dtype}{list(flags.shape)}; expected int32{list(want_flags)} "
            f"(batch, heads, blocks of {2 * cfg.block_q} query rows: redo_flags)"
        )
    for what, a, shape, dtype in (
        ("out", out, q.shape, q.dtype),
        ("lse", lse, rows, jnp.float32),
        ("checks.scores", checks.scores, rows, jnp.float32),
        ("checks.out", checks.out, rows, jnp.float32),
    ):
        if tuple(a.shape) != tuple(shape) or a.dtype != dtype:
            raise ValueError(
                f"{name}: {what} is {a.dtype}{list(a.shape)}; expected {jnp.dtype(dtype)}{list(shape)} "
                "(the first pass's result)"
            )


def _fold_vmap(fn):
    """``fn(*arrays)`` -> tuple of arrays, every operand and result with the batch on axis 0 and its
    rows independent, made vmappable by folding the vmapped axis into the batch (a Mosaic kernel
    given refs, as the redo's are, has no batching rule of its own)."""

    @jax.custom_batching.custom_vmap
    def folded(*xs):
        return fn(*xs)

    @folded.def_vmap
    def _(axis_size, in_batched, *xs):
        pairs = zip(xs, in_batched, strict=True)
        xs = [x if bat else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, bat in pairs]
        outs = folded(*(x.reshape(-1, *x.shape[2:]) for x in xs))
        outs = tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    return folded


def _in_place(kernel, values: tuple) -> tuple:
    """``kernel(*refs)`` on refs holding ``values``, the values it leaves in them returned: a Pallas
    kernel given refs updates them in place (aliased in and out, no copy). Through ``run_state``
    rather than ``jax.new_ref``: the refs stay inside it, so the call is a plain function of arrays
    to every transformation around it (jax 0.10 could not lower a ``new_ref`` inside
    ``_fold_vmap``'s ``custom_vmap``, nor vmap one inside a ``custom_vjp``)."""
    from jax.experimental import pallas as pl

    return tuple(pl.run_state(lambda refs: kernel(*refs))(tuple(values)))


@functools.cache
def _redo_fn(causal: bool, scale: float, gate: tuple[float, float] | None, cfg: FlashConfig):
    """The redo's launch as a jitted, vmappable function of arrays: (q, k, v, flags, out, lse, r_qk,
    r_pv, ks, vs, km) -> (out, lse, r_qk, r_pv, gated f32), the bounds' tiles given (the first
    pass's: :func:`flash_bounds`)."""

    def run(q, k, v, flags, out, lse, r_qk, r_pv, *bounds):
        kw = dict(causal=causal, scale=scale, checks=True, inject=False, cfg=cfg, gate=gate)
        kernel = lambda *refs: _kernel_call(q, k, v, bounds, redo=(flags.astype(jnp.int32), *refs), **kw)
        zeros = jnp.zeros(lse.shape, jnp.float32)
        res = _in_place(kernel, (out, lse, r_qk, r_pv) + ((zeros,) if gate is not None else ()))
        return res if gate is not None else (*res, zeros)

    return jax.jit(_fold_vmap(run))


def _gate_spec(gate) -> tuple[float, float] | None:
    return None if gate is None else (float(gate[0]), float(gate[1]))


@config_resolved(resolved)
@functools.partial(jax.jit, static_argnames=("causal", "scale", "lam", "gate", "config"))
def flash_attention_with_redo(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    faults: FlashFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    gate: tuple[float, float] | None = None,
    config: FlashConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b h t"], FlashChecks, FlashChecks, Int32[Array, "b h t"]]:
    """:func:`flash_attention` (``faults`` injected there), then :func:`flash_attention_redo` over
    the CTAs whose rows failed a check, the two passes sharing the bounds' tiles (one read of k and
    v). Returns ``(out, lse, first, checks, gated)``: the first pass's ratios and the final ones (a
    redone row that fails again says so there), and the gate's counts of the redone rows. What the
    attention core runs by default on a Hopper GPU; :func:`flash_attention_with_redo_reference` is
    the same through XLA."""
    cfg = config or FlashConfig()
    _check_inputs(q, k, v, causal, cfg)
    if q.dtype != jnp.bfloat16:
        raise TypeError(
            f"pimlayers.flash_attention_with_redo: q, k, v have dtype {q.dtype}; expected bfloat16"
        )
    if faults is not None:
        _check_faults(q, faults)
    if not hopper():
        raise NotImplementedError(
            "pimlayers.flash_attention_with_redo runs on a Hopper GPU (sm_90) only; "
            "flash_attention_with_redo_reference is the same computation through XLA"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bounds = flash_bounds(k, v, lam=lam, config=cfg)
    extras = bounds + (() if faults is None else tuple(a.astype(jnp.int32) for a in faults))
    kw = dict(causal=causal, scale=scale, checks=True, cfg=cfg)
    out, lse, r_qk, r_pv = _kernel_call(q, k, v, extras, inject=faults is not None, **kw)
    first = FlashChecks(r_qk, r_pv)
    run = _redo_fn(causal, scale, _gate_spec(gate), cfg)
    out, lse, r_qk, r_pv, gated = run(q, k, v, redo_flags(first, cfg), out, lse, r_qk, r_pv, *bounds)
    return out, lse, first, FlashChecks(r_qk, r_pv), gated.astype(jnp.int32)


def flash_attention_with_redo_reference(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    faults: FlashFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    gate: tuple[float, float] | None = None,
    config: FlashConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b h t"], FlashChecks, FlashChecks, Int32[Array, "b h t"]]:
    """:func:`flash_attention_with_redo` through XLA (any backend): :func:`flash_attention_reference`
    with ``faults``, then :func:`flash_attention_redo_reference`. For tests and the layers'
    reference path."""
    kw = dict(causal=causal, scale=scale, lam=lam, config=config)
    out, lse, first = flash_attention_reference(q, k, v, faults, **kw)
    out, lse, checks, gated = flash_attention_redo_reference(
        q, k, v, redo_flags(first, config), out, lse, first, gate=gate, **kw
    )
    return out, lse, first, checks, gated


def flash_attention_redo(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    flags: Int32[Array, "b h nq"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b h t"],
    checks: FlashChecks,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    gate: tuple[float, float] | None = None,
    config: FlashConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b h t"], FlashChecks, Int32[Array, "b h t"]]:
    """The verified kernel again on the CTAs ``flags`` marks (:func:`redo_flags` of the first pass's
    checks), on the device, with no branch: one launch over every CTA, of which a clean one reads its
    flag and exits, and a flagged one computes its 2 ``block_q`` rows afresh (no injected faults:
    they model transient errors) and writes them, their lse and their two checks over the first
    pass's ``out``, ``lse`` and ``checks``, which are updated in place (aliased, not copied).

    ``gate`` = (fill, limit or inf): the rewritten rows' output values that are non-finite or beyond
    the limit are replaced by fill, as :func:`pimlayers.ops.gate` would (compared in f32 after the
    rounding to bf16). Returns ``(out, lse, checks, gated)``, gated (B, H, T) int32 the values
    replaced per row (zero where the CTA was not redone or ``gate`` is None). A redone row whose
    checks fail again says so in the returned checks. Hopper only, as :func:`flash_attention`;
    :func:`flash_attention_redo_reference` is the same through XLA."""
    cfg = resolved(config)
    _check_inputs(q, k, v, causal, cfg)
    if q.dtype != jnp.bfloat16:
        raise TypeError(f"pimlayers.flash_attention_redo: q, k, v have dtype {q.dtype}; expected bfloat16")
    _check_redo(q, flags, out, lse, checks, cfg, "pimlayers.flash_attention_redo")
    if not hopper():
        raise NotImplementedError(
            "pimlayers.flash_attention_redo runs on a Hopper GPU (sm_90) only; "
            "flash_attention_redo_reference is the same computation through XLA"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    run = _redo_fn(causal, scale, _gate_spec(gate), cfg)
    bounds = flash_bounds(k, v, lam=lam, config=cfg)
    out, lse, r_qk, r_pv, gated = run(q, k, v, flags, out, lse, checks.scores, checks.out, *bounds)
    return out, lse, FlashChecks(r_qk, r_pv), gated.astype(jnp.int32)


def flash_attention_redo_reference(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    flags: Int32[Array, "b h nq"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b h t"],
    checks: FlashChecks,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    gate: tuple[float, float] | None = None,
    config: FlashConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b h t"], FlashChecks, Int32[Array, "b h t"]]:
    """:func:`flash_attention_redo` through XLA (any backend): :func:`flash_attention_reference`'s
    fault-free results on the flagged CTAs' rows, the given ones elsewhere, the gate applied to the
    fresh rows. For tests and the layers' reference path."""
    from ._gate import gate_reference

    cfg = _xla_bounds_unless_asked(config or FlashConfig())
    _check_inputs(q, k, v, causal, cfg)
    _check_redo(q, flags, out, lse, checks, cfg, "pimlayers.flash_attention_redo_reference")
    o2, l2, c2 = flash_attention_reference(q, k, v, causal=causal, scale=scale, lam=lam, config=cfg)
    redone = jnp.repeat(flags != 0, 2 * cfg.block_q, axis=-1)  # (B, H, T)
    gated = jnp.zeros(lse.shape, jnp.int32)
    if gate is not None:
        o2, counts = gate_reference(o2, fill=float(gate[0]), limit=float(gate[1]))  # counts (B, T, H)
        gated = jnp.where(redone, counts.transpose(0, 2, 1), 0)
    pick = lambda new, old: jnp.where(redone, new, old)
    out = jnp.where(redone.transpose(0, 2, 1)[..., None], o2, out)
    return out, pick(l2, lse), FlashChecks(pick(c2.scores, checks.scores), pick(c2.out, checks.out)), gated


def flash_attention_reference(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    faults: FlashFaults | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    lam: float = 8.0,
    config: FlashConfig | None = None,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b h t"], FlashChecks]:
    """The kernel's results through XLA, scores materialised in f32: the same checksums, bounds and
    injected flips (per row), the output rounded to q's dtype. Any backend; for tests. Its bounds are
    XLA's on every platform unless ``config.bounds_kernel`` is True (the default's Triton kernels
    are the Hopper kernel's, measured there)."""
    cfg = _xla_bounds_unless_asked(config or FlashConfig())
    _check_inputs(q, k, v, causal, cfg)
    if q.dtype != jnp.bfloat16:
        raise TypeError(
            f"pimlayers.flash_attention_reference: q, k, v have dtype {q.dtype}; expected bfloat16"
        )
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g, nb, bk = h // kvh, s // cfg.block_kv, cfg.block_kv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if faults is not None:
        _check_faults(q, faults)
    hi = lax.Precision.HIGHEST
    ks, vs, km = flash_bounds(k, v, lam=lam, config=cfg)
    f32 = lambda tile, i: tile[..., i, :].astype(jnp.float32)  # one row of a checksum tile
    # The scores bound: |q| against km's hi + lo (the kernel's small wgmma).
    kmh = jnp.repeat(f32(km, 0) + f32(km, 1), g, axis=1)  # (B, H, D)
    tol_qk = jnp.einsum("bthd,bhd->bht", jnp.abs(q).astype(jnp.float32), kmh, precision=hi)
    kh = jnp.repeat(k, g, axis=2)
    vh = jnp.repeat(v, g, axis=2)
    sc = jnp.einsum("bthd,bshd->bhts", q, kh, preferred_element_type=jnp.float32, precision=hi)
    if faults is not None:
        keys = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
        hit = (keys == faults.score_key[..., None]) & (faults.score_bit >= 0)[..., None]
        sc = _flip(sc, faults.score_bit[..., None], hit)
    # Checksum of each key block: the tile's hi + lo rows against q, in f32.
    ksum = f32(ks, 0) + f32(ks, 1)  # (B, KV, nb, D)
    e = jnp.einsum("bthd,bhjd->bhtj", q.astype(jnp.float32), jnp.repeat(ksum, g, axis=1), precision=hi)
    rs = jnp.sum(sc.reshape(b, h, t, nb, bk), axis=-1)
    r_qk = jnp.max(_ratio(rs - e, tol_qk[..., None]), axis=-1)
    if causal:
        visible = jnp.arange(s)[None, None, None, :] <= jnp.arange(t)[None, None, :, None]
        sc = jnp.where(visible, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True) * scale
    p = jnp.exp(sc * scale - m)
    p16 = p.astype(q.dtype)
    l_ = jnp.sum(p16.astype(jnp.float32), axis=-1)  # the kernel's l: the tensor cores' sum of p16
    acc = jnp.einsum("bhts,bshd->bhtd", p16, vh, preferred_element_type=jnp.float32, precision=hi)
    if faults is not None:
        cols = jnp.arange(d, dtype=jnp.int32)[None, None, None, :]
        hit = (cols == faults.out_col[..., None]) & (faults.out_bit >= 0)[..., None]
        acc = _flip(acc, faults.out_bit[..., None], hit)
    per_key = lambda x: jnp.repeat(x.reshape(b, kvh, s), g, axis=1)  # (B, KV, nb, bk) -> (B, H, S)
    p32 = p16.astype(jnp.float32)
    cs = jnp.einsum("bhts,bhs->bht", p32, per_key(f32(vs, 0) + f32(vs, 1)), precision=hi)
    # The bound, c_pv vmax l, as the kernel forms it: p16 against the tile's fourth and fifth rows.
    tol_pv = jnp.einsum("bhts,bhs->bht", p32, per_key(f32(vs, 3) + f32(vs, 4)), precision=hi)
    r_pv = _ratio(jnp.sum(acc, axis=-1) - cs, tol_pv)
    out = (acc / l_[..., None]).transpose(0, 2, 1, 3).astype(q.dtype)
    lse = m[..., 0] + jnp.log(l_)
    return out, lse, FlashChecks(r_qk, r_pv)
