"""RMSNorm: ``x / sqrt(mean(x²) + eps) * scale``, in each stock library's own order of operations."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ..faults import FaultPolicy, FaultReport
from ..ops import gate, gate_with_keep
from ._common import check_features, policy_or_default, promote

__all__ = ["rms_norm"]

STYLES = ("flax", "equinox", "llama")


def rms_norm(
    x: Float[Array, "*b e"],
    scale: Float[Array, " e"] | None,
    bias: Float[Array, " e"] | None = None,
    *,
    eps: float,
    dtype=None,
    style: str = "flax",
    policy: FaultPolicy | None = None,
    name: str = "pimlayers.RMSNorm",
) -> tuple[Float[Array, "*b e"], FaultReport]:
    """Root-mean-square norm over the last axis; ``(y, report)``.

    The statistics are always taken in float32 (a bf16 mean of squares loses the small terms). The
    order of the final products follows the library being replaced, so mode "off" is bit-identical:
      flax     y = x * (rsqrt(var + eps) * scale), cast to the promoted dtype   (flax.nnx.RMSNorm)
      equinox  y = scale * (rsqrt(var + eps) * x) + bias, cast back to x's dtype (equinox.nn.RMSNorm)
      llama    y = scale * (x * rsqrt(var + eps)).astype(x.dtype)               (Hugging Face LlamaRMSNorm)
    A norm has no GEMM to verify; with gates on, non-finite outputs are replaced and counted.
    """
    if style not in STYLES:
        raise ValueError(f"{name}: style must be one of {STYLES}; got {style!r}")
    if bias is not None and style != "equinox":
        raise ValueError(
            f"{name}: a bias exists only in the equinox style (equinox.nn.RMSNorm(use_bias=True))"
        )
    policy = policy_or_default(policy)
    if scale is not None:
        check_features(name, x, scale.shape[-1])
    with jax.named_scope(name):
        x_in, s_used = x, scale  # x and the scale as the products use them
        if style == "flax":
            x, scale = promote(x, scale, dtype=dtype)
            x_in = x
            out_dtype = x.dtype
            xf = jnp.asarray(x, _stats_dtype(x.dtype))
            var = jnp.mean(lax.square(xf), axis=-1, keepdims=True)
            mul = lax.rsqrt(var + eps)
            if scale is not None:
                s_used = scale.astype(mul.dtype)
                mul = mul * jnp.reshape(scale, (1,) * (x.ndim - 1) + (-1,)).astype(mul.dtype)
            y = (xf * mul).astype(out_dtype)
        else:
            out_dtype = x.dtype
            xf = x.astype(_stats_dtype(x.dtype))
            if style == "equinox":
                var = jnp.mean(xf**2, axis=-1, keepdims=True)
                y = lax.rsqrt(var + eps) * xf
                if scale is not None:
                    s_used = scale.astype(xf.dtype)
                    y = s_used * y
                if bias is not None:
                    y = y + bias.astype(xf.dtype)
                y = y.astype(out_dtype)
            else:
                var = jnp.mean(xf**2, axis=-1, keepdims=True)
                y = (xf * lax.rsqrt(var + eps)).astype(out_dtype)
                if scale is not None:
                    s_used = scale.astype(out_dtype)
                    y = jnp.reshape(scale, (1,) * (x.ndim - 1) + (-1,)).astype(out_dtype) * y
        report = FaultReport.zeros()
        if policy.gate and policy.gate_limit is None and out_dtype in _WIDE and eps > 0 and bias is None:
            cols = _columns_ok(s_used, x_in.shape[-1], x_in.dtype, eps, style)
            cols = cols.reshape((1,) * (x_in.ndim - 1) + (-1,))
            finite = jnp.isfinite(x_in)
            # The forward's mask, exactly isfinite(y) (``_columns_ok`` says why): a NaN row's
            # outputs are all NaN; elsewhere y is finite where x is, in the columns in range.
            # From x and the row's statistic, XLA fuses the select into the norm's own fusion
            # instead of a kernel that reads y again (gate_with_keep's ``exact``).
            exact = jnp.where(cols, finite & ~jnp.isnan(var), jnp.isfinite(y))
            y, counts = gate_with_keep(y, finite & cols, fill=policy.gate_fill, exact=exact)
            report = FaultReport(nonfinite_gated=jnp.sum(counts, dtype=jnp.int32))
        elif policy.gate:
            y, counts = gate(y, fill=policy.gate_fill, limit=policy.gate_limit)
            report = FaultReport(nonfinite_gated=jnp.sum(counts, dtype=jnp.int32))
        return y, report


# Output dtypes whose range is f32's (or f64's): there a finite row's values cannot overflow unless
# the scale is ~1e35 or more (below).
_WIDE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def _columns_ok(scale, e: int, dtype, eps: float, style: str) -> jax.Array:
    """Bool (E,): the columns where the norm's output is finite wherever x is finite, from the scale
    alone. The gate's gradient passes ``isfinite(x) & ok`` (``ops.gate_with_keep``'s ``keep``):
    computed from the output itself, a backward pass that rematerialises the norm needs the rows'
    statistics first, a second pass over x, where this mask is a sibling of their reduction.

    A row of finite x has |x_j|·rsqrt(mean(x²) + eps) <= sqrt(E) (its mean square is at least
    x_j²/E; f32's rounding of the sum is far inside the 1/64 margin), so its outputs are finite where
    the scale is finite and small enough that |s|·sqrt(E) stays below half the output's largest
    value; flax's order forms rsqrt(·)·s first, at most rsqrt(eps)·|s|, which must stay below half
    the statistics' dtype's. A column past those limits (at E = 4096 and eps = 1e-5, a scale from
    ~5e35 in flax's order and ~2.6e36 in the others: a corrupted parameter) passes no gradient. A
    row whose mean square is Inf (an Inf in x, or squares past f32's range) scales by
    rsqrt(Inf) = 0: its finite values become 0·s, kept where the column is, and its Infs NaN, which
    isfinite(x) drops. A row with a NaN is NaN throughout,
    so the gate keeps none of it, where the gradient's mask passes its finite columns: its input
    gradient and the scale's are NaN either way (the norm's backward multiplies by the row's NaN
    statistic, and the scale's gradient by its NaN outputs), so they agree with the gate's own mask
    bit for bit (``tests/test_layers.py``). A bias's gradient would not (it sums the cotangents
    alone): a norm with a bias (equinox's ``use_bias``) keeps the gate's own mask. The forward's
    mask adds the NaN rows (``~isnan(var)``), exact in these columns, and ``isfinite(y)`` in the
    others."""
    out_dtype = jnp.dtype(dtype)  # every style's output has x's dtype (flax's promoted)
    wide = jnp.float64 if jnp.float64 in (out_dtype, getattr(scale, "dtype", None)) else jnp.float32
    ok = jnp.ones((e,), jnp.bool_)
    room = jnp.full((e,), math.sqrt(e) * (1.0 + 2.0**-6), wide)  # |s|·sqrt(E)(1 + 2^-6)
    if scale is not None:
        s = jnp.abs(scale.astype(wide)).reshape(e)
        ok = ok & jnp.isfinite(s)
        room = room * s
        if style == "flax":
            ok = ok & (s <= float(jnp.finfo(scale.dtype).max) / 2.0 * math.sqrt(eps))
    return ok & (room <= float(jnp.finfo(out_dtype).max) / 2.0)


def _stats_dtype(dtype):
    # float32, or float64 for float64 inputs (jnp.promote_types would refuse under strict promotion).
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
