"""adamw_guard_many and adamw_guarded: AdamW's step with the encode fused into its write.

On a CPU the op is its reference (the update in XLA, then bank_guard_many), and the fused step
must be optax's step followed by the store's encode: parameters and moments to the last bit or
within an ulp (where XLA contracts a multiply-add in one program and not the other), counters
exactly, and protection data exactly that of the parameters the step returns; clipped or not,
skipped or not, with a schedule or a constant rate, with a weight-decay mask or without. A skipped
step and a clean one run one program. Bad input is refused with the argument named. The CUDA
kernel is compared with this reference in tests/test_gpu_adam_guard.py; its program, lowered for
CUDA here, is one call that updates every leaf in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pimlayers import ops
from pimlayers.faults import FaultReport
from pimlayers.memory import BankGeometry, PimStore
from pimlayers.optim import SKIP_NONE, SKIP_NONFINITE, SKIP_UNCORRECTABLE, adamw_guarded


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's schedules and bias corrections mix Python floats with int32 counts.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    # A leaf of whole parity groups, one of a partial group and ragged last bank, one of 3 values.
    return {
        "w": jax.random.normal(k[0], (64, 256)),
        "b": jax.random.normal(k[1], (1000,)),
        "s": jax.random.normal(k[2], (3,)),
    }


def _grads(params, scale):
    return jax.tree.map(lambda p: scale * jnp.sin(3.0 * p) + 0.01, params)


def _same(a, b, exact=False):
    """Equal trees: integers exactly, floats to the last bit or (``exact=False``) within an ulp.

    XLA may contract a multiply and an add into an FMA in one program and not in another (under the
    suite's CPU flags it does so differently in the two steps' ``wd * p`` term): 1 ulp apart."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if exact or not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_array_max_ulp(x, y, maxulp=1)


def _steps(opt, store, params, grads_fn, n, report_fn=None):
    """n steps unfused and fused from the same start; every result of each step compared."""
    state = opt.init(params)

    def unfused(p, s, g, r):
        u, s2 = opt.update(g, s, p, report=r)
        p2 = optax.apply_updates(p, u)
        return p2, s2, store.encode(p2)

    def fused(p, s, g, r):
        return opt.update_and_guard(g, s, p, store, report=r)

    fa, fb = jax.jit(unfused), jax.jit(fused)
    reasons, programs = [], []
    for i in range(n):
        g = grads_fn(i)
        r = report_fn(i) if report_fn else FaultReport.zeros()
        a = fa(params, state, g, r)
        b = fb(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), g, r)
        _same(a[:2], b[:2])
        _same(b[2], store.encode(b[0]), exact=True)  # the fused guard is its own result's encode
        params, state = a[0], a[1]
        reasons.append(int(state.last_skip_reason))
        programs.append(fb._cache_size())
    return params, state, reasons, programs


@pytest.mark.parametrize("clip", [None, 0.5, 1e6])
def test_fused_step_is_optax_then_encode(clip):
    params = _params()
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 8, 1e-3)
    opt = adamw_guarded(sched, weight_decay=0.1, clip=clip)
    store = PimStore(params, BankGeometry())
    p, state, reasons, _ = _steps(opt, store, params, lambda i: _grads(params, 0.1 * (i + 1)), 5)
    assert reasons == [SKIP_NONE] * 5
    assert int(state.inner_state[-1][0].count if clip else state.inner_state[0].count) == 5
    assert not np.array_equal(np.asarray(p["w"]), np.asarray(params["w"]))  # it moved


def test_skipped_steps_keep_everything_and_compile_once():
    params = _params(1)
    opt = adamw_guarded(1e-2, weight_decay=0.01, clip=1.0)  # a constant rate: no schedule state
    store = PimStore(params, BankGeometry())

    def grads(i):
        g = _grads(params, 0.2)
        return jax.tree.map(lambda x: x.at[0].set(jnp.nan), g) if i == 1 else g

    def report(i):  # an uncorrectable fault on step 3
        return FaultReport(gemm_uncorrectable=jnp.int32(i == 3))

    _, state, reasons, programs = _steps(opt, store, params, grads, 5, report)
    assert reasons == [SKIP_NONE, SKIP_NONFINITE, SKIP_NONE, SKIP_UNCORRECTABLE, SKIP_NONE]
    assert int(state.total_skipped) == 2 and int(state.total_steps) == 5
    assert int(state.inner_state[1][0].count) == 3  # Adam's count: the applied steps only
    # The skip is data: steps 1 to 4 (skipped, applied, skipped, applied) run one program (step 0's
    # arguments, made before any step, are placed differently).
    assert programs[1] == programs[4]


@pytest.mark.parametrize("kind", ["callable", "tree"])
def test_weight_decay_mask_decays_only_the_leaves_it_selects(kind):
    """optax's ``mask``: matrices decayed, vectors not (a callable of the params or a pytree of
    bools); the store runs the two sets as two calls, the undecayed with wd = 0."""
    params = _params(4)
    rule = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    mask = rule if kind == "callable" else rule(params)
    opt = adamw_guarded(1e-2, weight_decay=0.5, mask=mask, clip=1.0)
    store = PimStore(params, BankGeometry())
    _steps(opt, store, params, lambda i: _grads(params, 0.1), 3)
    # The mask matters: without it the vectors decay too and come out elsewhere.
    state = opt.init(params)
    g = _grads(params, 0.1)
    masked = jax.jit(lambda p, s: opt.update_and_guard(g, s, p, store))(params, state)[0]
    every = adamw_guarded(1e-2, weight_decay=0.5, clip=1.0)
    plain = jax.jit(lambda p, s: every.update_and_guard(g, s, p, store))(params, every.init(params))[0]
    assert np.array_equal(np.asarray(masked["w"]), np.asarray(plain["w"]))
    assert not np.array_equal(np.asarray(masked["b"]), np.asarray(plain["b"]))
    with pytest.raises(TypeError, match=r"decay for \['b'\] is .*Array.*; expected a Python bool"):
        store.adamw_update(params, g, params, params, opt.hyper(g, state)[0],
                           decay=jax.tree.map(jnp.asarray, rule(params)))  # fmt: skip


def test_bfloat16_gradients_are_widened_exactly():
    params = _params(2)
    opt = adamw_guarded(optax.constant_schedule(3e-3), clip=1.0)
    store = PimStore(params, BankGeometry())
    g16 = jax.tree.map(lambda g: g.astype(jnp.bfloat16), _grads(params, 0.3))
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), g16)
    state = opt.init(params)
    step = jax.jit(lambda p, s, g: opt.update_and_guard(g, s, p, store))
    _same(step(params, state, g16), step(params, state, g32), exact=True)  # one program's arithmetic


def test_op_guards_are_those_of_the_parameters_it_returns():
    params = list(_params(3).values())
    grads = [jnp.cos(p) for p in params]
    mu = [0.1 * p for p in params]
    nu = [0.01 * p * p for p in params]
    h = ops.AdamHyper(
        *(jnp.float32(v) for v in (0, 2.0, 1.0, 0.9, 0.1, 0.999, 0.001, 0.1, 0.001, 1e-8, 0, 0.1, -1e-3, 0))
    )
    p2, m2, v2, guards = ops.adamw_guard_many(params, grads, mu, nu, h, bank_bytes=512, group=4)
    want = ops.bank_guard_many(list(p2), bank_bytes=512, group=4)
    for g, w in zip(guards, want, strict=True):
        for x, y in zip(g, w, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Clipped by norm 2 to max 1: g / 2; m' = 0.1 g~ + 0.9 m, the rest follows in float32.
    gg = grads[0] / 2.0
    np.testing.assert_allclose(np.asarray(m2[0]), np.asarray(0.1 * gg + 0.9 * mu[0]), rtol=1e-6)
    assert all(x.dtype == jnp.float32 for x in (*p2, *m2, *v2))


def test_bad_input_is_refused_with_the_argument_named():
    p = [jnp.zeros((8, 4))]
    h = ops.AdamHyper(*(jnp.float32(0) for _ in ops.AdamHyper._fields))
    with pytest.raises(TypeError, match="grads is 2 arrays; expected a list of 1"):
        ops.adamw_guard_many(p, [p[0], p[0]], p, p, h)
    with pytest.raises(ValueError, match=r"mu\[0\] has shape \(4, 8\); expected params\[0\]'s \(8, 4\)"):
        ops.adamw_guard_many(p, p, [jnp.zeros((4, 8))], p, h)
    with pytest.raises(TypeError, match=r"nu\[0\] is bfloat16; expected float32"):
        ops.adamw_guard_many(p, p, p, [p[0].astype(jnp.bfloat16)], h)
    with pytest.raises(TypeError, match=r"grads\[0\] is int32; expected float32 or bfloat16"):
        ops.adamw_guard_many(p, [p[0].astype(jnp.int32)], p, p, h)
    with pytest.raises(TypeError, match="hyper is a tuple; expected an AdamHyper"):
        ops.adamw_guard_many(p, p, p, p, tuple(h))
    with pytest.raises(ValueError, match="the native kernel takes banks of at most 4096"):
        ops.adamw_guard_many(p, p, p, p, h, bank_bytes=8192, impl="native")
    with pytest.raises(ValueError, match=r"b2=1\.0; expected 0 <= b2 < 1"):
        adamw_guarded(1e-3, b2=1.0)
    with pytest.raises(ValueError, match="clip=0; expected a positive global norm"):
        adamw_guarded(1e-3, clip=0)
    store = PimStore({"a": jnp.zeros((8,), jnp.bfloat16)}, BankGeometry())
    with pytest.raises(TypeError, match=r"leaves \['a'\] are not float32"):
        store.adamw_update({"a": jnp.zeros((8,), jnp.bfloat16)}, {"a": p[0]}, {"a": p[0]}, {"a": p[0]}, h)


@pytest.mark.parametrize("gdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("trigger", "skip"), [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)])
def test_native_cpu_handler_is_the_kernels_arithmetic(gdtype, trigger, skip):
    """``impl="native"`` on a CPU (the default there is the reference): the CUDA kernel's arithmetic
    (``_update_numpy``) bit for bit, ragged leaves included, guarded from the values it writes; XLA's
    reference within 16 float32 epsilons of the magnitudes each value sums."""
    from helpers import adam_hyper, adam_leaves

    from pimlayers.ops._adam_guard import _misfit, _update_numpy

    leaves = adam_leaves(jax.devices("cpu")[0], 7, gdtype)
    h = adam_hyper(trigger, skip)
    run = lambda impl: jax.jit(lambda *a: ops.adamw_guard_many(*a, h, bank_bytes=512, group=3, impl=impl))(
        *[[jnp.copy(x) for x in t] for t in leaves]
    )
    p, m, v, guards = run("native")
    rp, rm, rv, _ = run("reference")
    for i, leaf in enumerate(zip(*leaves, strict=True)):
        for got, want in zip((p[i], m[i], v[i]), _update_numpy(*leaf, h), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        misfit = _misfit((p[i], m[i], v[i]), (rp[i], rm[i], rv[i]), *leaf, h)
        assert not np.any(np.asarray(misfit)), misfit
    own = ops.bank_guard_many(list(p), bank_bytes=512, group=3)
    _same(guards, own, exact=True)


def test_native_handler_returns_errors():
    """Operands the wrapper would never pass: the handler answers with an error, it does not abort."""
    from helpers import adam_hyper

    x = jnp.ones((100,), jnp.float32)
    packed = adam_hyper().pack()
    sd = jax.ShapeDtypeStruct
    outs = (sd((100,), jnp.float32),) * 3 + (
        sd((7, 2), jnp.uint32),
        sd((4, 64), jnp.uint8),
        sd((4, 2), jnp.uint32),
    )
    call = jax.ffi.ffi_call("pimlayers_adamw_guard_many", outs)
    kw = dict(bank_bytes=np.int64(64), group=np.int64(2))
    jax.block_until_ready(call(x, x, x, x, packed, **kw))  # well formed: runs
    with pytest.raises(
        Exception,
        match=r"adamw_guard_many: g of leaf 0 is int32\(100,\); expected float32 or bfloat16\(100,\)",
    ):
        jax.block_until_ready(call(x, x.astype(jnp.int32), x, x, packed, **kw))
    with pytest.raises(
        Exception, match=r"adamw_guard_many: m of leaf 0 is float32\(99,\); expected float32\(100,\)"
    ):
        jax.block_until_ready(call(x, x, x[:99], x, packed, **kw))
    with pytest.raises(
        Exception,
        match=r"adamw_guard_many: the scalars of array 1 is float32\(13,\); expected float32\(14,\)",
    ):
        jax.block_until_ready(call(x, x, x, x, packed[:13], **kw))
    with pytest.raises(Exception, match=r"adamw_guard_many: 6 operands; expected 4 per leaf"):
        jax.block_until_ready(call(x, x, x, x, packed, packed, **kw))
    short = jax.ffi.ffi_call("pimlayers_adamw_guard_many", outs[:5])
    with pytest.raises(Exception, match=r"adamw_guard_many: 1 leaves and 5 results; expected 6 per leaf"):
        jax.block_until_ready(short(x, x, x, x, packed, **kw))
    with pytest.raises(
        Exception, match=r"adamw_guard_many: sums of array 0 is uint32\(7, 2\); expected uint32\(9, 2\)"
    ):
        jax.block_until_ready(call(x, x, x, x, packed, bank_bytes=np.int64(48), group=np.int64(2)))


def test_the_gpu_program_is_one_call_that_updates_in_place(monkeypatch):
    """Lowered for CUDA here (no GPU needed), in a process that has a GPU with the kernel (faked):
    the training step's update is one custom call for every leaf, with each leaf's p, m and v
    aliased to its outputs (written in place, no second 3.5 GB per array at Llama-3-8B scale) and
    none of XLA's update arithmetic left in the program; lowered for the CPU it is XLA's reference."""
    from helpers import adam_hyper, adam_leaves

    from pimlayers.ops import _dispatch

    monkeypatch.setattr(_dispatch, "present_platforms", lambda: frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(_dispatch, "has_native", lambda platform: True)
    leaves = adam_leaves(jax.devices("cpu")[0], 7, jnp.bfloat16)
    n = len(leaves[0])
    h = adam_hyper(0.0, 0.0)
    fn = jax.jit(lambda p, g, m, v: ops.adamw_guard_many(p, g, m, v, h), donate_argnums=(0, 2, 3))
    gpu = fn.trace(*leaves).lower(lowering_platforms=("cuda",)).as_text()
    assert gpu.count("@pimlayers_adamw_guard_many") == 1
    # p, m, v of each leaf: three operand-to-result aliases a leaf.
    assert gpu.count("#stablehlo.output_operand_alias<") == 3 * n
    assert "stablehlo.sqrt" not in gpu and "stablehlo.divide" not in gpu
    cpu = fn.trace(*leaves).lower(lowering_platforms=("cpu",)).as_text()
    assert "pimlayers_adamw_guard_many" not in cpu and "stablehlo.sqrt" in cpu
