"""Banked GEMV (the "pim" execution backend): weights packed bank-major plus one checksum bank.

HBM-PIM parts compute next to each bank: a GEMV's weight rows are spread over the banks and every
bank's unit produces its own slice of the output. Here the N output rows are cut into ``banks``
slices of R = ceil(N / banks) rows (zero rows pad the last), bank b holds rows ``b*R .. b*R+R-1``,
and a checksum bank holds their f32 sum ``C = sum_b W_b``. Then ``C x = sum_b W_b x``, so when one bank
fails (its unit or its cells; it is not read at all) its slice is ``C x - sum of the others`` — rebuilt,
not recomputed. With two or more failed banks nothing can be rebuilt and the call says so.

The rebuilt slice carries f32 rounding of the sums (about K * 2^-24 of the row magnitudes), not the
bank's own rounding: it is an accurate value, not a bit-identical one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int32

from ..faults import FaultReport
from ._common import check_float, dtype_name
from ._dispatch import check_impl, dispatch

__all__ = ["PimWeights", "pim_gemv", "pim_gemv_reference", "pim_linear", "pim_pack"]


class PimWeights(NamedTuple):
    """A (K, N) kernel packed for the banked GEMV."""

    w: Float[Array, "banks rows k"]  # the kernel's dtype
    wsum: Float[Array, "rows k"]  # f32: the checksum bank
    n: int  # output features (static)


jax.tree_util.register_pytree_node(
    PimWeights, lambda p: ((p.w, p.wsum), p.n), lambda n, c: PimWeights(c[0], c[1], n)
)


def pim_pack(kernel: Float[Array, "k n"], banks: int) -> PimWeights:
    """Pack a (in, out) kernel into ``banks`` data banks and the checksum bank."""
    if isinstance(banks, bool) or not isinstance(banks, int | np.integer) or banks < 2:
        raise ValueError(f"pimlayers.pim_pack: banks={banks!r}; expected an int >= 2")
    check_float("pim_pack", "kernel", kernel)
    if kernel.ndim != 2:
        raise ValueError(f"pimlayers.pim_pack: kernel has shape {tuple(kernel.shape)}; expected (in, out)")
    k, n = kernel.shape
    rows = -(-n // banks)
    wt = jnp.pad(kernel.T, ((0, banks * rows - n), (0, 0))).reshape(banks, rows, k)
    return PimWeights(wt, jnp.sum(wt.astype(jnp.float32), axis=0), int(n))


def pim_gemv_reference(x, w, wsum, bank_ok) -> tuple[Float[Array, "t banks rows"], Float[Array, "t rows"]]:
    hi = lax.Precision.HIGHEST
    y = jnp.einsum("brk,tk->tbr", w, x, preferred_element_type=jnp.float32, precision=hi)
    y = jnp.where((bank_ok != 0)[None, :, None], y, jnp.float32(0))
    c = jnp.einsum("rk,tk->tr", wsum, x.astype(jnp.float32), precision=hi)
    return y, c


def _ffi(x, w, wsum, bank_ok):
    t, nb, r = x.shape[0], w.shape[0], w.shape[1]
    out = (jax.ShapeDtypeStruct((t, nb, r), jnp.float32), jax.ShapeDtypeStruct((t, r), jnp.float32))
    return jax.ffi.ffi_call("pimlayers_pim_gemv", out)(x, w, wsum, bank_ok)


@jax.custom_batching.custom_vmap
def _native(x, w, wsum, bank_ok):
    return _ffi(x, w, wsum, bank_ok)


@_native.def_vmap
def _native_vmap(axis_size, in_batched, x, w, wsum, bank_ok):
    # A batch of token blocks against one set of weights (Equinox's vmap over examples) is one
    # larger block of tokens; anything else batched runs one call per example.
    xb, *rest = in_batched
    if not any(rest):
        xs = x if xb else jnp.broadcast_to(x[None], (axis_size, *x.shape))
        t = xs.shape[1]
        y, c = _native(xs.reshape(axis_size * t, xs.shape[2]), w, wsum, bank_ok)
        return (y.reshape(axis_size, t, *y.shape[1:]), c.reshape(axis_size, t, c.shape[1])), (True, True)
    args = [
        a if b else jnp.broadcast_to(a[None], (axis_size, *a.shape))
        for a, b in zip((x, w, wsum, bank_ok), in_batched, strict=True)
    ]
    return lax.map(lambda a: _native(*a), args), (True, True)


def pim_gemv(
    x: Float[Array, "t k"], w, wsum, bank_ok: Int32[Array, " banks"], *, impl: str = "auto"
) -> tuple[Float[Array, "t banks rows"], Float[Array, "t rows"]]:
    """Every live bank's slice ``(T, banks, R)`` (zeros for banks with ``bank_ok == 0``, which are not
    read) and the checksum bank's ``(T, R)``, both f32."""
    check_impl("pim_gemv", impl)
    check_float("pim_gemv", "x", x)
    if x.ndim != 2 or w.ndim != 3 or w.shape[2] != x.shape[1] or wsum.shape != w.shape[1:]:
        raise ValueError(
            f"pimlayers.pim_gemv: x {tuple(x.shape)}, w {tuple(w.shape)}, wsum {tuple(wsum.shape)}; "
            "expected x (T, K), w (banks, R, K), wsum (R, K)"
        )
    if w.dtype != x.dtype or wsum.dtype != jnp.float32:
        raise TypeError(
            f"pimlayers.pim_gemv: w is {dtype_name(w.dtype)}, wsum {dtype_name(wsum.dtype)}; "
            f"expected w in x's dtype {dtype_name(x.dtype)} and wsum float32"
        )
    if bank_ok.shape != (w.shape[0],) or bank_ok.dtype != jnp.int32:
        raise ValueError(
            f"pimlayers.pim_gemv: bank_ok is {dtype_name(bank_ok.dtype)} {tuple(bank_ok.shape)}; "
            f"expected int32 ({w.shape[0]},)"
        )
    return dispatch("pim_gemv", impl, _native, pim_gemv_reference, x, w, wsum, bank_ok)


def pim_linear(
    x: Float[Array, "*b k"],
    packed: PimWeights,
    bank_ok: Int32[Array, " banks"] | None = None,
    *,
    impl: str = "auto",
) -> tuple[Float[Array, "*b n"], FaultReport]:
    """``x @ kernel`` on the banked GEMV, in x's dtype; one failed bank's slice rebuilt from the
    checksum bank. Report: one GEMM checked; detected when any bank failed; corrected when exactly one
    did; uncorrectable (slices left at zero) when more did."""
    nb, rows, k = packed.w.shape
    if x.shape[-1] != k:
        raise ValueError(f"pimlayers.pim_linear: x has {x.shape[-1]} features; the packed kernel takes {k}")
    ok = jnp.ones((nb,), jnp.int32) if bank_ok is None else bank_ok
    lead = x.shape[:-1]
    y, c = pim_gemv(x.reshape(-1, k), packed.w, packed.wsum, ok, impl=impl)
    failed = ok == 0
    nfail = jnp.sum(failed, dtype=jnp.int32)
    rebuilt = c - jnp.sum(y, axis=1)  # the failed bank's slice when exactly one failed
    fix = failed & (nfail == 1)
    y = jnp.where(fix[None, :, None], rebuilt[:, None, :], y)
    out = y.reshape(y.shape[0], nb * rows)[:, : packed.n].astype(x.dtype).reshape(*lead, packed.n)
    report = FaultReport(
        gemm_checked=1,
        gemm_detected=nfail > 0,
        gemm_corrected=nfail == 1,
        gemm_uncorrectable=nfail > 1,
    )
    return out, report
