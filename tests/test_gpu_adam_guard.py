"""adamw_guard_many's CUDA kernel against its reference on the GPU (skipped without a CUDA device).

The kernel rounds every operation on its own (IEEE float32, no FMA; the divisions by a scalar as
products by its reciprocal): it must equal NumPy's float32 arithmetic in the same order bit for
bit (ops._adam_guard._update_numpy). XLA's reference on the GPU rounds otherwise (it contracts
multiply-adds and divides by a scalar as a product by its reciprocal: with clipping the two differed
by up to 2^18 ulps of a result that cancels, on an H100): within 16 float32 epsilons of the
magnitudes each result sums (ops._adam_guard._misfit). Each side's protection data must be exactly
bank_guard_many of the parameters it returned. A skipped step is exact (p + 0, moments kept), as are
the float32 and bfloat16 reads of one gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adam_hyper, adam_leaves

import pimlayers as pl
from pimlayers import ops
from pimlayers.ops._adam_guard import _misfit, _update_numpy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    assert pl.native_info()["cuda"].loaded, pl.native_info()["cuda"].reason
    return jax.devices("cuda")[0]


def _run(impl, leaves, h, bank_bytes, group):
    f = jax.jit(lambda *a: ops.adamw_guard_many(*a, h, bank_bytes=bank_bytes, group=group, impl=impl))
    return f(*[[jnp.copy(x) for x in t] for t in leaves])


@pytest.mark.parametrize("gdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("trigger", [0.0, 1.0])
@pytest.mark.parametrize(("bank_bytes", "group"), [(4096, 8), (512, 3), (16, 1)])
def test_kernel_matches_reference(gpu, gdtype, trigger, bank_bytes, group):
    leaves = adam_leaves(gpu, 1, gdtype)
    h = adam_hyper(trigger)
    p, m, v, guards = _run("native", leaves, h, bank_bytes, group)
    rp, rm, rv, rguards = _run("reference", leaves, h, bank_bytes, group)
    for i, leaf in enumerate(zip(*leaves, strict=True)):
        for got, want in zip((p[i], m[i], v[i]), _update_numpy(*leaf, h), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        misfit = _misfit((p[i], m[i], v[i]), (rp[i], rm[i], rv[i]), *leaf, h)
        assert not np.any(np.asarray(misfit)), misfit
    own = ops.bank_guard_many(list(p), bank_bytes=bank_bytes, group=group, impl="reference")
    for got, want in zip(guards, own, strict=True):
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    rown = ops.bank_guard_many(list(rp), bank_bytes=bank_bytes, group=group)
    for got, want in zip(rguards, rown, strict=True):
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(p, leaves[0], strict=True))


def test_skipped_step_is_exact(gpu):
    leaves = adam_leaves(gpu, 2, jnp.bfloat16)
    leaves[1][0] = leaves[1][0].at[0, 0].set(jnp.nan)  # the reason a step is skipped
    p, m, v, _ = _run("native", leaves, adam_hyper(skip=1.0), 4096, 8)
    for got, want in zip((*p, *m, *v), (*leaves[0], *leaves[2], *leaves[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bfloat16_gradient_is_its_float32_widening(gpu):
    p, g, m, v = adam_leaves(gpu, 3, jnp.bfloat16)
    a = _run("native", (p, g, m, v), adam_hyper(), 4096, 8)
    b = _run("native", (p, [x.astype(jnp.float32) for x in g], m, v), adam_hyper(), 4096, 8)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_in_place_when_donated(gpu):
    """The parameters and moments are aliased to the results: a donated step writes over them."""
    p, g, m, v = adam_leaves(gpu, 4, jnp.bfloat16)
    h = adam_hyper()
    want = _run("native", (p, g, m, v), h, 4096, 8)
    step = lambda p, g, m, v: ops.adamw_guard_many(p, g, m, v, h, impl="native")
    f = jax.jit(step, donate_argnums=(0, 2, 3))
    ptrs = [x.unsafe_buffer_pointer() for x in p]
    got = f(p, g, m, v)
    assert [x.unsafe_buffer_pointer() for x in got[0]] == ptrs
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _is_adam(x):
    import optax

    return isinstance(x, optax.ScaleByAdamState)


def _store_step_against_optax(dev):
    """A masked, clipped AdamW step through PimStore.adamw_update (the kernel on a GPU) against
    optax's step then the store's encode: no misfit (ops._adam_guard._misfit), the protection data that of
    the returned parameters."""
    import optax

    from pimlayers.memory import BankGeometry, PimStore
    from pimlayers.ops._adam_guard import AdamHyper
    from pimlayers.optim import adamw_guarded

    rng = np.random.default_rng(5)
    params = {n: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32), dev)
              for n, s in (("w", (256, 384)), ("b", (1000,)), ("s", (3,)))}  # fmt: skip
    grads = jax.tree.map(lambda p: (0.3 * jnp.sin(5.0 * p)).astype(jnp.bfloat16), params)
    opt = adamw_guarded(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 5), weight_decay=0.1, clip=1.0,
        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
    )  # fmt: skip
    store = PimStore(params, BankGeometry())
    state = opt.init(params)
    wide = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    for _ in range(2):  # the second step from the first's moments
        u, ref_state = jax.jit(opt.update)(wide, state, params)
        ref = optax.apply_updates(params, u)
        h = opt.hyper(grads, state)[0]
        new, new_state, pim = jax.jit(lambda p, s, g: opt.update_and_guard(g, s, p, store))(
            jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), grads
        )
        adam = lambda s: next(x for x in jax.tree.leaves(s, is_leaf=_is_adam) if _is_adam(x))
        for k in params:
            decayed = params[k].ndim >= 2
            hk = h if decayed else AdamHyper(*h)._replace(wd=jnp.float32(0))
            got = (new[k], adam(new_state).mu[k], adam(new_state).nu[k])
            want = (ref[k], adam(ref_state).mu[k], adam(ref_state).nu[k])
            misfit = _misfit(got, want, params[k], grads[k], adam(state).mu[k], adam(state).nu[k], hk)
            assert not np.any(np.asarray(misfit)), (k, misfit)
        for x, y in zip(jax.tree.leaves(pim), jax.tree.leaves(store.encode(new)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert int(adam(new_state).count) == int(adam(ref_state).count)
        params, state = new, new_state


def test_store_step_with_a_mask_against_optax(gpu):
    with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix Python floats and int32 steps
        _store_step_against_optax(gpu)
