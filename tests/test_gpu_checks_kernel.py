"""The one-read checks kernel's Triton build on a GPU (skipped elsewhere): exact against XLA on
integer data, equal to the XLA checks at Llama-3-8B shapes, and inside protected_matmul when asked
for (``PIMLAYERS_CHECKS_KERNEL=1``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_checks_kernel import _weights, _x

from benchmarks.matmul import _same_checks
from pimlayers import ops
from pimlayers.faults import GemmFaults
from pimlayers.ops import _abft, _checks_kernel
from pimlayers.ops._checks_kernel import checks_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if jax.devices()[0].platform != "gpu":
        pytest.skip("the checks kernel's Triton build needs a CUDA GPU")


@pytest.mark.parametrize(
    ("g", "r", "k", "wc", "wm", "a_t"), [(1, 300, 200, 48, 8, False), (2, 129, 65, 288, 48, True)]
)
def test_the_kernel_multiplies_exactly_what_xla_does_on_the_gpu(cuda, g, r, k, wc, wm, a_t):
    ks = jax.random.split(jax.random.key(3), 3)
    ints = lambda key, shape: jax.random.randint(key, shape, -8, 9).astype(jnp.bfloat16)
    x = ints(ks[0], (g, k, r) if a_t else (g, r, k))
    pc = ints(ks[1], (g, k, _checks_kernel._padded(wc)))
    pm = ints(ks[2], (g, k, _checks_kernel._padded(wm)))
    got_c, got_m = _checks_kernel._call(x, pc, pm, a_t=a_t)
    xr = jnp.swapaxes(x, 1, 2) if a_t else x
    np.testing.assert_array_equal(
        np.asarray(got_c), np.asarray(jnp.matmul(xr, pc, preferred_element_type=jnp.float32))
    )
    np.testing.assert_array_equal(
        np.asarray(got_m), np.asarray(jnp.matmul(jnp.abs(xr), pm, preferred_element_type=jnp.float32))
    )


@pytest.mark.parametrize(("k", "n"), [(4096, 1024), (4096, 4096), (14336, 4096)])
def test_the_kernel_is_the_xla_checks_at_llama_shapes(cuda, k, n):
    enc = _weights((), k, n, 128)
    x = _x((8192, k))
    c_terms, mag_terms, scale = _abft._check_terms(k, 8.0)
    want_c, want_mag = jax.jit(
        lambda v, s, a: _abft._checks_reference(v, _abft.WeightChecksums(s, a), False, 8.0)
    )(x, enc.sums, enc.abs_sums)
    got_c, got_mag = jax.jit(lambda v, s, a: checks_kernel(v, s, a * scale, c_terms, mag_terms))(
        x, enc.sums, enc.abs_sums
    )
    _same_checks(f"{k}->{n}", (want_c, want_mag), (got_c, got_mag), x, enc)


def test_asked_for_a_protected_gemm_checks_on_it_and_corrects_a_fault(cuda, monkeypatch):
    kx, kw = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (8192, 4096)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (4096, 1024)) / 64).astype(jnp.bfloat16)
    enc = ops.abft_encode(w, 128)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    fault = GemmFaults(i32([100]), i32([7]), i32([30]), jnp.ones((1,), bool))  # an exponent bit

    def run():
        f = jax.jit(lambda a, b, e, fl: ops.protected_matmul(a, b, e, faults=fl))
        return f.lower(x, w, enc, fault).as_text(), f(x, w, enc, fault)

    text0, (y0, r0) = run()
    monkeypatch.setenv("PIMLAYERS_CHECKS_KERNEL", "1")
    text1, (y1, r1) = run()
    assert 'name = "pimlayers_checks_kernel"' in text1 and "pimlayers_checks_kernel" not in text0
    for r in (r0, r1):
        d = r.to_dict()
        assert d["gemm_detected"] == 1 and d["gemm_uncorrectable"] == 0, d
    np.testing.assert_array_equal(np.asarray(y0, np.float32), np.asarray(y1, np.float32))
