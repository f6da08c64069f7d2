"""Loads pimlayers' native extension, registers its XLA FFI targets and reports what loaded.

Two extension modules are built by ``pip install .``: ``_pimlayers_cpu`` (always) and
``_pimlayers_cuda`` (when a CUDA compiler was found). Each hands XLA a capsule per handler. Where a
module is missing or fails to load, every op runs its pure-JAX reference on that platform instead,
and :func:`native_info` says why. The library warns once, at import, when even the CPU handlers
are missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings

import jax

__all__ = ["PlatformInfo", "has_native", "native_info"]

# XLA platform names, as jax.ffi.register_ffi_target and lax.platform_dependent spell them.
_MODULES = {"cpu": ("_pimlayers_cpu", "cpu"), "cuda": ("_pimlayers_cuda", "CUDA")}


@dataclasses.dataclass(frozen=True)
class PlatformInfo:
    """What loaded for one platform: the FFI targets registered, or why none were."""

    platform: str
    loaded: bool
    targets: tuple[str, ...] = ()
    reason: str | None = None

    def __str__(self) -> str:
        if self.loaded:
            return f"{self.platform}: native ({', '.join(self.targets)})"
        return f"{self.platform}: pure-JAX reference ({self.reason})"


def _load(platform: str) -> PlatformInfo:
    if os.environ.get("PIMLAYERS_NATIVE", "1") == "0":
        return PlatformInfo(platform, False, reason="disabled by PIMLAYERS_NATIVE=0")
    module_name, xla_platform = _MODULES[platform]
    try:
        module = importlib.import_module(f"pimlayers.{module_name}")
    except ImportError as err:
        return PlatformInfo(
            platform, False, reason=f"extension {module_name} not built or not loadable: {err}"
        )
    names = []
    try:
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
            names.append(name)
    except Exception as err:  # a jaxlib that rejects the handlers must not break the library
        return PlatformInfo(platform, False, reason=f"registering with XLA failed: {err}")
    return PlatformInfo(platform, True, tuple(sorted(names)))


_INFO: dict[str, PlatformInfo] = {p: _load(p) for p in _MODULES}

if not _INFO["cpu"].loaded:
    warnings.warn(
        f"pimlayers: native CPU handlers unavailable ({_INFO['cpu'].reason}); every op uses its "
        "pure-JAX reference. Build them with `pip install --no-build-isolation .`.",
        RuntimeWarning,
        stacklevel=2,
    )


def native_info() -> dict[str, PlatformInfo]:
    """Which native handlers loaded, per platform ("cpu", "cuda"), and why not where they did not.

    A CUDA entry can be loaded on a machine without a GPU: the handlers are registered but only
    run when a computation is placed on a CUDA device.
    """
    return dict(_INFO)


def has_native(platform: str) -> bool:
    """Whether the native handlers of ``platform`` ("cpu" or "cuda") are registered."""
    return platform in _INFO and _INFO[platform].loaded
