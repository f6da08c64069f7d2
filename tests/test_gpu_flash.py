"""The verified flash attention kernel on a Hopper GPU against its XLA reference (skipped elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter, flash_faults

from benchmarks.bounds import _same_tiles
from pimlayers import layers as L
from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hopper():
    if not ops._fused_gemm.hopper():
        pytest.skip("the flash kernel needs a Hopper GPU (sm_90)")


def _qkv(b, t, h, kv, d, seed=0, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(
        jax.random.normal(kk, (b, t, n, d)).astype(dtype) for kk, n in zip(ks, (h, kv, kv), strict=True)
    )


def _flagged(r):
    return {tuple(i) for i in np.argwhere(~(np.asarray(r) <= 1.0)).tolist()}


SHAPES = [  # (B, T, H, KV, D, causal)
    (2, 256, 4, 2, 64, True),
    (1, 512, 8, 2, 128, True),
    (2, 256, 4, 4, 128, False),
    (1, 1024, 4, 1, 128, True),
    (1, 384, 6, 3, 128, False),
]


V_APART = ops.FlashConfig(fuse_v=False)  # the output check's columns from a wgmma of their own


@pytest.mark.parametrize(
    "config",
    [ops.FlashConfig(), ops.FlashConfig(fuse_e=False), ops.FlashConfig(bounds_kernel=False), V_APART],
    ids=["default", "e-apart", "xla-bounds", "v-apart"],
)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(hopper, shape, config):
    b, t, h, kv, d, causal = shape
    q, k, v = _qkv(b, t, h, kv, d)
    out, lse, checks = ops.flash_attention(q, k, v, causal=causal, config=config)
    ref_out, ref_lse, _ = ops.flash_attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-3)
    assert float(checks.scores.max()) < 0.25 and float(checks.out.max()) < 0.25
    plain, _, none = ops.flash_attention(q, k, v, causal=causal, checks=False, config=config)
    assert none is None
    np.testing.assert_allclose(np.asarray(plain, np.float32), np.asarray(ref_out, np.float32), atol=3e-2)


@pytest.mark.parametrize(
    "config",
    [ops.FlashConfig(), ops.FlashConfig(bounds_kernel=False), V_APART],
    ids=["default", "xla-bounds", "v-apart"],
)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_flags_the_rows_the_reference_flags(hopper, shape, config):
    b, t, h, kv, d, causal = shape
    q, k, v = _qkv(b, t, h, kv, d, seed=1)
    rng = np.random.default_rng(2)
    sb, sk, ob, oc = (np.array(a) for a in ops.FlashFaults.none(b, h, t))
    for i in range(6):
        bi, hi, ti = int(rng.integers(b)), int(rng.integers(h)), int(rng.integers(t))
        bit = int(rng.integers(24, 32))
        if i % 2:
            sb[bi, hi, ti], sk[bi, hi, ti] = bit, int(rng.integers(0, ti + 1 if causal else t))
        else:
            ob[bi, hi, ti], oc[bi, hi, ti] = bit, int(rng.integers(d))
    faults = ops.FlashFaults(*(jnp.asarray(a) for a in (sb, sk, ob, oc)))
    _, _, got = ops.flash_attention(q, k, v, faults, causal=causal, config=config)
    _, _, ref = ops.flash_attention_reference(q, k, v, faults, causal=causal)
    assert _flagged(got.scores) == _flagged(ref.scores)
    assert _flagged(got.out) == _flagged(ref.out)
    assert _flagged(got.scores) | _flagged(got.out)  # exponent and sign flips: some row fails


@pytest.mark.parametrize("shape", [(1, 8192, 8, 128), (2, 384, 3, 64)])
def test_bounds_kernel_tiles_are_xlas_on_the_gpu(hopper, shape):
    """The Triton bounds kernels (the default on a GPU) against XLA's tiles (hi + lo within f32
    rounding; other rows equal)."""
    kk, kv_ = jax.random.split(jax.random.key(6))
    k = (3 * jax.random.normal(kk, shape)).astype(jnp.bfloat16)
    v = (2 * jax.random.normal(kv_, shape)).astype(jnp.bfloat16)
    bounds = lambda cfg: jax.jit(lambda a, b: ops._flash.flash_bounds(a, b, lam=8.0, config=cfg))(k, v)
    got, want = bounds(ops.FlashConfig()), bounds(ops.FlashConfig(bounds_kernel=False))
    _same_tiles(got, want)  # hi + lo of each sum to f32 rounding; the constant rows equal
    forced = bounds(ops.FlashConfig(bounds_kernel=True))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, forced, strict=True))


def test_attention_core_takes_the_kernel_and_corrects(hopper):
    b, t, h, kv, d = 1, 512, 8, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=3)
    pol = FaultPolicy()
    clean, r0 = L.attention_core(q, k, v, policy=pol)  # default: the kernel
    mat, _ = L.attention_core(q, k, v, policy=pol, flash=False)
    np.testing.assert_allclose(np.asarray(clean, np.float32), np.asarray(mat, np.float32), atol=3e-2)
    assert r0.to_dict()["gemm_detected"] == 0
    body = TraceCounter(lambda q, k, v, f: L.attention_core(q, k, v, policy=pol, faults=f))
    run = jax.jit(body)
    for seed in range(3):
        fs = GemmFaults.random(jax.random.key(seed), (b * h * t, t), 2, 1.0, bit=30)
        out, r = run(q, k, v, {"scores": fs})
        rd = r.to_dict()
        assert rd["gemm_detected"] >= 1 and rd["gemm_uncorrectable"] == 0
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
    assert body.count == 1


@pytest.mark.parametrize("t", [256, 1000])
def test_attention_core_gradients_match_the_materialised_paths(hopper, t):
    """The default takes the kernels (T = 1000: both padded to 1024); outputs and gradients as the
    materialised path's."""
    b, h, kv, d = 1, 4, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=4)
    g = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)
    pol = FaultPolicy()

    def loss(q, k, v, flash):
        out, r = L.attention_core(q, k, v, policy=pol, flash=flash)
        return jnp.sum(out.astype(jnp.float32) * g), (out, r)

    assert "mosaic" in jax.jit(lambda *a: loss(*a, None)).lower(q, k, v).as_text().lower()
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, (o1, r1)), g1 = grad(q, k, v, None)
    (_, (o2, _)), g2 = grad(q, k, v, False)
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2, np.float32), atol=3e-2)
    assert r1.to_dict()["gemm_detected"] == 0
    for a, c in zip(g1, g2, strict=True):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.max(np.abs(a - c)) <= 2e-2 * float(np.max(np.abs(c)))  # a few bf16 ulps


def test_attention_core_kernels_inside_shard_map(hopper):
    """On a mesh of the GPU, inside shard_map with JAX's varying-axes checks on (the default; the
    rerun by the loop) and off (the device redo): the attention core takes the kernels, a fault
    injected there is corrected, and the output and gradients are bit for bit the unsplit call's
    (the same kernels on the same rows); the protected GEMM's device redo (``recompute_kernel``)
    likewise."""
    from jax.sharding import PartitionSpec as P

    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1], axis_types=auto)
    b, t, h, kv, d = 2, 512, 8, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=6)
    g = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    fs = GemmFaults.random(jax.random.key(8), (b * h * t, t), 1, 1.0, bit=30)

    def loss(q, k, v, fs):
        out, r = L.attention_core(q, k, v, faults={"scores": fs})
        return jnp.sum(out.astype(jnp.float32) * g), (out, r.gemm_detected, r.gemm_uncorrectable)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, (o2, _, _)), g2 = jax.jit(step)(q, k, v, fs)

    def local(*args):
        (value, (out, det, unco)), grads = step(*args)
        total = lambda x: jax.lax.psum(x, "d")
        return (total(value), (out, total(det), total(unco))), grads

    specs = ((P(), (P("d"), P(), P())), (P("d"),) * 3)
    for check_vma in (True, False):
        sm = jax.shard_map(
            local, mesh=mesh, in_specs=(P("d"),) * 3 + (P(),), out_specs=specs, check_vma=check_vma
        )
        split = jax.jit(sm)
        assert "mosaic" in split.lower(q, k, v, fs).as_text().lower()
        (_, (o1, det, unco)), g1 = split(q, k, v, fs)
        assert (int(det), int(unco)) == (1, 0)
        for a, c in zip((o1, *g1), (o2, *g2), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(c).tobytes(), check_vma

    x = jax.random.normal(jax.random.key(9), (512, 256)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(10), (256, 512)).astype(jnp.bfloat16)
    pol = FaultPolicy(recompute_kernel=True)
    gemm = lambda x, w: jnp.sum(jnp.sin(ops.protected_matmul(x, w, policy=pol)[0].astype(jnp.float32)))
    grads = jax.grad(gemm, argnums=(0, 1))
    sm = jax.shard_map(grads, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P()))
    for a, c in zip(jax.jit(sm)(x, w), jax.jit(grads)(x, w), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(c).tobytes()


def test_kernel_under_vmap_equals_one_call_per_example(hopper):
    # plgpu.kernel's vmap rule adds a grid axis; Equinox layers are vmapped over a batch.
    q, k, v = _qkv(3, 256, 4, 2, 128, seed=6)
    f = lambda q, k, v: ops.flash_attention(q[None], k[None], v[None])
    out, _, checks = jax.vmap(f)(q, k, v)
    for i in range(3):
        o1, _, c1 = f(q[i], k[i], v[i])
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(o1, np.float32))
        # The ratios' bounds come from XLA (|q|·kmax), whose batched and unbatched reductions may
        # round differently in the last place: equal to f32 rounding, not bit for bit.
        np.testing.assert_allclose(np.asarray(checks.scores[i]), np.asarray(c1.scores), rtol=1e-5)


def _redone(flags):
    """(B, T, H) bool: the query rows of the CTAs ``flags`` (B, H, T / 128) marks."""
    return np.repeat(np.asarray(flags) != 0, 128, axis=-1).transpose(0, 2, 1)


REDO_SHAPES = [(2, 384, 4, 2, 128, True), (1, 256, 8, 2, 64, False)]


def test_a_forward_and_its_redo_transpose_v_once(hopper):
    """The fused output check (the default) reads v transposed, (B, KV, D, S). The forward and its
    device redo each ask for the transpose (the redo inside a jit of its own); in the compiled
    program they share one: the forward with its redo makes as many arrays of that shape as the
    forward alone, and ``fuse_v=False`` makes none."""
    b, t, h, kv, d = 1, 384, 4, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=9)
    shape = f"= bf16[{b},{kv},{d},{t}]"  # an HLO instruction's result of the transposed shape

    def made(fn, config):
        text = jax.jit(lambda q, k, v: fn(q, k, v, config=config)[0]).lower(q, k, v).compile().as_text()
        entry = text[text.index("\nENTRY") :]
        entry = entry[: entry.index("\n}")]  # the entry computation: each kernel's result once
        return sum(shape in line for line in entry.splitlines())

    one = made(ops.flash_attention, ops.FlashConfig())
    assert one >= 1 and made(ops.flash_attention, V_APART) == 0
    assert made(ops.flash_attention_with_redo, ops.FlashConfig()) == one
    assert made(ops.flash_attention_with_redo, V_APART) == 0


@pytest.mark.parametrize("config", [ops.FlashConfig(), V_APART], ids=["default", "v-apart"])
@pytest.mark.parametrize("shape", REDO_SHAPES)
def test_redo_kernel_rewrites_the_flagged_blocks_alone(hopper, shape, config):
    b, t, h, kv, d, causal = shape
    q, k, v = _qkv(b, t, h, kv, d, seed=7)
    faults = flash_faults([("scores", 0, 1, 40, 30, 3), ("out", b - 1, h - 1, t - 1, 29, 7)], b, h, t)
    out, lse, checks = ops.flash_attention(q, k, v, faults, causal=causal, config=config)
    flags = ops.redo_flags(checks)
    assert int(np.sum(np.asarray(flags))) == 2
    # Head 0's second block is not flagged: whatever it holds (here garbage) must stay.
    garbage = out.at[:, 128:256, 0].set(3.0)
    o2, l2, c2, gated = ops.flash_attention_redo(
        q, k, v, flags, garbage, lse, checks, causal=causal, config=config
    )
    clean, lse0, _ = ops.flash_attention(q, k, v, causal=causal, config=config)
    ro, _, _, _ = ops.flash_attention_redo_reference(q, k, v, flags, garbage, lse, checks, causal=causal)
    rows = _redone(flags)
    o2, garbage, clean = (np.asarray(a, np.float32) for a in (o2, garbage, clean))
    np.testing.assert_array_equal(o2[rows], clean[rows])  # the kernel's own arithmetic, fault-free
    np.testing.assert_array_equal(o2[~rows], garbage[~rows])
    rows_h = rows.transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(l2)[rows_h], np.asarray(lse0)[rows_h])
    np.testing.assert_array_equal(np.asarray(l2)[~rows_h], np.asarray(lse)[~rows_h])
    assert float(np.max(c2.scores)) <= 1.0 and float(np.max(c2.out)) <= 1.0
    assert int(np.sum(np.asarray(gated))) == 0
    np.testing.assert_allclose(o2, np.asarray(ro, np.float32), atol=1e-2)


def test_persistent_redo_runs_several_units_a_cta(hopper):
    """``FlashConfig(redo_ctas=3)``: the redo's 8 units (2 batches, 2 heads, 2 blocks of 128 query
    rows; flat index (batch, head, block)) over 3 persistent CTAs, CTA p running the flagged ones of
    p, p + 3, p + 6. Units 0, 3 and 6 (all CTA 0's, back to back) and 5 (CTA 2's last) are flagged.
    At 64 keys a step each causal unit's first warpgroup skips key blocks that its rows do not see,
    and every barrier must still be in step when the CTA's next unit starts."""
    b, t, h, kv, d = 2, 256, 2, 1, 64
    cfg = ops.FlashConfig(block_kv=64, redo_ctas=3)
    q, k, v = _qkv(b, t, h, kv, d, seed=11)
    units = [(0, 0, 0), (0, 1, 1), (1, 1, 0), (1, 0, 1)]  # (batch, head, block): flat 0, 3, 6, 5
    faults = flash_faults([("scores", bi, hi, 128 * nq + 5, 30, 2) for bi, hi, nq in units], b, h, t)
    out, lse, checks = ops.flash_attention(q, k, v, faults, config=cfg)
    flags = np.asarray(ops.redo_flags(checks, cfg))
    assert sorted(zip(*np.nonzero(flags), strict=True)) == sorted(units)
    garbage = jnp.where(jnp.asarray(_redone(flags))[..., None], out, 3.0).astype(out.dtype)  # to be kept
    o2, l2, c2, _ = ops.flash_attention_redo(q, k, v, jnp.asarray(flags), garbage, lse, checks, config=cfg)
    clean, lse0, _ = ops.flash_attention(q, k, v, config=cfg)
    rows = _redone(flags)
    o2, garbage, clean = (np.asarray(a, np.float32) for a in (o2, garbage, clean))
    np.testing.assert_array_equal(o2[rows], clean[rows])
    np.testing.assert_array_equal(o2[~rows], garbage[~rows])
    rows_h = rows.transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(l2)[rows_h], np.asarray(lse0)[rows_h])
    assert float(np.max(c2.scores)) <= 1.0 and float(np.max(c2.out)) <= 1.0


def test_redo_kernel_gates_its_rows(hopper):
    b, t, h, kv, d = 1, 256, 4, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=8)
    q = q.at[0, 5, 3].set(jnp.nan).at[0, 200, 0].set(jnp.inf)
    out, lse, checks = ops.flash_attention(q, k, v)
    flags = ops.redo_flags(checks)
    inf = float("inf")
    _, _, c2, gated = ops.flash_attention_redo(q, k, v, flags, out, lse, checks, gate=(0.5, inf))
    _, _, _, want = ops.flash_attention_redo_reference(q, k, v, flags, out, lse, checks, gate=(0.5, inf))
    np.testing.assert_array_equal(np.asarray(gated), np.asarray(want))
    assert int(gated[0, 3, 5]) == d and int(gated[0, 0, 200]) == d
    assert not float(c2.scores[0, 3, 5]) <= 1.0  # still failing: the layer reports it
    # A limit: the redone rows' values beyond it replaced and counted, the others untouched.
    limit = 0.05
    bare, _, _, none = ops.flash_attention_redo(q, k, v, flags, out, lse, checks)
    gated_o, _, _, counts = ops.flash_attention_redo(q, k, v, flags, out, lse, checks, gate=(0.0, limit))
    bare, gated_o = np.asarray(bare, np.float32), np.asarray(gated_o, np.float32)
    rows = _redone(flags)
    beyond = ~(np.abs(bare) <= limit) & rows[..., None]
    assert int(np.sum(np.asarray(none))) == 0
    np.testing.assert_array_equal(np.asarray(counts), beyond.sum(-1).transpose(0, 2, 1))
    np.testing.assert_array_equal(gated_o, np.where(beyond, 0.0, bare))


def test_redo_kernel_under_vmap(hopper):
    q, k, v = _qkv(3, 256, 4, 2, 128, seed=9)
    clean, lse, checks = jax.vmap(lambda q, k, v: ops.flash_attention(q[None], k[None], v[None]))(q, k, v)
    flags = jnp.zeros((3, 1, 4, 2), jnp.int32).at[0, 0, 1, 0].set(1).at[2, 0, 3, 1].set(1)
    garbage = jnp.full_like(clean, 2.0)

    def redo(q, k, v, f, o, lse, c):
        return ops.flash_attention_redo(q[None], k[None], v[None], f, o, lse, c)[0]

    got = np.asarray(jax.vmap(redo)(q, k, v, flags, garbage, lse, checks), np.float32)
    for i in range(3):
        rows = _redone(flags[i])
        np.testing.assert_array_equal(got[i][rows], np.asarray(clean[i], np.float32)[rows])
        assert np.all(got[i][~rows] == 2.0)


def test_attention_core_device_redo_reports_as_the_loop(hopper):
    b, t, h, kv, d = 1, 512, 8, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=10)
    core = jax.jit(lambda q, k, v, f, p: L.attention_core(q, k, v, policy=p, faults=f), static_argnums=4)
    assert "mosaic" in core.lower(q, k, v, None, FaultPolicy()).as_text().lower()
    clean, _ = core(q, k, v, None, FaultPolicy())
    fs = GemmFaults.random(jax.random.key(3), (b * h * t, t), 3, 1.0, bit=30)
    fo = GemmFaults.random(jax.random.key(4), (b * h * t, d), 2, 1.0, bit=30)
    o1, r1 = core(q, k, v, {"scores": fs, "pv": fo}, FaultPolicy())  # the device redo
    o2, r2 = core(q, k, v, {"scores": fs, "pv": fo}, FaultPolicy(recompute_kernel=False))  # the loop
    rd = r1.to_dict()
    assert rd["gemm_detected"] >= 1 and rd["gemm_corrected"] == rd["gemm_detected"]
    assert 2 <= rd["gemm_recomputed"] <= 2 * b * kv
    assert {**rd, "gemm_recomputed": 0} == {**r2.to_dict(), "gemm_recomputed": 0}
    for o in (o1, o2):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(clean, np.float32))


def test_with_redo_shares_the_bounds_and_equals_the_clean_kernel(hopper):
    """The layer's op: first pass with faults, then the redo on the same bounds; its output is the
    fault-free kernel's bit for bit, its first checks flag the faults and its final ones pass."""
    b, t, h, kv, d = 2, 384, 4, 2, 128
    q, k, v = _qkv(b, t, h, kv, d, seed=12)
    faults = flash_faults([("scores", 1, 2, 100, 30, 7), ("out", 0, 3, 300, 30, 5)], b, h, t)
    out, lse, first, final, gated = ops.flash_attention_with_redo(q, k, v, faults, gate=(0.0, float("inf")))
    assert _flagged(first.scores) == {(1, 2, 100)} and _flagged(first.out) >= {(0, 3, 300)}
    assert not _flagged(final.scores) and not _flagged(final.out)
    assert int(np.sum(np.asarray(gated))) == 0
    clean, lse0, _ = ops.flash_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))
    ref = ops.flash_attention_with_redo_reference(q, k, v, faults, gate=(0.0, float("inf")))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref[0], np.float32), atol=1e-2)
