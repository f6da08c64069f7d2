"""The "pim" Dense backend: banked GEMV (native vs reference), a failed bank's slice rebuilt from the
checksum bank, two failed banks reported, the NNX and Equinox layers, and the timing model."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pimlayers import ops
from pimlayers.equinox import Linear as EqxLinear
from pimlayers.flax import nnx as pnnx
from pimlayers.memory import AQUABOLT_XL, PimTiming

HI = jax.lax.Precision.HIGHEST
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _ref(x, w):
    return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HI)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "t, k, n, banks", [(1, 64, 100, 4), (3, 37, 50, 8), (5, 128, 256, 16), (9, 1, 3, 2), (2, 130, 17, 5)]
)
def test_native_gemv_matches_reference(dtype, t, k, n, banks):
    rng = np.random.default_rng(t * 1000 + k)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    packed = ops.pim_pack(jnp.asarray(rng.standard_normal((k, n)), dtype), banks)
    ok = jnp.ones((banks,), jnp.int32).at[banks // 2].set(0)
    y_n, c_n = ops.pim_gemv(x, packed.w, packed.wsum, ok, impl="native")
    y_r, c_r = ops.pim_gemv(x, packed.w, packed.wsum, ok, impl="reference")
    scale = float(jnp.max(jnp.abs(c_r))) + 1.0
    np.testing.assert_allclose(y_n, y_r, atol=4e-6 * scale * max(k, 8) ** 0.5)
    np.testing.assert_allclose(c_n, c_r, atol=4e-6 * scale * max(k, 8) ** 0.5)
    assert float(jnp.max(jnp.abs(y_n[:, banks // 2]))) == 0.0  # the failed bank was not read


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_failed_bank_is_rebuilt_two_are_reported(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 96)), dtype)
    w = jnp.asarray(rng.standard_normal((96, 200)), dtype)
    packed = ops.pim_pack(w, 8)
    ref = _ref(x, w)
    tol = TOL[dtype] * float(jnp.max(jnp.abs(ref)))
    y, rep = ops.pim_linear(x, packed)
    assert y.dtype == dtype and y.shape == (3, 200)
    np.testing.assert_allclose(y.astype(jnp.float32), ref, atol=tol)
    assert rep.to_dict()["gemm_detected"] == 0
    for b in range(8):
        ok = jnp.ones((8,), jnp.int32).at[b].set(0)
        y, rep = ops.pim_linear(x, packed, ok)
        np.testing.assert_allclose(y.astype(jnp.float32), ref, atol=tol)  # rebuilt slice included
        assert (int(rep.gemm_detected), int(rep.gemm_corrected), int(rep.gemm_uncorrectable)) == (1, 1, 0)
    ok = jnp.ones((8,), jnp.int32).at[2].set(0).at[5].set(0)
    y, rep = ops.pim_linear(x, packed, ok)
    assert int(rep.gemm_uncorrectable) == 1 and int(rep.gemm_corrected) == 0
    rows = 25  # 200 outputs over 8 banks
    assert float(jnp.max(jnp.abs(y[:, 2 * rows : 3 * rows]))) == 0.0  # not invented


def test_bank_health_is_data_no_recompile():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    packed = ops.pim_pack(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32), 4)
    f = jax.jit(lambda x, ok: ops.pim_linear(x, packed, ok))
    full = f(x, jnp.ones((4,), jnp.int32))[0]
    masks = [jnp.ones((4,), jnp.int32).at[b].set(0) for b in range(4)]  # built before: .at traces
    with jax.no_tracing():
        for ok in masks:
            y, rep = f(x, ok)
            np.testing.assert_allclose(y, full, atol=1e-4)
            assert int(rep.gemm_corrected) == 1


def test_bad_inputs_give_clear_errors():
    w = jnp.zeros((8, 12), jnp.float32)
    packed = ops.pim_pack(w, 4)
    with pytest.raises(ValueError, match="banks=1"):
        ops.pim_pack(w, 1)
    with pytest.raises(ValueError, match=r"expected \(in, out\)"):
        ops.pim_pack(jnp.zeros((2, 3, 4)), 2)
    with pytest.raises(TypeError, match="int32"):
        ops.pim_pack(jnp.zeros((2, 3), jnp.int32), 2)
    with pytest.raises(ValueError, match="takes 8"):
        ops.pim_linear(jnp.zeros((1, 9)), packed)
    with pytest.raises(TypeError, match="x's dtype"):
        ops.pim_gemv(jnp.zeros((1, 8), jnp.bfloat16), packed.w, packed.wsum, jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="bank_ok"):
        ops.pim_gemv(jnp.zeros((1, 8)), packed.w, packed.wsum, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="backend='gpu'"):
        pnnx.Linear(8, 12, backend="gpu", rngs=nnx.Rngs(0))


def test_nnx_linear_pim_backend_matches_stock_and_reports():
    rngs = nnx.Rngs(0)
    layer = pnnx.Linear(48, 80, backend="pim", pim_banks=8, rngs=rngs)
    stock = nnx.Linear(48, 80, rngs=nnx.Rngs(1))
    stock.kernel.set_value(layer.kernel[...])
    stock.bias.set_value(jnp.linspace(-1, 1, 80, dtype=jnp.float32))
    layer.bias.set_value(stock.bias[...])
    x = jax.random.normal(jax.random.key(2), (2, 3, 48))
    with jax.default_matmul_precision("highest"):
        want = stock(x)
    np.testing.assert_allclose(layer(x), want, atol=1e-5)
    layer.bank_ok.set_value(jnp.ones((8,), jnp.int32).at[3].set(0))
    np.testing.assert_allclose(layer(x), want, atol=1e-5)
    assert int(pnnx.fault_report(layer).gemm_corrected) == 1
    # Encode on write: after the kernel changes, repack() refreshes the packed copy.
    layer.kernel.set_value(layer.kernel[...] * 2)
    layer.repack()
    stock.kernel.set_value(layer.kernel[...])
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(layer(x), stock(x), atol=2e-5)


def test_equinox_linear_pim_backend_under_vmap():
    layer = EqxLinear(24, 40, key=jax.random.key(0), backend="pim", pim_banks=4)
    stock = eqx.nn.Linear(24, 40, key=jax.random.key(0))
    stock = eqx.tree_at(lambda m: (m.weight, m.bias), stock, (layer.weight, layer.bias))
    x = jax.random.normal(jax.random.key(1), (6, 24))
    with jax.default_matmul_precision("highest"):
        want = jax.vmap(stock)(x)
    np.testing.assert_allclose(jax.vmap(layer)(x), want, atol=1e-5)
    broken = eqx.tree_at(lambda m: m.bank_ok, layer, jnp.ones((4,), jnp.int32).at[0].set(0))
    y, rep = jax.vmap(broken.with_report)(x)
    np.testing.assert_allclose(y, want, atol=1e-5)
    assert int(jnp.sum(rep.gemm_corrected)) == 6
    doubled = eqx.tree_at(lambda m: m.weight, layer, layer.weight * 2).repack()
    np.testing.assert_allclose(jax.vmap(doubled)(x), 2 * want - stock.bias[None, :], atol=3e-5)


def test_timing_model_reproduces_the_published_peak():
    assert AQUABOLT_XL.peak_flops == pytest.approx(1.2288e12)  # "1.2 TFLOPS" per cube (ISSCC 2021)
    six = PimTiming(cubes=6)
    assert six.peak_flops == pytest.approx(6 * 1.2288e12)
    one = six.gemv_seconds(4096, 14336, tokens=1)
    assert one["compute"] == pytest.approx(2 * 4096 * 14336 / six.peak_flops)
    assert one["total"] > one["compute"] > one["broadcast"] > 0
    eight = six.gemv_seconds(4096, 14336, tokens=8)
    assert eight["compute"] == pytest.approx(8 * one["compute"])  # weights re-streamed per token
