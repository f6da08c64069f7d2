"""compile_ahead: compiles from abstract shapes without allocating, then runs on real inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pimlayers as pl


def step(x, w):
    y, counts = pl.ops.gate(x @ w, limit=1e3)
    return y, pl.ops.bank_checksums(w, bank_bytes=256), counts


def test_compiles_without_allocating_and_runs():
    specs = (jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 32), jnp.float32))
    before = len(jax.live_arrays())
    compiled = pl.compile_ahead(step, *specs)
    assert len(jax.live_arrays()) == before
    x = jnp.ones((64, 128))
    w = jnp.full((128, 32), 0.5)
    y, sums, _ = compiled(x, w)
    ref = step(x, w)
    assert np.array_equal(np.asarray(y), np.asarray(ref[0]))
    assert np.array_equal(np.asarray(sums), np.asarray(ref[1]))
    with pytest.raises(TypeError):
        compiled(jnp.ones((3, 128)), w)  # compiled for one shape only


def test_rejects_concrete_arrays():
    with pytest.raises(TypeError, match=r"pass jax\.ShapeDtypeStruct"):
        pl.compile_ahead(step, jnp.ones((2, 2)), jnp.ones((2, 2)))
