"""protected_matmul: y = x @ w verified by ABFT, corrected, recomputed on a rare slow path, reported.

Forward, for x: (..., K) and w: (K, N) in f32, bf16 or f16:
  1. y = x @ w with f32 accumulation (bf16/f16 products are exact in f32; f32 inputs run at
     HIGHEST precision so TF32 rounding cannot swamp the bound), written by the GEMM in bf16 when
     operands and result are bf16 (its epilogue rounds the accumulator once), else in f32;
  2. [tests and demos] injected faults flip bits of the f32 accumulator inside the compiled step;
  3. abft_finish checks y against the weight's encoded checksum columns (``enc``; "encode on
     write": whoever writes w refreshes them); a bf16 y is checked where it lies, its rounding
     in the bound (``_product_dtype`` says why that keeps the check about as sharp);
  4. errors located there are rebuilt in place; anything detected but not located triggers one
     recompute of the GEMM in a loop of 0 or 1 trips (the rare slow path) or, with
     ``policy.recompute_blocks``, a branch-free redo of the flagged column blocks alone, or with
     ``policy.recompute_kernel`` (bf16/f16) the device kernel that computes only the detected
     blocks (``_redo_kernel``); each is checked again, and what still disagrees is reported as
     uncorrectable — never silent;
  5. the insulation gate replaces non-finite (and out-of-range) values and counts them; checks 3-5
     (and an f32 product's cast to the output dtype) are one pass over y (``abft_finish``).

Backward (custom VJP): dx = dy @ w^T and dw = x^T @ dy go through the same checked GEMM, with the
checksum columns of w^T and dy encoded on the fly, and the same gate. Their report comes out as
the cotangent of ``tap`` (a float32 vector of FaultReport.NUM fields): differentiate with respect
to it to read the backward pass's faults.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Int32

from ..faults import FaultPolicy, FaultReport
from ..faults._inject import GemmFaults, inject_gemm_faults
from . import _margins
from ._abft import (
    ABFT_DETECTED,
    F32_ROUNDOFF,
    WeightChecksums,
    abft_checks,
    abft_encode,
    abft_encode_pair,
    abft_finish,
    abft_finish_reference,
    checks_after,
    checks_native_everywhere,
)
from ._common import check_float, first_true
from ._fused_check import fused_flags, inject_fused, redo_tiles
from ._fused_gemm import (
    TILE,
    FusedConfig,
    check_tiles_of,
    fused_gemm,
    fused_gemm_checked,
    fused_gemm_checked_supported,
    fused_gemm_supported,
    hopper,
)
from ._fused_rows import fused_rows
from ._gate import gate
from ._redo_kernel import redo_detected, redo_kernel_applies, redo_kernel_wanted
from ._redo_sharding import tally_parts
from ._rows import row_sums
from ._vma import vary_alike, zero_cotangent

__all__ = [
    "TRANSPOSED_CHECKSUMS",
    "protected_bmm",
    "protected_bmm_grads",
    "protected_matmul",
    "protected_matmuls",
    "report_from_tap",
    "zero_tap",
]

# The name (``jax.ad_checkpoint.checkpoint_name``) of the checksum columns of wᵀ that a protected
# GEMM being differentiated encodes in its forward pass, with w's own, for its backward's dx
# check: a rematerialisation policy that saves it (``save_only_these_names``) keeps the backward
# from encoding w again.
TRANSPOSED_CHECKSUMS = "pimlayers.transposed_checksums"


def zero_tap() -> jax.Array:
    """The ``tap`` argument: zeros whose gradient is the backward pass's FaultReport."""
    return jnp.zeros((len(FaultReport.FIELDS),), jnp.float32)


def report_from_tap(g: jax.Array) -> FaultReport:
    """A FaultReport from the gradient of a tap (counts travel as exact small floats)."""
    return FaultReport.from_counts(jnp.rint(g).astype(jnp.int32))


def _to_tap(r: FaultReport) -> jax.Array:
    return r.counts.astype(jnp.float32)


def _dot(a, b, precision, a_t: bool = False, b_t: bool = False, out=jnp.float32):
    """(G, R, K) @ (G, K, N) -> (G, R, N), accumulated in f32 (bf16/f16 products are exact in f32)
    and stored as ``out``. ``a_t``: a is stored as (G, K, R); ``b_t``: b as (G, N, K) (the
    backward's transposes, never materialised)."""
    dims = (((1 if a_t else 2,), (2 if b_t else 1,)), ((0,), (0,)))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out)


def _product_dtype(a, b, out_dtype):
    """The dtype the checked GEMM writes its product in.

    bf16 operands with a bf16 result: bf16, rounded once from the f32 accumulator by the GEMM's own
    epilogue, and checked where it lies (in place). An f32 product costs the GEMM 2 extra bytes
    per value written and the check 2 more read plus 2 written for the cast (on an H200 at
    8192 x 4096 -> 14336: ~0.07 ms in the GEMM and 0.34 ms for the finish, against 0.14-0.16 ms
    for the in-place check of the bf16 product; docs/gpu-tests.md, 2026-12-01). The check's bound
    then carries bf16's rounding of y, ``2^-8 · Σ|y|``, beside the f32 accumulation's
    ``λ·√K·2^-24·mag`` (λ = 8). For products whose terms have random signs Σ|y| ≈ mag / √K, so the
    two are about equal at K = 4096 and the new one is smaller beyond: the check stays about as
    sharp. Everything else (f32; f16, whose narrow range would turn large clean products into
    infinities before the check) keeps the f32 product and casts it in the checking pass.
    """
    if a.dtype == b.dtype == jnp.dtype(out_dtype) == jnp.bfloat16:
        return jnp.bfloat16
    return jnp.float32


def _checked_gemm(
    a,
    b,
    enc: WeightChecksums,
    policy: FaultPolicy,
    faults,
    precision,
    impl,
    out_dtype,
    role: str = "y",
    a_t: bool = False,
    b_t: bool = False,
    checks=None,
):
    """(G, R, K) @ (G, K, N) -> (out_dtype (G, R, N), FaultReport), per the policy.

    ``checks``: ``(c, mag, offset)`` already formed by the caller for an ``a`` it has pinned
    (:func:`_checked_gemms`: one check GEMM for several weights sharing the operand, this product's
    blocks from ``offset`` on; the finish reads them there).

    ``a_t`` / ``b_t``: the operand is stored transposed, a as (G, K, R), b as (G, N, K) (``enc``
    then comes from ``abft_encode(b, transposed=True)``): the backward's xᵀ and wᵀ are read in place.

    G independent GEMMs (1 for a layer's matmul; batch x heads for attention) share one slow path:
    the recompute runs when any of them has an error it could not locate, so the branch predicate
    is one scalar and stays a real branch (a per-GEMM predicate would turn into a select under vmap).
    The product is checked, corrected, gated (and, if f32, cast to ``out_dtype``) in one pass
    (``abft_finish``): y is read once after the GEMM writes it, in place when it is bf16.
    """
    g, r, k = a.shape[0], a.shape[2 if a_t else 1], a.shape[1 if a_t else 2]
    n = b.shape[1 if b_t else 2]
    if policy.enabled and a.dtype != jnp.float32 and checks is None:
        # The GEMM and its checksum must read the same operand. Without the barrier XLA may fuse an
        # operand's producer (e.g. silu(g) * u in bf16) into each consumer separately and drop the
        # bf16 rounding in one of them (convert pairs are simplified away), so the two products
        # differ by the operand's rounding, far beyond the bound: false detections (seen on CPU).
        # An f32 operand has no rounding to lose, and the barrier costs a copy of it on the CPU.
        a = lax.optimization_barrier(a)
    if _fused_applies(a, b, policy, out_dtype, impl, a_t, b_t):
        return _checked_gemm_fused(a, b, enc, policy, faults, precision, role, b_t, checks)
    prod = _product_dtype(a, b, out_dtype)
    y = _dot(a, b, precision, a_t, b_t, prod)
    y = inject_gemm_faults(y.reshape(g * r, n), faults).reshape(g, r, n)
    if not policy.enabled:
        report = FaultReport.zeros()
        if policy.gate:
            y, counts = gate(y, fill=policy.gate_fill, limit=policy.gate_limit)
            report = report + FaultReport(nonfinite_gated=jnp.sum(counts, dtype=jnp.int32))
        return y.astype(out_dtype), report
    kw = dict(
        k=k,
        block_n=policy.block_n,
        lam=policy.lam,
        impl=impl,
        out_dtype=out_dtype,
        gate=policy.gate,
        fill=policy.gate_fill,
        limit=policy.gate_limit,
        weighted=policy.weighted_checks,
    )
    if checks is None:
        c, mag = abft_checks(
            checks_after(y, a), enc, transposed=a_t, lam=policy.lam, weighted=policy.weighted_checks
        )
        off = 0
    else:
        c, mag, off = checks  # a shared check GEMM's: this product's blocks from `off` on
    kw["block_offset"] = off
    nb = enc.abs_sums.shape[-1]

    def own():  # this product's checks alone (copies where shared: margins and the block redo only)
        if off == 0 and c.shape[-2] == nb:
            return c, mag
        return c[..., off : off + nb, :], mag[..., off : off + nb]

    if _margins.active():
        _margins.record(role, y, *own(), a.dtype, **_margin_kw(policy, k))
    out, flags, counts = _finish(y, c, mag, correct=policy.corrects and policy.locate, **kw)
    kernel = policy.corrects and policy.recompute and _redo_kernel_applies(a, b, out_dtype, policy, r, k, n)
    if kernel:  # the redo kernel's programs tally the first pass from the flags they read anyway
        out, gated, still, recomputed, tally = redo_detected(
            a,
            b,
            c,
            mag,
            out,
            flags,
            counts,
            **_redo_kw(policy),
            a_t=a_t,
            b_t=b_t,
            block_offset=off,
            tally=True,
        )
    else:
        tally = _tally(flags, counts)
    in_place, pending, flagged, gated_first = tally
    detected = jnp.sum(flagged > 0, dtype=jnp.int32)
    in_place, pending, gated_first = (jnp.sum(t, dtype=jnp.int32) for t in (in_place, pending, gated_first))
    if kernel:
        gated = gated + gated_first
    elif policy.corrects and policy.recompute and policy.recompute_blocks is not None:
        out, gated, still, recomputed = _redo_blocks(
            a, b, *own(), out, flags, counts, policy, precision, a_t, b_t
        )
        gated = gated + gated_first
    elif policy.corrects and policy.recompute:

        def slow(carry):
            # The barrier keeps XLA from reusing the first product: this is a real recompute.
            a2, b2 = lax.optimization_barrier((a, b))
            y2 = _dot(a2, b2, precision, a_t, b_t, prod)
            if _margins.active():
                _margins.record("redo", y2, *own(), a.dtype, **_margin_kw(policy, k))
            out2, flags2, counts2 = _finish(y2, c, mag, correct=policy.locate, **kw)
            still2 = jnp.sum(flags2 == ABFT_DETECTED, dtype=jnp.int32)
            # The stop flag from the carry's (zeros_like), not a constant: inside shard_map it then
            # varies over the mesh axes as the flag it replaces does, which the loop requires.
            return out2, counts2, still2, jnp.int32(g), jnp.zeros_like(carry[-1])

        # A loop of 0 or 1 trips rather than lax.cond: the loop carries `out` in place where the
        # cond's keep branch copies it (112 us at 8192 x 14336 bf16 on an H200); side by side the
        # loop was 0.01-0.09 ms faster per GEMM (docs/gpu-tests.md). Under vmap it still runs only
        # when some GEMM needs it, where a batched cond turns into a select that always recomputes.
        init = (out, counts, pending, jnp.int32(0), pending > 0)
        out, counts, still, recomputed, _ = lax.while_loop(lambda carry: carry[-1], slow, init)
        gated = jnp.sum(counts, dtype=jnp.int32)  # the recompute's counts, where it ran
    else:
        still, gated, recomputed = pending, gated_first, jnp.int32(0)
    report = FaultReport(
        gemm_checked=g,
        gemm_detected=detected,
        gemm_corrected=in_place + (pending - still),
        gemm_recomputed=recomputed,
        gemm_uncorrectable=still,
        nonfinite_gated=gated,
    )
    return out, report


def _checked_gemms(
    a, bs, encs, policy: FaultPolicy, faults, precision, impl, out_dtype, role: str = "y", a_t: bool = False
):
    """``_checked_gemm`` of one operand ``a`` against several weights ``bs`` (with their checksums
    ``encs`` and fault sites ``faults``, one per weight): ``(tuple of products, summed FaultReport)``.

    Each product is checked, corrected and reported as alone, from one check GEMM: ``a`` against
    every weight's checksum columns side by side, so ``a`` is read once for all their checks rather
    than once per weight (attention's q, k and v projections share x; the MLP's gate and up do; so
    do their weight gradients, xᵀ against each dy's checksum columns). Not where the checks are
    native (a CPU-only process, :func:`checks_native_everywhere`): there each product's own native
    pass, ordered after it, was faster. The operand is pinned once,
    so every GEMM and the shared checks read the same value (``_checked_gemm`` says why).
    """
    # Native checks (a CPU-only process): each product's own, ordered after it (checks_after).
    shared = policy.enabled and len(bs) > 1 and not checks_native_everywhere()
    forms = lambda b: (
        _fused_applies(a, b, policy, out_dtype, impl, a_t, False)
        and _kernel_forms_checks(a.shape[1], a.shape[2], b.shape[2], a.dtype, policy)
    )
    if shared and any(forms(b) for b in bs):
        shared = False  # a fused kernel forms its own checks (the fused path without them shares)
    checks = [None] * len(bs)
    if shared:
        if a.dtype != jnp.float32:
            a = lax.optimization_barrier(a)
        nbs = [e.abs_sums.shape[-1] for e in encs]
        both = WeightChecksums(
            jnp.concatenate([e.sums for e in encs], axis=-2),
            jnp.concatenate([e.abs_sums for e in encs], axis=-1),
        )
        c, mag = abft_checks(a, both, transposed=a_t, lam=policy.lam, weighted=policy.weighted_checks)
        # Each product's finish reads its blocks where they lie: slices of c and mag would each
        # be a copy kernel (80 per 4-layer Llama-3-8B-dimension step on an H200, 0.28 ms).
        offsets = _offsets(nbs)
        checks = [(c, mag, int(o)) for o in offsets]
    outs, report = [], FaultReport.zeros()
    for b, enc, f, chk in zip(bs, encs, faults, checks, strict=True):
        y, r = _checked_gemm(a, b, enc, policy, f, precision, impl, out_dtype, role, a_t=a_t, checks=chk)
        outs.append(y)
        report = report + r
    return tuple(outs), report


def _redo_kernel_applies(a, b, out_dtype, policy: FaultPolicy, r: int, k: int, n: int) -> bool:
    """Whether this GEMM's detected blocks are redone by the device kernel (``_redo_kernel``): the
    policy asks for it here (``redo_kernel_wanted``: ``recompute_kernel=True``, or the default None
    on a GPU that runs it without ``recompute_blocks``) and the GEMM is one it takes (bf16 / f16
    operands, tiled blocks)."""
    return redo_kernel_wanted(policy) and redo_kernel_applies(a, b, out_dtype, policy.block_n, r, k, n)


def _redo_kw(policy: FaultPolicy) -> dict:
    """The policy's settings that :func:`redo_detected` takes."""
    p = policy
    return dict(
        block_n=p.block_n,
        lam=p.lam,
        gate=p.gate,
        fill=p.gate_fill,
        limit=p.gate_limit,
        weighted=p.weighted_checks,
    )


def _margin_kw(policy: FaultPolicy, k: int) -> dict:
    """The policy's settings that ``_margins.record`` takes."""
    return dict(k=k, block_n=policy.block_n, lam=policy.lam, weighted=policy.weighted_checks)


def _tally(flags: Int32[Array, "g r nb"], counts: Int32[Array, "g r nb"]) -> tuple[Int32[Array, " g"], ...]:
    """Per GEMM: blocks corrected in place, blocks pending (detected, not located), blocks flagged
    at all, values gated. (Where the redo kernel runs, its programs count these instead, from the
    flags they read anyway: ``redo_detected(..., tally=True)``.) One variadic reduction reads flags
    and counts once; as four sums XLA made several small kernels per protected GEMM on a GPU
    (~0.65 ms over a 4-layer step's 84 products on an H200, plus a launch gap each). Over several
    devices each sums its own rows and one all-reduce adds them (``_rows.row_sums``)."""
    return row_sums(_tally_local)(flags, counts)


def _tally_local(flags, counts):
    """``_tally`` of the rows at hand (one device's, where they are split: ``row_sums`` adds them)."""
    parts = tally_parts(flags, counts)
    zero = jnp.int32(0)
    return lax.reduce(
        parts, (zero,) * 4, lambda x, y: tuple(u + v for u, v in zip(x, y, strict=True)), (1, 2)
    )


def _finish(y, c, mag, **kw):
    """abft_finish of (G, R, N) products; for G = 1 on (R, N): the GEMM's output reaches the in-place
    op directly, where through the (1, R, N) reshape XLA copied it first (a pass over y, 0.1 ms at
    256 x 1024 f32 on a 2-core CPU)."""
    if y.shape[0] != 1:
        return abft_finish(y, c, mag, **kw)
    return tuple(r[None] for r in abft_finish(y[0], c[0], mag[0], **kw))


def _fused_kernel():
    """The fused GEMM (``_fused_gemm``) where it runs — a Hopper GPU — else None.

    The fused path's logic (sums, flags, injection, redo) is tested on the CPU by substituting
    ``_fused_gemm.fused_gemm_reference`` here; the kernel itself is tested against it on the GPU.
    """
    return fused_gemm if hopper() else None


def _fused_checked_kernel():
    """The fused GEMM that also forms the plain checks (``_fused_gemm.fused_gemm_checked``) where it
    runs — a Hopper GPU — else None (tests substitute its reference, as for :func:`_fused_kernel`)."""
    return fused_gemm_checked if hopper() else None


# The widest product (N) for which the fused path forms its checks in the kernel. Measured on an H200
# (2026-12-06, M = 8192; matmul-s47 and the kernels alone, docs/gpu-tests.md): the kernel's second
# small wgmma per K step costs far more than its 6.25% of the multiply-adds (4096 -> 14336: 1.75 ms
# against the fused kernel's 1.34-1.47 and XLA's 1.42; 14336 -> 4096: 1.70 against 1.40), so wide
# products keep the fused kernel with XLA's check GEMMs (forward 0.879x of the plain GEMM against
# 0.714x at 4096 -> 14336); at 4096 -> 1024, where the check GEMMs' read of x is most of what
# protection adds, the checks in the kernel won (forward 0.692x against 0.597x, forward+backward
# 0.615x against 0.600x). The backward's dx (N = the forward's K, 4096 or more here) keeps the
# unfused path.
CHECKED_MAX_N = 1024


def _fused_config(k: int, n: int) -> FusedConfig:
    """Tiling for a (K, N) weight. One configuration so far: on an H200 at M = 8192 it was the
    fastest of six at all four Llama-3-8B shapes (0.95-0.99x XLA's unprotected GEMM, with the first
    version's three-sum epilogue; docs/gpu-tests.md, 2026-12-01)."""
    del k, n
    return FusedConfig()


def _fused_applies(a, b, policy: FaultPolicy, out_dtype, impl: str, a_t: bool, b_t: bool) -> bool:
    """Whether this GEMM takes the fused path: ``FaultPolicy(fused=True)`` (not the default), one
    bf16 GEMM with a bf16 result, 128-column blocks, correcting without a gate limit, on a GPU that
    runs the kernel, with ``impl="auto"`` ("native" keeps the unfused native check, "reference" the
    pure-JAX one). A transposed a (the weight gradient's xᵀ) keeps the unfused path; a transposed b
    (dx = dy @ wᵀ) takes it with the plain checks, which the kernel forms itself
    (``fused_gemm_checked``), where what is detected is redone by the device kernel or not at all,
    and dx is at most ``CHECKED_MAX_N`` columns wide (where the checks in the kernel won).

    With ``recompute`` only a branch-free redo is taken there (``_fused_check.redo_tiles``, or with
    ``recompute_kernel`` the device kernel, ``_redo_kernel``): a whole recompute would need a
    branch, whose predicate goes through the host on a GPU.
    """
    if impl != "auto" or a_t or a.shape[0] != 1:
        return False
    if not (policy.fused and policy.corrects and policy.gate_limit is None):
        return False
    if policy.block_n != TILE:
        return False
    if not (a.dtype == b.dtype == jnp.dtype(out_dtype) == jnp.bfloat16):
        return False
    m, k = a.shape[1], a.shape[2]
    if b_t:
        redo_ok = not policy.recompute or redo_kernel_wanted(policy)
        return redo_ok and _kernel_forms_checks(m, k, b.shape[1], a.dtype, policy)
    return _fused_kernel() is not None and fused_gemm_supported(m, k, b.shape[2], a.dtype)


def _kernel_forms_checks(m: int, k: int, n: int, dtype, policy: FaultPolicy) -> bool:
    """Whether the fused path of an M x K by K x N product (b stored either way) forms its checks
    in the kernel (``fused_gemm_checked``): the plain checks, a Hopper GPU, at most
    ``CHECKED_MAX_N`` columns."""
    return (
        not policy.weighted_checks
        and _fused_checked_kernel() is not None
        and n <= CHECKED_MAX_N
        and fused_gemm_checked_supported(m, k, n, dtype, _fused_config(k, n))
    )


def _checked_gemm_fused(
    a,
    b,
    enc: WeightChecksums,
    policy: FaultPolicy,
    faults,
    precision,
    role: str,
    b_t: bool = False,
    checks=None,
):
    """``_checked_gemm`` for one bf16 GEMM on the fused kernel: y and its block sums from one kernel,
    the check on the sums (y is not read again), detected blocks redone without a branch.

    Without ``policy.recompute`` nothing is redone, and nothing can be corrected in place either (that
    needs y, which this path never reads): every detected block is left as the kernel wrote it and
    reported uncorrectable (``fault_aware`` then skips the step), never silent. The unfused path
    would have corrected a located error in place and gated non-finite values; this one trades that
    for no redo's fixed-shape gathers and GEMM on every call.

    ``checks``: ``(c, mag, offset)`` from a check GEMM shared by several products of ``a``
    (:func:`_checked_gemms`), this product's blocks from ``offset`` on; None: its own.
    """
    k, n = a.shape[2], b.shape[1 if b_t else 2]
    cfg = _fused_config(k, n)
    weighted = policy.weighted_checks
    off = 0
    if b_t or (checks is None and _kernel_forms_checks(a.shape[1], k, n, a.dtype, policy)):
        # The plain checks from the GEMM's own read of x (c1 and mag in the kernel: no check GEMMs).
        tiles, terms = check_tiles_of(enc, policy.lam)
        y, sums4 = fused_rows(_fused_checked_kernel(), a[0], b[0], cfg, tiles, terms, b_t)
        y, sums = inject_fused(y, sums4[:2], faults)
        c1 = sums4[2].T
        c, mag = jnp.stack([c1, jnp.zeros_like(c1)], axis=-1)[None], sums4[3].T[None]
    else:
        # Each device's rows of x (``_fused_rows``); on one device the plain call.
        y, sums = fused_rows(_fused_kernel(), a[0], b[0], cfg)
        y, sums = inject_fused(y, sums, faults)
        if checks is None:
            c, mag = abft_checks(a, enc, weighted=weighted)
        else:
            c, mag, off = checks  # read in place by the redo kernel; sliced where XLA consumes them
    nb = n // TILE
    c_own, mag_own = c[..., off : off + nb, :], mag[..., off : off + nb]
    # (Margins are recorded against the unfused check's bound, which y's bf16 rounding widens.)
    _margins.record(role, y[None], c_own, mag_own, a.dtype, **_margin_kw(policy, k))
    flags = fused_flags(sums, c_own[0], mag_own[0], k, policy.lam, weighted)
    if policy.recompute and redo_kernel_wanted(policy):  # every detected block, on the device kernel
        pending = jnp.sum(flags == ABFT_DETECTED, dtype=jnp.int32)
        zeros = jnp.zeros(flags.shape, jnp.int32)  # nothing gated yet: the fused path has no finish
        y, gated, still, redone = redo_detected(
            a, b, c, mag, y[None], flags[None], zeros[None], b_t=b_t, block_offset=off, **_redo_kw(policy)
        )
        y = y[0]
    elif policy.recompute:
        kw = dict(lam=policy.lam, precision=precision, gate=policy.gate, fill=policy.gate_fill)
        y, pending, still, gated, redone = redo_tiles(
            a[0], b[0], c_own[0], mag_own[0], y, flags, weighted=weighted, **kw
        )
    else:
        pending = jnp.sum(flags == ABFT_DETECTED, dtype=jnp.int32)
        still, gated, redone = pending, jnp.int32(0), jnp.int32(0)
    report = FaultReport(
        gemm_checked=jnp.int32(1),
        gemm_detected=(pending > 0).astype(jnp.int32),
        gemm_corrected=pending - still,
        gemm_recomputed=redone,
        gemm_uncorrectable=still,
        nonfinite_gated=gated,
    )
    return y[None], report


def _redo_blocks(a, b, c, mag, out, flags, counts, policy: FaultPolicy, precision, a_t=False, b_t=False):
    """Recompute the column blocks whose error could not be located, without a branch.

    Up to ``policy.recompute_blocks`` (row, block) pairs flagged "detected" are gathered (a fixed
    number, found by ``first_true``, so no shape depends on the data), their K-long dot
    products redone from the operands, checked again and scattered into ``out`` in place. The
    default whole recompute runs only when needed, but on a GPU its loop's predicate goes through
    the host (~0.15-0.3 ms per GEMM with the branch); this costs one gather
    of ``recompute_blocks`` x K x block_n operand values per GEMM. Pending blocks beyond the
    capacity are reported uncorrectable (left as the first pass wrote them, gated).

    Returns ``(out, gated, still_uncorrectable, gemms_recomputed)``; ``gated`` corrects the first
    pass's count of gated values (``counts``, per block): each recomputed block's count replaces
    its first one. The first product itself is not read again (the check may have overwritten it
    in place).
    """
    g, r, kk = a.shape[0], a.shape[2 if a_t else 1], a.shape[1 if a_t else 2]
    n = b.shape[1 if b_t else 2]
    nb = flags.shape[-1]
    bn = policy.block_n
    limit = math.inf if policy.gate_limit is None else policy.gate_limit
    out_dtype = out.dtype
    pend = (flags == ABFT_DETECTED).reshape(-1)
    pending = jnp.sum(pend, dtype=jnp.int32)
    cap = min(policy.recompute_blocks, pend.shape[0])
    if cap == 0:
        return out, jnp.int32(0), pending, jnp.int32(0)
    idx = first_true(pend, cap)
    valid = jnp.arange(cap, dtype=jnp.int32) < pending
    gi, ri, bi = idx // (r * nb), (idx // nb) % r, idx % nb
    w = min(bn, n)  # columns gathered per pair (static); a partial last block is shifted into range
    start = jnp.minimum(bi * bn, n - w)
    width = jnp.minimum(bn, n - bi * bn)
    j = jnp.arange(bn, dtype=jnp.int32)
    src = jnp.clip(j[None, :] + (bi * bn - start)[:, None], 0, w - 1)
    inside = j[None, :] < width[:, None]

    def align(v):  # (cap, w) gathered at `start` -> (cap, bn) aligned to the block, zeros outside
        return jnp.where(inside, jnp.take_along_axis(v, src, axis=1), jnp.zeros((), v.dtype))

    rows = a[gi, :, ri] if a_t else a[gi, ri]  # (cap, K)
    if b_t:  # (cap, w, K) slices of b's rows, transposed: small
        cols = jnp.swapaxes(
            jax.vmap(lambda gg, s: lax.dynamic_slice(b, (gg, s, 0), (1, w, kk))[0])(gi, start), 1, 2
        )
    else:
        cols = jax.vmap(lambda gg, s: lax.dynamic_slice(b, (gg, 0, s), (1, kk, w))[0])(gi, start)
    # The barrier keeps XLA from folding this into the first product: a real recompute.
    rows, cols = lax.optimization_barrier((rows, cols))
    prod = lax.dot_general(
        rows, cols, (((1,), (1,)), ((0,), (0,))), precision=precision, preferred_element_type=jnp.float32
    )
    redo, flags2, counts2 = abft_finish_reference(
        align(prod)[:, None, :],
        c[gi, ri, bi][:, None, None, :],
        mag[gi, ri, bi][:, None, None],
        kk,
        bn,
        policy.lam,
        F32_ROUNDOFF,
        policy.locate,
        out_dtype,
        policy.gate,
        policy.gate_fill,
        limit,
        width[:, None, None],
        weighted=policy.weighted_checks,
    )
    gated_first = jnp.sum(jnp.where(valid, counts[gi, ri, bi], 0), dtype=jnp.int32)
    colidx = jnp.where(valid[:, None] & inside, bi[:, None] * bn + j[None, :], n)  # n: dropped
    out = out.at[gi[:, None], ri[:, None], colidx].set(redo[:, 0, :], mode="drop")
    still = (pending - jnp.sum(valid, dtype=jnp.int32)) + jnp.sum(
        valid & (flags2[:, 0, 0] == ABFT_DETECTED), dtype=jnp.int32
    )
    redone = jnp.zeros((g,), jnp.int32).at[gi].max(valid.astype(jnp.int32))
    gated = jnp.sum(jnp.where(valid, counts2[:, 0, 0], 0), dtype=jnp.int32) - gated_first
    return out, gated, still, jnp.sum(redone, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _pmm(a, bs, encs, faults, tap, policy, precision, impl, out_dtype):
    """``a @ b`` for every weight b of ``bs`` (one operand, checks shared: :func:`_checked_gemms`),
    with ``encs`` (None entries: encoded here) and ``faults`` (None or a (forward, dx, dw) triple of
    GemmFaults) per weight."""
    del tap
    return _forward(a, bs, encs, faults, policy, precision, impl, out_dtype, with_transposes=False)[0]


def _pmm_fwd(a, bs, encs, faults, tap, policy, precision, impl, out_dtype):
    # Differentiated (this rule runs only then), weights encoded here get their transposes'
    # checksums too, for the backward's dx check: on a GPU from the same read of w.
    del tap
    out, encs_t = _forward(a, bs, encs, faults, policy, precision, impl, out_dtype, with_transposes=True)
    return out, (a, bs, encs, encs_t, faults)


def _forward(a, bs, encs, faults, policy, precision, impl, out_dtype, with_transposes: bool):
    """The checked forward products (and, per weight, wᵀ's checksums or None: :func:`_encodes`)."""
    fwd_faults = tuple(None if f is None else f[0] for f in faults)
    filled, encs_t = _encodes(bs, encs, policy, with_transposes)
    if _merges_forward(a, bs, policy, out_dtype, impl):
        return _merged_forward(a, bs, filled, policy, fwd_faults, precision, impl, out_dtype), encs_t
    return _checked_gemms(a, bs, filled, policy, fwd_faults, precision, impl, out_dtype), encs_t


def _offsets(widths) -> list[int]:
    """The first columns of consecutive ranges of ``widths`` columns (products side by side)."""
    return np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(int).tolist()


def _columns(y, widths) -> tuple:
    """``y``'s (..., ΣN) last axis cut into its consecutive ranges of ``widths`` columns (the
    products of one merged GEMM)."""
    return tuple(y[..., o : o + w] for o, w in zip(_offsets(widths), widths, strict=True))


def _widths_if_merged(ys, bs) -> list[int] | None:
    """The weights' widths where ``_pmm``'s products ``ys`` (or their cotangents) are one product
    of several weights (:func:`_merges_forward` decided so: it returns that product whole, (G, R,
    ΣN), and its callers split it), else None: read off the products' count, so the forward's one
    decision is the only one."""
    return [b.shape[2] for b in bs] if len(ys) != len(bs) else None


def _pmm_bwd(policy, precision, impl, out_dtype, res, cts):
    a, bs, encs, encs_t, faults = res
    dys, _ = cts
    widths = _widths_if_merged(dys, bs)
    del out_dtype
    # The backward GEMMs run on the operands' own dtype with f32 accumulation, as the forward does:
    # bf16 x bf16 products are exact in f32, so the f32 bound holds, and the tensor cores run at
    # bf16 rate (casting to f32 first would run a TF32 or f32 GEMM several times slower).
    dtype = jnp.result_type(a.dtype, *(b.dtype for b in bs))
    dys = [dy.astype(dtype) for dy in dys]
    if policy.enabled and dtype != jnp.float32:
        # dw's checksums are encoded from dy here: the barrier keeps XLA from folding an f32
        # cotangent's rounding to bf16 out of the encode (the forward's operand barrier, for dy).
        # (It also writes each dy once where several GEMMs read it: XLA had formed a concatenation
        # of them once per reader, profile-protect-s56.)
        dys = list(lax.optimization_barrier(dys))
    dy_all = None
    if widths is not None:  # the one product's cotangent, (G, R, ΣN): the dy side by side already
        (dy_all,) = dys
        dys = list(_columns(dy_all, widths))
    f_da = [None if f is None else f[1] for f in faults]
    f_db = [None if f is None else f[2] for f in faults]
    # dx = dy @ wᵀ and dw = xᵀ @ dy read w and x where they lie (transposed operands: a copy of
    # each, and a strided encode of wᵀ, cost the CPU more than the checks themselves). The dw GEMMs
    # share xᵀ, so one check GEMM serves them all; the dx of several weights is one checked GEMM
    # (_summed_dx).
    aa = a.astype(dtype)
    bbs = [b.astype(dtype) for b in bs]
    # wᵀ's checksums from the forward where it encoded them with w's (the same values: b in its own
    # dtype), else encoded here from w in place.
    enc_bts = [
        et if et is not None and bb.dtype == b.dtype else _encode(bb, policy, transposed=True)
        for b, bb, et in zip(bs, bbs, encs_t, strict=True)
    ]
    summed = policy.enabled and _sums_dx(dys, bbs)
    if summed:
        if dy_all is None:
            # (G, R, ΣN): the summed dx's operand, and dw's. Written once: without the barrier XLA
            # formed the concatenation twice, once for each GEMM that reads it (profile-protect-s56).
            dy_all = lax.optimization_barrier(jnp.concatenate(dys, axis=-1))
        da, r_da = _summed_dx(dy_all, bbs, enc_bts, policy, f_da, precision, impl, a.dtype)
    else:  # each dx checked, then summed as autodiff sums a shared input's cotangents
        da, r_da = None, FaultReport.zeros()
        for bb, enc_bt, dy, f in zip(bbs, enc_bts, dys, f_da, strict=True):
            d, r = _checked_gemm(dy, bb, enc_bt, policy, f, precision, impl, a.dtype, "dx", b_t=True)
            da, r_da = (d if da is None else da + d), r_da + r
    # The reduction over tokens gets its own safety factor (FaultPolicy.lam_dw says why).
    dw_policy = policy.replace(lam=policy.lam_dw)
    if summed and _merges_dw(dys, bs, policy):
        db, r_db = _merged_dw(aa, dy_all, dys, dw_policy, f_db, precision, impl, bs[0].dtype)
    else:
        dy_encs = [_encode(dy, policy) for dy in dys]
        db, r_db = _checked_gemms(
            aa, dys, dy_encs, dw_policy, f_db, precision, impl, bs[0].dtype, "dw", a_t=True
        )
    zeros_enc = jax.tree.map(jnp.zeros_like, encs)
    no_faults = jax.tree.map(zero_cotangent, faults)
    return da, db, zeros_enc, no_faults, _to_tap(r_da + r_db)


_pmm.defvjp(_pmm_fwd, _pmm_bwd)


def _sums_dx(dys, bs) -> bool:
    """Whether x's gradient through these weights is one GEMM over them side by side
    (:func:`_summed_dx`): where the copies that takes, the dy (G, R, ΣN) and the weights (G, K, ΣN)
    side by side, hold fewer values than the n - 1 products of x's size (G, R, K) it saves, each
    of which the separate GEMMs write, check and add (about three passes over it). At Llama-3-8B
    dimensions (R = 8192 tokens, K = 4096) q, k and v copy 75M values to save two products of
    33.6M (~201M values passed over), gate and up would copy 352M to save one (~101M). So it
    measured (``python -m benchmarks.rev_ab --rev 245e1d6 --rev 9c4d950 --case projections``:
    this rule, always summed, never; 2026-12-06): on an H100 q, k and v's forward and backward
    4.1% faster summed, gate and up's 3.9% slower (rev-ab-s54sumdx); on a 2-core CPU (``--shape
    512,512,128,1536``) 12% and 13% (rev-ab-cpu-s54sumdx)."""
    if len(bs) < 2:
        return False
    g, r, k = dys[0].shape[0], dys[0].shape[1], bs[0].shape[1]
    width = sum(b.shape[2] for b in bs)
    return (r + k) * width * g < 3 * (len(bs) - 1) * r * k * g


def _summed_dx(dy, bs, encs_t, policy: FaultPolicy, faults, precision, impl, out_dtype):
    """dx = Σ_i dy_i @ w_iᵀ for the weights of one input, as one checked GEMM over the concatenated
    contraction: [dy_1 ... dy_n] @ [w_1 ... w_n]ᵀ, ``dy`` (G, R, ΣN) the dy_i side by side.
    Returns ``(dx, FaultReport)``.

    Each product checked on its own and then added (as autodiff sums a shared input's cotangents)
    would write and check n products of x's size and add them; here one product is written and
    checked, accumulated in f32 and rounded once. wᵀ's checksum rows are per row of wᵀ, so the
    concatenation's are the weights' stacked; the check's K is the summed width. The cost: a copy
    of the weights side by side (and of the dy, where XLA does not write them there directly).
    ``faults``: one (dx) entry per weight, each site flipped in the one product (their union).
    """
    b = jnp.concatenate(bs, axis=-1)  # (G, K, ΣN), read as (G, ΣN, K)ᵀ: b_t
    enc = WeightChecksums(
        jnp.concatenate([e.sums for e in encs_t], axis=-3),  # (G, ΣN, nb, 2)
        jnp.concatenate([e.abs_sums for e in encs_t], axis=-2),  # (G, ΣN, nb)
    )
    sites = [f for f in faults if f is not None]
    union = None if not sites else GemmFaults(*(jnp.concatenate(v) for v in zip(*sites, strict=True)))
    return _checked_gemm(dy, b, enc, policy, union, precision, impl, out_dtype, "dx", b_t=True)


def _merges_dw(dys, bs, policy: FaultPolicy) -> bool:
    """Whether the weight gradients of a summed dx are one GEMM over its concatenated dy
    (:func:`_merged_dw`): where each weight's width holds whole checksum blocks
    (:func:`_whole_blocks`) and the weights share one dtype (one product)."""
    return _whole_blocks([dy.shape[-1] for dy in dys], policy) and len({b.dtype for b in bs}) == 1


def _whole_blocks(widths, policy: FaultPolicy) -> bool:
    """Whether products of these widths side by side hold each one's checksum blocks whole (blocks of
    ``block_n`` columns dividing every width): then every block of the one product, its check and
    what a fault in it can reach, are one weight's own, as in its own product."""
    bn = policy.block_n
    return bn is not None and all(w % bn == 0 for w in widths)


def _merged_dw(a, dy, dys, policy: FaultPolicy, faults, precision, impl, out_dtype):
    """dw_i = xᵀ @ dy_i for the weights of one input as one checked GEMM, xᵀ @ [dy_1 ... dy_n]
    (``dy``, the summed dx's operand: the dy_i side by side), split into the weights' column ranges.
    Returns ``(tuple of dw_i, FaultReport)``.

    XLA merged the separate dw GEMMs of q, k and v into one itself, writing its own copy of the dy
    side by side (a second one beside the summed dx's; 0.27 ms of a 4-layer Llama-3-8B-dimension
    step on an H100, profile-protect-s55), and each product still had its own encode of dy, check
    and redo launch. Here the summed dx's copy serves both, and one encode, check GEMM, check and
    redo cover the three (:func:`_merged_gemm`)."""
    widths = [d.shape[-1] for d in dys]
    return _merged_gemm(
        a, dy, _encode(dy, policy), widths, policy, faults, precision, impl, out_dtype, "dw", True
    )


def _merges_forward(a, bs, policy: FaultPolicy, out_dtype, impl: str) -> bool:
    """Whether the forward products of one input are one GEMM over the weights side by side
    (:func:`_merged_forward`): where x's gradient is (:func:`_sums_dx`: the copy of the weights
    side by side costs less than the products it merges), every weight's width holds whole checksum
    blocks, and no product takes the fused kernel (which forms its own checks per product)."""
    widths = [b.shape[2] for b in bs]
    return (
        policy.enabled
        and _sums_dx([a], bs)
        and _whole_blocks(widths, policy)
        and not any(_fused_applies(a, b, policy, out_dtype, impl, False, False) for b in bs)
    )


def _merged_forward(a, bs, encs, policy: FaultPolicy, faults, precision, impl, out_dtype):
    """y_i = x @ w_i for the weights of one input as one checked GEMM, x @ [w_1 ... w_n], split
    into the weights' column ranges (their checksum columns side by side, as the shared check GEMM
    reads them). Returns ``(tuple of y_i, FaultReport)``.

    XLA merged the separate forward GEMMs of q, k and v into one itself (writing the same copy of
    the weights side by side), then copied each product out of its output for its own check,
    redo and tally, each a launch of its own. Here one product is checked, redone and tallied as a
    whole, and returned whole (``_pmm`` gives (G, R, ΣN); ``_matmuls`` names it, then slices it).
    In the 4-layer Llama-3-8B-dimension step on an H100 all three slices were still copied out,
    0.47 ms of copies against 0.44 before (profile-protect-s56b, -s56old): the rematerialisation
    policy kept each slice, named one by one. Named whole since (``protected_matmuls(...,
    checkpoint=...)``), only v's slice is copied in the forward (the flash kernel takes v whole):
    the step's slices of the product 0.26 ms (profile-protect-s57nocb, which also counts the merged
    weight gradient's three slices)."""
    # (G, K, ΣN), written once: without the barrier XLA formed it twice, for the GEMM and for the
    # redo kernel that reads it (profile-protect-s56).
    b = lax.optimization_barrier(jnp.concatenate(bs, axis=-1))
    enc = WeightChecksums(
        jnp.concatenate([e.sums for e in encs], axis=-2),  # (G, K, Σnb, 2)
        jnp.concatenate([e.abs_sums for e in encs], axis=-1),  # (G, K, Σnb)
    )
    widths = [w.shape[2] for w in bs]
    return _merged_gemm(
        a, b, enc, widths, policy, faults, precision, impl, out_dtype, "y", False, split=False
    )


def _merged_gemm(
    a, b, enc, widths, policy: FaultPolicy, faults, precision, impl, out_dtype, role, a_t, split=True
):
    """One checked GEMM of products side by side (``b`` their operands' columns concatenated, ``enc``
    its checksum columns), split into their column ranges ``widths`` (``split=False``: the one
    product whole, a tuple of one): ``(tuple of products, FaultReport)``, counted as one GEMM.
    Every block lies within one product's columns (:func:`_whole_blocks`), so each is checked,
    corrected and recomputed as in its own product. ``faults``: one entry per product, its columns
    shifted to the product's place (their union)."""
    offsets = _offsets(widths)
    sites = [f._replace(cols=f.cols + o) for f, o in zip(faults, offsets, strict=True) if f is not None]
    union = None if not sites else GemmFaults(*(jnp.concatenate(v) for v in zip(*sites, strict=True)))
    (y,), report = _checked_gemms(
        a, (b,), (enc,), policy, (union,), precision, impl, out_dtype, role, a_t=a_t
    )
    return ((y,) if not split else _columns(y, widths)), report


def _prepare(policy, operands, precision, faults, tap):
    policy = FaultPolicy() if policy is None else policy
    if precision is None:
        precision = lax.Precision.HIGHEST if operands == jnp.float32 else lax.Precision.DEFAULT
    if isinstance(faults, GemmFaults):
        faults = (faults, None, None)
    if faults is not None:
        faults = tuple(GemmFaults.none() if f is None else f for f in faults)
    return policy, precision, faults, zero_tap() if tap is None else tap


def protected_matmul(
    x,
    w,
    enc: WeightChecksums | None = None,
    *,
    policy: FaultPolicy | None = None,
    faults: tuple[GemmFaults | None, GemmFaults | None, GemmFaults | None] | GemmFaults | None = None,
    tap: jax.Array | None = None,
    precision=None,
    impl: str = "auto",
):
    """``y = x @ w`` verified, corrected and reported. Returns ``(y, report)``.

    Args:
      x: (..., K) float32, bfloat16 or float16.
      w: (K, N), same dtype family; y has ``jnp.result_type(x, w)``.
      enc: ``abft_encode(w, policy.block_n)``, refreshed whenever w is written. None encodes on the
        fly (an extra pass over w per call).
      policy: FaultPolicy (default: correct, recompute, gate non-finite).
      faults: injection for tests and demos — a GemmFaults for the forward product, or a triple
        (forward, dx, dw) that also hits the backward products.
      tap: ``zero_tap()``; its gradient is the backward pass's report (``report_from_tap``).
      precision: matmul precision; default HIGHEST for f32 inputs, DEFAULT otherwise.
      impl: "auto" (the native check where it measured faster; with ``FaultPolicy(fused=True)``
        on a Hopper GPU a bf16 forward runs the fused kernel, ``_fused_gemm``, where its shapes
        tile), "native" (the GEMM, then the native check pass over y) or "reference" (pure JAX).
    """
    (y,), report = _matmuls("protected_matmul", x, (w,), (enc,), policy, (faults,), tap, precision, impl)
    return y, report


def protected_matmuls(
    x,
    ws,
    encs=None,
    *,
    policy: FaultPolicy | None = None,
    faults=None,
    tap: jax.Array | None = None,
    precision=None,
    impl: str = "auto",
    checkpoint: str | None = None,
):
    """``x @ w`` for each weight of ``ws``, each verified, corrected and reported as by
    :func:`protected_matmul`, with one check GEMM for all of them. Returns ``(ys, report)``.

    For projections of one input (attention's q, k and v; the MLP's gate and up): x is read once
    for every product's checks (x against the weights' checksum columns side by side), and in the
    backward once for every weight gradient's (xᵀ against each dy's). x's gradient, the sum of
    every weight's dy @ wᵀ, is one checked GEMM over the weights side by side where the copies that
    takes are smaller than the products it saves (q, k and v at Llama-3-8B dimensions;
    ``_sums_dx``); there, where each weight's width holds whole checksum blocks, the forward products
    and the weight gradients are one checked GEMM each too, split into the weights' columns
    (``_merged_forward``, ``_merged_dw``); elsewhere they are separate GEMMs. ``ws``:
    (K, N_i) weights of one dtype; ``encs``: None or a sequence of ``abft_encode(w,
    policy.block_n)`` (None entries encode on the fly); ``faults``: None or a sequence with one
    entry per weight, each as :func:`protected_matmul` takes it (the dx sites of all of them land
    in the one dx product where it is one). ``report`` sums the products' (each counts as one GEMM
    checked; a summed dx, a merged forward or weight gradient as one, and a detection in it as one
    product's). ``checkpoint``: a name (``jax.ad_checkpoint.checkpoint_name``) for the products as
    computed, for a rematerialisation policy to keep: each product, or where they are one GEMM
    that product whole, so that what is kept is one array and the ys are slices of it (named one
    by one, each slice would be kept as a copy of its own).
    """
    ws = tuple(ws)
    n = len(ws)
    encs = (None,) * n if encs is None else tuple(encs)
    faults = (None,) * n if faults is None else tuple(faults)
    if n == 0 or len(encs) != n or len(faults) != n:
        raise ValueError(
            f"pimlayers.protected_matmuls: {n} weights, {len(encs)} checksums and {len(faults)} fault "
            f"entries; expected at least one weight and one checksum and fault entry (or None) per weight"
        )
    return _matmuls("protected_matmuls", x, ws, encs, policy, faults, tap, precision, impl, checkpoint)


def _matmuls(op: str, x, ws, encs, policy, faults, tap, precision, impl, checkpoint=None):
    check_float(op, "x", x)
    for i, w in enumerate(ws):
        check_float(op, "w" if len(ws) == 1 else f"ws[{i}]", w)
        if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
            raise ValueError(
                f"pimlayers.{op}: x {tuple(x.shape)} @ w {tuple(w.shape)}; expected x (..., K) and "
                f"w (K, N) with the same K"
            )
    if len({jnp.dtype(w.dtype) for w in ws}) != 1:
        raise TypeError(f"pimlayers.{op}: weights of dtypes {[str(w.dtype) for w in ws]}; expected one dtype")
    k = x.shape[-1]
    out_dtype = jnp.result_type(x.dtype, ws[0].dtype)
    prepared = [_prepare(policy, out_dtype, precision, f, tap) for f in faults]
    policy, precision, _, tap = prepared[0]
    faults = tuple(p[2] for p in prepared)
    for w, enc in zip(ws, encs, strict=True):
        if enc is None:  # encoded inside (with wᵀ's where the product is differentiated)
            continue
        n = w.shape[1]
        nb = 0 if n == 0 else -(-n // (n if policy.block_n is None else policy.block_n))
        if enc.sums.shape != (k, nb, 2) or enc.abs_sums.shape != (k, nb):
            raise ValueError(
                f"pimlayers.{op}: checksum columns have shapes {tuple(enc.sums.shape)} / "
                f"{tuple(enc.abs_sums.shape)}; expected ({k}, {nb}, 2) / ({k}, {nb}) — re-encode w with "
                f"abft_encode(w, block_n={policy.block_n})"
            )
    with jax.named_scope(f"pimlayers.{op}"):
        encs1 = tuple(None if e is None else WeightChecksums(e.sums[None], e.abs_sums[None]) for e in encs)
        ws1 = tuple(w[None] for w in ws)
        x1 = x.reshape(1, -1, k)
        x1, ws1, encs1, tap = vary_alike(x1, ws1, encs1, tap)  # inside shard_map: _vma says why
        ys, report = _pmm(x1, ws1, encs1, faults, tap, policy, precision, impl, out_dtype)
        if checkpoint is not None:
            ys = tuple(checkpoint_name(y, checkpoint) for y in ys)
        widths = _widths_if_merged(ys, ws1)
        if widths is not None:  # the one product, named whole: its slices are views of what is kept
            ys = _columns(ys[0], widths)
    return tuple(y.reshape(*x.shape[:-1], w.shape[1]) for y, w in zip(ys, ws, strict=True)), report


def protected_bmm(
    a,
    b,
    *,
    policy: FaultPolicy | None = None,
    faults: tuple[GemmFaults | None, GemmFaults | None, GemmFaults | None] | GemmFaults | None = None,
    tap: jax.Array | None = None,
    precision=None,
    out_dtype=None,
    impl: str = "auto",
):
    """Batched ``a @ b`` (same leading axes), every matrix product verified. Returns ``(y, report)``.

    For products whose right operand is data rather than a stored weight (attention's q·kᵀ and p·v):
    b's checksum columns are encoded on the fly. a: (*B, R, K), b: (*B, K, N) -> y: (*B, R, N).
    Injected fault sites index the output flattened to (prod(B)·R, N). The report counts prod(B)
    GEMMs; one recompute (if needed) redoes all of them. ``out_dtype`` (default: the operands'
    result type) lets attention keep its scores in float32 for the softmax.
    """
    check_float("protected_bmm", "a", a)
    check_float("protected_bmm", "b", b)
    if a.ndim < 2 or b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"pimlayers.protected_bmm: a {tuple(a.shape)} @ b {tuple(b.shape)}; expected a (*B, R, K) and "
            f"b (*B, K, N) with the same leading axes B and the same K"
        )
    *lead, r, k = a.shape
    n = b.shape[-1]
    operands = jnp.result_type(a.dtype, b.dtype)
    out_dtype = operands if out_dtype is None else out_dtype
    policy, precision, faults, tap = _prepare(policy, operands, precision, faults, tap)
    g = int(np.prod(lead, dtype=np.int64))
    a3, b3 = a.reshape(g, r, k), b.reshape(g, k, n)
    with jax.named_scope("pimlayers.protected_bmm"):
        enc = _encode(b3, policy)
        a3, b3, enc, tap = vary_alike(a3, b3, enc, tap)  # inside shard_map: _vma says why
        (y,), report = _pmm(a3, (b3,), (enc,), (faults,), tap, policy, precision, impl, jnp.dtype(out_dtype))
    return y.reshape(*lead, r, n), report


def protected_bmm_grads(
    a,
    b,
    dy,
    *,
    policy: FaultPolicy | None = None,
    faults: tuple[GemmFaults | None, GemmFaults | None, GemmFaults | None] | None = None,
    precision=None,
    impl: str = "auto",
):
    """The verified backward of ``y = a @ b`` (as :func:`protected_bmm`'s own backward runs it) for a
    cotangent ``dy``, without the forward: ``(da, db, report)`` with ``da = dy @ bᵀ`` (checked with
    ``policy.lam``) and ``db = aᵀ @ dy`` (the reduction over rows, checked with ``policy.lam_dw``),
    each read in place. ``faults``: ``(unused, dA's, dB's)`` sites as for ``protected_bmm``. For
    backward passes assembled by hand, such as attention's from a flash forward's saved softmax.
    """
    if a.ndim < 2 or b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"pimlayers.protected_bmm_grads: a {tuple(a.shape)} @ b {tuple(b.shape)}; expected a (*B, R, K) "
            f"and b (*B, K, N) with the same leading axes B and the same K"
        )
    *lead, r, k = a.shape
    n = b.shape[-1]
    if dy.shape != (*lead, r, n):
        raise ValueError(f"pimlayers.protected_bmm_grads: dy {tuple(dy.shape)}; expected {(*lead, r, n)}")
    operands = jnp.result_type(a.dtype, b.dtype)
    policy, precision, faults, _ = _prepare(policy, operands, precision, faults, None)
    g = int(np.prod(lead, dtype=np.int64))
    res = (a.reshape(g, r, k), (b.reshape(g, k, n),), (None,), (None,), (faults,))
    with jax.named_scope("pimlayers.protected_bmm_grads"):
        da, (db,), _, _, tap = _pmm_bwd(policy, precision, impl, None, res, ((dy.reshape(g, r, n),), None))
    return da.reshape(a.shape), db.reshape(b.shape), report_from_tap(tap)


def _encodes(bs, encs, policy: FaultPolicy, with_transposes: bool):
    """The checksum columns of each (G, K, N) weight (given ones kept) and, ``with_transposes``,
    where this encodes them, those of its transpose for the backward's dx check
    (``abft_encode_pair``: on a GPU one read of w for both, where the backward would read it again),
    named ``TRANSPOSED_CHECKSUMS`` so a rematerialisation policy can keep them; None elsewhere (the
    backward encodes wᵀ itself). Only a differentiated product asks for them: a forward pass alone
    would pay the pair's second set of sums for nothing."""
    out, out_t = [], []
    for b, e in zip(bs, encs, strict=True):
        et = None
        if e is None and with_transposes and policy.enabled:
            e, et = abft_encode_pair(b, policy.block_n)
            et = jax.tree.map(lambda v: checkpoint_name(v, TRANSPOSED_CHECKSUMS), et)
        elif e is None:
            e = _encode(b, policy)
        out.append(e)
        out_t.append(et)
    return tuple(out), tuple(out_t)


def _encode(b, policy: FaultPolicy, transposed: bool = False) -> WeightChecksums:
    """On-the-fly checksum columns of a (G, K, N) operand (stored as (G, N, K) if ``transposed``);
    mode "off" reads none, so skip the pass."""
    if policy.enabled:
        return abft_encode(b, policy.block_n, transposed=transposed)
    g, k = b.shape[0], b.shape[2 if transposed else 1]
    return WeightChecksums(jnp.zeros((g, k, 0, 2), jnp.float32), jnp.zeros((g, k, 0), jnp.float32))
