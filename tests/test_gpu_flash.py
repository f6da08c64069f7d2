"""The verified flash attention kernel on a Hopper GPU against its XLA reference (skipped elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter

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


@pytest.mark.parametrize(
    "config", [ops.FlashConfig(), ops.FlashConfig(fuse_e=False), ops.FlashConfig(bounds_kernel=False)]
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


@pytest.mark.parametrize("config", [ops.FlashConfig(), ops.FlashConfig(bounds_kernel=False)])
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
