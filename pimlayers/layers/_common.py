"""Checks and dtype rules shared by the neutral layers (errors name the layer and the fix)."""

from __future__ import annotations

import jax.numpy as jnp

from ..faults import FaultPolicy


def policy_or_default(policy: FaultPolicy | None) -> FaultPolicy:
    if policy is None:
        return FaultPolicy()
    if not isinstance(policy, FaultPolicy):
        raise TypeError(f"policy must be a pimlayers.FaultPolicy; got {type(policy).__name__} {policy!r}")
    return policy


def stock(policy: FaultPolicy) -> bool:
    """Mode "off" without gates: run the stock layer's exact arithmetic (bit-identical outputs)."""
    return not policy.enabled and not policy.gate


def check_features(layer: str, x, expected: int, what: str = "features") -> None:
    """x must be a floating array whose last axis has ``expected`` entries."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{layer}: input must be a floating-point array (float32, bfloat16, float16); got "
            f"{type(x).__name__} of dtype {dtype}"
        )
    if x.ndim < 1 or x.shape[-1] != expected:
        raise ValueError(
            f"{layer}: input has shape {tuple(x.shape)}; expected (..., {expected}) — the last axis must be "
            f"the layer's {expected} input {what}"
        )


def promote(*arrays, dtype=None):
    """Flax's rule (``flax.nnx.dtypes.promote_dtype``): cast every array (None kept) to ``dtype``,
    or to the result type of all of them when ``dtype`` is None."""
    present = [a for a in arrays if a is not None]
    if dtype is None:
        dtype = jnp.result_type(*present)
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in arrays)
