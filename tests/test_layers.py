"""Drop-in layers against the stock Flax NNX / Linen / Equinox layers with the same weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import TraceCounter, all_gathers

import pimlayers as pl
from pimlayers import layers as L
from pimlayers.equinox import Linear as EqxLinear
from pimlayers.equinox import RMSNorm as EqxRMSNorm
from pimlayers.faults import GemmFaults
from pimlayers.flax import linen as plinen
from pimlayers.flax import nnx as pnnx

OFF = pl.FaultPolicy.off()
CHECKED = [pl.FaultPolicy(mode="detect"), pl.FaultPolicy(mode="correct")]
# Protected GEMMs accumulate in f32 and round once; the stock bf16 dot may round differently: one
# bf16 ulp (2^-8 relative) of the output's scale. f32: both are f32 dots of the same terms.
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    # On GPUs the stock layers' f32 matmuls default to TF32 (10-bit mantissa) while protected GEMMs
    # run f32 at HIGHEST; compare like with like.
    with jax.default_matmul_precision("highest"):
        yield


def _x(shape, dtype=jnp.float32, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _close(a, b, dtype):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(float(np.max(np.abs(b))), 1e-30)
    assert float(np.max(np.abs(a - b))) <= TOL[dtype] * scale, (float(np.max(np.abs(a - b))), scale)


# ---------------------------------------------------------------- Linear / Dense


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_linear_matches_stock(dtype):
    stock = nnx.Linear(24, 40, param_dtype=dtype, rngs=nnx.Rngs(0))
    x = _x((3, 5, 24), dtype)
    off = pnnx.Linear(24, 40, param_dtype=dtype, policy=OFF, rngs=nnx.Rngs(0))
    assert np.array_equal(off.kernel[...], stock.kernel[...]) and np.array_equal(
        off.bias[...], stock.bias[...]
    )
    assert np.array_equal(np.asarray(off(x), np.float32), np.asarray(stock(x), np.float32))  # bit-identical
    for policy in CHECKED:
        ours = pnnx.Linear(24, 40, param_dtype=dtype, policy=policy, rngs=nnx.Rngs(0))
        _close(ours(x), stock(x), dtype)
        assert pnnx.fault_report(ours).to_dict()["gemm_checked"] == 1
        # Gradients jitted: eager, each backward op compiles on its own (the forward above is eager).
        g0 = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x).astype(jnp.float32)))))(stock)
        g1 = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x).astype(jnp.float32)))))(ours)
        _close(g1["kernel"][...], g0["kernel"][...], dtype)
        _close(g1["bias"][...], g0["bias"][...], dtype)


def test_nnx_linear_multiplies_by_the_kernel_as_pinned(cpu_mesh):
    """``kernel_sharding``: the kernel (split over its outputs here, as FSDP splits a wide one) is
    pinned whole where it is multiplied, so each device checks its own rows: the program gathers
    the kernel and nothing of x or the product, with the stock layer's outputs and gradients."""
    n_dev = cpu_mesh.size
    stock = nnx.Linear(24, 8 * n_dev, rngs=nnx.Rngs(0))
    ours = pnnx.Linear(24, 8 * n_dev, policy=pl.FaultPolicy(block_n=8), rngs=nnx.Rngs(0))
    split = jax.sharding.NamedSharding(cpu_mesh, jax.sharding.PartitionSpec(None, "d"))
    ours.kernel.set_value(jax.device_put(ours.kernel[...], split))
    rows = jax.sharding.NamedSharding(cpu_mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(_x((4 * n_dev, 24)), rows)
    whole = jax.sharding.NamedSharding(cpu_mesh, jax.sharding.PartitionSpec())
    loss = lambda m, x, **kw: jnp.sum(jnp.sin(m(x, **kw)))
    f = nnx.jit(nnx.value_and_grad(lambda m, x: loss(m, x, kernel_sharding=whole)))
    (v, g), (v0, g0) = f(ours, x), nnx.jit(nnx.value_and_grad(loss))(stock, x)
    _close(v, v0, jnp.float32)
    _close(g["kernel"][...], g0["kernel"][...], jnp.float32)
    hlo = f.lower(ours, x).compile().as_text()
    gathered = [t for t, _ in all_gathers(hlo)]
    assert gathered and all(t == f"f32[24,{8 * n_dev}]" for t in gathered), gathered


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_dense_matches_stock(dtype):
    x = _x((4, 24), dtype)
    params = nn.Dense(40, param_dtype=dtype).init(jax.random.key(0), x)
    stock = nn.Dense(40, param_dtype=dtype).apply(params, x)
    ours_params = plinen.Dense(40, param_dtype=dtype).init(jax.random.key(0), x)
    assert jax.tree.structure(ours_params["params"]) == jax.tree.structure(params["params"])
    assert np.array_equal(ours_params["params"]["kernel"], params["params"]["kernel"])
    off = plinen.Dense(40, param_dtype=dtype, policy=OFF).apply(params, x)
    assert np.array_equal(np.asarray(off, np.float32), np.asarray(stock, np.float32))
    y, state = plinen.Dense(40, param_dtype=dtype).apply(params, x, mutable=["fault_report"])
    _close(y, stock, dtype)
    assert plinen.fault_report(state).to_dict()["gemm_checked"] == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equinox_linear_matches_stock(dtype):
    stock = eqx.nn.Linear(24, 40, dtype=dtype, key=jax.random.key(0))
    off = EqxLinear(24, 40, dtype=dtype, key=jax.random.key(0), policy=OFF)
    ours = EqxLinear(24, 40, dtype=dtype, key=jax.random.key(0))
    x = _x((24,), dtype)
    assert np.array_equal(off.weight, stock.weight) and np.array_equal(off.bias, stock.bias)
    assert np.array_equal(np.asarray(off(x), np.float32), np.asarray(stock(x), np.float32))
    _close(ours(x), stock(x), dtype)
    xb = _x((6, 24), dtype)
    _close(jax.vmap(ours)(xb), jax.vmap(stock)(xb), dtype)
    loss = lambda m: jnp.sum(jnp.sin(jax.vmap(m)(xb).astype(jnp.float32)))
    g0 = eqx.filter_jit(eqx.filter_grad(loss))(stock)  # jitted: eager, each backward op compiles alone
    g1 = eqx.filter_jit(eqx.filter_grad(loss))(ours)
    _close(g1.weight, g0.weight, dtype)
    _close(g1.bias, g0.bias, dtype)


def test_same_weights_same_outputs_in_nnx_linen_and_equinox():
    """TestLinenConsistency's pattern: one set of weights loaded into every front end."""
    kernel, bias, x = _x((24, 40), seed=2), _x((40,), seed=3), _x((5, 24), seed=4)
    m = pnnx.Linear(24, 40, rngs=nnx.Rngs(0))
    m.kernel[...], m.bias[...] = kernel, bias
    y_nnx = m(x)
    y_linen = plinen.Dense(40).apply({"params": {"kernel": kernel, "bias": bias}}, x)
    e = eqx.tree_at(lambda t: (t.weight, t.bias), EqxLinear(24, 40, key=jax.random.key(0)), (kernel.T, bias))
    y_eqx = jax.vmap(e)(x)
    np.testing.assert_array_equal(y_nnx, y_linen)
    np.testing.assert_allclose(y_eqx, y_nnx, rtol=0, atol=1e-6)  # same GEMM; x @ (w^T)^T may re-layout


def test_jit_vmap_grad_and_named_sharding_over_8_devices(cpu_mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = pnnx.Linear(16, 64, rngs=nnx.Rngs(0))
    x = _x((8, 16))
    ref = m(x)
    state = nnx.state(m)
    sharded = jax.tree.map(
        lambda a: jax.device_put(
            a, NamedSharding(cpu_mesh, P(None, "d") if a.ndim == 2 and a.shape[1] == 64 else P())
        ),
        state,
    )
    nnx.update(m, sharded)
    assert m.kernel[...].sharding.spec == P(None, "d")
    y = nnx.jit(lambda mod, a: mod(a))(m, jax.device_put(x, NamedSharding(cpu_mesh, P("d"))))
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    assert pnnx.fault_report(m).to_dict()["gemm_checked"] == 1
    graphdef, params = nnx.split(m)
    yv = jax.vmap(lambda st, a: nnx.merge(graphdef, st)(a), in_axes=(None, 0))(params, x[:, None, :])
    np.testing.assert_allclose(yv[:, 0], ref, rtol=1e-6, atol=1e-6)
    g = nnx.grad(lambda mod: jnp.sum(mod(x) ** 2))(m)
    np.testing.assert_allclose(g["bias"][...], 2 * jnp.sum(ref, 0), rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_layer_and_the_shapes():
    m = pnnx.Linear(16, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"pimlayers.flax.nnx.Linear.*\(4, 12\).*\(\.\.\., 16\)"):
        m(jnp.ones((4, 12)))
    with pytest.raises(TypeError, match=r"pimlayers.flax.nnx.Linear.*floating"):
        m(jnp.ones((4, 16), jnp.int32))
    e = EqxLinear(16, 8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"pimlayers.equinox.Linear.*\(4, 16\).*jax.vmap"):
        e(jnp.ones((4, 16)))
    with pytest.raises(ValueError, match=r"pimlayers.flax.linen.Dense.*\(2, 3\)"):
        plinen.Dense(8).apply(
            {"params": {"kernel": jnp.ones((16, 8)), "bias": jnp.ones(8)}}, jnp.ones((2, 3))
        )
    with pytest.raises(ValueError, match=r"pimlayers.flax.nnx.Attention.*num_kv_heads"):
        pnnx.Attention(64, 8, 3, rngs=nnx.Rngs(0))


def test_injected_faults_are_corrected_without_recompiling():
    m = pnnx.Linear(32, 48, rngs=nnx.Rngs(0))
    x = _x((16, 32))
    clean = m(x)
    body = TraceCounter(lambda mod, a: mod(a))
    f = nnx.jit(body)
    for seed in range(4):
        rate = 1.0 if seed % 2 == 0 else 0.0
        pnnx.inject(m, GemmFaults.random(jax.random.key(seed), (16, 48), 3, rate, bit=30))
        y = f(m, x)
        np.testing.assert_allclose(y, clean, rtol=1e-5, atol=1e-5)
        d = pnnx.fault_report(m).to_dict()
        assert d["gemm_detected"] == (1 if rate else 0) and d["gemm_uncorrectable"] == 0
        if rate:
            assert d["gemm_corrected"] >= 1
    assert body.count == 1


def test_backward_faults_are_reported_through_fault_tap():
    m = pnnx.LlamaMLP(16, 40, rngs=nnx.Rngs(0))
    x = _x((6, 16))
    hit = (GemmFaults.none(), GemmFaults.random(jax.random.key(5), (6, 16), 2, 1.0, bit=30), None)
    pnnx.inject(m, {"down": hit})
    diff = nnx.DiffState(0, (nnx.Param, pnnx.FaultTap))
    g = nnx.jit(nnx.grad(lambda mod: jnp.sum(jnp.sin(mod(x))), argnums=diff))(m)
    back = pnnx.backward_report(g).to_dict()
    assert back["gemm_checked"] == 6 and back["gemm_detected"] == 1 and back["gemm_uncorrectable"] == 0
    pnnx.inject(m, None)
    g0 = nnx.jit(nnx.grad(lambda mod: jnp.sum(jnp.sin(mod(x)))))(m)
    np.testing.assert_allclose(
        g["gate_proj"]["kernel"][...], g0["gate_proj"]["kernel"][...], rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------- RMSNorm, MLP


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_bit_identical_when_off_and_gated_when_on(dtype):
    x = _x((3, 32), dtype) * 3
    stock = nnx.RMSNorm(32, param_dtype=dtype, rngs=nnx.Rngs(0))
    off = pnnx.RMSNorm(32, param_dtype=dtype, policy=OFF, rngs=nnx.Rngs(0))
    with jax.numpy_dtype_promotion("standard"):  # the stock norms mix bf16 and f32 implicitly
        p = nn.RMSNorm(param_dtype=dtype).init(jax.random.key(0), x)
        want_nnx, want_linen = stock(x), nn.RMSNorm(param_dtype=dtype).apply(p, x)
    assert np.array_equal(np.asarray(off(x), np.float32), np.asarray(want_nnx, np.float32))
    assert np.array_equal(
        np.asarray(plinen.RMSNorm(param_dtype=dtype, policy=OFF).apply(p, x), np.float32),
        np.asarray(want_linen, np.float32),
    )
    e0, e1 = eqx.nn.RMSNorm(32, dtype=dtype), EqxRMSNorm(32, dtype=dtype, policy=OFF)
    assert np.array_equal(np.asarray(jax.vmap(e1)(x), np.float32), np.asarray(jax.vmap(e0)(x), np.float32))
    on = pnnx.RMSNorm(32, param_dtype=dtype, rngs=nnx.Rngs(0))
    # An Inf input: its row's mean square is Inf, so the others scale to 0 and the Inf to Inf*0 = NaN.
    y = on(x.at[1, 3].set(jnp.inf))
    assert np.isfinite(np.asarray(y, np.float32)).all() and float(y[1, 3]) == 0.0
    assert pnnx.fault_report(on).to_dict()["nonfinite_gated"] == 1


# The gate with a limit no finite output of these cases reaches: its own mask, from the output.
GENERAL = pl.FaultPolicy(gate_limit=3e38)


def _norm_case(style, dtype, seed=3):
    """Rows that exercise the gate: plain, an Inf, a NaN, squares past f32's range (f32 only), zeros."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(6, 40)).astype(np.float32) * 3
    x[1, 3] = np.inf
    x[2, 7] = np.nan
    x[3] = 1e20 if dtype == jnp.float32 else x[3]  # Σx² overflows f32: the row scales by 0
    x[4] = 0.0
    x[5, 9] = -np.inf
    scale = jnp.asarray(1 + 0.2 * rng.normal(size=40), dtype)
    return jnp.asarray(x, dtype), scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("style", ["flax", "equinox", "llama"])
def test_rms_norm_gate_gradient_mask_from_the_input_matches_the_outputs(style, dtype):
    """The gated norm's masks come from x, the scale and the row's statistic
    (``layers.norm._columns_ok``: no second pass over x in a rematerialised backward, no select
    reading y again in the forward), not from its output; on rows with an Inf, a NaN, squares past
    f32's range and zeros, values, counts and the gradients of x and the scale are bit for bit
    those of the gate's own mask (a limit past every finite output: the general path)."""
    x, scale = _norm_case(style, dtype)
    cot = jnp.asarray(np.random.default_rng(4).normal(size=x.shape), dtype)

    def run(policy):
        def f(x, scale):
            norm = lambda r: L.rms_norm(r, scale, eps=1e-5, style=style, policy=policy)
            y, rep = jax.vmap(norm)(x) if style == "equinox" else norm(x)  # equinox's: one vector
            gated = jnp.sum(rep.nonfinite_gated)
            return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)), (y, gated)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, scale)

    (_, (y_fast, n_fast)), g_fast = run(pl.FaultPolicy())
    (_, (y_gen, n_gen)), g_gen = run(GENERAL)
    assert int(n_fast) == int(n_gen) > 0
    assert np.asarray(y_fast).tobytes() == np.asarray(y_gen).tobytes()
    assert np.isfinite(np.asarray(y_fast, np.float32)).all()
    for a, b in zip(g_fast, g_gen, strict=True):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), equal_nan=True)
    # The input gradient is finite on the rows without an Inf or NaN (their gradient is NaN either
    # way: the norm's backward multiplies by the row's statistic).
    finite_rows = [bool(np.isfinite(r).all()) for r in np.asarray(g_fast[0], np.float32)]
    assert finite_rows == [True, False, False, True, True, False]


def test_rms_norm_gate_with_a_bias_keeps_the_outputs_mask():
    """An equinox norm with a bias keeps the gate's own mask (a bias's gradient sums the cotangents
    alone, so the input's mask would let a NaN row's finite columns through): the NaN row gives the
    bias no gradient, which is the bias gradient of the other rows alone."""
    x, scale = _norm_case("equinox", jnp.float32)
    bias = jnp.asarray(0.1 * np.random.default_rng(5).normal(size=40), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(4).normal(size=x.shape), jnp.float32)

    def db(rows):
        norm = lambda r, b: L.rms_norm(r, scale, b, eps=1e-5, style="equinox")[0]
        f = lambda b: jnp.sum(jax.vmap(norm, in_axes=(0, None))(x[rows], b) * cot[rows])
        return np.asarray(jax.grad(f)(bias))

    everything, without_nan_row = db(np.arange(6)), db(np.asarray([0, 1, 3, 4, 5]))
    np.testing.assert_allclose(everything, without_nan_row, rtol=1e-6, atol=1e-6)


def test_rms_norm_gate_mask_blocks_a_scale_column_past_its_range():
    """A scale entry so large that |s|·sqrt(E) passes half of f32's range (a corrupted parameter)
    passes no gradient in its column, even on rows whose value stayed finite; the other columns and
    the forward are the general path's."""
    x, scale = _norm_case("llama", jnp.float32)
    x = x[jnp.asarray([0, 4])]  # finite rows
    scale = scale.at[5].set(1e38)

    def grads(policy):
        norm = lambda s: L.rms_norm(x, s, eps=1e-5, style="llama", policy=policy)[0]
        return jax.grad(lambda s: jnp.sum(norm(s)))(scale), norm(scale)

    ds, y = grads(pl.FaultPolicy())
    ds_g, y_g = grads(GENERAL)
    assert np.asarray(y).tobytes() == np.asarray(y_g).tobytes()
    assert np.isfinite(np.asarray(y)[:, 5]).all()  # kept by the gate: no value overflowed
    assert float(ds[5]) == 0.0 and np.isfinite(np.asarray(ds_g[5]))
    others = np.arange(40) != 5
    np.testing.assert_allclose(np.asarray(ds)[others], np.asarray(ds_g)[others], rtol=0, atol=0)


@pytest.mark.parametrize("style", ["flax", "equinox", "llama"])
def test_rms_norm_gate_forward_exact_where_a_scale_column_overflows(style):
    """A scale entry large enough that its column's outputs overflow on some rows (Inf, or 0·Inf):
    there the forward's mask falls back to the outputs' own (isfinite(y)), so values and counts are
    the general path's bit for bit and the overflowed values are gated."""
    x, scale = _norm_case(style, jnp.float32)
    scale = scale.at[5].set(3e38)

    def run(policy):
        norm = lambda r: L.rms_norm(r, scale, eps=1e-5, style=style, policy=policy)
        y, rep = jax.vmap(norm)(x) if style == "equinox" else norm(x)
        return np.asarray(y), int(jnp.sum(rep.nonfinite_gated))

    (y, n), (y_g, n_g) = run(pl.FaultPolicy()), run(GENERAL)
    assert y.tobytes() == y_g.tobytes() and n == n_g
    ungated, _ = run(pl.FaultPolicy(gate=False))
    overflowed = ~np.isfinite(ungated[:, 5]) & np.isfinite(np.asarray(x)[:, 5])
    assert overflowed.any() and (y[overflowed, 5] == 0).all()


def test_llama_mlp_matches_swiglu_reference():
    m = pnnx.LlamaMLP(16, 40, rngs=nnx.Rngs(0))
    x = _x((2, 5, 16))
    hi = jax.lax.Precision.HIGHEST
    ref = jnp.matmul(
        jax.nn.silu(jnp.matmul(x, m.gate_proj.kernel[...], precision=hi))
        * jnp.matmul(x, m.up_proj.kernel[...], precision=hi),
        m.down_proj.kernel[...],
        precision=hi,
    )
    np.testing.assert_allclose(m(x), ref, rtol=1e-5, atol=1e-6)
    assert pnnx.fault_report(m).to_dict()["gemm_checked"] == 3


# ---------------------------------------------------------------- RoPE and attention


def _hf_llama3_inv_freq(dim, theta, scaling):
    """Hugging Face's _compute_llama3_parameters, written out per frequency (an independent twin)."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / theta ** (i / dim)
        if scaling is not None:
            lo = scaling.original_max_position / scaling.low_freq_factor
            hi = scaling.original_max_position / scaling.high_freq_factor
            wl = 2 * np.pi / f
            if wl > lo:
                f = f / scaling.factor
            elif wl >= hi:
                s = (scaling.original_max_position / wl - scaling.low_freq_factor) / (
                    scaling.high_freq_factor - scaling.low_freq_factor
                )
                f = (1 - s) * f / scaling.factor + s * f
        out.append(f)
    return np.array(out)


def test_rope_frequencies_are_llama3s():
    f = L.rope_frequencies(128, 500000.0)
    assert (
        f[0] == 1.0
        and np.isclose(f[1], 500000.0 ** (-2 / 128))
        and np.isclose(f[-1], 500000.0 ** (-126 / 128))
    )
    np.testing.assert_allclose(f, _hf_llama3_inv_freq(128, 500000.0, None), rtol=1e-12)
    s = L.Llama31Scaling()
    np.testing.assert_allclose(
        L.rope_frequencies(128, 500000.0, s), _hf_llama3_inv_freq(128, 500000.0, s), rtol=1e-12
    )
    assert not np.allclose(L.rope_frequencies(128, 500000.0, s), f)  # the scaling does act


def test_rope_is_a_rotation_by_relative_position():
    d = 64
    inv = L.rope_frequencies(d, 500000.0)
    q, k = _x((1, 1, 1, d), seed=7), _x((1, 1, 1, d), seed=8)

    def dot(m, n):
        a = L.apply_rope(q, jnp.full((1, 1), m, jnp.int32), inv)
        b = L.apply_rope(k, jnp.full((1, 1), n, jnp.int32), inv)
        return float(jnp.sum(a * b))

    np.testing.assert_allclose(
        np.linalg.norm(L.apply_rope(q, jnp.full((1, 1), 37, jnp.int32), inv)), np.linalg.norm(q), rtol=1e-6
    )
    np.testing.assert_allclose(dot(10, 3), dot(107, 100), rtol=1e-4)  # depends on m - n only
    # The complex form: pairs (i, i + D/2) as z = a + ib are multiplied by exp(i m f).
    m = 5
    z = np.asarray(q[0, 0, 0, : d // 2]) + 1j * np.asarray(q[0, 0, 0, d // 2 :])
    z = z * np.exp(1j * m * inv)
    want = np.concatenate([z.real, z.imag])
    got = np.asarray(L.apply_rope(q, jnp.full((1, 1), m, jnp.int32), inv))[0, 0, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", [OFF, pl.FaultPolicy()])
def test_attention_matches_dot_product_attention_reference(policy):
    e, h, kv, hd = 64, 8, 2, 8
    m = pnnx.Attention(e, h, kv, policy=policy, rngs=nnx.Rngs(0))
    x = _x((2, 9, e))
    hi = jax.lax.Precision.HIGHEST
    inv = L.rope_frequencies(hd, 500000.0)
    pos = np.arange(9)

    def rope(t):  # the complex form, independently of apply_rope
        t = np.asarray(t, np.float64)
        z = (t[..., : hd // 2] + 1j * t[..., hd // 2 :]) * np.exp(1j * pos[None, :, None, None] * inv)
        return jnp.asarray(np.concatenate([z.real, z.imag], -1), jnp.float32)

    q = rope(jnp.matmul(x, m.q_proj.kernel[...], precision=hi).reshape(2, 9, h, hd))
    k = rope(jnp.matmul(x, m.k_proj.kernel[...], precision=hi).reshape(2, 9, kv, hd))
    v = jnp.matmul(x, m.v_proj.kernel[...], precision=hi).reshape(2, 9, kv, hd)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    ref = jnp.matmul(o.reshape(2, 9, h * hd), m.o_proj.kernel[...], precision=hi)
    np.testing.assert_allclose(m(x), ref, rtol=1e-4, atol=1e-5)


def test_kv_cache_decoding_equals_full_attention_and_never_recompiles():
    m = pnnx.Attention(32, 4, 2, rngs=nnx.Rngs(0))
    x = _x((2, 7, 32))
    full = m(x)
    cache = L.KVCache.init(2, 16, 2, 8)
    body = TraceCounter(lambda mod, a, c: mod(a, cache=c))
    step = nnx.jit(body)
    y, cache = nnx.jit(lambda mod, a, c: mod(a, cache=c))(m, x[:, :3], cache)  # prefill 3 tokens
    outs = [y]
    for t in range(3, 7):
        y, cache = step(m, x[:, t : t + 1], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert int(cache.index) == 7 and body.count == 1


def test_equinox_and_linen_attention_equal_nnx_with_the_same_weights():
    from pimlayers.equinox import Attention as EqxAttention

    m = pnnx.Attention(32, 4, 2, rngs=nnx.Rngs(0))
    x = _x((2, 5, 32))
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    params = {n: {"kernel": getattr(m, n).kernel[...]} for n in names}
    # Jitted: the point is equal outputs (eager use is covered above), and eager each op compiles alone.
    y_linen = jax.jit(plinen.Attention(32, 4, 2).apply)({"params": params}, x)
    e = EqxAttention(32, 4, 2, key=jax.random.key(0))
    e = eqx.tree_at(
        lambda t: [getattr(t, n).weight for n in names], e, [params[n]["kernel"].T for n in names]
    )
    y_nnx = nnx.jit(lambda mod, a: mod(a))(m, x)
    np.testing.assert_allclose(y_linen, y_nnx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        eqx.filter_jit(lambda mod, a: jax.vmap(mod)(a))(e, x), y_nnx, rtol=1e-5, atol=1e-6
    )


def test_attention_core_faults_in_scores_and_values_are_corrected():
    q, k, v = _x((2, 6, 4, 8), seed=1), _x((2, 6, 2, 8), seed=2), _x((2, 6, 2, 8), seed=3)
    clean, _ = L.attention_core(q, k, v)
    faults = {
        "scores": GemmFaults.random(jax.random.key(1), (2 * 2 * 2 * 6, 6), 3, 1.0, bit=29),
        "pv": GemmFaults.random(jax.random.key(2), (2 * 2 * 2 * 6, 8), 3, 1.0, bit=29),
    }
    out, r = L.attention_core(q, k, v, faults=faults)
    np.testing.assert_allclose(out, clean, rtol=1e-5, atol=1e-6)
    d = r.to_dict()
    assert d["gemm_checked"] == 8 and d["gemm_detected"] >= 2 and d["gemm_uncorrectable"] == 0


def test_without_location_the_layers_recompute_what_they_detect():
    # FaultPolicy(locate=False) through a drop-in layer and the attention core (materialised here):
    # the same clean outputs, every detection recomputed rather than corrected in place.
    pol = pl.FaultPolicy(locate=False)
    m = pnnx.Linear(32, 48, policy=pol, rngs=nnx.Rngs(0))
    x = _x((16, 32))
    clean = m(x)
    pnnx.inject(m, GemmFaults.random(jax.random.key(0), (16, 48), 3, 1.0, bit=30))
    np.testing.assert_allclose(nnx.jit(lambda mod, a: mod(a))(m, x), clean, rtol=1e-5, atol=1e-5)
    d = pnnx.fault_report(m).to_dict()
    assert d["gemm_detected"] == 1 and d["gemm_recomputed"] == 1 and d["gemm_uncorrectable"] == 0
    q, k, v = _x((2, 6, 4, 8), seed=1), _x((2, 6, 2, 8), seed=2), _x((2, 6, 2, 8), seed=3)
    faults = {"scores": GemmFaults.random(jax.random.key(1), (2 * 2 * 2 * 6, 6), 3, 1.0, bit=29)}
    out, r = L.attention_core(q, k, v, faults=faults, policy=pol)
    np.testing.assert_allclose(out, L.attention_core(q, k, v, policy=pol)[0], rtol=1e-5, atol=1e-6)
    d = r.to_dict()
    assert d["gemm_detected"] >= 1 and d["gemm_recomputed"] >= 1 and d["gemm_uncorrectable"] == 0


# ---------------------------------------------------------------- protect()


class _StockBlock(nnx.Module):
    """A transformer block written only with stock Flax NNX layers."""

    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=rngs)
        self.mlp = nnx.List([nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)])

    def __call__(self, x):
        h = x + self.attn(self.norm(x), mask=nnx.make_causal_mask(x[..., 0]))
        return h + self.mlp[1](jax.nn.gelu(self.mlp[0](h)))


def test_protect_nnx_block_keeps_outputs_and_corrects_faults():
    m = _StockBlock(nnx.Rngs(0))
    x = _x((2, 6, 32))
    before = m(x)
    kernel = m.mlp[0].kernel
    pl.protect(m)
    assert isinstance(m.mlp[0], pnnx.Linear) and m.mlp[0].kernel is kernel  # weights kept, not copied
    assert isinstance(m.attn.query, pnnx.LinearGeneral) and isinstance(m.norm, pnnx.RMSNorm)
    f = nnx.jit(lambda mod, a: mod(a))
    np.testing.assert_allclose(f(m, x), before, rtol=1e-5, atol=1e-5)
    assert pnnx.fault_report(m).to_dict()["gemm_checked"] == 4 + 2 + 2 * 4 * 2
    pnnx.inject(m.mlp[0], GemmFaults.random(jax.random.key(3), (12, 64), 2, 1.0, bit=30))
    pnnx.inject(
        m.attn.attention_fn, {"scores": GemmFaults.random(jax.random.key(4), (48, 6), 2, 1.0, bit=30)}
    )
    np.testing.assert_allclose(f(m, x), before, rtol=1e-5, atol=1e-5)
    d = pnnx.fault_report(m).to_dict()
    assert d["gemm_detected"] >= 2 and d["gemm_corrected"] >= 2 and d["gemm_uncorrectable"] == 0


class _StockEqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.RMSNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(4, 32, key=k1)
        self.norm = eqx.nn.RMSNorm(32)
        self.mlp = eqx.nn.MLP(32, 32, 64, 1, key=k2)

    def __call__(self, x):
        h = x + self.attn(x, x, x, mask=jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool)))
        return h + jax.vmap(self.mlp)(jax.vmap(self.norm)(h))


def test_protect_equinox_block_keeps_outputs_and_corrects_faults():
    m = _StockEqxBlock(jax.random.key(0))
    x = _x((6, 32))
    before = m(x)
    p = pl.protect(m)
    assert isinstance(p.mlp.layers[0], EqxLinear) and p.mlp.layers[0].weight is m.mlp.layers[0].weight
    assert isinstance(p.attn.query_proj, EqxLinear) and isinstance(p.norm, EqxRMSNorm)
    np.testing.assert_allclose(eqx.filter_jit(lambda mod, a: mod(a))(p, x), before, rtol=1e-5, atol=1e-5)
    hit = GemmFaults.random(jax.random.key(3), (1, 64), 1, 1.0, bit=30)
    p2 = eqx.tree_at(lambda t: t.mlp.layers[0].faults, p, hit, is_leaf=lambda v: v is None)
    np.testing.assert_allclose(eqx.filter_jit(lambda mod, a: mod(a))(p2, x), before, rtol=1e-5, atol=1e-5)
    y, r = p2.mlp.layers[0].with_report(jax.vmap(p2.norm)(x)[0])
    assert r.to_dict()["gemm_detected"] == 1 and r.to_dict()["gemm_corrected"] == 1
    l0 = p2.mlp.layers[0]
    detect = EqxLinear(32, 64, key=jax.random.key(0), policy=pl.FaultPolicy(mode="detect", gate=False))
    detect = eqx.tree_at(
        lambda t: (t.weight, t.bias, t.faults), detect, (l0.weight, l0.bias, hit), is_leaf=lambda v: v is None
    )
    assert not np.allclose(detect(jax.vmap(p2.norm)(x)[0]), y)  # the injected fault was real


def test_failing_groups_are_one_reduction_per_shape_and_count_nan_as_failing():
    # The attention's report: which (batch, KV head) group of each checked GEMM had a row past its
    # bound (ratio > 1) or NaN. The backward's seven ratio rows come in two shapes (the dq kernel's
    # per query head, the dk/dv kernel's per KV head): two reductions, each GEMM's answer its own.
    from helpers import jaxpr_eqns

    from pimlayers.layers.attention import _failing

    b, h, kvh, t = 2, 4, 2, 16
    rng = np.random.default_rng(0)
    rows = [rng.uniform(0, 0.9, (b, h, t)).astype(np.float32) for _ in range(3)]
    rows += [rng.uniform(0, 0.9, (b, kvh, t)).astype(np.float32) for _ in range(4)]
    rows[1][1, 3, 5] = 1.5  # batch 1, query head 3: KV group 1
    rows[4][0, 0, 2] = np.nan
    rows[6][1, 1, 15] = 1.0 + 2**-20
    got = np.asarray(_failing([jnp.asarray(r) for r in rows], b, kvh))
    want = np.zeros((7, b, kvh), bool)
    want[1, 1, 1] = want[4, 0, 0] = want[6, 1, 1] = True
    np.testing.assert_array_equal(got, want)
    jaxpr = jax.make_jaxpr(lambda *r: _failing(list(r), b, kvh))(*rows).jaxpr
    assert sum(e.primitive.name == "reduce_or" for e, _ in jaxpr_eqns(jaxpr)) == 2


@pytest.mark.parametrize("flash", [False, True])
def test_attention_core_inside_shard_map(cpu_mesh, flash):
    """The batch split over a mesh: inside shard_map the attention core (materialised, or the flash
    kernels' references with their rerun loop) runs under JAX's varying-axes checks, a fault on one
    device's batch is corrected and counted once by the psum'd report, and the gradient, with the
    checks on and off, is the unsplit core's."""
    from jax.sharding import PartitionSpec as P

    n = cpu_mesh.devices.size
    t, d = (128, 64) if flash else (6, 8)
    dt = jnp.bfloat16 if flash else jnp.float32  # the flash kernels' checksums are bf16
    q, k, v = (_x((n, t, h, d), dt, seed=i) for i, h in ((1, 2), (2, 1), (3, 1)))
    sites = (1 * 1 * 2 * t, t)  # one device's scores GEMMs: (batch, KV head, group, rows), keys

    def local(q, k, v, fire):
        f = GemmFaults.random(jax.random.key(1), sites, 1, 1.0, bit=29)
        f = f._replace(active=f.active & (fire[0] > 0))
        out, r = L.attention_core(q, k, v, faults={"scores": f}, flash=flash)
        return out, jax.lax.psum(r.gemm_detected, "d"), jax.lax.psum(r.gemm_uncorrectable, "d")

    fire = jnp.zeros((n,), jnp.int32).at[n - 1].set(1)
    spec = P("d")
    sm = jax.shard_map(local, mesh=cpu_mesh, in_specs=(spec,) * 4, out_specs=(spec, P(), P()))
    out, detected, unco = jax.jit(sm)(q, k, v, fire)
    clean, _ = L.attention_core(q, k, v, flash=flash)
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
    assert (int(detected), int(unco)) == (1, 0)

    unsplit = lambda *a: jnp.sum(jnp.sin(L.attention_core(*a, flash=flash)[0].astype(jnp.float32)))
    want = jax.grad(unsplit, argnums=(0, 1, 2))(q, k, v)
    for check_vma in (True, False):
        loss = jax.shard_map(
            lambda q, k, v: jax.lax.psum(
                jnp.sum(jnp.sin(L.attention_core(q, k, v, flash=flash)[0].astype(jnp.float32))), "d"
            ),
            mesh=cpu_mesh,
            in_specs=(spec,) * 3,
            out_specs=P(),
            check_vma=check_vma,
        )
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(got, want, strict=True):  # each device's batch is its own: the same values
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6
            )
