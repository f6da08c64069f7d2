"""Framework-neutral layer math: every front end (Flax NNX, Flax Linen, Equinox) calls these.

Each function takes arrays and static configuration and returns ``(outputs, FaultReport)``; none
holds state. Shape letters used across the package: B batch, T query positions, S key positions,
E model width, F MLP width, H query heads, KV key/value heads, D head width.
"""

from .attention import FLASH_RESIDUALS as FLASH_RESIDUALS
from .attention import KVCache as KVCache
from .attention import attention_core as attention_core
from .attention import gqa_attention as gqa_attention
from .linear import COMPUTE_WEIGHT as COMPUTE_WEIGHT
from .linear import LINEAR_OUTPUT as LINEAR_OUTPUT
from .linear import linear as linear
from .mlp import llama_mlp as llama_mlp
from .norm import rms_norm as rms_norm
from .rope import Llama31Scaling as Llama31Scaling
from .rope import apply_rope as apply_rope
from .rope import rope_frequencies as rope_frequencies

__all__ = [
    "COMPUTE_WEIGHT",
    "FLASH_RESIDUALS",
    "LINEAR_OUTPUT",
    "KVCache",
    "Llama31Scaling",
    "apply_rope",
    "attention_core",
    "gqa_attention",
    "linear",
    "llama_mlp",
    "rms_norm",
    "rope_frequencies",
]
