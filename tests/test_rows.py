"""Row-parallel native calls: with tokens sharded over devices, each device checks its own rows
(the compiled program's native calls see M / devices rows and no all-gather feeds them), with
results equal to the unsharded run's; vmap adds a row axis. A GEMM's counts are summed per device
and added by one all-reduce."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pimlayers import ops
from pimlayers.ops._abft import ABFT_CLEAN, ABFT_CORRECTED, ABFT_DETECTED
from pimlayers.ops._protected_matmul import _tally, _tally_local


def _native_calls(hlo: str, target: str) -> list[str]:
    return [line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]


def test_protected_matmul_checks_each_devices_rows(cpu_mesh):
    n_dev = cpu_mesh.size
    m, k, n = 8 * n_dev, 48, 96
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    g = jax.random.normal(jax.random.key(2), (m, n), jnp.float32)

    def loss(a, b, gg):
        y, _ = ops.protected_matmul(a, b, impl="native")
        return jnp.sum(y * gg), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    xs = jax.device_put(x, NamedSharding(cpu_mesh, P("d")))
    ws = jax.device_put(w, NamedSharding(cpu_mesh, P()))
    gs = jax.device_put(g, NamedSharding(cpu_mesh, P("d")))  # the cotangent is sharded as y is
    hlo = step.lower(xs, ws, gs).compile().as_text()
    finishes = _native_calls(hlo, "pimlayers_abft_finish")
    assert len(finishes) >= 3  # y, dx, dw (and their recompute branches)
    # y and dx are (M, N) and (M, K) globally (single GEMMs reach the finish without their unit
    # batch axis): per device only M / devices rows reach the call.
    rows = {re.search(r"f32\[(?:1,)?(\d+),(\d+)\]", line).groups() for line in finishes}
    assert (str(m // n_dev), str(n)) in rows and (str(m // n_dev), str(k)) in rows, rows
    assert not any(str(m) == r for r, _ in rows)  # dw is (K, N): no token rows to split
    assert "all-gather" not in hlo  # w is replicated; nothing gathers y or dy to every device

    (total, y), (gx, gw) = step(xs, ws, gs)
    one = jax.devices("cpu")[0]  # the unsharded run on one of the mesh's (CPU) devices, as they compute
    x1, w1, g1 = (jax.device_put(v, one) for v in (x, w, g))
    (total1, y1), (gx1, gw1) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x1, w1, g1)
    # Equal to f32 rounding, not bit for bit: the CPU's dot kernel for 8 rows and for 64 may sum in
    # different orders (seen with the suite's LLVM -O0 on some CPUs).
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(gw1), rtol=1e-5, atol=1e-5)  # dw sums devices
    np.testing.assert_allclose(float(total), float(total1), rtol=1e-6)
    assert y.sharding.spec[0] == "d"


def test_vmap_adds_a_row_axis():
    x = jax.random.normal(jax.random.key(3), (3, 5, 40), jnp.float32)
    x = x.at[1, 2, 7].set(jnp.inf)
    y, counts = jax.vmap(lambda a: ops.gate(a, impl="native"))(x)
    y_ref, counts_ref = ops.gate(x, impl="reference")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_ref))

    w = jax.random.normal(jax.random.key(4), (40, 32), jnp.float32)
    enc = ops.abft_encode(w, 16)
    prod = jnp.einsum("bmk,kn->bmn", x.at[1, 2, 7].set(0.0), w, precision="highest")
    checks, mag = jax.vmap(lambda a: ops.abft_checks(a, enc))(x.at[1, 2, 7].set(0.0))
    bad = prod.at[2, 4, 9].add(100.0)
    # mag shared by all examples (unbatched: broadcast to the batch) — the largest is a valid bound
    shared = jnp.max(mag, axis=0)
    out, flags = jax.vmap(
        lambda yy, c, mg: ops.abft_check(yy, c, mg, k=40, block_n=16, impl="native"), in_axes=(0, 0, None)
    )(bad, checks, shared)
    expected = np.zeros(flags.shape, np.int32)
    expected[2, 4, 0] = 1  # the one corrupted value, located and rebuilt
    np.testing.assert_array_equal(np.asarray(flags), expected)
    np.testing.assert_allclose(np.asarray(out), np.asarray(prod), rtol=1e-5, atol=1e-4)


def test_a_gemms_counts_are_added_over_devices_by_one_all_reduce(cpu_mesh):
    """``_tally`` (per GEMM: corrected, pending, flagged blocks, gated values) with the rows split:
    each device sums its own rows and one all-reduce adds them. XLA's own partitioning of that
    variadic reduction gathered every device's partial sums, one all-gather per count."""
    rng = np.random.default_rng(0)
    states = np.array([ABFT_CLEAN, ABFT_CORRECTED, ABFT_DETECTED], np.int32)
    flags = jnp.asarray(rng.choice(states, size=(2, 8 * cpu_mesh.size, 5), p=[0.8, 0.1, 0.1]))
    counts = jnp.asarray(rng.integers(0, 3, flags.shape), jnp.int32)
    rows = NamedSharding(cpu_mesh, P(None, "d"))
    args = jax.device_put((flags, counts), rows)
    want = [np.asarray(v) for v in _tally_local(flags, counts)]
    assert [np.asarray(v).tolist() for v in jax.jit(_tally)(*args)] == [w.tolist() for w in want]
    assert want[1].sum() > 0 and want[3].sum() > 0  # something to count in each
    hlo = jax.jit(_tally).lower(*args).compile().as_text()
    assert "all-gather" not in hlo and hlo.count(" all-reduce(") == 1
    plain = jax.jit(_tally_local).lower(*args).compile().as_text()
    assert "all-gather" in plain  # XLA's way: the property above could fail
    # Under vmap (an axis folded into G) the same counts.
    got = jax.jit(jax.vmap(_tally))(flags[:, None], counts[:, None])
    assert [np.asarray(v)[:, 0].tolist() for v in got] == [w.tolist() for w in want]
