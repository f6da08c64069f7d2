"""PimStore and the banked GEMV on the GPU: CuPy writes in place behind XLA's back, repair rebuilds
bit-exactly in the same buffers, CuPy buffers are adopted without a copy (skipped without CUDA)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_GEOMETRY

import pimlayers as pl
from pimlayers import faults, ops
from pimlayers.memory import PimStore, adopt

pytestmark = pytest.mark.gpu

GEO = SMALL_GEOMETRY


@pytest.fixture(scope="module")
def gpu():
    assert pl.native_info()["cuda"].loaded, pl.native_info()["cuda"].reason
    return jax.devices("cuda")[0]


def _params(gpu, rng):
    return {
        "w": jax.device_put(jnp.asarray(rng.standard_normal((256, 96)), jnp.bfloat16), gpu),
        "b": jax.device_put(jnp.asarray(rng.standard_normal((1000,)), jnp.float32), gpu),
        "q": jax.device_put(jnp.asarray(rng.integers(-128, 128, (77, 13)), jnp.int8), gpu),
    }


def test_flips_through_cupy_are_found_and_repaired_in_place(gpu):
    rng = np.random.default_rng(0)
    params = _params(gpu, rng)
    clean = [np.asarray(x).copy() for x in jax.tree.leaves(params)]
    store = PimStore(params, GEO)
    state = store.encode(params)
    ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)]
    out = store.repair(params, state)  # compile on the clean path
    params, state = out.params, out.state
    store.scrub(params, state)
    with jax.no_tracing():
        for seed in range(5):
            flips = faults.random_bit_flips(store, params, 12, seed=seed)
            found = store.scrub(params, state)
            assert int(found.report.banks_faulty) == len({(f.leaf, f.byte // 256) for f in flips})
            out = store.repair(params, state)
            params, state = out.params, out.state
            assert int(out.report.banks_uncorrectable) == 0
        faults.fail_bank(store, params, state, 6)
        out = store.repair(params, state)
    assert int(out.report.banks_uncorrectable) == 0 and int(out.report.banks_repaired) > 0
    for a, b in zip(jax.tree.leaves(out.params), clean, strict=True):
        assert np.asarray(a).tobytes() == b.tobytes()
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(out.params)] == ptrs


def test_cupy_buffers_are_adopted_without_a_copy(gpu):
    cp = pytest.importorskip("cupy")
    a = cp.arange(4096, dtype=cp.float32)
    tree, copied = adopt({"a": a})
    assert copied == [] and tree["a"].unsafe_buffer_pointer() == a.data.ptr
    a[0] = 7.0
    cp.cuda.runtime.deviceSynchronize()
    assert float(tree["a"][0]) == 7.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "t, k, n, banks", [(1, 4096, 1000, 16), (3, 37, 50, 8), (5, 136, 256, 4), (9, 1, 3, 2)]
)
def test_pim_gemv_cuda_matches_reference(gpu, dtype, t, k, n, banks):
    rng = np.random.default_rng(k + n)
    x = jax.device_put(jnp.asarray(rng.standard_normal((t, k)), dtype), gpu)
    packed = jax.device_put(ops.pim_pack(jnp.asarray(rng.standard_normal((k, n)), dtype), banks), gpu)
    ok = jax.device_put(jnp.ones((banks,), jnp.int32).at[1].set(0), gpu)
    y_n, c_n = jax.jit(lambda *a: ops.pim_gemv(*a, impl="native"))(x, packed.w, packed.wsum, ok)
    y_r, c_r = jax.jit(lambda *a: ops.pim_gemv(*a, impl="reference"))(x, packed.w, packed.wsum, ok)
    scale = float(jnp.max(jnp.abs(c_r))) + 1.0
    np.testing.assert_allclose(y_n, y_r, atol=4e-6 * scale * max(k, 8) ** 0.5)
    np.testing.assert_allclose(c_n, c_r, atol=4e-6 * scale * max(k, 8) ** 0.5)
    _y, rep = jax.jit(lambda x, p, o: ops.pim_linear(x, p, o))(x, packed, ok)
    assert int(rep.gemm_corrected) == 1
