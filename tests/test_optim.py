"""fault_aware: skips bad steps bit-exactly, applies good ones exactly like the inner optimizer, counts."""

import os
import sys

if "jax" not in sys.modules:  # Same device setup as the other modules; harmless if jax is already up.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pimlayers.faults import FaultPolicy, FaultReport
from pimlayers.optim import (
    SKIP_NONE,
    SKIP_NONFINITE,
    SKIP_UNCORRECTABLE,
    FaultAwareState,
    fault_aware,
    refresh_after_update,
)

CLEAN = FaultReport(gemm_checked=4, gemm_detected=1, gemm_corrected=1)  # Faults, all corrected.
LOST = FaultReport(gemm_checked=4, banks_uncorrectable=1)


def _params() -> dict[str, jax.Array]:
    return {
        "w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 7,
        "b": jnp.array([0.5, -0.25], jnp.float32),
    }


def _grads(scale: float) -> dict[str, jax.Array]:
    return {
        "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3) * scale,
        "b": jnp.array([0.1, -0.3], jnp.float32) * scale,
    }


def _nan_grads() -> dict[str, jax.Array]:
    g = _grads(1.0)
    return {**g, "b": g["b"].at[1].set(jnp.nan)}


def _tree_equal(a, b) -> bool:
    """Bitwise equality of two pytrees (same structure, same dtypes, same bits)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False

    def bits(x) -> np.ndarray:
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)  # Compares NaNs and -0.0 exactly too.

    same = jax.tree.map(
        lambda x, y: np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(bits(x), bits(y)), a, b
    )
    return all(jax.tree.leaves(same))


def _tree_applied(a, b, maxulp: int = 4) -> bool:
    """The wrapper's applied step against the inner optimizer's, computed in another program: same
    structure and dtypes, values within ``maxulp`` units in the last place. Not bitwise: XLA fuses
    the wrapper's select into the inner update's loops, and the CPU code it then emits (vectorised
    division and square root) can round differently from the reference program's, by an ulp (seen on
    a 2-core AMD EPYC CI machine, 2026-12-02, for rmsprop)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False

    def close(x, y) -> bool:
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.issubdtype(x.dtype, np.floating):
            return np.array_equal(x, y)
        try:
            np.testing.assert_array_max_ulp(x, y, maxulp=maxulp)
        except AssertionError:
            return False
        return True

    return all(jax.tree.leaves(jax.tree.map(close, a, b)))


def _counters(state: FaultAwareState) -> tuple[int, int, int, int, bool]:
    return (
        int(state.notfinite_count),
        int(state.total_skipped),
        int(state.total_steps),
        int(state.last_skip_reason),
        bool(state.gave_up),
    )


def _stateful() -> optax.GradientTransformation:
    """A stateful optimizer whose update also reads params; works under strict dtype promotion."""
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.rmsprop(1e-2, momentum=0.9), optax.add_decayed_weights(1e-2)
    )


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_applied_steps_match_the_inner_optimizer_exactly(name):
    if name == "adam":
        # optax's Adam bias correction computes float ** int32, which strict promotion rejects; the
        # wrapper itself is covered under strict promotion by the rmsprop case.
        with jax.numpy_dtype_promotion("standard"):
            _check_applied_steps(optax.adam(1e-2))
    else:
        _check_applied_steps(_stateful())


def _check_applied_steps(inner: optax.GradientTransformation) -> None:
    opt = fault_aware(inner)
    params = _params()
    s_ref, s = inner.init(params), opt.init(params)
    ref_update, wrapped_update = jax.jit(inner.update), jax.jit(opt.update)
    for k in range(3):  # Several steps so Adam's moments and count matter.
        g = _grads(1.0 + k)
        u_ref, s_ref = ref_update(g, s_ref, params)
        u, s = wrapped_update(g, s, params, report=CLEAN)
        assert _tree_applied(u, u_ref)
        assert _tree_applied(s.inner_state, s_ref)
        params = optax.apply_updates(params, u)
    assert _counters(s) == (0, 0, 3, SKIP_NONE, False)


def test_nonfinite_grads_skip_with_zero_updates_and_untouched_state():
    opt = fault_aware(_stateful())
    params = _params()
    s0 = opt.init(params)
    _, s1 = opt.update(_grads(1.0), s0, params)  # One real step first, so the state is not all zeros.
    for bad in (_nan_grads(), {**_grads(1.0), "w": _grads(1.0)["w"].at[0, 0].set(jnp.inf)}):
        u, s2 = opt.update(bad, s1, params)
        assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
        assert jax.tree.map(lambda x: x.dtype, u) == jax.tree.map(lambda x: x.dtype, _params())
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, s2.inner_state, s1.inner_state)))
        assert _tree_equal(s2.inner_state, s1.inner_state)
        assert _counters(s2) == (1, 1, 2, SKIP_NONFINITE, False)


def test_uncorrectable_report_skips_and_corrected_faults_do_not():
    opt = fault_aware(optax.sgd(0.1, momentum=0.9))
    params = _params()
    s0 = opt.init(params)
    _, s1 = opt.update(_grads(1.0), s0, params, report=CLEAN)
    u, s2 = opt.update(_grads(2.0), s1, params, report=LOST)
    assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
    assert _tree_equal(s2.inner_state, s1.inner_state)
    assert _counters(s2) == (1, 1, 2, SKIP_UNCORRECTABLE, False)
    # Each uncorrectable counter alone triggers a skip; corrected/gated/retried ones alone do not.
    for name in ("gemm_uncorrectable", "banks_uncorrectable", "link_failures"):
        _, s = opt.update(_grads(1.0), s1, params, report=FaultReport(**{name: 1}))
        assert int(s.last_skip_reason) == SKIP_UNCORRECTABLE, name
    for name in ("gemm_detected", "gemm_corrected", "gemm_recomputed", "nonfinite_gated", "link_retries"):
        _, s = opt.update(_grads(1.0), s1, params, report=FaultReport(**{name: 5}))
        assert int(s.last_skip_reason) == SKIP_NONE, name
    # Both reasons at once: the uncorrectable fault is reported, as the cause.
    _, s = opt.update(_nan_grads(), s1, params, report=LOST)
    assert int(s.last_skip_reason) == SKIP_UNCORRECTABLE
    # A batched (vmapped) report is reduced: one lost element is enough.
    batched = jax.vmap(lambda k: FaultReport(link_failures=k))(jnp.array([0, 0, 1], jnp.int32))
    _, s = opt.update(_grads(1.0), s1, params, report=batched)
    assert int(s.last_skip_reason) == SKIP_UNCORRECTABLE


def test_policy_can_ignore_uncorrectable_reports():
    inner = optax.sgd(0.1)
    opt = fault_aware(inner, policy=FaultPolicy(skip_on_uncorrectable=False))
    params = _params()
    u, s = opt.update(_grads(1.0), opt.init(params), params, report=LOST)
    u_ref, _ = inner.update(_grads(1.0), inner.init(params), params)
    assert _tree_applied(u, u_ref) and int(s.last_skip_reason) == SKIP_NONE
    _, s = opt.update(_nan_grads(), s, params, report=LOST)
    assert int(s.last_skip_reason) == SKIP_NONFINITE  # Non-finite grads are still refused.


def test_counters_over_a_sequence_and_reset_of_consecutive_count():
    opt = fault_aware(optax.sgd(0.1))
    params = _params()
    s = opt.init(params)
    plan = [("ok", CLEAN), ("nan", CLEAN), ("ok", LOST), ("nan", LOST), ("ok", CLEAN), ("nan", CLEAN)]
    expected = [
        (0, 0, 1, SKIP_NONE),
        (1, 1, 2, SKIP_NONFINITE),
        (2, 2, 3, SKIP_UNCORRECTABLE),
        (3, 3, 4, SKIP_UNCORRECTABLE),
        (0, 3, 5, SKIP_NONE),
        (1, 4, 6, SKIP_NONFINITE),
    ]
    for (kind, rep), want in zip(plan, expected, strict=True):
        g = _grads(1.0) if kind == "ok" else _nan_grads()
        _, s = opt.update(g, s, params, report=rep)
        assert _counters(s)[:4] == want


def test_jit_traces_once_while_the_skip_decision_flips():
    traces = 0
    inner = _stateful()
    opt = fault_aware(inner, max_consecutive_skips=2)

    @jax.jit
    def step(params, state, grads, report):
        nonlocal traces
        traces += 1  # Python side effect: runs only while tracing.
        updates, state = opt.update(grads, state, params, report=report)
        return optax.apply_updates(params, updates), state

    params = _params()
    state = opt.init(params)
    ref_params, ref_state = params, inner.init(params)
    for g, rep, applied in [
        (_grads(1.0), CLEAN, True),
        (_nan_grads(), CLEAN, False),
        (_grads(2.0), LOST, False),
        (_grads(3.0), CLEAN, True),
        (_nan_grads(), LOST, False),
        (_grads(0.5), CLEAN, True),
    ]:
        before = params
        params, state = step(params, state, g, rep)
        if applied:
            u, ref_state = jax.jit(inner.update)(g, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, u)
            assert _tree_applied(params, ref_params)
        else:
            assert _tree_equal(params, before)
    assert traces == 1
    assert _tree_applied(state.inner_state, ref_state)
    assert _counters(state) == (0, 3, 6, SKIP_NONE, False)


def test_gave_up_is_set_after_too_many_consecutive_skips_and_is_sticky():
    opt = fault_aware(optax.sgd(0.1), max_consecutive_skips=2)
    update = jax.jit(opt.update)
    params = _params()
    s = opt.init(params)
    for k in range(3):
        u, s = update(_nan_grads(), s, params, report=CLEAN)
        # Still refusing the non-finite update (unlike optax.apply_if_finite, which gives in).
        assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
        assert bool(s.gave_up) == (k == 2), k  # 3 consecutive skips > 2.
    assert int(s.notfinite_count) == 3
    u, s = update(_grads(1.0), s, params, report=CLEAN)
    assert int(s.notfinite_count) == 0 and bool(s.gave_up)  # Sticky: the loop must see it.
    assert not all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
    # Without a limit the flag is never set.
    opt2 = fault_aware(optax.sgd(0.1))
    s2 = opt2.init(params)
    for _ in range(5):
        _, s2 = opt2.update(_nan_grads(), s2, params)
    assert not bool(s2.gave_up) and int(s2.notfinite_count) == 5


def test_vmap_over_replicas_selects_per_replica():
    # Each replica must still skip or apply on its own (the decision is a select per replica).
    inner = optax.sgd(0.1, momentum=0.9)
    opt = fault_aware(inner)
    params = _params()
    grads = jax.tree.map(lambda a, b: jnp.stack([a, b]), _grads(1.0), _nan_grads())
    state = jax.vmap(opt.init)(jax.tree.map(lambda x: jnp.stack([x, x]), params))
    u, s = jax.vmap(lambda g, st: opt.update(g, st, params))(grads, state)
    u_ref, _ = inner.update(_grads(1.0), inner.init(params), params)
    assert _tree_applied(jax.tree.map(lambda x: x[0], u), u_ref)
    assert all(bool(jnp.all(x[1] == 0)) for x in jax.tree.leaves(u))
    np.testing.assert_array_equal(s.last_skip_reason, [SKIP_NONE, SKIP_NONFINITE])


def test_extra_args_are_forwarded_and_report_is_not():
    seen = {}

    def inner_update(updates, state, params=None, *, scale=1.0, **extra):
        seen.update(extra, scale=scale)
        return jax.tree.map(lambda g: g * scale, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
    opt = fault_aware(inner)
    params = _params()
    u, _ = opt.update(_grads(1.0), opt.init(params), params, report=CLEAN, scale=3.0)
    assert "report" not in seen and seen["scale"] == 3.0
    assert _tree_equal(u, jax.tree.map(lambda g: g * 3.0, _grads(1.0)))


def test_argument_validation():
    with pytest.raises(ValueError, match=r"max_consecutive_skips must be >= 0 or None; got -1"):
        fault_aware(optax.sgd(0.1), max_consecutive_skips=-1)
    with pytest.raises(TypeError, match=r"max_consecutive_skips must be an int"):
        fault_aware(optax.sgd(0.1), max_consecutive_skips=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"policy must be a pimlayers.faults.FaultPolicy"):
        fault_aware(optax.sgd(0.1), policy="correct")  # type: ignore[arg-type]
    opt = fault_aware(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"report must be a FaultReport or None; got dict"):
        opt.update(_grads(1.0), opt.init(_params()), report={"link_failures": 1})


def test_refresh_after_update_encodes_the_written_params():
    def encode(p):  # A stand-in checksum: per-leaf sum, as a parity/checksum encoder would compute.
        return jax.tree.map(lambda x: jnp.sum(x, axis=-1), p)

    params, updates = _params(), _grads(0.1)
    new, enc = jax.jit(refresh_after_update, static_argnums=2)(params, updates, encode)
    want = optax.apply_updates(params, updates)
    assert _tree_equal(new, jax.jit(optax.apply_updates)(params, updates))
    np.testing.assert_allclose(enc["w"], jnp.sum(want["w"], axis=-1), rtol=1e-6)  # Fused vs eager sum.
    assert _tree_equal(enc, jax.jit(encode)(new))  # Encoded from exactly the params returned.
    # Zero updates (a skipped step) leave params, and so their encoding, unchanged.
    same, enc0 = refresh_after_update(params, jax.tree.map(jnp.zeros_like, updates), encode)
    assert _tree_equal(same, params) and _tree_equal(enc0, encode(params))


def test_the_skip_is_a_select_not_a_branch():
    # On a GPU a branch's predicate is read on the host, and this one depends on the whole backward
    # pass: a cond here made the host wait inside every training step. Skipping must stay a select,
    # and still leave the inner state bit-identical (checked above).
    from helpers import host_control_flow

    opt = fault_aware(optax.sgd(0.1, momentum=0.9))
    params = _params()
    state = opt.init(params)
    jaxpr = jax.make_jaxpr(lambda g, s: opt.update(g, s, params, report=LOST))(_grads(1.0), state)
    assert host_control_flow(jaxpr) == {"cond": 0, "while": 0}
    u, s = jax.jit(lambda g, s: opt.update(g, s, params, report=LOST))(_grads(1.0), state)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u))
    assert _tree_equal(s.inner_state, state.inner_state) and int(s.total_skipped) == 1
