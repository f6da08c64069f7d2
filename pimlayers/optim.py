"""Fault-aware optimizer wrapper (optax shape) and the encode-on-write parameter update."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax

from pimlayers.faults import FaultPolicy, FaultReport

__all__ = [
    "SKIP_NONE",
    "SKIP_NONFINITE",
    "SKIP_UNCORRECTABLE",
    "FaultAwareState",
    "fault_aware",
    "refresh_after_update",
]

# Codes stored in `FaultAwareState.last_skip_reason`.
SKIP_NONE = 0  # The update was applied.
SKIP_NONFINITE = 1  # A gradient leaf held NaN or Inf.
SKIP_UNCORRECTABLE = 2  # The step's FaultReport counted an uncorrectable fault (wins over SKIP_NONFINITE).

_INT32_MAX = jnp.iinfo(jnp.int32).max


class FaultAwareState(NamedTuple):
    """State of `fault_aware`; every counter is an int32 scalar, so it can be checked on the host.

    Attributes:
      notfinite_count: consecutive skipped steps (either reason); reset to 0 by an applied step.
      total_skipped: skipped steps since init; never reset.
      total_steps: calls to `update` since init, skipped or not.
      last_skip_reason: why the last step was skipped: `SKIP_NONE`, `SKIP_NONFINITE` or `SKIP_UNCORRECTABLE`.
      gave_up: bool; sticky once `notfinite_count` exceeded `max_consecutive_skips`. The wrapper still
        refuses bad updates; the flag tells the training loop to act (restore a checkpoint, drop a host).
      inner_state: the wrapped transformation's state, bit-identical across a skipped step.
    """

    notfinite_count: jax.Array
    total_skipped: jax.Array
    total_steps: jax.Array
    last_skip_reason: jax.Array
    gave_up: jax.Array
    inner_state: optax.OptState


def _safe_increment(x: jax.Array) -> jax.Array:
    # Saturate instead of wrapping, as optax's `safe_increment`: a wrapped step counter would read as
    # "no skips" after 2**31 steps.
    return jnp.where(x < _INT32_MAX, x + 1, x)


def _all_finite(tree: Any) -> jax.Array:
    # One reduction per leaf, then a scalar AND; integer leaves are finite by construction.
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return functools.reduce(jnp.logical_and, flags, jnp.array(True))


def fault_aware(
    inner: optax.GradientTransformation,
    *,
    max_consecutive_skips: int | None = None,
    policy: FaultPolicy | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `inner` so a step with non-finite gradients or an uncorrectable fault changes nothing.

    Modelled on `optax.apply_if_finite`. On a skipped step the returned updates are zeros and the inner
    state is passed through untouched (bit-identical); otherwise the inner transformation runs exactly as
    it would unwrapped. The decision is data (a select on a traced flag), so flipping it never
    recompiles. Unlike `apply_if_finite`, the wrapper never gives up and applies bad updates: after more
    than `max_consecutive_skips` consecutive skips it sets the sticky `gave_up` flag instead.

    `update(updates, state, params=None, *, report=None, **extra)`: `report` is the step's
    `FaultReport` (batched reports are reduced). Under data parallelism pass gradients and a report that
    agree on every device (`pmean` the gradients, `report.psum(axis)`), or replicas will diverge.

    Args:
      inner: the transformation to protect.
      max_consecutive_skips: consecutive skips tolerated before `gave_up` is set; None never sets it.
      policy: only `policy.skip_on_uncorrectable` is read; False ignores `report` and skips on
        non-finite gradients alone. Default `FaultPolicy()` (skip).
    """
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int)
    ):
        raise TypeError(
            f"max_consecutive_skips must be an int >= 0 or None; got {type(max_consecutive_skips).__name__}."
        )
    if max_consecutive_skips is not None and max_consecutive_skips < 0:
        raise ValueError(f"max_consecutive_skips must be >= 0 or None; got {max_consecutive_skips}.")
    if policy is None:
        policy = FaultPolicy()
    if not isinstance(policy, FaultPolicy):
        raise TypeError(
            f"policy must be a pimlayers.faults.FaultPolicy or None; got {type(policy).__name__}."
        )
    skip_on_uncorrectable = policy.skip_on_uncorrectable
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> FaultAwareState:
        return FaultAwareState(
            notfinite_count=jnp.zeros([], jnp.int32),
            total_skipped=jnp.zeros([], jnp.int32),
            total_steps=jnp.zeros([], jnp.int32),
            last_skip_reason=jnp.full([], SKIP_NONE, jnp.int32),
            gave_up=jnp.zeros([], jnp.bool_),
            inner_state=inner.init(params),
        )

    def update(
        updates: optax.Updates,
        state: FaultAwareState,
        params: optax.Params | None = None,
        *,
        report: FaultReport | None = None,
        **extra: Any,
    ) -> tuple[optax.Updates, FaultAwareState]:
        if report is not None and not isinstance(report, FaultReport):
            raise TypeError(f"report must be a FaultReport or None; got {type(report).__name__}.")
        finite = _all_finite(updates)
        if report is not None and skip_on_uncorrectable:
            lost = jnp.any(report.any_uncorrectable())  # `any` reduces a vmapped (batched) report.
        else:
            lost = jnp.array(False)
        skip = jnp.logical_or(~finite, lost)
        reason = jnp.where(
            lost,
            jnp.int32(SKIP_UNCORRECTABLE),
            jnp.where(finite, jnp.int32(SKIP_NONE), jnp.int32(SKIP_NONFINITE)),
        )

        # Both outcomes computed, one selected (not `lax.cond`): on a GPU the runtime reads a cond's
        # predicate on the host, and this one depends on the whole backward pass, so the host would
        # wait for it inside every step and could not queue the next step meanwhile. XLA can fuse the
        # select into the inner update's elementwise pass (which reads the old state anyway); a
        # skipped step, rare, pays for an update it throws away. Skipped: zero updates, the inner state
        # passed through bit-identical (a select returns the old value's bits, NaN or not).
        new_updates, new_inner_state = inner.update(updates, state.inner_state, params, **extra)
        new_updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
        new_inner_state = jax.tree.map(lambda n, o: jnp.where(skip, o, n), new_inner_state, state.inner_state)

        notfinite_count = jnp.where(skip, _safe_increment(state.notfinite_count), jnp.zeros([], jnp.int32))
        if max_consecutive_skips is None:
            gave_up = state.gave_up
        else:
            gave_up = jnp.logical_or(state.gave_up, notfinite_count > max_consecutive_skips)
        new_state = FaultAwareState(
            notfinite_count=notfinite_count,
            total_skipped=jnp.where(skip, _safe_increment(state.total_skipped), state.total_skipped),
            total_steps=_safe_increment(state.total_steps),
            last_skip_reason=reason,
            gave_up=gave_up,
            inner_state=new_inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)


P = TypeVar("P")
E = TypeVar("E")


def refresh_after_update(params: P, updates: optax.Updates, encode_fn: Callable[[P], E]) -> tuple[P, E]:
    """Apply `updates` and re-encode the new parameters in the same step ("encode on write").

    `encode_fn` is the caller's checksum/parity encoder (e.g. a `PimStore` encoder); running it right
    after the write means readers never see parameters whose protection data is stale. Pure and
    jit-compatible. A skipped step (zero updates) leaves params unchanged, so the encoding matches.

    Returns:
      `(new_params, encode_fn(new_params))`.
    """
    new_params = optax.apply_updates(params, updates)  # type: ignore[arg-type]
    return new_params, encode_fn(new_params)  # type: ignore[arg-type]
