"""ABFT for GEMMs: encode a weight's checksum columns, form the checks, verify and correct y.

Math and bound: see csrc/abft.h, restated here. For y = x @ w (x: (M, K), w: (K, N)), each row of y
is cut into column blocks of ``block_n``. The weight carries, per block b (encode on write),
``w1[:, b] = sum_j w[:, j]``, ``w2[:, b] = sum_j (j+1) w[:, j]`` and ``wa[:, b] = sum_j |w[:, j]|``
(j counted inside the block). The GEMM's checks are ``c = x @ [w1, w2]`` and ``mag = |x| @ wa``,
computed in f32 at HIGHEST precision. The check then compares the block sums of y with c:

    B1 = lam * u * (sqrt(K) + sqrt(n) + 2) * mag + u_y * sum_j |y_ij| + (K + n + 2) * FLT_MIN

a probabilistic rounding-error bound (Higham & Mary 2019; lam = 8 fails with probability about
2.5e-14 per sum) plus the rounding of y to its storage dtype (u_y = 0 for f32, 2^-8 for bf16) and a
floor for subnormal values, which a GEMM may flush to zero where the checks keep them
(:func:`abft_bound`).
|r1| > B1 or |r2| > n*B1 is "detected"; a single error with |r1| > 4 n B1 is located for certain
(for a rounded y, B1 here leaves out the candidate column's own |y|: that value and its rounding are
the one error the test assumes) and rebuilt from the checksum, and the rebuilt block must then pass
the check a clean block passes (else it is "detected" after all: a second error can hide behind a
huge one in the location test, whose tolerance grows with |r1|); smaller detected errors are
reported as not corrected (the caller recomputes). A lone NaN/Inf is located by itself. Two errors
in one block cannot always be told apart from one by two checksums (Huang & Abraham's scheme
corrects one per block); usually they are detected and recomputed. One case is silent: two *equal*
errors at columns j1, j2 with j1 + j2 even look exactly like one error of twice the size at (j1 +
j2) / 2, are "corrected" there, and leave both checksums agreeing with a wrong block (a stuck bit in
two values of one exponent can do it). A third, quadratically weighted checksum would tell them
apart; it is not implemented. A smaller ``block_n`` makes two errors in one block less likely;
``FaultPolicy(locate=False)`` (``correct=False`` here) never corrects in place and has the protected
GEMMs recompute every detected block instead, which closes the case at the cost of a redo per
detection.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int32

from .._native import has_native
from ._common import UNIT_ROUNDOFF, check_float
from ._dispatch import check_impl, dispatch, present_platforms
from ._gate import gate_keep, gate_reference
from ._rows import row_parallel

__all__ = [
    "ABFT_CLEAN",
    "ABFT_CORRECTED",
    "ABFT_DETECTED",
    "WeightChecksums",
    "abft_check",
    "abft_check_reference",
    "abft_checks",
    "abft_encode",
    "abft_encode_reference",
    "abft_finish",
    "abft_finish_reference",
]

ABFT_CLEAN, ABFT_CORRECTED, ABFT_DETECTED = 0, 1, 2
F32_ROUNDOFF = 2.0**-24
_F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal f32, FLT_MIN


def abft_bound(mag, sum_abs, k: int, width, lam: float, u: float, u_y: float = 0.0):
    """B1, a block's detection bound (csrc/abft.h, AbftBound): the accumulation's part, the rounding
    of y to its storage dtype, and a floor for subnormal values, ``(K + n + 2) · FLT_MIN``: a GEMM that
    flushes subnormal operands or products to zero where the checks keep them (or the other way
    round) differs from them by up to FLT_MIN per product and sum, while a block of subnormal values
    has a mag, and so a relative bound, that underflows to 0. ``width``: the block's n (an array for
    ragged last blocks)."""
    return (
        lam * u * (math.sqrt(k) + jnp.sqrt(width) + 2.0) * mag + u_y * sum_abs + (k + width + 2.0) * _F32_TINY
    )


class WeightChecksums(NamedTuple):
    """The checksum columns of a weight w: (K, N), per column block of ``block_n``."""

    sums: Float[Array, "k nb 2"]  # sum_j w[:, j] and sum_j (j+1) w[:, j], per block
    abs_sums: Float[Array, "k nb"]  # sum_j |w[:, j]| per block


def _scoped(name: str):
    """Run the op under ``jax.named_scope(name)``: its kernels carry the name in their HLO metadata,
    so a profile can tell the checks' encodes, dots and finishes apart (``benchmarks.profile``)."""

    def wrap(fn):
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return scoped

    return wrap


def _blocks(n: int, block_n: int | None) -> tuple[int, int]:
    bn = n if block_n is None else int(block_n)
    bn = max(bn, 1)
    return bn, (0 if n == 0 else -(-n // bn))


@functools.partial(jax.jit, static_argnames=("block_n", "transposed"))
def abft_encode_reference(
    w: Float[Array, "*g k n"], block_n: int | None = None, transposed: bool = False
) -> WeightChecksums:
    """Pure-JAX twin of the native encodes (f32 sums, as the CUDA handler's; the CPU one sums in f64)."""
    if transposed:
        *g, n, k = w.shape
        bn, nb = _blocks(n, block_n)
        pad = [(0, 0)] * (w.ndim - 2) + [(0, nb * bn - n), (0, 0)]
        wf = jnp.pad(w.astype(jnp.float32), pad).reshape(*g, nb, bn, k)
        pos = jnp.arange(1, bn + 1, dtype=jnp.float32).reshape(*(1,) * (w.ndim - 2), 1, bn, 1)
        s1, s2, sa = wf.sum(-2), (wf * pos).sum(-2), jnp.abs(wf).sum(-2)  # (*g, nb, K): small
        s1, s2, sa = _materialised((s1, s2, sa))
        sums = jnp.stack([jnp.swapaxes(s1, -1, -2), jnp.swapaxes(s2, -1, -2)], axis=-1)
        return WeightChecksums(sums, jnp.swapaxes(sa, -1, -2))
    *g, k, n = w.shape
    bn, nb = _blocks(n, block_n)
    pad = [(0, 0)] * (w.ndim - 1) + [(0, nb * bn - n)]
    wf = jnp.pad(w.astype(jnp.float32), pad).reshape(*g, k, nb, bn)
    lead = (1,) * (w.ndim - 1)  # explicit broadcasting (rank promotion may be set to raise)
    pos = jnp.arange(1, bn + 1, dtype=jnp.float32).reshape(*lead, 1, bn)
    s1, s2, sa = _materialised((wf.sum(-1), (wf * pos).sum(-1), jnp.abs(wf).sum(-1)))
    return WeightChecksums(jnp.stack([s1, s2], axis=-1), sa)


def encode_transposed_gemm(w: Float[Array, "*g n k"], block_n: int | None = None) -> WeightChecksums:
    """``abft_encode_reference(w, block_n, transposed=True)`` as two GEMMs against a block matrix.

    The transposed sums reduce w's rows in blocks: s1[b] = Σ_t w[b·bn + t], s2[b] = Σ_t (t+1)
    w[b·bn + t], sa[b] = Σ_t |w[b·bn + t]|. That is E @ w with E (2·nb, N) holding 1 and t + 1 on
    block b's columns, and E₁ @ |w| with E₁ its ones: skinny GEMMs that read w at the GEMM's
    bandwidth, where XLA's reductions over w's non-minor axis reached ~500 GB/s on an H200 (bf16,
    128-row blocks). Exact where the reduction is: the weights t + 1 <= 256 are exact in bf16 and
    f16, so every product is exact in the f32 accumulator; only the order of the f32 additions
    differs. For bf16/f16 w and blocks of at most 256 rows; anything else takes the reduction.
    ``abft_encode(..., transposed=True)`` runs it where "auto" finds no native encode (a GPU build
    without the CUDA module; the handler itself was faster still, ``_ENCODE_NATIVE_ON``): on an H200
    a 4096 x 14336 bf16 weight's transposed encode took 0.083 ms against the reduction's 0.230
    (128-row blocks; 4096 x 1024: 0.055 against 0.061), ``python -m benchmarks.run --suite
    matmul-parts``, 2026-12-02.
    """
    n = w.shape[-2]
    bn, nb = _blocks(n, block_n)
    if w.dtype not in (jnp.bfloat16, jnp.float16) or bn > 256 or nb == 0:
        return abft_encode_reference(w, block_n, transposed=True)
    row = lax.broadcasted_iota(jnp.int32, (nb, n), 1)
    blk = lax.broadcasted_iota(jnp.int32, (nb, n), 0)
    inside = row // bn == blk
    ones = inside.astype(w.dtype)
    pos = jnp.where(inside, row % bn + 1, 0).astype(w.dtype)
    e = jnp.concatenate([ones, pos], axis=0)  # (2 nb, N)

    def blocks(m, v):  # (P, N) @ (*g, N, K) -> (*g, K, P), f32
        return jnp.einsum("pn,...nk->...kp", m, v, preferred_element_type=jnp.float32)

    s12 = blocks(e, w)
    sa = blocks(ones, jnp.abs(w))
    sums = jnp.stack([s12[..., :nb], s12[..., nb:]], axis=-1)
    return WeightChecksums(sums, sa)


def _materialised(sums):
    """The encode's block sums, written out before they are stacked or transposed (small arrays).

    Without the barrier XLA on the GPU fused the stack (and, transposed, the transpose) into the
    reductions: it reduced straight into the interleaved or transposed layout, and a stacking fusion
    read w a second time to redo one sum. On an H200 (jax 0.11.2) the barrier took the transposed
    encode of a 4096 x 14336 bf16 weight from 0.45 to 0.23 ms (14336 x 4096: 0.58 to 0.24; f32:
    0.99 to 0.27) and the plain one of the f32 weight from 0.17 to 0.08 ms; in the protected
    Llama-3-8B-dimension training step these fusions took ~8 ms of ~123 ms of kernels
    (benchmarks/results/2026-12-02-abft-encode-barrier-ab-*; ``--suite matmul-parts`` times the
    encodes as they are now).
    """
    return lax.optimization_barrier(sums)


# The platforms where abft_encode's impl="auto" calls the native handler. On an H200 the CUDA
# handler (csrc/abft_encode.cu: one pass over w, the sums written in their final layout) beat XLA's
# encodes at every shape timed (128-column blocks, bf16: 4096 x 14336 0.057 ms against 0.071, its
# transposed encode 0.052 against the GEMM encode's 0.082; 4096 x 1024 0.038 against 0.044 and
# 0.063 against 0.069; ``python -m benchmarks.run --suite matmul-parts``, 2026-12-02), and in the
# 4-layer Llama-3-8B-dimension training step the encodes' kernels took 2.27 ms per step against
# 3.54 (benchmarks.profile; the step's time itself moved by less than its run-to-run spread).
_ENCODE_NATIVE_ON: tuple[str, ...] = ("cpu", "cuda")


def _encode_native(w, block_n: int | None, transposed: bool) -> WeightChecksums:
    *g, r, c = w.shape
    k, n = (c, r) if transposed else (r, c)
    bn, nb = _blocks(n, block_n)
    out = (
        jax.ShapeDtypeStruct((*g, k, nb, 2), jnp.float32),
        jax.ShapeDtypeStruct((*g, k, nb), jnp.float32),
    )
    call = jax.ffi.ffi_call("pimlayers_abft_encode", out, vmap_method="broadcast_all")
    return WeightChecksums(*call(w, block_n=np.int64(bn), transposed=np.bool_(transposed)))


@_scoped("pimlayers.abft_encode")
def abft_encode(
    w: Float[Array, "*g k n"],
    block_n: int | None = None,
    *,
    transposed: bool = False,
    impl: str = "auto",
) -> WeightChecksums:
    """Encode w's checksum columns (in f32; the writer of w calls this, "encode on write").

    Leading axes of w (a batch of matrices, e.g. attention's keys per head) carry over to the sums.
    ``transposed=True``: ``w`` holds the GEMM's operand transposed, (*g, N, K) (the backward's wᵀ is
    the forward's w): the sums are those of its transpose, read from w in place, so no transpose is
    materialised (on the CPU that copy cost more than the GEMM's checks).

    The sums carry no gradient (``stop_gradient``). Native on the CPU and the GPU, one pass over w:
    XLA's CPU reductions took 0.13-1.2 ms there where the GEMM they protect took ~0.7 (2026-11-30);
    on an H200 the CUDA handler beat XLA's reductions and the GEMM encode (``_ENCODE_NATIVE_ON``
    has the figures). Where no native handler is built, "auto" takes XLA's reductions, or for a
    transposed bf16/f16 w two skinny GEMMs (:func:`encode_transposed_gemm`, 2.8x faster than the
    reduction at 4096 x 14336 on an H200). ``impl="reference"`` is the plain reduction everywhere.
    """
    check_float("abft_encode", "w", w)
    if w.ndim < 2:
        raise ValueError(f"pimlayers.abft_encode: w has shape {tuple(w.shape)}; expected (..., K, N)")
    if block_n is not None and (isinstance(block_n, bool) or int(block_n) < 1):
        raise ValueError(f"pimlayers.abft_encode: block_n={block_n!r}; expected an int >= 1 or None")
    check_impl("abft_encode", impl)
    if transposed:
        native = lambda v: _encode_native(v, block_n, True)
    else:  # w's rows are its sums' rows: each device encodes its own (dy's rows are tokens in dw)
        rows = row_parallel(lambda v: tuple(_encode_native(v, block_n, False)), (1,), (2, 1))
        native = lambda v: WeightChecksums(*rows(v))
    if transposed and impl == "auto":  # where "auto" finds no native encode
        fallback = lambda v: encode_transposed_gemm(v, block_n)
    else:
        fallback = lambda v: abft_encode_reference(v, block_n, transposed)
    return dispatch(
        "abft_encode",
        impl,
        native,
        fallback,
        lax.stop_gradient(w),  # checksums carry no gradient (the protected GEMM's VJP gives them none)
        native_on=_ENCODE_NATIVE_ON,
    )


# The pair's handler (csrc/abft_encode.cu, AbftEncodePairKernel) is CUDA only: on the CPU the two
# encodes are native already and each reads w once from cache-sized blocks.
_PAIR_NATIVE_ON: tuple[str, ...] = ("cuda",)
PAIR_BLOCK = 128  # the pair's tile, both ways: 128-column blocks of w, 128-row blocks of wᵀ's


def pair_applies(shape: tuple[int, ...], block_n: int | None) -> bool:
    """Whether :func:`abft_encode_pair` reads w once on a GPU: 128-column blocks, K and N
    multiples of 128 (every Llama-3 weight); elsewhere it is two encodes."""
    return (
        len(shape) >= 2
        and block_n == PAIR_BLOCK
        and shape[-2] % PAIR_BLOCK == 0
        and shape[-1] % PAIR_BLOCK == 0
        and all(d > 0 for d in shape)
    )


def _encode_pair_native(w, block_n: int) -> tuple[WeightChecksums, WeightChecksums]:
    *g, k, n = w.shape
    out = (
        jax.ShapeDtypeStruct((*g, k, n // block_n, 2), jnp.float32),
        jax.ShapeDtypeStruct((*g, k, n // block_n), jnp.float32),
        jax.ShapeDtypeStruct((*g, n, k // block_n, 2), jnp.float32),
        jax.ShapeDtypeStruct((*g, n, k // block_n), jnp.float32),
    )
    call = jax.ffi.ffi_call("pimlayers_abft_encode_pair", out, vmap_method="broadcast_all")
    s, a, st, at = call(w, block_n=np.int64(block_n))
    return WeightChecksums(s, a), WeightChecksums(st, at)


@_scoped("pimlayers.abft_encode_pair")
def abft_encode_pair(
    w: Float[Array, "*g k n"], block_n: int | None = None, *, impl: str = "auto"
) -> tuple[WeightChecksums, WeightChecksums]:
    """``(abft_encode(w, block_n), abft_encode(w, block_n, transposed=True))``: the checksum columns
    of w for ``x @ w`` and those of wᵀ for ``dy @ wᵀ`` (the backward's dx, w read in place).

    On a GPU, where :func:`pair_applies` (128-column blocks, K and N multiples of 128), one kernel
    reads w once for both; the two encodes read it twice. Elsewhere, and with ``impl="reference"``,
    the two encodes (``"reference"``: their pure-JAX twins). The sums are f32 like the encodes',
    in another order of additions (within the checks' bound, which allows for f32 sums).
    """
    check_float("abft_encode_pair", "w", w)
    check_impl("abft_encode_pair", impl)
    if w.ndim < 2:
        raise ValueError(f"pimlayers.abft_encode_pair: w has shape {tuple(w.shape)}; expected (..., K, N)")
    fits = pair_applies(tuple(w.shape), block_n)
    if impl == "native" and not fits:
        raise ValueError(
            f"pimlayers.abft_encode_pair: w {tuple(w.shape)} with block_n={block_n!r} has no native pair; "
            f"expected block_n={PAIR_BLOCK} and K, N multiples of {PAIR_BLOCK} (impl='auto' encodes twice)"
        )
    sub = "reference" if impl == "reference" else "auto"
    two = lambda v: (abft_encode(v, block_n, impl=sub), abft_encode(v, block_n, transposed=True, impl=sub))
    if not fits:
        return two(w)
    native = lambda v: _encode_pair_native(v, PAIR_BLOCK)
    return dispatch("abft_encode_pair", impl, native, two, lax.stop_gradient(w), native_on=_PAIR_NATIVE_ON)


@_scoped("pimlayers.abft_checks")
def abft_checks(
    x: Float[Array, "*m k"],
    enc: WeightChecksums,
    *,
    transposed: bool = False,
    impl: str = "auto",
    lam: float | None = None,
    weighted: bool = True,
) -> tuple[Float[Array, "*m nb 2"], Float[Array, "*m nb"]]:
    """The checks of y = x @ w from w's checksum columns: ``(c, mag)`` in f32 at HIGHEST precision.

    For a batch of weights (sums (*g, K, nb, 2)), x is (*g, R, K): matmul's batch broadcasting.
    ``transposed=True``: ``x`` holds the GEMM's operand transposed, (*g, K, R) with the same leading
    axes as the sums (the backward's xᵀ is the forward's x): contracted over its K axis in place.

    Native on the CPU for x's rows (one pass over x for both, f32 sums; XLA's two narrow GEMMs and
    the |x| between them took 0.14-0.63 ms at 256 x 256-1024 on a 2-core CPU, the native op
    0.04-0.14 on one thread); ``transposed`` too in a CPU-only process with one device (with
    several, XLA's dots: see below). The GPU keeps XLA's dots, or with ``PIMLAYERS_CHECKS_KERNEL=1``
    (opt-in) a Triton kernel reading x once where the columns fit it (``_checks_kernel``).

    ``lam``: the λ of the check these feed (``FaultPolicy.lam``, or ``lam_dw`` for a weight
    gradient). Given, a bf16 x's split-dot checks (the GPU's path, ``_checks_reference``) are formed
    only as precisely as that check needs, and mag comes out raised to cover what is left out
    (:func:`_check_terms`): still an upper scale for the bound, so no clean product fails it.
    Without ``lam`` both are f32-accurate. The native (CPU) checks are f32-accurate either way.

    ``weighted=False``: only the plain checks c1 are formed; c[..., 1] is 0 (``FaultPolicy(
    weighted_checks=False)``: a check on c1 alone, nothing located). On a GPU the check GEMMs then
    carry 4 bf16 columns per 128-column block instead of 7 (3 terms of c1 and 1 of mag, where c2
    took 3 more); the native CPU pass forms both and c2 is zeroed.
    """
    _check_weighted("abft_checks", False, weighted)
    weighted = bool(weighted)
    *g, k, nb = enc.abs_sums.shape
    if transposed and (x.ndim != len(g) + 2 or tuple(x.shape[:-2]) != tuple(g) or x.shape[-2] != k):
        raise ValueError(
            f"pimlayers.abft_checks: transposed x has shape {tuple(x.shape)}; expected "
            f"({', '.join(map(str, (*g, k)))}, R) for checksums of {tuple(enc.sums.shape)}"
        )
    check_impl("abft_checks", impl)
    reference = lambda v, s, a: _checks_reference(v, WeightChecksums(s, a), transposed, lam, weighted)
    if x.shape[-2 if transposed else -1] != k:
        raise ValueError(
            f"pimlayers.abft_checks: x has shape {tuple(x.shape)}; expected K = {k} on its "
            f"{'second-to-last' if transposed else 'last'} axis for checksums of {tuple(enc.sums.shape)}"
        )
    if impl == "auto" and x.dtype == jnp.bfloat16:  # the opt-in one-read kernel
        reference = _with_checks_kernel(reference, x, enc, k, transposed, lam, weighted)
    if transposed:
        # xᵀ @ s contracts over x's leading axis, the one a data-parallel x is split over: XLA
        # sums the devices' partial dots, where this custom call would have x gathered to each
        # device (no partitioning rule for it yet). So with several devices "auto" keeps XLA's
        # dots here; with one there is nothing to split, and the kernel (3-6x faster than XLA's
        # dots on a 2-core CPU) took the protected Dense's forward+backward at 256 x 1024 -> 256
        # (128-column blocks, f32) from 0.67-0.74x the plain one's speed to 0.91-1.02x
        # (2026-12-04, a probe alternating the two; `python -m benchmarks.run --suite matmul --m
        # 256 --dtype float32 --shapes small` times it as it is now).
        # (A process with a GPU keeps them too: there the checks are XLA's dots anyway, and its
        # programs stay as they were measured.)
        native = lambda v, s, a: _checks_native(v, s, a, True)
        one_cpu = jax.device_count() == 1 and checks_native_everywhere()
        impl = "reference" if impl == "auto" and not one_cpu else impl
    elif not g:  # one weight: x's rows, flattened, split over devices as they come
        rows = row_parallel(lambda v, s, a: _checks_native(v, s, a, False), (1, 3, 2), (2, 1))

        def native(v, s, a):
            c, m = rows(v.reshape(-1, k), s, a)
            return c.reshape(*v.shape[:-1], nb, 2), m.reshape(*v.shape[:-1], nb)
    elif tuple(x.shape[:-2]) == tuple(g):  # a weight per leading index, shared by its R rows
        native = row_parallel(lambda v, s, a: _checks_native(v, s, a, False), (1, 3, 2), (2, 1))
    else:  # matmul broadcasting between x's and the weights' leading axes
        native = reference
    if not weighted:
        native = _without_c2(native)
    return dispatch("abft_checks", impl, native, reference, x, enc.sums, enc.abs_sums, native_on=("cpu",))


def _without_c2(fn):
    """``fn``'s checks with c2 zeroed (the native CPU pass forms both: one pass over x either way)."""

    def call(v, s, a):
        c, mag = fn(v, s, a)
        return jnp.stack([c[..., 0], jnp.zeros_like(c[..., 0])], axis=-1), mag

    return call


def _with_checks_kernel(
    reference, x, enc: WeightChecksums, k: int, transposed: bool, lam, weighted: bool = True
):
    """``reference``, or where this process asked for the one-read checks kernel and it takes these
    checks (``_checks_kernel``: ``PIMLAYERS_CHECKS_KERNEL=1``, an NVIDIA GPU), the kernel where a GPU
    lowers them and ``reference`` elsewhere. x's rows are split over devices as they come (each
    device checks its own, as the native CPU checks do: ``row_parallel``). Transposed checks
    contract over the rows, which a data-parallel x has split: there, with several devices,
    XLA's dots stay (they add the devices' partial sums)."""
    from ._checks_kernel import (
        PROTECTED_COLUMNS,
        checks_kernel,
        checks_kernel_applies,
        checks_kernel_wanted,
        protected_grid,
    )

    c_terms, mag_terms, scale = _check_terms(k, lam)
    applies = checks_kernel_applies(
        x, enc.sums, c_terms, mag_terms, transposed, weighted, max_columns=PROTECTED_COLUMNS
    )
    if not (checks_kernel_wanted() and applies):
        return reference
    if transposed and jax.device_count() > 1:
        return reference

    def kernel(v, s, a):
        a = a if scale == 1.0 else a * jnp.float32(scale)  # as _checks_reference scales them
        bm, splits = protected_grid(transposed)
        return checks_kernel(
            v,
            s,
            a,
            c_terms,
            mag_terms,
            transposed=transposed,
            interpret=False,
            bm=bm,
            splits=splits,
            weighted=weighted,
        )

    def switch(v, s, a):
        return lax.platform_dependent(v, s, a, cuda=kernel, default=reference)

    if transposed:
        return switch
    rows = row_parallel(switch, (1, 3, 2), (2, 1))
    if enc.sums.ndim > 3:  # a weight per leading index: x (*g, R, K) split as it comes
        return rows
    nb = enc.abs_sums.shape[-1]

    def one_weight(v, s, a):  # x's rows, flattened
        c, m = rows(v.reshape(-1, k), s, a)
        return c.reshape(*v.shape[:-1], nb, 2), m.reshape(*v.shape[:-1], nb)

    return one_weight


def checks_after(y: jax.Array, x: jax.Array) -> jax.Array:
    """x, for :func:`abft_checks` of the GEMM that produced y: where the checks run natively (a
    CPU-only process), only once y exists; elsewhere x as it is.

    Nothing else orders the two (the checks read x, not y), and XLA:CPU runs independent ops at
    once on its thread pool, where the checks then competed with the GEMM for the cores. On a
    2-core CPU (f32, M = 256, 128-column blocks, 2026-12-04; probes alternating the builds in one
    process, 12-20 rounds) ordered checks ran the protected Dense's forward+backward 1.5-16% faster at
    256 x 256-1024, and two products of one x (each with its own checks, where one check pass for
    both had run before either GEMM: :func:`checks_native_everywhere`) 17-34% faster forward and
    backward, 1-4% forward. The handler keeps its quarter of the pool: with the whole pool the
    same probes were slower where the checks still ran beside another op (the backward's second
    GEMM). Only in a CPU-only process (:func:`checks_native_everywhere`): a process with a GPU
    keeps its programs as they were measured."""
    return lax.optimization_barrier((y, x))[1] if checks_native_everywhere() else x


def checks_native_everywhere() -> bool:
    """Whether every platform this process can lower for runs :func:`abft_checks` natively (a
    CPU-only process with the native module). There several products of one operand each get their
    own checks, ordered after the product (:func:`checks_after`), instead of one check pass for all
    of them formed before any (which would run beside the GEMMs): the checks are one pass over the
    operand either way, and a GPU, where they are GEMMs, keeps the shared one."""
    return present_platforms() == frozenset({"cpu"}) and has_native("cpu")


def _checks_native(x, sums, abs_sums, transposed: bool):
    *g, _, nb = abs_sums.shape
    rows = x.shape[-1] if transposed else x.shape[-2]
    out = (
        jax.ShapeDtypeStruct((*g, rows, nb, 2), jnp.float32),
        jax.ShapeDtypeStruct((*g, rows, nb), jnp.float32),
    )
    call = jax.ffi.ffi_call("pimlayers_abft_checks", out, vmap_method="broadcast_all")
    return call(x, sums, abs_sums, transposed=np.bool_(transposed))


# A bf16 term of an f32 value v: rounding to nearest leaves |v - head| <= 2^-8 |v| (8 significant
# bits), so after t terms the rest is at most 2^-8t |v|.
_BF16_REST = 2.0**-8


def _check_terms(k: int, lam: float | None) -> tuple[int, int, float]:
    """``(c_terms, mag_terms, mag_scale)`` for bf16 split-dot checks feeding a check with this λ.

    Three bf16 terms carry an f32 checksum column to f32 precision (rest <= 2^-24), what the bound's
    f32 part, λ·u·(√K + √n + 2)·mag with u = 2^-24, assumes. Two leave a rest of at most 2^-16 of
    each column's value, and |Σ_k x_k s_k| <= Σ_k |x_k| |s_k| <= mag for the plain sums (n·mag for
    the position-weighted ones, which the check compares against n·B1): an error of at most
    2^-16·mag in c. Two terms are taken where that is at most 1/8 of the bound's f32 part (taking
    √n + 2 >= 3): λ·(√K + 3) >= 2^8·8, which the weight gradients' λ = 64 meets from K = 841 and
    the default λ = 8 only beyond K = 64000. mag is then raised by that share, so the bound covers
    c's error: at most 1/8 looser than with f32-accurate checks. mag itself only scales the bound:
    one bf16 term of the absolute sums raised by 2^-7 (the scale applies to those small columns,
    before their term is taken, not to mag) is at least (1 + 2^-7)(1 - 2^-8) > 1 + 2^-9 times the
    sums, so mag stays an upper scale (the 2^-9 also covers mag's own f32 summation). Without
    ``lam``: three and two terms, unscaled (f32-accurate).
    """
    if lam is None:
        return 3, 2, 1.0
    room = lam * F32_ROUNDOFF * (math.sqrt(k) + 3.0)  # the f32 part of B1 per unit of mag, smallest n
    rest2 = _BF16_REST**2
    scale = 1.0 + 2.0 * _BF16_REST
    if rest2 <= room / 8:
        return 2, 1, scale * (1.0 + rest2 / room)
    return 3, 1, scale


@functools.partial(jax.jit, static_argnames=("transposed", "lam", "weighted", "split"))
def _checks_reference(
    x,
    enc: WeightChecksums,
    transposed: bool,
    lam: float | None = None,
    weighted: bool = True,
    split: int = 1,
):
    """:func:`abft_checks` from XLA's dots (the GPU's path; the reference elsewhere).

    ``split``: a bf16 x's two check GEMMs with K cut into that many slices (:func:`_split_dot`), for
    the checks suite to time. The protected GEMMs keep K whole: cut, the checks ran no faster on an
    H100 (2026-12-06, the suite's ``xla_s{S}_us``; docs/performance.md)."""
    *g, k, nb = enc.abs_sums.shape
    per = 2 if weighted else 1  # c1 and c2, or (weighted=False) c1 alone
    sums = enc.sums.reshape(*g, k, nb * 2) if weighted else enc.sums[..., 0]
    rows = x.shape[-1] if transposed else x.shape[-2]
    lead = x.shape[:-2]

    def pair(c):  # (..., rows, nb * per) -> (..., rows, nb, 2), c2 zero where not formed
        c = c.reshape(*lead, rows, nb, per)
        return c if weighted else jnp.concatenate([c, jnp.zeros_like(c)], axis=-1)

    if x.dtype == jnp.bfloat16:
        # bf16 x: the f32 checksum columns split into bf16 terms (hi + mid + lo carries 24 bits,
        # f32's precision) ride on the tensor cores: each bf16 x bf16 product is exact in f32, so
        # the f32-accumulated sum of the three products is the f32 check, at bf16 GEMM speed (an
        # f32 GEMM at HIGHEST runs on CUDA cores, ~15x slower on an H200). Given the check's λ,
        # fewer terms where the bound has room for their rest (_check_terms): every term is a
        # column per block in these GEMMs (8 per 128-column block with f32-accurate checks, 6.25%
        # of the protected GEMM's own work; 7, or 5 for the weight gradients, given λ).
        c_terms, mag_terms, scale = _check_terms(k, lam)
        c = pair(_split_dot(x, sums, c_terms, transposed, split))
        abs_sums = enc.abs_sums if scale == 1.0 else enc.abs_sums * jnp.float32(scale)  # (K, nb): small
        return c, _split_dot(jnp.abs(x), abs_sums, mag_terms, transposed, split)
    xf = x.astype(jnp.float32)
    hi = lax.Precision.HIGHEST  # TF32 or bf16 passes would swamp the bound
    c = pair(_dot_x(xf, sums, transposed, precision=hi))
    mag = _dot_x(jnp.abs(xf), enc.abs_sums, transposed, precision=hi)
    return c, mag


def _dot_x(x, w, transposed: bool, **kw):
    """x @ w with matmul's broadcasting, or (transposed) xᵀ @ w over matching leading axes."""
    if not transposed:
        return jnp.matmul(x, w, **kw)
    batch = tuple(range(x.ndim - 2))
    return lax.dot_general(x, w, (((x.ndim - 2,), (w.ndim - 2,)), (batch, batch)), **kw)


def _split_dot(
    x: Float[Array, "*m k"],
    w: Float[Array, "*g k c"],
    terms: int,
    transposed: bool = False,
    split: int = 1,
) -> Float[Array, "*m c"]:
    """x (bf16) @ w (f32) in f32 via w = sum of ``terms`` bf16 parts: one bf16 GEMM, exact products.

    ``split`` > 1 (dividing K): K cut into that many slices, one batched GEMM of them whose f32
    partial products are added in slice order; the same products, accumulated in another order."""
    parts = _split_parts(w, terms)
    if split == 1:
        y = _dot_x(x, parts, transposed, preferred_element_type=jnp.float32)
    else:
        y = _dot_x_split(x, parts, transposed, split)
    return _sum_terms(y, terms, w.shape[-1])


def _dot_x_split(x, w: Array, transposed: bool, split: int) -> Array:
    """:func:`_dot_x` in f32 with K cut into ``split`` equal slices, each slice's product a batch
    entry of one GEMM, the partial products added in slice order."""
    k = w.shape[-2]
    if k % split:
        raise ValueError(f"pimlayers: split={split} does not divide K = {k}")
    ws = w.reshape(*w.shape[:-2], split, k // split, w.shape[-1])  # (*g, S, K/S, C)
    if transposed:  # x (*g, K, R): contract over K in place, batch over (*g, S)
        xs = x.reshape(*x.shape[:-2], split, k // split, x.shape[-1])
        batch = tuple(range(xs.ndim - 2))
        dims = (((xs.ndim - 2,), (ws.ndim - 2,)), (batch, batch))
        y = lax.dot_general(xs, ws, dims, preferred_element_type=jnp.float32)  # (*g, S, R, C)
    else:  # x (*m, R, K): (*m, S, R, K/S) @ (*g, S, K/S, C) by matmul's broadcasting
        xs = jnp.moveaxis(x.reshape(*x.shape[:-1], split, k // split), -2, -3)
        y = jnp.matmul(xs, ws, preferred_element_type=jnp.float32)  # (*m, S, R, C)
    out = y[..., 0, :, :]
    for i in range(1, split):
        out = out + y[..., i, :, :]
    return out


def _split_parts(w: Float[Array, "*g k c"], terms: int) -> Array:
    """w's ``terms`` bf16 parts side by side, (*g, K, terms * c), largest first: their sum is w up
    to 2^-8 per term of each value (f32's 24 bits with three).

    Formed as one elementwise map over (*g, K, terms, c), each output value picking its term by
    the term axis' index, then a reshape (a bitcast): not as ``terms`` casts and a concatenation,
    which XLA on the GPU left as separate kernels (a multi-output convert fusion, then a
    concatenation; with the dw checks of gate and up a concatenation of the two sums before them):
    three launches over arrays of 8192 rows where one elementwise kernel does."""
    heads, rest = [], w
    for _ in range(terms):
        head = _bf16_head(rest)
        heads.append(head)
        rest = rest - head  # exact in f32
    shape = (*w.shape[:-1], terms, w.shape[-1])
    which = lax.broadcasted_iota(jnp.int32, shape, w.ndim - 1)
    out = jnp.broadcast_to(jnp.expand_dims(heads[-1], -2), shape)
    for t in range(terms - 2, -1, -1):
        out = jnp.where(which == t, jnp.expand_dims(heads[t], -2), out)
    # Exact: every head is a bf16 value.
    return out.astype(jnp.bfloat16).reshape(*w.shape[:-1], terms * w.shape[-1])


def _sum_terms(y: Float[Array, "*m tc"], terms: int, cols: int) -> Float[Array, "*m c"]:
    """The products of :func:`_split_parts`' terms, (*m, terms * cols), added smallest first."""
    y = y.reshape(*y.shape[:-1], terms, cols)
    out = y[..., terms - 1, :]
    for t in range(terms - 2, -1, -1):  # smallest first
        out = out + y[..., t, :]
    return out


def _bf16_head(v: Float[Array, ...]) -> Float[Array, ...]:
    """v rounded to its nearest bf16 value (half away from zero), kept in f32, by bit arithmetic.

    Not ``v.astype(bf16).astype(f32)``: XLA may elide such a convert pair (it allows excess
    precision by default), which on the H200 turned ``v - head`` into 0 inside jit, dropped the lower
    parts and left the checks with bf16 precision: every 128-column block of attention's GEMMs was
    flagged. Integer arithmetic on the bits is never elided.
    """
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    rounded = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(rounded, jnp.float32)


@functools.partial(jax.jit, static_argnames=("k", "block_n", "lam", "u", "correct", "weighted"))
def abft_check_reference(
    y, checks, mag, k: int, block_n: int, lam: float, u: float, correct: bool, width=None, weighted=True
):
    """Pure-JAX twin of the native check (sums in f32 instead of f64: equal flags away from the bound).

    ``width`` (int32, y's shape with nb for N; optional) overrides each block's column count, for
    blocks gathered out of a wider product whose last block is partial (the batched recompute).
    ``weighted=False``: the checks hold no c2 (its slot is not read), r1 alone decides and nothing
    is located.
    """
    n = y.shape[-1]
    bn, nb = block_n, checks.shape[-2]
    yf = y.astype(jnp.float32)
    yb = jnp.pad(yf, [(0, 0)] * (y.ndim - 1) + [(0, nb * bn - n)]).reshape(*y.shape[:-1], nb, bn)
    lead = (1,) * (y.ndim - 1)  # explicit broadcasting (the suite runs with rank promotion raising)
    col = jnp.arange(bn).reshape(*lead, 1, bn)
    if width is None:
        width = jnp.minimum(bn, n - jnp.arange(nb) * bn).reshape(*lead, nb)
        inside = (jnp.arange(nb).reshape(*lead, nb, 1) * bn + col) < n
    else:
        inside = col < width[..., None]
    width = width.astype(jnp.float32)
    nonfinite = ~jnp.isfinite(yb) & inside
    yz = jnp.where(nonfinite | ~inside, 0.0, yb)
    s1 = yz.sum(-1)
    s2 = (yz * (col + 1).astype(jnp.float32)).sum(-1)
    sa = jnp.abs(yz).sum(-1)
    c1, c2 = checks[..., 0], checks[..., 1]
    u_y = 0.0 if y.dtype == jnp.float32 else UNIT_ROUNDOFF[jnp.dtype(y.dtype)]
    bound = lambda sum_abs: abft_bound(mag, sum_abs, k, width, lam, u, u_y)
    b1 = bound(sa)
    r1, r2 = s1 - c1, s2 - c2
    if not weighted:  # no c2: r1 alone decides (csrc/abft.h), nothing is located
        c2 = r2 = jnp.zeros_like(c1)
        correct = False
    bad = ~(jnp.isfinite(c1) & jnp.isfinite(c2) & jnp.isfinite(mag))
    detected = bad | ~(jnp.abs(r1) <= b1) | ~(jnp.abs(r2) <= width * b1)
    jl = jnp.rint(r2 / r1) - 1.0
    b1_loc = b1
    if u_y > 0.0:  # locating in a rounded y: the candidate's own |y| leaves the bound (csrc/abft.h)
        jc = jnp.clip(jl, 0, bn - 1).astype(jnp.int32)[..., None]
        yj = jnp.take_along_axis(yz, jc, axis=-1)[..., 0]
        rest = jnp.maximum(sa - jnp.abs(yj), 0.0)
        b1_loc = bound(rest)
    # A single error leaves r2 = (jl + 1) r1 up to rounding (csrc/abft.h; the sums here are f32, so
    # the rounding term uses f32's epsilon); two errors of very different size do not.
    tol = 2.0 * width * b1_loc + 4.0 * width * width * jnp.abs(r1) * float(np.finfo(np.float32).eps)
    single = jnp.abs(r2 - (jl + 1.0) * r1) <= tol
    locatable = correct & ~bad & (jnp.abs(r1) > 4.0 * width * b1_loc) & (jl >= 0) & (jl < width) & single
    n_nonfinite = nonfinite.sum(-1)
    nf_loc = jnp.argmax(nonfinite, axis=-1).astype(jnp.float32)
    tol_nf = 2.0 * width * b1 + 4.0 * width * width * jnp.abs(r1) * float(np.finfo(np.float32).eps)
    nf_single = jnp.abs(r2 - (nf_loc + 1.0) * r1) <= tol_nf
    flag = jnp.where(
        n_nonfinite > 0,
        jnp.where(
            (n_nonfinite == 1) & correct & jnp.isfinite(c1) & jnp.isfinite(c2) & nf_single,
            ABFT_CORRECTED,
            ABFT_DETECTED,
        ),
        jnp.where(detected, jnp.where(locatable, ABFT_CORRECTED, ABFT_DETECTED), ABFT_CLEAN),
    ).astype(jnp.int32)
    loc = jnp.where(n_nonfinite > 0, jnp.argmax(nonfinite, axis=-1), jl.astype(jnp.int32))
    at = col == loc[..., None]
    others = jnp.where(at, 0.0, yz).sum(-1)
    value = c1 - others
    # The rebuilt block must pass the check a clean block passes (csrc/abft.h, AbftRebuild): a
    # second, smaller error can hide behind a huge one in the location test's tolerance.
    rest = jnp.where(at, 0.0, yz)
    r2_fixed = (rest * (col + 1).astype(jnp.float32)).sum(-1) + (loc + 1).astype(jnp.float32) * value - c2
    b1_fixed = bound(jnp.abs(rest).sum(-1) + jnp.abs(value))
    rebuilt_ok = jnp.isfinite(value) & (
        jnp.abs(r2_fixed) <= width * (b1_fixed + jnp.abs(value) * float(np.finfo(np.float32).eps))
    )
    flag = jnp.where((flag == ABFT_CORRECTED) & ~rebuilt_ok, ABFT_DETECTED, flag).astype(jnp.int32)
    fixed = jnp.where((flag == ABFT_CORRECTED)[..., None] & at, value[..., None], yb)
    out = fixed.reshape(*y.shape[:-1], nb * bn)[..., :n].astype(y.dtype)
    return out, flag


def _check_attrs(k, block_n, lam, u, correct, weighted) -> dict:
    """The attributes both native checks take (typed as their handlers bind them)."""
    return dict(
        block_n=np.int64(block_n),
        k=np.int64(k),
        unit_roundoff=np.float32(u),
        lam=np.float32(lam),
        correct=np.bool_(correct),
        weighted=np.bool_(weighted),
    )


def _native(y, checks, mag, k, block_n, lam, u, correct, weighted):
    out = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(mag.shape, jnp.int32))
    call = jax.ffi.ffi_call(
        "pimlayers_abft_check", out, vmap_method="broadcast_all", input_output_aliases={0: 0}
    )
    return call(y, checks, mag, **_check_attrs(k, block_n, lam, u, correct, weighted))


@_scoped("pimlayers.abft_check")
def abft_check(
    y: Float[Array, "*m n"],
    checks: Float[Array, "*m nb 2"],
    mag: Float[Array, "*m nb"],
    *,
    k: int,
    block_n: int | None = None,
    lam: float = 8.0,
    unit_roundoff: float = F32_ROUNDOFF,
    correct: bool = True,
    weighted: bool = True,
    impl: str = "auto",
) -> tuple[Float[Array, "*m n"], Int32[Array, "*m nb"]]:
    """Verify a GEMM output against its checks; locate and rebuild one wrong value per row block.

    Args:
      y: the GEMM output (f32 before rounding is where the bound is tight; bf16/f16 accepted).
      checks, mag: from :func:`abft_checks`.
      k: the GEMM's inner dimension (enters the bound).
      block_n: column block width used by :func:`abft_encode` (None: the whole row).
      lam: safety factor of the probabilistic bound.
      unit_roundoff: u of the accumulation (f32: 2^-24).
      correct: rebuild located values; False only detects.
      weighted: the checks hold c2 (``abft_checks(..., weighted=True)``, the default). False: c2
        was not formed (its slot is not read); r1 alone decides and nothing is located, so
        ``correct`` must be False.

    Returns ``(y_out, flags)``; flags per (row, block): 0 clean, 1 corrected, 2 detected and not
    corrected. No shape depends on the data: a fault never recompiles anything.
    """
    check_impl("abft_check", impl)
    check_float("abft_check", "y", y)
    _check_weighted("abft_check", correct, weighted)
    args = (*_check_args("abft_check", y, checks, mag, k, block_n, lam, unit_roundoff), bool(correct))
    w = bool(weighted)
    return dispatch(
        "abft_check",
        impl,
        row_parallel(lambda a, c, m: _native(a, c, m, *args, w), (1, 2, 1), (1, 1)),
        lambda a, c, m: abft_check_reference(a, c, m, *args, weighted=w),
        y,
        checks,
        mag,
    )


def _check_weighted(op: str, correct, weighted) -> None:
    """Location reads c2: a check without it (``weighted=False``) cannot correct in place."""
    if not isinstance(weighted, bool | np.bool_):
        raise TypeError(f"pimlayers.{op}: weighted={weighted!r}; expected a bool")
    if correct and not weighted:
        raise ValueError(
            f"pimlayers.{op}: correct=True with weighted=False; locating an error reads the "
            "position-weighted checks c2, which weighted=False says were not formed (pass correct=False)"
        )


def _check_args(
    op: str, y, checks, mag, k, block_n, lam, unit_roundoff, block_offset: int | None = None
) -> tuple[int, int, float, float]:
    """Validate a check's operands; returns ``(k, block width, lam, unit_roundoff)``.

    ``block_offset`` given (abft_finish): checks and mag may hold more column blocks per row than
    y has (B >= block_offset + nb), y's being blocks ``block_offset ..``; else exactly nb."""
    if y.ndim < 2:
        raise ValueError(f"pimlayers.{op}: y has shape {tuple(y.shape)}; expected (..., M, N)")
    off = 0 if block_offset is None else block_offset
    if not isinstance(off, int | np.integer) or off < 0:
        raise ValueError(f"pimlayers.{op}: block_offset={block_offset!r}; expected an int >= 0")
    bn, nb = _blocks(y.shape[-1], block_n)
    blocks = nb
    if block_offset is not None:  # a wider row of checks is taken, y's at block_offset
        blocks = max(checks.shape[-2] if checks.ndim == y.ndim + 1 else 0, nb + off)
    want_c, want_m = (*y.shape[:-1], blocks, 2), (*y.shape[:-1], blocks)
    for name, arr, want in (("checks", checks, want_c), ("mag", mag, want_m)):
        if tuple(arr.shape) != want or arr.dtype != jnp.float32:
            extra = f" and block_offset={off}" if off else ""
            raise ValueError(
                f"pimlayers.{op}: {name} has {arr.dtype} {tuple(arr.shape)}; expected float32 {want} "
                f"for y {tuple(y.shape)} with block_n={block_n}{extra}"
            )
    if not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"pimlayers.{op}: k={k!r}; expected the GEMM inner dimension (int >= 0)")
    if not lam > 0 or not unit_roundoff > 0:
        raise ValueError(f"pimlayers.{op}: lam={lam}, unit_roundoff={unit_roundoff}; expected both > 0")
    return int(k), bn, float(lam), float(unit_roundoff)


def abft_finish_reference(
    y,
    checks,
    mag,
    k,
    block_n,
    lam,
    u,
    correct,
    out_dtype,
    gate,
    fill,
    limit,
    width=None,
    block_offset=0,
    weighted=True,
):
    """Pure-JAX twin of the native abft_finish: check and correct, cast, then gate the stored value."""
    nb = _blocks(y.shape[-1], block_n)[1]
    if block_offset or checks.shape[-2] != nb:  # y's blocks of a wider row of checks
        checks = checks[..., block_offset : block_offset + nb, :]
        mag = mag[..., block_offset : block_offset + nb]
    out, flags = abft_check_reference(y, checks, mag, k, block_n, lam, u, correct, width, weighted)
    out = out.astype(out_dtype)
    if not gate:
        return out, flags, jnp.zeros(flags.shape, jnp.int32)
    gone = ~gate_keep(out, limit)  # judged on the final (corrected, cast) values
    out, _ = gate_reference(out, fill, limit)
    n, nb = y.shape[-1], flags.shape[-1]
    pad = [(0, 0)] * (y.ndim - 1) + [(0, nb * block_n - n)]
    counts = jnp.pad(gone, pad).reshape(*y.shape[:-1], nb, block_n).sum(-1, dtype=jnp.int32)
    return out, flags, counts


def _finish_native(
    y, checks, mag, k, block_n, lam, u, correct, out_dtype, gate, fill, limit, block_offset, weighted
):
    nb = _blocks(y.shape[-1], block_n)[1]
    out = (
        jax.ShapeDtypeStruct(y.shape, out_dtype),
        jax.ShapeDtypeStruct((*y.shape[:-1], nb), jnp.int32),
        jax.ShapeDtypeStruct((*y.shape[:-1], nb), jnp.int32),
    )
    # y_out aliases y when it has y's dtype (a GEMM's bf16 output checked where it lies): the
    # kernel then only reads y and writes what it corrects or gates. Inside jit y is the GEMM's
    # temporary, so XLA donates it and nothing is copied.
    alias = {0: 0} if jnp.dtype(out_dtype) == y.dtype else {}
    call = jax.ffi.ffi_call(
        "pimlayers_abft_finish", out, vmap_method="broadcast_all", input_output_aliases=alias
    )
    gated = dict(gate=np.bool_(gate), fill=np.float32(fill), limit=np.float32(limit))
    attrs = _check_attrs(k, block_n, lam, u, correct, weighted)
    return call(y, checks, mag, **attrs, **gated, block_offset=np.int64(block_offset))


@_scoped("pimlayers.abft_finish")
def abft_finish(
    y: Float[Array, "*m n"],
    checks: Float[Array, "*m nb 2"],
    mag: Float[Array, "*m nb"],
    *,
    k: int,
    block_n: int | None = None,
    lam: float = 8.0,
    unit_roundoff: float = F32_ROUNDOFF,
    correct: bool = True,
    out_dtype=None,
    gate: bool = True,
    fill: float = 0.0,
    limit: float | None = None,
    block_offset: int = 0,
    weighted: bool = True,
    impl: str = "auto",
) -> tuple[Float[Array, "*m n"], Int32[Array, "*m nb"], Int32[Array, "*m nb"]]:
    """:func:`abft_check`, the insulation gate and the cast to ``out_dtype`` in one pass over y.

    What a protected GEMM does with an f32 product: verify (and correct) it where the bound is
    tight, then store it in the layer's dtype with non-finite (and ``|y| > limit``) values replaced
    by ``fill`` — judged after the cast, so an f32 value that overflows bf16 is caught too. Three
    separate passes (check, gate, cast) read y three times; this reads it once.

    With ``out_dtype`` equal to y's dtype (a GEMM that wrote bf16 itself) the native op works in
    place: y is read once and only corrected or gated values are written (the bound then carries
    y's storage rounding, ``u_y · Σ|y|``, see the module docstring).

    Returns ``(y_out, flags, counts)``: y_out in ``out_dtype`` (default y's), flags per (row, block)
    as :func:`abft_check`, counts (int32, per (row, block), like flags) of gated values in the
    stored block. Not differentiable (the protected GEMMs' custom VJP wraps it).

    ``block_offset``: checks and mag may hold B >= block_offset + nb blocks per row (one check GEMM
    shared by several products, their checks side by side); y's are blocks ``block_offset ..
    block_offset + nb - 1``, read in place. Slicing them out instead cost a copy kernel per slice
    (80 per 4-layer Llama-3-8B-dimension training step on an H200, 0.28 ms; 2026-12-04).

    ``weighted``: as :func:`abft_check`'s (False: no c2, r1 alone decides, ``correct`` False).
    """
    check_impl("abft_finish", impl)
    _check_weighted("abft_finish", correct, weighted)
    check_float("abft_finish", "y", y)
    out_dtype = jnp.dtype(y.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"pimlayers.abft_finish: out_dtype={out_dtype}; expected float32, bfloat16 or float16"
        )
    if limit is None:
        limit = math.inf
    if not isinstance(limit, int | float) or math.isnan(limit) or limit < 0:
        raise ValueError(f"pimlayers.abft_finish: limit={limit!r}; expected None or a number >= 0")
    args = _check_args("abft_finish", y, checks, mag, k, block_n, lam, unit_roundoff, block_offset)
    args = (*args, bool(correct), out_dtype, bool(gate), float(fill), float(limit))
    off, w = int(block_offset), bool(weighted)
    return dispatch(
        "abft_finish",
        impl,
        row_parallel(lambda a, c, m: _finish_native(a, c, m, *args, off, w), (1, 2, 1), (1, 1, 1)),
        lambda a, c, m: abft_finish_reference(a, c, m, *args, block_offset=off, weighted=w),
        y,
        checks,
        mag,
    )
