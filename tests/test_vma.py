"""ops._vma: the custom VJPs' operands and the kernels' results typed by the mesh axes they vary
over inside shard_map (JAX's varying-axes checks), and nothing changed outside it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from pimlayers.ops import _vma


def _axes(x) -> frozenset:
    return _vma._varying(x)


def test_outside_shard_map_nothing_varies_and_nothing_changes():
    x, w, i = jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.ones((4,), jnp.int32)
    trees = ((x, w), {"i": i})
    same = lambda a, b: all(p is q for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    assert same(_vma.vary_alike(*trees), trees)
    assert same(_vma.vary_as((x, w), x, i), (x, w))
    struct = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    assert _vma.typed_like(struct, x, w) is struct
    assert not _vma.varies(trees)


def test_inside_shard_map_the_types_follow_the_split_operands(cpu_mesh):
    """Rows split over the mesh (varying), a weight replicated (invariant): ``varies`` tells them
    apart, ``vary_alike`` casts the replicated float operand (not the integer one), ``vary_as``
    casts a kernel's results to the operands' axes and ``typed_like`` writes them into its result
    types."""
    n = cpu_mesh.devices.size
    seen = {}

    def body(x, w, i):
        seen["varies"] = (_vma.varies(x), _vma.varies(w), _vma.varies((w, i)))
        wx, iw = _vma.vary_alike(w, jnp.zeros((2,), jnp.int32))
        seen["alike"] = (_axes(wx), _axes(iw))
        (out,) = _vma.vary_as((w * 2.0,), x, w)
        seen["as"] = _axes(out)
        struct = _vma.typed_like(jax.ShapeDtypeStruct((2, 2), jnp.float32), x)
        seen["typed"] = frozenset(struct.manual_axis_type.varying)
        return x + jnp.sum(wx) + jnp.sum(out)

    sm = jax.shard_map(body, mesh=cpu_mesh, in_specs=(P("d"), P(), P()), out_specs=P("d"))
    jax.make_jaxpr(sm)(jnp.ones((n, 2)), jnp.ones((2, 2)), jnp.ones((2,), jnp.int32))
    assert seen == {
        "varies": (True, False, False),
        "alike": (frozenset(), frozenset()),  # w alone: nothing varies, nothing to cast to
        "as": frozenset({"d"}),
        "typed": frozenset({"d"}),
    }

    def body2(x, w):  # with a varying operand beside it, the replicated weight is cast
        wx, xx = _vma.vary_alike(w, x)
        return xx + jnp.sum(wx) * 0 + float(_axes(wx) == {"d"})

    sm2 = jax.shard_map(body2, mesh=cpu_mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    assert np.asarray(jax.jit(sm2)(jnp.zeros((n, 2)), jnp.ones((2, 2)))).tolist() == [[1.0, 1.0]] * n


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


@pytest.mark.parametrize("typed", [False, True])
def test_a_pallas_kernel_inside_shard_map_needs_its_results_typed(cpu_mesh, typed):
    """Pallas refuses a kernel's untyped results inside shard_map with the checks on; typed by
    ``typed_like`` the call traces, its results varying as its operand (traced only: Pallas'
    interpreter, which would run it here, does not itself pass the varying-axes checks)."""
    n = cpu_mesh.devices.size

    def body(x):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        out = _vma.typed_like(out, x) if typed else out
        y = pl.pallas_call(_double, out_shape=out, interpret=True)(x)
        return _vma.vary_as(y, x)

    seen = []

    def body_seen(x):
        y = body(x)
        seen.append(_axes(y))
        return y

    sm = jax.shard_map(body_seen, mesh=cpu_mesh, in_specs=P("d"), out_specs=P("d"))
    x = jnp.arange(n * 8, dtype=jnp.float32).reshape(n, 8)
    if not typed:
        with pytest.raises(ValueError, match="manual_axis_type"):
            jax.make_jaxpr(sm)(x)
        return
    jax.make_jaxpr(sm)(x)
    assert seen == [frozenset({"d"})]
