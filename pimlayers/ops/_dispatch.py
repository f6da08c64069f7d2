"""Choosing, per platform and at lowering time, between a native FFI call and its reference."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from .._native import has_native
from ._vma import varies, vary_as

IMPLS = ("auto", "native", "reference")


def check_impl(op: str, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"pimlayers.{op}: impl={impl!r}; expected one of {IMPLS}")


def dispatch(
    op: str,
    impl: str,
    native: Callable[..., Any],
    reference: Callable[..., Any],
    *args,
    native_on: tuple[str, ...] = ("cpu", "cuda"),
):
    """Run ``native`` where its handlers are registered for the platform being lowered (and the op
    lists that platform in ``native_on``, i.e. the kernel measured faster there), else
    ``reference``. The choice is made by ``lax.platform_dependent`` when XLA lowers for a device,
    so one traced function serves CPU and GPU placements alike. Where every platform this process
    has a backend for picks the same one (a CPU-only process; a GPU process whose op is native on
    both), that one is called directly: ``platform_dependent`` traces every branch, and tracing the
    unused references was about 40% of a training step's trace on the CPU. A program lowered for a
    platform the process has no backend for (``jax.export`` with other ``platforms``) then needs
    ``impl="reference"`` or ``"native"`` said outright. ``impl="native"`` uses the FFI call
    everywhere (lowering fails with XLA's message where no handler exists); ``impl="reference"``
    never calls native code.
    """
    check_impl(op, impl)
    native = _varying_like(native, args)
    reference = _varying_like(reference, args)
    if impl == "reference":
        return reference(*args)
    if impl == "native":
        return native(*args)
    cpu = native if has_native("cpu") and "cpu" in native_on else reference
    cuda = native if has_native("cuda") and "cuda" in native_on else reference
    per_platform = {"cpu": cpu, "cuda": cuda}
    picked = {per_platform.get(p, reference) for p in present_platforms()}
    if len(picked) == 1:
        return picked.pop()(*args)
    return lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=reference)


@functools.cache
def present_platforms() -> frozenset[str]:
    """The XLA platforms ("cpu", "cuda", ...) this process has a backend for: the ones a jitted
    program can be lowered for here. Empty (every branch kept) if jax cannot say."""
    try:
        from jax.extend.backend import backends

        return frozenset(backends())
    except Exception:  # an older or newer jax without this listing: keep the per-platform switch
        return frozenset()


def _varying_like(fn: Callable[..., Any], args) -> Callable[..., Any]:
    """Inside shard_map, mark fn's outputs as varying over the mesh axes its inputs vary over.

    An FFI call's results carry no such annotation, so without this the native and reference
    branches of platform_dependent would disagree in type (``_vma.vary_as``).
    """
    if not varies(args):
        return fn
    return lambda *a: vary_as(fn(*a), *args)


def compute_device():
    """The device JAX computes on where nothing else places a computation: the default device
    where one is set (``jax.default_device``: a device or a platform's name), else the first; None
    where there is none. What the kernels' paths are chosen by: a program placed on the CPU of a
    machine with a GPU takes the CPU's."""
    try:
        d = jax.config.jax_default_device
        return jax.devices()[0] if d is None else jax.devices(d)[0] if isinstance(d, str) else d
    except RuntimeError:
        return None
