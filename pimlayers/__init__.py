"""pimlayers: fault-tolerant JAX layers for Llama-3-class models.

Public surface (one place to find every name):
  native_info()            which native FFI handlers loaded, per platform, and why not
  compile_ahead(fn, ...)   ahead-of-time compile from jax.ShapeDtypeStruct, allocating nothing
  ops                      gate, bank_checksums, parity, reconstruct, abft_check, pim_gemv (+ references)
  FaultPolicy, FaultReport what protected code is told to do, and what it reports
  optim                    fault-aware optimizer wrapper (optax shape)
  memory                   PimStore: bank geometry, checksums, parity, scrub, repair, shard rebuild
  layers                   the framework-neutral layer math (linear, llama_mlp, rms_norm, rope, attention)
  flax.nnx, flax.linen, equinox   drop-in layers for each framework (import the one you use)
  protect(model, policy)   convert an existing NNX or Equinox model's stock layers to protected ones
"""

from . import _xla_flags
from . import layers as layers
from . import memory as memory
from . import ops as ops
from ._aot import compile_ahead as compile_ahead
from ._native import PlatformInfo as PlatformInfo
from ._native import has_native as has_native
from ._native import native_info as native_info
from .faults import FaultPolicy as FaultPolicy
from .faults import FaultReport as FaultReport
from .protect import protect as protect

_xla_flags.warn_if_hazardous()

__version__ = "0.1.0"
