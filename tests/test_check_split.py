"""The check GEMMs cut along K (``_abft._split_dot(split=...)``, which the checks suite times against
the uncut GEMMs): the same checks up to the order of f32 accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.matmul import _same_checks
from pimlayers import ops
from pimlayers.ops import _abft
from pimlayers.ops._abft import WeightChecksums


def _weights(g, k, n, seed=0):
    w = jax.random.normal(jax.random.key(seed), (*g, k, n)) / np.sqrt(k)
    if not g:
        return ops.abft_encode(w, 128)
    encs = [ops.abft_encode(w[i], 128) for i in range(g[0])]
    return WeightChecksums(jnp.stack([e.sums for e in encs]), jnp.stack([e.abs_sums for e in encs]))


def _x(shape, seed=1):
    x = jax.random.normal(jax.random.key(seed), shape)
    return x.at[..., 3].multiply(40.0).astype(jnp.bfloat16)  # an outlier feature, as LLM activations have


@pytest.mark.parametrize("split", [2, 8])
@pytest.mark.parametrize(
    ("x_shape", "g", "k", "n", "transposed"),
    [
        ((64, 512), (), 512, 384, False),  # one weight
        ((2, 48, 512), (2,), 512, 256, False),  # a weight per leading index
        ((3, 48, 512), (), 512, 256, False),  # x's leading axes broadcast against one weight
        ((2, 512, 40), (2,), 512, 256, True),  # the weight gradients' checks: contracted over x's rows
    ],
)
@pytest.mark.parametrize("weighted", [True, False])
def test_split_checks_are_the_checks(x_shape, g, k, n, transposed, split, weighted):
    enc = _weights(g, k, n)
    x = _x(x_shape)
    want = _abft._checks_reference(x, enc, transposed, 8.0, weighted)
    got = jax.jit(lambda v: _abft._checks_reference(v, enc, transposed, 8.0, weighted, split))(x)
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
    # Each slice's products are the unsplit GEMM's (exact bf16 products in f32), added in another
    # order: within the f32 accumulation's tolerance of each sum's magnitude.
    _same_checks(f"split={split}", want, got, x, enc, transposed)
    # The comparison can fail: one check off by 2^-10 of its value is caught.
    off = (got[0].at[(0,) * got[0].ndim].multiply(1 + 2.0**-10), got[1])
    with pytest.raises(AssertionError, match="differs"):
        _same_checks("perturbed", want, off, x, enc, transposed)


def test_a_split_checks_a_gemm_as_the_uncut_checks_do():
    # A clean bf16 GEMM passes the split checks; a wrong value is flagged in its block alone, as the
    # uncut checks flag it.
    k, n = 2048, 256
    w = (jax.random.normal(jax.random.key(0), (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    enc = ops.abft_encode(w, 128)
    x = _x((32, k))
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    uncut = _abft._checks_reference(x, enc, False, 8.0)
    cut = _abft._checks_reference(x, enc, False, 8.0, True, 4)
    for err in (0.0, 0.25, 4.0):
        bad = y.at[5, 130].add(err)
        flags = [np.asarray(ops.abft_check(bad, c, mag, k=k, block_n=128)[1]) for c, mag in (uncut, cut)]
        np.testing.assert_array_equal(flags[0], flags[1])
        assert np.count_nonzero(flags[1]) == (err != 0) and (err == 0 or flags[1][5, 1] != 0)


def test_the_split_must_divide_k():
    enc = _weights((), 100, 128)
    with pytest.raises(ValueError, match="split=8 does not divide K = 100"):
        _abft._checks_reference(_x((8, 100)), enc, False, 8.0, True, 8)
