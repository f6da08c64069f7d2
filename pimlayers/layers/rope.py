"""Rotary position embeddings as Llama 3 uses them (θ = 500000; Llama 3.1 frequency scaling).

Rotation convention: Hugging Face Llama's "rotate half" (the head's first and second halves form
the pairs), which is what Llama checkpoints converted to Hugging Face format expect.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["Llama31Scaling", "apply_rope", "rope_frequencies"]


@dataclasses.dataclass(frozen=True)
class Llama31Scaling:
    """Llama 3.1's RoPE scaling (``rope_scaling`` with ``rope_type="llama3"`` in the HF config):
    long wavelengths are slowed by ``factor``, short ones kept, the band between interpolated."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192  # Llama 3's pre-training context


def rope_frequencies(
    head_dim: int, theta: float = 500000.0, scaling: Llama31Scaling | None = None
) -> np.ndarray:
    """The inverse frequencies ``theta^(-2i/D)``, i < D/2, in float64 (numpy; constants of the model)."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_frequencies: head_dim must be even and >= 2; got {head_dim}")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv
    s = scaling
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    return np.where(wavelen > low_wavelen, inv / s.factor, np.where(wavelen < high_wavelen, inv, mid))


def apply_rope(
    x: Float[Array, "b t h d"], positions: Int[Array, "b t"], inv_freq: np.ndarray
) -> Float[Array, "b t h d"]:
    """Rotate each head's (i, i + D/2) pairs by position · inv_freq[i]; computed in f32, cast back."""
    inv = jnp.asarray(inv_freq, jnp.float32).reshape(1, 1, -1)
    angles = positions.astype(jnp.float32)[..., None] * inv  # (B, T, D/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
