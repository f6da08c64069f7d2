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

# CUDA handlers XLA may record into its command buffers (CUDA graphs) with the kernels around them.
# A handler not marked so ends the graph it would sit in: the graph before it is launched, then the
# handler, then the next graph, each a launch the host must keep ahead of the device. Marked here:
# the handlers of every protected GEMM (a 4-layer Llama-3 step launches ~140 of them), which enqueue
# the same kernels (and device-to-device copies) for the same attributes and never read device data
# on the host. Not marked: the bank guards, the scrub and the fused AdamW update, whose handlers
# copy a table of their leaves from host memory and take scratch memory per call (a graph replayed
# later would read a table freed since), and the handlers no training step runs on a GPU.
# Opt-in (PIMLAYERS_COMMAND_BUFFERS=1, read once at import): on an H100 (2026-12-06, `python -m
# benchmarks.step_ab --env PIMLAYERS_COMMAND_BUFFERS=1`, step-ab-s55cb) XLA then ran 99 of the
# 4-layer step's 108 ms of kernels as one command buffer and the device idled 1.02 ms inside the
# step against 1.60 (profile-protect-s55cb, -s55), yet the step's time did not change beyond its
# +-3 ms spread (the non-repair steps' means 110.0 ms against 109.5, fault counts the same).
COMMAND_BUFFER_TARGETS = frozenset(
    {"pimlayers_abft_check", "pimlayers_abft_finish", "pimlayers_abft_encode", "pimlayers_abft_encode_pair"}
)


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
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform, **_traits(platform, name))
            names.append(name)
    except Exception as err:  # a jaxlib that rejects the handlers must not break the library
        return PlatformInfo(platform, False, reason=f"registering with XLA failed: {err}")
    return PlatformInfo(platform, True, tuple(sorted(names)))


def _traits(platform: str, name: str) -> dict:
    """The traits XLA registers target ``name`` of ``platform`` with: command-buffer compatible for
    the CUDA handlers of :data:`COMMAND_BUFFER_TARGETS` where PIMLAYERS_COMMAND_BUFFERS=1."""
    if platform != "cuda" or name not in COMMAND_BUFFER_TARGETS:
        return {}
    if os.environ.get("PIMLAYERS_COMMAND_BUFFERS", "0") != "1":
        return {}
    from jax._src.lib import xla_client

    trait = getattr(getattr(xla_client, "CustomCallTargetTraits", None), "COMMAND_BUFFER_COMPATIBLE", None)
    return {} if trait is None else {"traits": trait}


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
