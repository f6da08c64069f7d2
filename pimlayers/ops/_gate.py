"""The insulation gate: replace non-finite (and optionally out-of-range) values, count them.

Forward: ``y = where(keep, x, fill)`` with ``keep = isfinite(x) & (|x| <= limit)`` and
``counts[...] = sum(~keep, axis=-1)`` (per row). Backward: the gradient passes only where the value
was kept, ``dx = where(keep, dy, 0)``, so it is finite even where x held NaN/Inf (the double-`where`
rule: no NaN from the replaced branch can leak into the gradient).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._common import check_float
from ._dispatch import check_impl, dispatch
from ._rows import row_parallel
from ._vma import zero_cotangent  # the counts' float0 zero, varying as they do in shard_map

__all__ = ["gate", "gate_reference", "gate_with_keep"]


def gate_keep(x, limit: float):
    """True where the gate keeps x: finite and |x| <= limit."""
    xf = x.astype(jnp.float32)  # compare in f32, as the native handlers do
    return jnp.isfinite(xf) & (jnp.abs(xf) <= jnp.float32(limit))


def gate_reference(
    x: Float[Array, "*rows n"], fill: float = 0.0, limit: float = math.inf
) -> tuple[Float[Array, "*rows n"], Int[Array, "*rows"]]:
    """Pure-JAX twin of the native gate (same outputs, bit for bit)."""
    return _select(x, gate_keep(x, limit), fill)


def _select(x, keep, fill: float):
    """``(where(keep, x, fill), per-row count of ~keep)``: the gate's values and counts for a mask."""
    y = jnp.where(keep, x, jnp.asarray(fill, jnp.float32).astype(x.dtype))
    dropped = (~keep).astype(jnp.int32)
    return y, dropped if x.ndim == 0 else jnp.sum(dropped, axis=-1, dtype=jnp.int32)


def _gate_native(x, fill: float, limit: float):
    out = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(x.shape[:-1] if x.ndim else (), jnp.int32),
    )
    call = jax.ffi.ffi_call("pimlayers_gate", out, vmap_method="broadcast_all")
    return call(x, fill=np.float32(fill), limit=np.float32(limit))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _gate(x, fill, limit, impl):
    return dispatch(
        "gate",
        impl,
        row_parallel(lambda a: _gate_native(a, fill, limit), (1,), (1, 0)),
        lambda a: gate_reference(a, fill, limit),
        x,
        # On the H200 XLA's fused select ran at 0.77x (bf16) to 0.93x (f32) of our kernel's time
        # (docs/benchmarks.md), and it fuses with its producer, so "auto" keeps XLA there.
        native_on=("cpu",),
    )


@_gate.defjvp
def _gate_jvp(fill, limit, impl, primals, tangents):
    # The gate is the identity where it keeps and a constant elsewhere. Writing the tangent as a
    # select (linear in dx) gives forward and reverse mode; its transpose is where(keep, dy, 0), so
    # a NaN cotangent at a replaced position never reaches dx.
    (x,), (dx,) = primals, tangents
    y, counts = _gate(x, fill, limit, impl)
    dy = jnp.where(gate_keep(x, limit), dx, jnp.zeros_like(dx))
    return (y, counts), (dy, zero_cotangent(counts))


def gate(
    x: Float[Array, "*rows n"], *, fill: float = 0.0, limit: float | None = None, impl: str = "auto"
) -> tuple[Float[Array, "*rows n"], Int[Array, "*rows"]]:
    """Insulation gate. Returns ``(y, counts)``; ``counts`` (int32, shape ``x.shape[:-1]``) holds
    how many values of each row were replaced.

    Args:
      x: float32, bfloat16 or float16 array of any shape (a scalar is one row of one value).
      fill: the replacement value (cast to x's dtype).
      limit: also replace values with ``|x| > limit``; ``None`` replaces only NaN and ±Inf.
      impl: "auto" (native where built, else the reference), "native" or "reference".
    """
    check_impl("gate", impl)
    if not hasattr(x, "dtype"):
        raise TypeError(f"pimlayers.gate: x must be an array, got {type(x).__name__}")
    check_float("gate", "x", x)
    if limit is None:
        limit = math.inf
    if not isinstance(limit, int | float) or math.isnan(limit) or limit < 0:
        raise ValueError(f"pimlayers.gate: limit={limit!r}; expected None or a number >= 0")
    if not isinstance(fill, int | float):
        raise TypeError(f"pimlayers.gate: fill must be a Python number, got {type(fill).__name__}")
    return _gate(x, float(fill), float(limit), impl)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _gate_keep_given(x, keep, exact, fill, impl):
    if exact is None:
        return _gate(x, fill, math.inf, impl)
    return _select(x, exact, fill)  # the caller's mask is isfinite(x) exactly: gate_reference's


@_gate_keep_given.defjvp
def _gate_keep_given_jvp(fill, impl, primals, tangents):
    (x, keep, exact), (dx, _, _) = primals, tangents
    y, counts = _gate_keep_given(x, keep, exact, fill, impl)
    dy = jnp.where(keep, dx, jnp.zeros_like(dx))
    return (y, counts), (dy, zero_cotangent(counts))


def gate_with_keep(
    x: Float[Array, "*rows n"],
    keep: Array,
    *,
    fill: float = 0.0,
    impl: str = "auto",
    exact: Array | None = None,
) -> tuple[Float[Array, "*rows n"], Int[Array, "*rows"]]:
    """:func:`gate` (NaN and ±Inf only) whose gradient passes where ``keep`` (bool, broadcastable to
    x) says, in place of where the values were kept: for a caller that knows the kept positions from
    cheaper inputs than x itself. ``keep`` must equal ``isfinite(x)`` wherever the gradient
    matters; the forward (values, counts) is :func:`gate`'s, bit for bit.

    Why: the gradient's mask from x makes a backward pass that rematerialises x compute it first. An
    RMSNorm's output needs its rows' statistics, so its backward took two dependent passes over the
    input where the ungated norm takes one (``python -m benchmarks.norm_gate`` on an H100, 8192 x
    4096 bf16 under ``jax.checkpoint``, 2026-12-07, norm-gate-s61: +58.6 µs over the ungated norm's
    0.235 ms); from the input and the scale alone the
    mask is a sibling of the statistics' reduction (``layers.rms_norm``).

    ``exact`` (optional, bool, broadcastable to x like ``keep``): ``isfinite(x)`` itself, computed
    by the caller from x's own inputs; the forward then selects and counts by it (``impl`` unused),
    bit for bit :func:`gate`'s where it is exact. For a producer whose exact mask XLA fuses into
    the fusion that writes x, where ``isfinite(x)`` reads x again after it is written: the
    RMSNorm's select ran as a kernel of its own (``python -m benchmarks.norm_gate``, 8192 x 4096
    bf16 on an H100, 2026-12-07, norm-gate-s62: the forward 0.135 ms gated by its output's mask,
    0.086 by the exact one). The op cannot check exactness: a mask that is not exact lets what it
    keeps through."""
    check_float("gate_with_keep", "x", x)
    if not isinstance(fill, int | float):
        raise TypeError(f"pimlayers.gate_with_keep: fill must be a Python number, got {type(fill).__name__}")
    keep = _mask("keep", keep, x)
    exact = None if exact is None else _mask("exact", exact, x)
    check_impl("gate_with_keep", impl)
    return _gate_keep_given(x, keep, exact, float(fill), impl)


def _mask(what: str, mask, x) -> jax.Array:
    """``mask`` validated as gate_with_keep's ``keep``/``exact`` and broadcast to x's shape."""
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"pimlayers.gate_with_keep: {what} has dtype {mask.dtype}; expected bool")
    try:
        shape = jnp.broadcast_shapes(mask.shape, x.shape)
    except ValueError:
        raise ValueError(
            f"pimlayers.gate_with_keep: {what} has shape {tuple(mask.shape)}, which does not broadcast "
            f"to x's {tuple(x.shape)}"
        ) from None
    if shape != tuple(x.shape):
        raise ValueError(
            f"pimlayers.gate_with_keep: {what} has shape {tuple(mask.shape)}; it must broadcast to x's "
            f"{tuple(x.shape)} without growing it"
        )
    return jnp.broadcast_to(mask, x.shape)
