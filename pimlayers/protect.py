"""``protect(model)``: turn an existing Flax NNX or Equinox model's stock layers into protected ones.

The weights are kept, not copied: NNX layers are given the stock layer's own ``Param`` variables;
Equinox layers reference the stock layer's arrays. Converted (stock -> pimlayers):

  flax.nnx.Linear -> flax.nnx.Linear;  flax.nnx.LinearGeneral (trailing axes) -> LinearGeneral;
  flax.nnx.RMSNorm (last axis) -> RMSNorm;  flax.nnx.MultiHeadAttention: its projections as above
  and its ``attention_fn`` replaced by a verified one (ProtectedAttentionFn);
  equinox.nn.Linear -> Linear;  equinox.nn.RMSNorm (1-D) -> RMSNorm;  equinox.nn.MultiheadAttention:
  its four projections (its score and value products stay Equinox's own).

Layers outside these cases are left as they are and listed by ``protect(..., verbose=True)``.
"""

from __future__ import annotations

import typing as tp

from .faults import FaultPolicy

__all__ = ["protect"]


def protect(model: tp.Any, policy: FaultPolicy | None = None, *, verbose: bool = False) -> tp.Any:
    """Convert ``model``'s linear, norm and attention layers; returns the converted model.

    An NNX model is converted in place (and returned); an Equinox model, being immutable, is
    returned as a new pytree sharing the original arrays.
    """
    policy = FaultPolicy() if policy is None else policy
    if not isinstance(policy, FaultPolicy):
        raise TypeError(f"protect: policy must be a pimlayers.FaultPolicy; got {type(policy).__name__}")
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional
        nnx = None
    if nnx is not None and isinstance(model, nnx.Module):
        from ._protect_nnx import protect_nnx

        return protect_nnx(model, policy, verbose)
    try:
        import equinox as eqx
    except ImportError:  # pragma: no cover - equinox is optional
        eqx = None
    if eqx is not None and isinstance(model, eqx.Module):
        from ._protect_eqx import protect_eqx

        return protect_eqx(model, policy, verbose)
    raise TypeError(
        f"protect: expected a flax.nnx.Module or an equinox.Module; got {type(model).__name__}. "
        "(Flax Linen modules have no weights of their own: build them from pimlayers.flax.linen layers.)"
    )
