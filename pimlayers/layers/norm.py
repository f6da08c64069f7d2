"""RMSNorm: ``x / sqrt(mean(x²) + eps) * scale``, in each stock library's own order of operations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ..faults import FaultPolicy, FaultReport
from ..ops import gate
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
        if style == "flax":
            x, scale = promote(x, scale, dtype=dtype)
            out_dtype = x.dtype
            xf = jnp.asarray(x, _stats_dtype(x.dtype))
            var = jnp.mean(lax.square(xf), axis=-1, keepdims=True)
            mul = lax.rsqrt(var + eps)
            if scale is not None:
                mul = mul * jnp.reshape(scale, (1,) * (x.ndim - 1) + (-1,)).astype(mul.dtype)
            y = (xf * mul).astype(out_dtype)
        else:
            out_dtype = x.dtype
            xf = x.astype(_stats_dtype(x.dtype))
            if style == "equinox":
                y = lax.rsqrt(jnp.mean(xf**2, axis=-1, keepdims=True) + eps) * xf
                if scale is not None:
                    y = scale.astype(xf.dtype) * y
                if bias is not None:
                    y = y + bias.astype(xf.dtype)
                y = y.astype(out_dtype)
            else:
                var = jnp.mean(xf**2, axis=-1, keepdims=True)
                y = (xf * lax.rsqrt(var + eps)).astype(out_dtype)
                if scale is not None:
                    y = jnp.reshape(scale, (1,) * (x.ndim - 1) + (-1,)).astype(out_dtype) * y
        report = FaultReport.zeros()
        if policy.gate:
            y, counts = gate(y, fill=policy.gate_fill, limit=policy.gate_limit)
            report = FaultReport(nonfinite_gated=jnp.sum(counts, dtype=jnp.int32))
        return y, report


def _stats_dtype(dtype):
    # float32, or float64 for float64 inputs (jnp.promote_types would refuse under strict promotion).
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
