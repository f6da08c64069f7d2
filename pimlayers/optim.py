"""Fault-aware optimizer wrapper (optax shape) and the encode-on-write parameter update (AdamW's
with the encode fused into its write: `adamw_guarded`)."""

from __future__ import annotations

import dataclasses
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
    "GuardedAdamW",
    "adamw_guarded",
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


def _decide(
    updates: Any, report: FaultReport | None, skip_on_uncorrectable: bool
) -> tuple[jax.Array, jax.Array]:
    """Whether `fault_aware` skips this step, and why (a `SKIP_*` code)."""
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
    return skip, reason


def _next_state(
    state: FaultAwareState, skip, reason, max_consecutive_skips: int | None, inner_state
) -> FaultAwareState:
    """`fault_aware`'s counters after a step (skipped or not), around the given inner state."""
    notfinite_count = jnp.where(skip, _safe_increment(state.notfinite_count), jnp.zeros([], jnp.int32))
    if max_consecutive_skips is None:
        gave_up = state.gave_up
    else:
        gave_up = jnp.logical_or(state.gave_up, notfinite_count > max_consecutive_skips)
    return FaultAwareState(
        notfinite_count=notfinite_count,
        total_skipped=jnp.where(skip, _safe_increment(state.total_skipped), state.total_skipped),
        total_steps=_safe_increment(state.total_steps),
        last_skip_reason=reason,
        gave_up=gave_up,
        inner_state=inner_state,
    )


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
        skip, reason = _decide(updates, report, skip_on_uncorrectable)

        # Both outcomes computed, one selected (not `lax.cond`): on a GPU the runtime reads a cond's
        # predicate on the host, and this one depends on the whole backward pass, so the host would
        # wait for it inside every step and could not queue the next step meanwhile. XLA can fuse the
        # select into the inner update's elementwise pass (which reads the old state anyway); a
        # skipped step, rare, pays for an update it throws away. Skipped: zero updates, the inner state
        # passed through bit-identical (a select returns the old value's bits, NaN or not).
        new_updates, new_inner_state = inner.update(updates, state.inner_state, params, **extra)
        new_updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
        new_inner_state = jax.tree.map(lambda n, o: jnp.where(skip, o, n), new_inner_state, state.inner_state)

        return new_updates, _next_state(state, skip, reason, max_consecutive_skips, new_inner_state)

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


def _tree_norm(tree: Any) -> jax.Array:
    """optax's global norm (``optax.tree.norm``, ``optax.global_norm`` in older releases)."""
    tree_mod = getattr(optax, "tree", None)
    if tree_mod is not None and hasattr(tree_mod, "norm"):
        return tree_mod.norm(tree)
    return optax.global_norm(tree)


def _replace(state: Any, cls: type, new: Any) -> Any:
    return jax.tree.map(
        lambda x: new if isinstance(x, cls) else x, state, is_leaf=lambda x: isinstance(x, cls)
    )


@dataclasses.dataclass(frozen=True)
class GuardedAdamW:
    """AdamW (after ``clip_by_global_norm`` when ``clip`` is set) under `fault_aware`, whose step can
    run fused with the parameters' encode: made by `adamw_guarded`.

    ``tx`` is the optax transformation itself (``fault_aware(chain(clip_by_global_norm(clip),
    adamw(...)))``): ``init`` and the unfused step are its. `update_and_guard` takes and returns the
    same state, so either step may follow the other (and a checkpoint of one restores into both).
    """

    tx: optax.GradientTransformationExtraArgs
    learning_rate: float | Callable[[jax.Array], jax.Array]
    b1: float
    b2: float
    eps: float
    eps_root: float
    weight_decay: float
    clip: float | None
    skip_on_uncorrectable: bool
    max_consecutive_skips: int | None
    mask: Any = None  # optax's weight-decay mask: a pytree of bools like the params, or a callable

    def init(self, params: optax.Params) -> FaultAwareState:
        return self.tx.init(params)

    def update(self, updates, state, params=None, **extra):
        """The unfused step: ``tx.update`` (then ``optax.apply_updates`` and an encode)."""
        return self.tx.update(updates, state, params, **extra)

    def hyper(self, grads: Any, state: FaultAwareState, report: FaultReport | None = None):
        """The step's scalars (`pimlayers.ops.AdamHyper`), each as optax computes it, and the skip
        decision and reason (`fault_aware`'s)."""
        from pimlayers.ops import AdamHyper

        skip, reason = _decide(grads, report, self.skip_on_uncorrectable)
        adam = _one(state.inner_state, optax.ScaleByAdamState)
        one = jnp.float32(1)
        if self.clip is None:
            trigger, norm, max_norm = one, one, one
        else:  # the norm of the gradients the unfused step clips (widened to float32)
            norm = _tree_norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
            trigger, max_norm = jnp.squeeze(norm < self.clip).astype(jnp.float32), jnp.float32(self.clip)
        count = optax.safe_increment(adam.count)
        if callable(self.learning_rate):
            sched = _one(state.inner_state, optax.ScaleByScheduleState)
            step = jnp.asarray(-1 * self.learning_rate(sched.count), jnp.float32)
        else:
            step = jnp.float32(-1 * self.learning_rate)
        f = jnp.float32
        h = AdamHyper(
            trigger=trigger,
            norm=norm,
            max_norm=max_norm,
            b1=f(self.b1),
            one_minus_b1=f(1 - self.b1),
            b2=f(self.b2),
            one_minus_b2=f(1 - self.b2),
            bc1=(1 - self.b1**count).astype(jnp.float32),
            bc2=(1 - self.b2**count).astype(jnp.float32),
            eps=f(self.eps),
            eps_root=f(self.eps_root),
            wd=f(self.weight_decay),
            step=step,
            skip=skip.astype(jnp.float32),
        )
        return h, skip, reason

    def update_and_guard(
        self,
        grads: Any,
        state: FaultAwareState,
        params: Any,
        store: Any,
        *,
        report: FaultReport | None = None,
    ) -> tuple[Any, FaultAwareState, Any]:
        """``tx.update``, ``optax.apply_updates`` and ``store.encode`` in one pass over the parameters
        (`pimlayers.PimStore.adamw_update`; on CUDA one kernel). Returns ``(params, state,
        pim_state)``; ``params`` and the moments in ``state`` are donated. ``grads`` may be bfloat16
        (read as float32, exactly)."""
        h, skip, reason = self.hyper(grads, state, report)
        adam = _one(state.inner_state, optax.ScaleByAdamState)
        decay = self.mask(params) if callable(self.mask) else self.mask
        new_params, mu, nu, pim = store.adamw_update(params, grads, adam.mu, adam.nu, h, decay=decay)
        # The moments come back selected (kept on a skipped step); the counters as fault_aware's.
        count = jnp.where(skip, adam.count, optax.safe_increment(adam.count))
        inner = _replace(state.inner_state, optax.ScaleByAdamState, optax.ScaleByAdamState(count, mu, nu))
        if callable(self.learning_rate):
            sched = _one(state.inner_state, optax.ScaleByScheduleState)
            new = jnp.where(skip, sched.count, optax.safe_increment(sched.count))
            inner = _replace(inner, optax.ScaleByScheduleState, optax.ScaleByScheduleState(new))
        return new_params, _next_state(state, skip, reason, self.max_consecutive_skips, inner), pim


def _one(state: Any, cls: type) -> Any:
    """The one ``cls`` state (optax's ScaleByAdamState, ScaleByScheduleState) inside ``state``."""
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls)) if isinstance(s, cls)]
    if len(found) != 1:
        raise ValueError(f"expected one {cls.__name__} in the optimizer state; found {len(found)}")
    return found[0]


def adamw_guarded(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    mask: Any = None,
    clip: float | None = None,
    max_consecutive_skips: int | None = None,
    policy: FaultPolicy | None = None,
) -> GuardedAdamW:
    """``fault_aware(chain(clip_by_global_norm(clip), adamw(...)))`` with a step fused with the encode.

    The arguments are optax's (``optax.adamw``: ``learning_rate`` a float or a schedule of the
    step count; decoupled weight decay on the leaves ``mask`` selects, all of them with None: a
    pytree of Python bools like the params, or a callable of the params giving one, as optax's;
    ``clip`` the global norm, None for none) and
    `fault_aware`'s. ``update_and_guard(grads, state, params, store)`` then takes the step and
    encodes its result for a `pimlayers.PimStore` in one pass over the parameters: on a GPU the
    update's own kernel forms the checksums and parity (``pimlayers.ops.adamw_guard_many``), so the
    encode does not read the 4 bytes of every parameter again. Float32 parameters and moments.
    """
    for name, v in (("b1", b1), ("b2", b2)):
        if not 0.0 <= float(v) < 1.0:
            raise ValueError(f"adamw_guarded: {name}={v}; expected 0 <= {name} < 1")
    if clip is not None and not float(clip) > 0.0:
        raise ValueError(f"adamw_guarded: clip={clip}; expected a positive global norm or None")
    inner = optax.adamw(
        learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay, mask=mask
    )
    if clip is not None:
        inner = optax.chain(optax.clip_by_global_norm(clip), inner)
    tx = fault_aware(inner, max_consecutive_skips=max_consecutive_skips, policy=policy)
    skip_on = (policy or FaultPolicy()).skip_on_uncorrectable
    return GuardedAdamW(
        tx, learning_rate, b1, b2, eps, eps_root, weight_decay, clip, skip_on, max_consecutive_skips, mask
    )
