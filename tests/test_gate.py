"""gate: native vs reference (bit-exact), gradients, transformations, bad input."""

import math

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from helpers import RAGGED_SHAPES, random_array
from jax.sharding import PartitionSpec as P

from pimlayers import ops

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _poisoned(rng, shape, dtype):
    x = np.array(random_array(rng, shape, jnp.float32))
    if x.size:
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=max(1, flat.size // 5), replace=True)
        flat[idx] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -7.5], size=idx.size)
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
@pytest.mark.parametrize("limit", [None, 5.0])
def test_native_matches_reference_bit_exactly(dtype, shape, limit):
    x = _poisoned(np.random.default_rng(0), shape, dtype)
    y_n, c_n = jax.jit(lambda a: ops.gate(a, fill=-1.5, limit=limit, impl="native"))(x)
    y_r, c_r = ops.gate(x, fill=-1.5, limit=limit, impl="reference")
    assert y_n.dtype == x.dtype and y_n.shape == x.shape and c_n.shape == x.shape[:-1]
    # Bit patterns, so NaN payloads and -0.0 count too.
    assert np.asarray(y_n).tobytes() == np.asarray(y_r).tobytes()
    assert np.array_equal(np.asarray(c_n), np.asarray(c_r))
    xf = np.asarray(x.astype(jnp.float32))
    keep = np.isfinite(xf) & (np.abs(xf) <= (math.inf if limit is None else limit))
    assert np.asarray(c_n).sum() == (~keep).sum()
    assert np.all(np.isfinite(np.asarray(y_n.astype(jnp.float32))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [None, float(np.finfo(np.float32).max), 1.0, 0.0])
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_edge_values_are_kept_only_when_finite_and_within_the_limit(dtype, limit, impl):
    # Where a cheaper rule could part from "finite and |x| <= limit": the largest finite values,
    # the limit itself and just past it, signed zeros, Inf, NaN.
    big = float(jnp.finfo(dtype).max)
    vals = [math.nan, math.inf, -math.inf, big, -big, 0.0, -0.0, 1.0, -1.0, 1.0 + 2.0**-7, 2.0**-20]
    x = jnp.asarray(vals, jnp.float32).astype(dtype)
    y, counts = ops.gate(x, fill=-0.5, limit=limit, impl=impl)
    xf = np.asarray(x.astype(jnp.float32))
    keep = np.isfinite(xf) & (np.abs(xf) <= (math.inf if limit is None else limit))
    yf = np.asarray(y.astype(jnp.float32))
    assert int(counts) == int((~keep).sum())
    assert np.array_equal(yf[keep], xf[keep]) and np.all(yf[~keep] == -0.5)


def test_gradient_passes_only_kept_values_and_is_finite():
    x = jnp.array([1.0, jnp.nan, -2.0, jnp.inf, 100.0])
    g = jax.grad(lambda a: jnp.sum(ops.gate(a, limit=10.0)[0] * jnp.arange(5.0)))(x)
    assert np.array_equal(np.asarray(g), [0.0, 0.0, 2.0, 0.0, 0.0])
    # Upstream NaN cotangents at replaced positions do not leak either.
    _, vjp = jax.vjp(lambda a: ops.gate(a, limit=10.0)[0], x)
    (gx,) = vjp(jnp.full(5, jnp.nan).at[0].set(3.0).at[2].set(4.0))
    assert np.array_equal(np.asarray(gx), [3.0, 0.0, 4.0, 0.0, 0.0])


def test_check_grads_on_finite_inputs():
    x = jax.random.normal(jax.random.key(0), (3, 5))
    jax.test_util.check_grads(lambda a: ops.gate(a, limit=10.0)[0], (x,), order=2, modes=("fwd", "rev"))


def test_vmap_matches_unbatched():
    x = _poisoned(np.random.default_rng(1), (4, 3, 9), jnp.bfloat16)
    y_b, c_b = jax.vmap(lambda a: ops.gate(a, limit=2.0))(x)
    for i in range(4):
        y_i, c_i = ops.gate(x[i], limit=2.0)
        assert np.array_equal(np.asarray(y_b[i]).view(np.uint16), np.asarray(y_i).view(np.uint16))
        assert np.array_equal(np.asarray(c_b[i]), np.asarray(c_i))


def test_inside_shard_map(cpu_mesh):
    n = cpu_mesh.devices.size
    x = _poisoned(np.random.default_rng(2), (n * 3, 17), jnp.float32)
    f = jax.shard_map(
        lambda a: ops.gate(a, limit=4.0), mesh=cpu_mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))
    )
    y, c = jax.jit(f)(x)
    y_r, c_r = ops.gate(x, limit=4.0, impl="reference")
    assert np.array_equal(np.asarray(y), np.asarray(y_r), equal_nan=True)
    assert np.array_equal(np.asarray(c), np.asarray(c_r))
    # Differentiated there too (the counts' zero tangent varies over the mesh axis as they do).
    g = jax.jit(jax.grad(lambda a: jnp.sum(f(a)[0])))(x)
    xf = np.asarray(x)
    assert np.array_equal(np.asarray(g), (np.isfinite(xf) & (np.abs(xf) <= 4.0)).astype(np.float32))


def test_bad_input_errors():
    with pytest.raises(TypeError, match=r"gate: x has dtype int32; expected float32, bfloat16 or float16"):
        ops.gate(jnp.arange(3))
    with pytest.raises(ValueError, match=r"limit=-1.0; expected None or a number >= 0"):
        ops.gate(jnp.ones(3), limit=-1.0)
    with pytest.raises(ValueError, match=r"impl='fast'"):
        ops.gate(jnp.ones(3), impl="fast")


def test_gate_with_keep_is_the_gate_forward_and_its_mask_backward():
    """``gate_with_keep``: values and counts are ``gate``'s bit for bit; the gradient passes exactly
    where ``keep`` says (here a mask broadcast along the rows, unlike the values'); bad masks are
    refused by name."""
    x = _poisoned(np.random.default_rng(1), (5, 12), jnp.float32)
    keep = jnp.asarray(np.random.default_rng(2).random(12) < 0.5)
    y, c = ops.gate_with_keep(x, keep, fill=-1.5)
    y_r, c_r = ops.gate(x, fill=-1.5)
    assert np.asarray(y).tobytes() == np.asarray(y_r).tobytes() and np.array_equal(c, c_r)
    g = jax.grad(lambda a: jnp.sum(ops.gate_with_keep(a, keep)[0] * 3.0))(x)
    assert np.array_equal(
        np.asarray(g), np.where(np.asarray(keep)[None], 3.0, 0.0).repeat(5, 0).reshape(5, 12)
    )
    with pytest.raises(TypeError, match="keep has dtype float32; expected bool"):
        ops.gate_with_keep(x, keep.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"keep has shape \(5, 12, 2\)"):
        ops.gate_with_keep(x, jnp.ones((5, 12, 2), bool))
    with pytest.raises(ValueError, match=r"keep has shape \(7,\)"):
        ops.gate_with_keep(x, jnp.ones((7,), bool))


def test_gate_with_keep_exact_mask_drives_the_forward_only():
    """With ``exact`` = isfinite(x) the forward is ``gate``'s bit for bit; the select and counts
    come from that mask (a different one shows it: it is not recomputed from x) and the gradient
    still from ``keep``; bad masks are refused by name."""
    x = _poisoned(np.random.default_rng(5), (6, 10), jnp.bfloat16)
    keep = jnp.asarray(np.random.default_rng(6).random((6, 10)) < 0.5)
    y, c = jax.jit(lambda a: ops.gate_with_keep(a, keep, fill=-2.0, exact=jnp.isfinite(a)))(x)
    y_r, c_r = ops.gate(x, fill=-2.0)
    assert np.asarray(y).tobytes() == np.asarray(y_r).tobytes() and np.array_equal(c, c_r)
    other = jnp.asarray(np.random.default_rng(7).random((6, 10)) < 0.5)
    y_o, c_o = ops.gate_with_keep(x, keep, exact=other)
    want = np.where(np.asarray(other), np.asarray(x, np.float32), 0.0)
    assert np.array_equal(np.asarray(y_o, np.float32), want, equal_nan=True)
    assert np.array_equal(c_o, (~np.asarray(other)).sum(-1))
    g = jax.grad(lambda a: jnp.sum(ops.gate_with_keep(a, keep, exact=other)[0].astype(jnp.float32)))(x)
    assert np.array_equal(np.asarray(g, np.float32), np.asarray(keep, np.float32))
    with pytest.raises(TypeError, match="exact has dtype int32; expected bool"):
        ops.gate_with_keep(x, keep, exact=other.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"exact has shape \(6, 10, 2\)"):
        ops.gate_with_keep(x, keep, exact=jnp.ones((6, 10, 2), bool))


@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_gate_with_keep_any_shape_under_jit_grad_and_vmap(shape):
    """``gate_with_keep`` for every ragged shape (rank 0, zero-size), jitted: the forward is the
    gate's (with and without its exact mask), the gradient the mask's; batched by vmap as
    unbatched; an impl it does not know is refused in its own name."""
    rng = np.random.default_rng(3)
    x = _poisoned(rng, shape, jnp.bfloat16)
    keep = jnp.asarray(rng.random(shape) < 0.5)
    y_r, c_r = ops.gate(x, fill=2.0)
    for exact in (None, jnp.isfinite(x)):
        y, c = jax.jit(lambda a, k, e: ops.gate_with_keep(a, k, fill=2.0, exact=e))(x, keep, exact)
        assert np.asarray(y).tobytes() == np.asarray(y_r).tobytes() and np.array_equal(c, c_r)
    g = jax.jit(jax.grad(lambda a: jnp.sum(ops.gate_with_keep(a, keep)[0].astype(jnp.float32))))(x)
    assert np.array_equal(np.asarray(g, np.float32), np.asarray(keep, np.float32))
    if len(shape) >= 2:
        y_b, c_b = jax.vmap(lambda a, k: ops.gate_with_keep(a, k))(x, keep)
        assert np.asarray(y_b).tobytes() == np.asarray(ops.gate(x)[0]).tobytes()
        assert np.array_equal(c_b, ops.gate(x)[1])
    with pytest.raises(ValueError, match=r"pimlayers.gate_with_keep: impl='fast'"):
        ops.gate_with_keep(x, keep, impl="fast")


def test_gate_with_keep_inside_shard_map(cpu_mesh):
    """Each device gates its rows with its part of the mask: values, counts and gradient as the
    whole array's."""
    rng = np.random.default_rng(4)
    n = cpu_mesh.devices.size
    xs = _poisoned(rng, (n * 2, 9), jnp.float32)
    ks = jnp.asarray(rng.random((n * 2, 9)) < 0.5)
    f = jax.shard_map(
        lambda a, k: ops.gate_with_keep(a, k),
        mesh=cpu_mesh,
        in_specs=(P("d"), P("d")),
        out_specs=(P("d"), P("d")),
    )
    y_s, c_s = jax.jit(f)(xs, ks)
    assert np.array_equal(np.asarray(y_s), np.asarray(ops.gate(xs)[0]), equal_nan=True)
    assert np.array_equal(np.asarray(c_s), np.asarray(ops.gate(xs)[1]))
    g = jax.jit(jax.grad(lambda a: jnp.sum(f(a, ks)[0])))(xs)
    assert np.array_equal(np.asarray(g), np.asarray(ks, np.float32))
