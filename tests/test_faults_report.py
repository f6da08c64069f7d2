"""FaultReport: values of add/sum/psum, pytree behaviour under jit/vmap/shard_map, host-side text."""

import os
import sys

# Several CPU devices for the shard_map test. Only effective before jax creates its backends; if jax was
# imported already (another test module, a conftest) the tests use whatever devices exist.
if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import copy
import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pimlayers.faults import FaultReport

try:
    from jax import shard_map
except ImportError:  # Older jax.
    from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]

FIELDS = list(FaultReport.FIELDS)


def _report(start: int = 1) -> FaultReport:
    """Distinct values per field (start, start+1, ...) so a swapped or dropped field shows."""
    return FaultReport(**{name: start + i for i, name in enumerate(FIELDS)})


def test_field_order_is_the_documented_one():
    assert FIELDS == [
        "gemm_checked",
        "gemm_detected",
        "gemm_corrected",
        "gemm_recomputed",
        "gemm_uncorrectable",
        "nonfinite_gated",
        "banks_checked",
        "banks_faulty",
        "banks_repaired",
        "banks_uncorrectable",
        "link_retries",
        "link_failures",
    ]
    # One pytree leaf, the counters in field order on its last axis.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(_report())[0]]
    assert paths == [".counts"]
    np.testing.assert_array_equal(_report().counts, np.arange(1, len(FIELDS) + 1))


def test_constructor_converts_to_int32_scalars():
    r = FaultReport(gemm_detected=3, banks_faulty=np.int64(2), link_failures=True)
    for name in FIELDS:
        leaf = getattr(r, name)
        assert isinstance(leaf, np.ndarray) and leaf.dtype == np.int32 and leaf.shape == ()  # host
    assert r.to_dict() == {
        **dict.fromkeys(FIELDS, 0),
        "gemm_detected": 3,
        "banks_faulty": 2,
        "link_failures": 1,
    }
    assert FaultReport.zeros().to_dict() == dict.fromkeys(FIELDS, 0)
    # int8 arrays are widened; the stored dtype is always int32.
    assert FaultReport(gemm_checked=jnp.array(5, jnp.int8)).gemm_checked.dtype == jnp.int32


def test_constructor_rejects_floats_and_out_of_range():
    with pytest.raises(TypeError, match=r"gemm_checked must be an int .* got float"):
        FaultReport(gemm_checked=1.0)
    with pytest.raises(TypeError, match=r"nonfinite_gated .* dtype float32"):
        FaultReport(nonfinite_gated=jnp.ones((), jnp.float32))
    with pytest.raises(OverflowError):
        FaultReport(gemm_checked=2**31)


def test_add_and_sum_are_fieldwise():
    a, b, c = _report(1), _report(100), _report(1000)
    got = (a + b).to_dict()
    assert got == {name: (1 + i) + (100 + i) for i, name in enumerate(FIELDS)}
    total = FaultReport.sum([a, b, c]).to_dict()
    assert total == {name: 1101 + 3 * i for i, name in enumerate(FIELDS)}
    assert FaultReport.sum(iter([a, b, c])).to_dict() == total  # Any iterable, consumed once.
    assert FaultReport.sum([]).to_dict() == dict.fromkeys(FIELDS, 0)
    assert sum([a, b, c]).to_dict() == total  # Builtin sum starts from 0: __radd__.
    with pytest.raises(TypeError):
        a + 1


def test_total_faults_and_uncorrectable():
    r = FaultReport(
        gemm_checked=50,
        gemm_detected=4,
        gemm_corrected=3,
        gemm_uncorrectable=1,
        nonfinite_gated=7,
        banks_faulty=2,
        banks_repaired=2,
        banks_uncorrectable=5,
        link_retries=9,
        link_failures=11,
    )
    assert int(r.total_faults()) == 4 + 7 + 2 + 11
    u = r.uncorrectable()
    assert u.dtype == jnp.int32 and u.shape == () and int(u) == 1 + 5 + 11
    assert bool(r.any_uncorrectable())
    assert not bool(FaultReport(gemm_detected=3, gemm_corrected=3, link_retries=2).any_uncorrectable())
    # A count that wrapped negative still reads as uncorrectable, though uncorrectable() > 0 would not.
    wrapped = FaultReport(gemm_uncorrectable=jnp.iinfo(jnp.int32).max) + FaultReport(gemm_uncorrectable=1)
    assert int(wrapped.gemm_uncorrectable) == jnp.iinfo(jnp.int32).min  # Documented int32 wrap.
    assert int(wrapped.uncorrectable()) < 0 and bool(wrapped.any_uncorrectable())


def test_jit_roundtrip_and_arithmetic():
    @jax.jit
    def step(x: jax.Array, r: FaultReport) -> FaultReport:
        bad = ~jnp.isfinite(x)
        mine = FaultReport(nonfinite_gated=jnp.sum(bad), gemm_checked=1)
        return r + mine

    x = jnp.array([1.0, jnp.nan, jnp.inf, 2.0])
    out = step(x, step(x, FaultReport.zeros()))
    assert isinstance(out, FaultReport)
    assert out.to_dict() == {**dict.fromkeys(FIELDS, 0), "nonfinite_gated": 4, "gemm_checked": 2}


def test_vmap_batches_fields_and_summary_sums_the_batch():
    def per_example(x: jax.Array) -> FaultReport:
        return FaultReport(gemm_detected=jnp.sum(x > 0), link_retries=1)

    xs = jnp.array([[1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    rep = jax.vmap(per_example)(xs)
    assert rep.gemm_detected.shape == (3,)
    assert rep.gemm_checked.shape == (3,)  # Unbatched defaults are broadcast by out_axes=0.
    np.testing.assert_array_equal(rep.gemm_detected, [1, 2, 0])
    np.testing.assert_array_equal(rep.total_faults(), [1, 2, 0])  # Elementwise over the batch.
    assert rep.to_dict()["gemm_detected"] == 3 and rep.to_dict()["link_retries"] == 3
    text = rep.summary()
    assert _row(text, "gemm_detected") == "3" and _row(text, "link_retries") == "3"
    # vmap over a report input works too (the report is an ordinary pytree).
    doubled = jax.vmap(lambda r: r + r)(rep)
    np.testing.assert_array_equal(doubled.gemm_detected, [2, 4, 0])


def test_psum_inside_shard_map_over_all_devices():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))

    def per_device(x: jax.Array) -> FaultReport:
        # Each device sees one row; every field gets a distinct per-device value.
        k = jnp.sum(x).astype(jnp.int32)
        rep = FaultReport(**{name: k * (i + 1) for i, name in enumerate(FIELDS)})
        return rep.psum("d")

    x = jax.device_put(jnp.ones((n, 1), jnp.float32), NamedSharding(mesh, P("d")))  # One unit per device.
    out = jax.jit(shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P()))(x)
    assert out.to_dict() == {name: n * (i + 1) for i, name in enumerate(FIELDS)}


def _row(text: str, name: str) -> str:
    """The count column of the row for `name` in a summary table."""
    (line,) = [ln for ln in text.splitlines() if ln.split() and ln.split()[0] == name]
    return line.split()[1]


def test_summary_lists_every_field_count_and_description():
    r = _report(10)
    text = r.summary()
    for i, name in enumerate(FIELDS):
        assert _row(text, name) == str(10 + i)
    assert "GEMMs verified by ABFT checksums" in text  # Description column.
    assert _row(text, "total_faults") == str(int(r.total_faults()))
    assert _row(text, "uncorrectable") == str(int(r.uncorrectable()))
    assert str(r) == text


def test_str_under_tracing_falls_back_to_repr():
    seen: list[str] = []

    @jax.jit
    def f(r: FaultReport) -> FaultReport:
        seen.append(str(r))  # Must not raise on tracers.
        with pytest.raises(TypeError, match="needs concrete values"):
            r.summary()
        return r

    f(_report())
    assert seen and seen[0].startswith("FaultReport(counts=") and "Trace" in seen[0]
    assert repr(_report()).startswith("FaultReport(gemm_checked=array(1, dtype=int32")


def test_tree_map_with_non_array_leaves_keeps_them():
    # JAX rebuilds pytrees with non-array leaves (specs, None, ShapeDtypeStruct); unflatten must not
    # convert or validate them.
    specs = jax.tree.map(lambda _: P(), _report())
    assert all(getattr(specs, name) == P() for name in FIELDS)
    shapes = jax.eval_shape(lambda r: r + r, _report())
    assert isinstance(shapes, FaultReport)
    assert shapes.gemm_checked == jax.ShapeDtypeStruct((), jnp.int32)
    assert "FaultReport(" in str(specs)  # No summary for non-array leaves.


def test_flatten_and_unflatten_keep_every_field_in_order_and_refuse_a_wrong_count():
    """The report is one leaf (the counters in declaration order), rebuilt exactly as given; a wrong
    number of leaves is an error, never a report with a field missing or shifted."""
    from pimlayers.faults import _report as module

    report = _report()
    leaves, treedef = jax.tree.flatten(report)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.int32 and leaves[0].shape == (len(FIELDS),)
    assert [int(v) for v in leaves[0]] == list(range(1, len(FIELDS) + 1))
    back = jax.tree.unflatten(treedef, [leaves[0] * 2])
    assert back.to_dict() == {name: 2 * (i + 1) for i, name in enumerate(FIELDS)}
    with pytest.raises(ValueError, match=r"2 leaves; expected 1 \(counts\)"):
        module._unflatten(None, [leaves[0], leaves[0]])


def test_one_output_buffer_per_report():
    # A jitted call returning a report hands the host one array for it, not one per counter (each
    # output costs the host a buffer); the counters keep their shapes, broadcast to one.
    out = jax.jit(lambda x: FaultReport(gemm_checked=3, gemm_detected=jnp.sum(x > 0)))(jnp.arange(4.0))
    assert len(jax.tree.leaves(out)) == 1
    assert out.to_dict()["gemm_checked"] == 3 and out.to_dict()["gemm_detected"] == 3
    mixed = FaultReport(gemm_checked=2, gemm_detected=jnp.array([1, 0, 1]))
    assert mixed.counts.shape == (3, len(FIELDS)) and mixed.gemm_checked.shape == (3,)
    with pytest.raises(TypeError, match="unknown counters"):
        FaultReport(gemm_checkd=1)
    with pytest.raises(OverflowError, match="int32"):
        FaultReport(banks_checked=2**31)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.counts = None
    for twin in (copy.deepcopy(out), pickle.loads(pickle.dumps(out))):
        assert isinstance(twin, FaultReport) and twin.to_dict() == out.to_dict()
