"""Routed attention: exact against jax.nn.dot_product_attention, verified and rerouted transfers
under the link model, gradients, no recompilation, clear errors, and the simulator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pimlayers import FaultPolicy
from pimlayers.ops import report_from_tap, zero_tap
from pimlayers.routing import PhotonicMesh, layout_permutation, local_attention, routed_attention, simulate

B, T, H, KV, D = 2, 64, 4, 2, 16
STOCK = FaultPolicy(mode="off", gate=False)


def _qkv(seed=0, dtype=jnp.float32, t=T):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, t, KV, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, t, KV, D)), dtype)
    return q, k, v


def _ring_mesh():
    return Mesh(np.array(jax.devices("cpu")[:8]), ("d",))


def _torus_mesh():
    return Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("r", "c"))


@pytest.mark.parametrize(
    "schedule, layout, causal",
    [
        ("ring", "zigzag", True),
        ("ring", "striped", True),
        ("ring", "contiguous", True),
        ("ring", "zigzag", False),
        ("bidir", "zigzag", True),
        ("allgather", "striped", True),
        ("torus", "zigzag", True),
    ],
)
def test_equals_dot_product_attention(schedule, layout, causal):
    q, k, v = _qkv()
    torus = schedule == "torus"
    mesh, axis = (_torus_mesh(), ("r", "c")) if torus else (_ring_mesh(), "d")
    out, rep = jax.jit(
        lambda q, k, v: routed_attention(
            q, k, v, mesh=mesh, axis=axis, schedule=schedule, layout=layout, causal=causal
        )
    )(q, k, v)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    # f32 at HIGHEST precision: blockwise online softmax differs from one softmax by a few ulps.
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=2e-6)
    assert not bool(rep.incomplete.any()) and int(rep.faults.link_failures) == 0
    counts = rep.faults.to_dict()
    assert counts["gemm_checked"] > 0 and counts["gemm_detected"] == 0  # the local kernel is verified
    assert int(rep.rounds) == (0 if schedule == "allgather" else 7)  # n - 1 transfers, no retries


@pytest.mark.slow
def test_own_blocks_long_enough_to_cut_still_equal_the_reference():
    # 256 tokens per device: each device's diagonal block (zig-zag: two chunks) skips its invisible
    # quarter (the contiguous layout's own block runs the same code)
    layout = "zigzag"
    q, k, v = _qkv(3, t=2048)
    mesh = _ring_mesh()

    def f(q, k, v):
        return routed_attention(q, k, v, mesh=mesh, axis="d", layout=layout)[0]

    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v)), np.asarray(ref), rtol=1e-5, atol=2e-6)
    w = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(
        jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a, is_causal=True) * w), argnums=(0, 1, 2))
    )(q, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_88_percent_link_faults_50_iterations_exact_with_no_recompilation():
    q, k, v = _qkv(1)
    mesh = _ring_mesh()
    pm = PhotonicMesh((8,))
    f = jax.jit(lambda q, k, v, links: routed_attention(q, k, v, mesh=mesh, axis="d", links=links))
    clean, _ = f(q, k, v, pm.state(fault_rate=0.0))
    clean = np.asarray(clean)
    ref = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    np.testing.assert_allclose(clean, ref, rtol=1e-5, atol=2e-6)
    retries, rounds, corrupted, dropped = [], [], 0, 0
    with jax.no_tracing():  # new fault patterns are data: nothing is traced or compiled again
        for it in range(50):
            out, rep = f(q, k, v, pm.state(fault_rate=0.88, seed=7, step=it))
            out = np.asarray(out)
            rel = np.max(np.abs(out - clean)) / np.max(np.abs(clean))
            assert rel <= 1e-6, f"iteration {it}: relative error {rel}"
            # numpy, not jnp: an eager jnp reduction may trace (and no_tracing would raise)
            assert not np.asarray(rep.incomplete).any() and int(rep.faults.link_failures) == 0
            retries.append(int(rep.faults.link_retries))
            rounds.append(int(rep.rounds))
            corrupted += int(rep.corrupted)
            dropped += int(rep.dropped)
    assert f._cache_size() == 1
    # 56 transfers per call at 88%: about 56 * 0.88 / 0.12 = 411 retries; both fault kinds occur.
    assert 300 < np.mean(retries) < 520, np.mean(retries)
    assert corrupted > 1000 and dropped > 1000
    # The simulator's Monte Carlo of the same model and route choice predicts the retry rounds.
    est = simulate.estimate(
        pm, batch=B, seq_len=T, heads=H, kv_heads=KV, head_dim=D, fault_rate=0.88, draws=400
    )
    assert abs(est.attempts - np.mean(rounds)) < 0.1 * np.mean(rounds), (est.attempts, np.mean(rounds))


def test_a_dead_link_is_routed_around_and_a_cut_off_device_is_reported():
    q, k, v = _qkv(2)
    mesh = _ring_mesh()
    ref = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    pm = PhotonicMesh((8,), max_attempts=6)
    f = jax.jit(
        lambda q, k, v, links: routed_attention(q, k, v, mesh=mesh, axis="d", links=links, policy=STOCK)
    )
    # Device 2 -> 3 clockwise is dead: device 3's blocks come the long way round (7 hops).
    out, rep = f(q, k, v, pm.state(fault_rate=0.0, dead=[pm.link_id(2, 0, +1)]))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=2e-6)
    assert not bool(rep.incomplete.any())
    assert int(rep.faults.link_retries) == 7 and int(rep.dropped) == 7  # one per round, then the detour
    # Every link into device 3 dead: no route reaches it. Its rows, and rows downstream that needed
    # what it would have forwarded, are reported; every other row is still exact.
    into3 = [pm.link_id(2, 0, +1), pm.link_id(4, 0, -1)]
    with jax.no_tracing():
        out, rep = f(q, k, v, pm.state(fault_rate=0.0, dead=into3))
    bad = np.asarray(rep.incomplete)
    assert int(rep.faults.link_failures) > 0 and bad.any() and not bad.all()
    tokens3 = layout_permutation("zigzag", T, 8)[3 * (T // 8) : 4 * (T // 8)]
    assert bad[tokens3[T // 16 :]].all()  # device 3's second chunk sees earlier blocks it never got
    np.testing.assert_allclose(np.asarray(out)[:, ~bad], ref[:, ~bad], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("schedule", ["ring", "allgather"])
def test_gradients_equal_the_reference_under_link_faults(schedule):
    q, k, v = _qkv(3)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, H, D)), jnp.float32)
    mesh = _ring_mesh()
    pm = PhotonicMesh((8,))

    def loss(q, k, v, tap, links):
        out, _ = routed_attention(q, k, v, mesh=mesh, axis="d", links=links, schedule=schedule, tap=tap)
        return jnp.sum(out * w)

    def ref_loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * w)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, zero_tap(), pm.state(fault_rate=0.5, seed=1))
    ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(g[:3], ref, strict=True):
        # Sums of 64 f32 products per entry in a different order: a few ulps of the largest entries.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    back = report_from_tap(g[3]).to_dict()
    assert back["gemm_checked"] > 0 and back["link_failures"] == 0
    if schedule == "ring":  # the backward's transfers (blocks out, dK/dV home) met faults and retried
        assert back["link_retries"] > 0


def test_bfloat16_matches_the_reference_within_bf16_rounding():
    q, k, v = _qkv(5, jnp.bfloat16)
    mesh = _ring_mesh()
    out, _ = jax.jit(lambda q, k, v: routed_attention(q, k, v, mesh=mesh, axis="d", schedule="bidir"))(
        q, k, v
    )
    ref = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    # p is rounded to bf16 before p·v (as in flash kernels): ~3 significant digits.
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_bad_input_gives_clear_errors():
    q, k, v = _qkv()
    mesh = _ring_mesh()
    call = lambda *a, **kw: routed_attention(*a, mesh=mesh, **{"axis": "d", **kw})
    with pytest.raises(ValueError, match="not divisible by 16"):
        call(*_qkv(t=40))
    with pytest.raises(ValueError, match="cannot share"):
        call(q[:, :, :3], k, v)
    with pytest.raises(TypeError, match="one float dtype"):
        call(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="expected k and v"):
        call(q, k[:, :32], v)
    with pytest.raises(ValueError, match="mesh axis names"):
        call(q, k, v, axis="x")
    with pytest.raises(ValueError, match="needs axis=\\(row_axis, col_axis\\)"):
        call(q, k, v, schedule="torus")
    with pytest.raises(ValueError, match="schedule="):
        call(q, k, v, schedule="mesh")
    with pytest.raises(ValueError, match="links model a mesh of \\(4,\\)"):
        call(q, k, v, links=PhotonicMesh((4,)).state())
    with pytest.raises(ValueError, match="expected \\(n,\\) for a ring"):
        PhotonicMesh((2, 2, 2))
    with pytest.raises(ValueError, match="fault_rate"):
        PhotonicMesh((8,)).state(fault_rate=1.5)


def test_link_model_thermal_drift_and_routes():
    pm = PhotonicMesh((8,))
    p = pm.fault_probability([0.0, 1.0, 2.0, 3.0, 6.0])
    assert np.all(np.diff(p) > 0) and p[0] < 1e-4 and p[-1] > 0.5  # hotter rings fail more
    s0, s1 = pm.state(fault_rate=0.3, step=0), pm.state(fault_rate=0.3, step=1)
    assert s0.p_fault.shape == (pm.nlinks,) == (16,) and not np.array_equal(s0.key, s1.key)
    assert np.array_equal(s0.at_step(5).key, s0.at_step(5).key)
    assert pm.routes(0, 1) == [((0, 1),), ((0, -1),) * 7]
    torus = PhotonicMesh((2, 4))
    assert len(torus.routes(1, 1)) == 4 and torus.nlinks == 32  # direct, two detours, the long way
    # Route tables: the link of the last hop of the direct route to device 3 leaves device 2.
    assert pm.route_links(pm.routes(0, 1)[0])[3, 0] == pm.link_id(2, 0, 1)


def test_simulator_orders_schedules_and_faults():
    pm = PhotonicMesh((8,))
    kw = dict(batch=1, seq_len=131072, heads=32, kv_heads=8, head_dim=128, device_flops=400e12)
    ring = simulate.estimate(pm, schedule="ring", **kw)
    bidir = simulate.estimate(pm, schedule="bidir", **kw)
    gather = simulate.estimate(pm, schedule="allgather", **kw)
    faulty = simulate.estimate(pm, schedule="ring", fault_rate=0.5, **kw)
    rerouted = simulate.estimate(pm, schedule="ring", dead=[pm.link_id(2, 0, 1)], **kw)
    assert ring.mean_s < gather.mean_s  # transfers hide behind compute
    assert bidir.mean_s <= ring.mean_s * 1.01
    assert faulty.mean_s > ring.mean_s and faulty.attempts > ring.attempts == 7
    assert rerouted.attempts == 14 and rerouted.abandoned == 0  # each round: direct fails, detour delivers


@pytest.mark.parametrize("t, blocks", [(T, 1), (512, 7)])
def test_the_local_kernel_alone_matches_the_reference_forward_and_backward(t, blocks):
    # t = 512: the causal block is cut in halves (the invisible quarter skipped), and each diagonal
    # half again: 7 blocks
    q, k, v = _qkv(6, t=t)
    w = jnp.asarray(np.random.default_rng(7).standard_normal((B, t, H, D)), jnp.float32)
    out, rep = jax.jit(local_attention)(q, k, v)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=2e-6)
    assert int(rep.gemm_checked) == 2 * B * KV * blocks  # q·kᵀ and p·v per (batch, KV head) and block

    def loss(f, *a):
        return jnp.sum(f(*a) * w)

    # Jitted: eager, each of the backward's ops would compile on its own (hundreds of compiles).
    got = jax.jit(
        jax.grad(lambda q, k, v: loss(lambda *a: local_attention(*a)[0], q, k, v), argnums=(0, 1, 2))
    )(q, k, v)
    want = jax.jit(
        jax.grad(
            lambda q, k, v: loss(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True), q, k, v),
            argnums=(0, 1, 2),
        )
    )(q, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
