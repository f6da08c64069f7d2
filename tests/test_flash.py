"""Verified flash attention: the kernel's reference, its checks, and the attention core's flash path.

On the CPU the flash path runs with ``flash_attention_reference`` standing in for the Hopper kernel
(the same outputs, ratios and injected flips, computed by XLA with the scores materialised); the GPU
tests (``tests/test_gpu.py``) check the kernel against that reference and run the same fault
scenarios through it.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_CUDA
from helpers import TraceCounter, flash_faults

from benchmarks.bounds import _same_tiles
from pimlayers import layers as L
from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults

B, T, H, KV, D = 2, 256, 4, 2, 64  # two key blocks, one CTA's worth of query rows x2


def _qkv(b=B, t=T, h=H, kv=KV, d=D, seed=0, scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 3)
    mk = lambda key, heads: (scale * jax.random.normal(key, (b, t, heads, d))).astype(jnp.bfloat16)
    return mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv)


def _gpu_text(fn, *args) -> str:
    """``fn``'s program lowered for a GPU, as text (Mosaic GPU and Triton lower without one)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lowered(fn, *args) -> tuple[int, int, int]:
    """``fn`` lowered for a GPU: its Mosaic GPU launches, Triton launches and while loops."""
    text = _gpu_text(fn, *args)
    calls = collections.Counter(re.findall(r"custom_call @([\w$.]+)", text))
    return calls["mosaic_gpu_v2"], calls["__gpu$xla.gpu.triton"], text.count("stablehlo.while")


def _faults(rows, b=B, h=H, t=T):
    """FlashFaults with the given (site, batch, head, row, bit, key-or-column) flips."""
    return flash_faults(rows, b, h, t)


# Under jit, as the layers call it: eagerly each of its ops compiles on its own (several times slower).
_reference = jax.jit(ops.flash_attention_reference, static_argnames="causal")


def _flagged(ratios):
    return {tuple(i) for i in np.argwhere(~(np.asarray(ratios) <= 1.0)).tolist()}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("h", "kv"), [(4, 2), (4, 4), (8, 1)])
def test_reference_matches_jax_attention(causal, h, kv):
    q, k, v = _qkv(h=h, kv=kv)
    out, lse, checks = _reference(q, k, v, causal=causal)
    with jax.numpy_dtype_promotion("standard"):  # jax's own attention promotes bf16 with f32
        ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    # bf16 outputs: the reference normalises by the sum of the bf16 probabilities (as the kernel's
    # tensor cores do), jax by the f32 sum: a few bf16 ulps at most.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)
    kh = jnp.repeat(k, h // kv, axis=2).astype(jnp.float32)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kh) / np.sqrt(D)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None, None], s, -jnp.inf)
    # l is the sum of the bf16 probabilities (each within 2^-9 of its f32 value): lse within ~2^-9.
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(s, axis=-1)), atol=2**-8)
    assert _flagged(checks.scores) == set() and _flagged(checks.out) == set()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_clean_ratios_stay_well_inside_the_bound(scale):
    # Magnitudes from tiny to large logits (30^2 * 64 / 8 = 7200 before the softmax's scale).
    q, k, v = _qkv(seed=3, scale=scale)
    _, _, checks = _reference(q, k, v)
    assert float(checks.scores.max()) < 0.25 and float(checks.out.max()) < 0.25


@pytest.mark.parametrize("bit", [30, 27, 24, 31])
def test_injected_flips_are_flagged_on_their_rows(bit):
    q, k, v = _qkv(seed=1)
    sites = [("scores", 0, 1, 100, bit, 50), ("scores", 1, 3, 255, bit, 200), ("out", 1, 0, 7, bit, 13)]
    _, _, clean = _reference(q, k, v)
    _, _, checks = _reference(q, k, v, _faults(sites))
    assert _flagged(checks.scores) == {(0, 1, 100), (1, 3, 255)}
    # A huge score can also break the softmax of its own row, whose out check then fails too.
    assert (1, 0, 7) in _flagged(checks.out) <= {(1, 0, 7), (0, 1, 100), (1, 3, 255)}
    np.testing.assert_array_equal(np.asarray(clean.scores)[0, 0], np.asarray(checks.scores)[0, 0])


def test_a_flip_below_the_rounding_bound_passes():
    q, k, v = _qkv(seed=2)
    _, _, checks = _reference(q, k, v, _faults([("scores", 0, 0, 10, 0, 3)]))
    assert _flagged(checks.scores) == set()  # the last mantissa bit of one f32 score: harmless


@pytest.mark.parametrize(
    "config", [ops.FlashConfig(), *(ops.FlashConfig(bounds_kernel=x) for x in (False, True))]
)
def test_bounds_shapes_and_tiles(config):
    _, k, v = _qkv()
    ks, vs, km = ops._flash.flash_bounds(k, v, lam=8.0, config=config)
    nb = T // ops.FlashConfig().block_kv
    assert ks.shape == (B, KV, nb, 8, D) and vs.shape == (B, KV, nb, 8, 128) and km.shape == (B, KV, 8, D)
    hilo = lambda tile, i: tile[..., i, :].astype(jnp.float32) + tile[..., i + 1, :].astype(jnp.float32)
    # hi + lo carries the key block sums to 2^-16 relative; the value tile's third row is ones.
    kf = k.astype(jnp.float32).reshape(B, nb, 128, KV, D).sum(2).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.asarray(hilo(ks, 0)), np.asarray(kf), rtol=2**-16, atol=1e-6)
    assert bool(jnp.all(vs[:, :, :, 2] == 1)) and bool(jnp.all(vs[:, :, :, 5:] == 0))
    assert bool(jnp.all(ks[:, :, :, 2:] == 0)) and bool(jnp.all(km[:, :, 2:] == 0))
    # The bounds' factors: c_qk kmax (kmax = the largest |key block| sum per D) and c_pv vmax (the
    # largest sum over D of |v| of a key), the latter in every key's column.
    c_qk, c_pv = ops._flash._bound_consts(D, T, 128, 8.0)
    kabs = jnp.abs(k.astype(jnp.float32)).reshape(B, nb, 128, KV, D).sum(2).max(1)
    np.testing.assert_allclose(np.asarray(hilo(km, 0)), np.asarray(c_qk * kabs), rtol=2**-16)
    vmax = jnp.abs(v.astype(jnp.float32)).sum(-1).max(1)  # (B, KV)
    want = jnp.broadcast_to((c_pv * vmax)[:, :, None, None], (B, KV, nb, 128))
    np.testing.assert_allclose(np.asarray(hilo(vs, 3)), np.asarray(want), rtol=2**-16)


@pytest.mark.parametrize(("shape", "block_kv"), [((2, 256, 2, 64), 128), ((1, 384, 3, 128), 64)])
def test_bounds_kernel_tiles_are_xlas(shape, block_kv):
    """The one-pass Pallas bounds (run by Pallas' interpreter here) against XLA's tiles: the same
    shapes and constant rows, hi + lo of every sum within f32 rounding of XLA's (another order)."""
    kk, kv_ = jax.random.split(jax.random.key(4))
    k = (3 * jax.random.normal(kk, shape)).astype(jnp.bfloat16)
    v = (2 * jax.random.normal(kv_, shape)).astype(jnp.bfloat16)
    want = ops._flash.flash_bounds(
        k, v, lam=8.0, config=ops.FlashConfig(block_kv=block_kv, bounds_kernel=False)
    )
    cfg = ops.FlashConfig(block_kv=block_kv, bounds_kernel=True)
    got = jax.jit(lambda a, b: ops._flash.flash_bounds(a, b, lam=8.0, config=cfg))(k, v)
    for name, a, w in zip(("ks", "vs", "km"), got, want, strict=True):
        assert a.shape == w.shape and a.dtype == w.dtype == jnp.bfloat16, name
    _same_tiles(got, want)  # hi + lo of each sum to f32 rounding; the constant rows equal


def test_bounds_kernel_carries_a_nan_into_every_tile_of_its_head():
    _, k, v = _qkv()
    k = k.at[1, 130, 0, 5].set(jnp.nan)
    v = v.at[0, 7, 1, 3].set(jnp.inf)
    ks, vs, km = ops._flash.flash_bounds(k, v, lam=8.0, config=ops.FlashConfig(bounds_kernel=True))
    f = lambda t: np.asarray(t, np.float32)
    assert np.isnan(f(ks)[1, 0, 1, :2, 5]).all() and np.isfinite(f(ks)[1, 0, 0]).all()
    assert not np.isfinite(f(km)[1, 0, :2, 5]).any() and np.isfinite(f(km)[0]).all()
    assert not np.isfinite(f(vs)[0, 1, :, 3:5]).any()  # c_pv·vmax in every block of that head
    assert np.isfinite(f(vs)[1]).all()


def test_bounds_kernel_lowers_to_two_triton_kernels_for_a_gpu():
    """The kernels a GPU would run, lowered here (no GPU needed): two Triton calls, no interpreter."""
    k = jnp.zeros((1, 1024, 8, 128), jnp.bfloat16)
    cfg = ops.FlashConfig(bounds_kernel=True)
    f = jax.jit(lambda a, b: ops._flash.flash_bounds(a, b, lam=8.0, config=cfg))
    text = f.trace(k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "pimlayers_flash_bounds_blocks" in text and "pimlayers_flash_bounds_finish" in text


def test_the_default_bounds_are_the_triton_kernels_on_a_gpu_and_xlas_elsewhere():
    """FlashConfig() lowers to the two Triton kernels for a GPU, to no kernel call for a CPU, where
    its tiles are XLA's bit for bit; bounds_kernel=False lowers to XLA's for a GPU too."""
    _, k, v = _qkv()
    lowered = lambda cfg, platform: (
        jax.jit(lambda a, b: ops._flash.flash_bounds(a, b, lam=8.0, config=cfg))
        .trace(k, v)
        .lower(lowering_platforms=(platform,))
        .as_text()
    )
    assert lowered(ops.FlashConfig(), "cuda").count("__gpu$xla.gpu.triton") == 2
    assert "triton" not in lowered(ops.FlashConfig(bounds_kernel=False), "cuda")
    assert "triton" not in lowered(ops.FlashConfig(), "cpu")
    got = ops._flash.flash_bounds(k, v, lam=8.0)
    want = ops._flash.flash_bounds(k, v, lam=8.0, config=ops.FlashConfig(bounds_kernel=False))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want, strict=True))


def test_the_references_bounds_are_xlas_unless_asked_for_the_kernels():
    """The references (pure XLA, for tests and non-Hopper fallbacks) lower to no Triton call for a GPU
    with the default config, where the kernels' own paths take the Triton bounds; True asks for them."""
    from pimlayers.ops._flash_bwd import FlashBwdConfig

    q, k, v = _qkv()
    out, lse, _ = _reference(q, k, v)
    fwd = lambda cfg: _gpu_text(lambda a, b, c: ops.flash_attention_reference(a, b, c, config=cfg), q, k, v)
    bwd = lambda cfg: _gpu_text(
        lambda *xs: ops.flash_attention_bwd_reference(*xs, config=cfg)[:3], q, k, v, out, lse, q
    )
    assert "triton" not in fwd(None) and "triton" not in bwd(None)
    assert fwd(ops.FlashConfig(bounds_kernel=True)).count("xla.gpu.triton") == 2
    assert bwd(FlashBwdConfig(bounds_kernel=True)).count("xla.gpu.triton") == 3


def test_the_environment_can_make_the_default_bounds_xlas(monkeypatch):
    """PIMLAYERS_BOUNDS_KERNEL=0: the default lowers to XLA's bounds for a GPU too (the forward's and
    the backward's); an explicit True still asks for the kernels."""
    from pimlayers.ops._flash_bwd import FlashBwdConfig, flash_bwd_bounds

    monkeypatch.setenv("PIMLAYERS_BOUNDS_KERNEL", "0")
    _, k, v = _qkv()
    q = jnp.concatenate([k, k], axis=2)  # 2 query heads per KV head: any values do for lowering

    def lowered(fwd, bwd):
        f = jax.jit(lambda a, b: ops._flash.flash_bounds(a, b, lam=8.0, config=fwd))
        g = jax.jit(lambda a, b, c: flash_bwd_bounds(a, b, c, a, lam=8.0, config=bwd, out=a))
        return _gpu_text(f, k, v).count("xla.gpu.triton"), _gpu_text(g, q, k, v).count("xla.gpu.triton")

    assert lowered(ops.FlashConfig(), FlashBwdConfig()) == (0, 0)
    assert lowered(ops.FlashConfig(bounds_kernel=True), FlashBwdConfig(bounds_kernel=True)) == (2, 3)


def test_bounds_kernel_under_vmap_is_one_call_per_example():
    """On one GPU a vmapped attention call reaches the bounds kernels batched (the default there):
    Pallas' batching rule, run here by its interpreter, gives each example's own tiles."""
    kk, kv_ = jax.random.split(jax.random.key(5))
    shape = (3, 1, 256, 2, 64)  # a vmapped axis of 3 over (B, S, KV, D)
    k = (3 * jax.random.normal(kk, shape)).astype(jnp.bfloat16)
    v = (2 * jax.random.normal(kv_, shape)).astype(jnp.bfloat16)
    cfg = ops.FlashConfig(bounds_kernel=True)
    f = lambda a, b: ops._flash.flash_bounds(a, b, lam=8.0, config=cfg)
    got = jax.jit(jax.vmap(f))(k, v)
    for i in range(shape[0]):
        want = jax.jit(f)(k[i], v[i])
        assert all(np.array_equal(np.asarray(a[i]), np.asarray(w)) for a, w in zip(got, want, strict=True))


def test_reference_with_the_bounds_kernel_flags_the_same_rows():
    q, k, v = _qkv(seed=3)
    faults = _faults([("scores", 0, 1, 40, 30, 12), ("out", 1, 2, 200, 28, 7)])
    cfg = ops.FlashConfig(bounds_kernel=True)
    out, lse, got = ops.flash_attention_reference(q, k, v, faults, config=cfg)
    out0, lse0, want = _reference(q, k, v, faults)
    assert np.array_equal(np.asarray(out), np.asarray(out0)) and np.array_equal(
        np.asarray(lse), np.asarray(lse0)
    )
    assert _flagged(got.scores) == _flagged(want.scores) == {(0, 1, 40)}
    assert _flagged(got.out) == _flagged(want.out) == {(1, 2, 200)}


def test_kernel_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.flash_attention(q[:, :100], k[:, :100], v[:, :100])
    with pytest.raises(ValueError, match="T == S"):
        ops.flash_attention(q, k[:, :128], v[:, :128])
    with pytest.raises(TypeError, match="one dtype"):
        ops.flash_attention(q, k.astype(jnp.float16), v)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.flash_attention(*(a.astype(jnp.float16) for a in (q, k, v)))
    with pytest.raises(ValueError, match="expected int32"):
        ops.flash_attention(q, k, v, ops.FlashFaults.none(B, T, H))
    with pytest.raises(ValueError, match="pass checks=True"):
        ops.flash_attention(q, k, v, ops.FlashFaults.none(B, H, T), checks=False)
    if not ops._fused_gemm.hopper():
        with pytest.raises(NotImplementedError, match="Hopper"):
            ops.flash_attention(q, k, v)


# --- the attention core's flash path (the reference standing in for the kernel on the CPU) ---

POLICY = FaultPolicy()


def test_flash_path_matches_the_materialised_path():
    q, k, v = _qkv(seed=4)
    core = jax.jit(lambda q, k, v, f: L.attention_core(q, k, v, policy=POLICY, flash=f), static_argnums=3)
    o1, r1 = core(q, k, v, True)
    o2, r2 = core(q, k, v, False)
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2, np.float32), atol=3e-2)
    assert r1.to_dict() == r2.to_dict() == {**r2.zeros().to_dict(), "gemm_checked": 2 * B * KV}


def test_flash_path_recomputes_a_detected_fault_without_recompiling():
    q, k, v = _qkv(seed=5)
    clean, _ = L.attention_core(q, k, v, policy=POLICY, flash=True)
    body = TraceCounter(lambda q, k, v, f: L.attention_core(q, k, v, policy=POLICY, flash=True, faults=f))
    run = jax.jit(body)
    for seed in range(3):
        # Exponent flips at random sites of both GEMMs (rows of the (B·KV·g·T, ·) outputs).
        fs = GemmFaults.random(jax.random.key(seed), (B * H * T, T), 2, 1.0, bit=30)
        fo = GemmFaults.random(jax.random.key(seed + 10), (B * H * T, D), 1, 1.0, bit=30)
        out, r = run(q, k, v, {"scores": fs, "pv": fo})
        rd = r.to_dict()
        # Up to 5: a huge score can break its row's out check too.
        assert 1 <= rd["gemm_detected"] <= 5 and rd["gemm_corrected"] == rd["gemm_detected"]
        assert rd["gemm_recomputed"] == 2 * B * KV and rd["gemm_uncorrectable"] == 0
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
    assert body.count == 1


REDO = FaultPolicy(recompute_kernel=True)  # the device redo (its XLA twin on the CPU), no loop


def _cta_rows(flags):
    """(B, H, T) bool: the query rows of the CTAs ``flags`` (B, H, T / 128) marks."""
    return np.repeat(np.asarray(flags) != 0, 128, axis=-1)


def test_redo_reference_rewrites_the_flagged_blocks_alone():
    q, k, v = _qkv(t=384, seed=11)
    faults = _faults([("scores", 0, 1, 40, 30, 3), ("out", 1, 2, 300, 29, 7)], t=384)
    out, lse, checks = _reference(q, k, v, faults)
    flags = ops.redo_flags(checks)
    want_flags = np.zeros((B, H, 3), np.int32)
    want_flags[0, 1, 0] = want_flags[1, 2, 2] = 1
    np.testing.assert_array_equal(np.asarray(flags), want_flags)
    # A block nothing flagged keeps whatever it held (here garbage): nothing but the flagged CTAs
    # is written.
    garbage = out.at[0, 128:256, 3].set(7.0)
    o2, l2, c2, gated = ops.flash_attention_redo_reference(q, k, v, flags, garbage, lse, checks)
    clean, lse0, _ = _reference(q, k, v)
    rows = _cta_rows(flags).transpose(0, 2, 1)  # (B, T, H)
    o2, garbage, clean = (np.asarray(a, np.float32) for a in (o2, garbage, clean))
    np.testing.assert_array_equal(o2[rows], clean[rows])
    np.testing.assert_array_equal(o2[~rows], garbage[~rows])
    assert float(np.max(c2.scores)) <= 1.0 and float(np.max(c2.out)) <= 1.0
    np.testing.assert_array_equal(np.asarray(l2), np.asarray(lse0))  # lse: flagged fresh, others the same
    assert int(np.sum(gated)) == 0


def test_with_redo_reference_corrects_the_first_pass():
    q, k, v = _qkv(t=384, seed=14)
    faults = _faults([("scores", 1, 2, 100, 30, 7), ("out", 0, 3, 300, 30, 5)], t=384)
    out, lse, first, final, gated = jax.jit(ops.flash_attention_with_redo_reference)(q, k, v, faults)
    assert _flagged(first.scores) == {(1, 2, 100)} and _flagged(first.out) >= {(0, 3, 300)}
    assert not _flagged(final.scores) and not _flagged(final.out) and int(np.sum(gated)) == 0
    clean, lse0, _ = _reference(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))


def test_redo_reference_gates_the_rows_it_rewrites():
    q, k, v = _qkv(seed=12)
    q = q.at[1, 5, 3].set(jnp.nan).at[0, 200, 0].set(jnp.nan)
    out, lse, checks = _reference(q, k, v)
    flags = ops.redo_flags(checks)  # NaN rows fail their checks
    assert np.asarray(flags)[1, 3, 0] == 1 and np.asarray(flags)[0, 0, 1] == 1
    o2, _, c2, gated = ops.flash_attention_redo_reference(
        q, k, v, flags, out, lse, checks, gate=(0.5, float("inf"))
    )
    g = np.asarray(gated)
    assert g[1, 3, 5] == D and g[0, 0, 200] == D and int(g.sum()) == 2 * D
    assert np.all(np.asarray(o2, np.float32)[1, 5, 3] == 0.5)
    assert not c2.scores[1, 3, 5] <= 1.0  # still failing: the layers report it uncorrectable


def test_redo_errors():
    q, k, v = _qkv()
    out, lse, checks = _reference(q, k, v)
    flags = ops.redo_flags(checks)
    for f in (ops.flash_attention_redo, ops.flash_attention_redo_reference):
        with pytest.raises(ValueError, match=r"flags is int32\[2, 4, 1\]; expected int32\[2, 4, 2\]"):
            f(q, k, v, flags[..., :1], out, lse, checks)
        with pytest.raises(ValueError, match="lse is"):
            f(q, k, v, flags, out, lse[:, :2], checks)
        with pytest.raises(TypeError, match="expected FlashChecks"):
            f(q, k, v, flags, out, lse, tuple(checks))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.redo_flags(ops.FlashChecks(lse[..., :100], lse[..., :100]))
    if not ops._fused_gemm.hopper():
        with pytest.raises(NotImplementedError, match="Hopper"):
            ops.flash_attention_redo(q, k, v, flags, out, lse, checks)
        with pytest.raises(NotImplementedError, match="Hopper"):
            ops.flash_attention_with_redo(q, k, v)
    with pytest.raises(TypeError, match="expected bfloat16"):
        ops.flash_attention_with_redo(*(a.astype(jnp.float16) for a in (q, k, v)))


def test_fold_vmap_folds_the_vmapped_axis_into_the_batch():
    calls = []

    def fn(x, y):
        calls.append(x.shape)
        return x * 2 + y, jnp.sum(x, axis=-1)

    f = ops._flash._fold_vmap(fn)
    x = jnp.arange(24.0).reshape(3, 2, 4)
    y = jnp.ones((2, 4))
    a, s = jax.vmap(f, in_axes=(0, None))(x, y)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(x * 2 + y[None]))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(jnp.sum(x, axis=-1)))
    # Traced once per example for its shapes, then called on the folded batch (3 x 2 rows).
    assert calls[-1] == (6, 4) and (3, 2, 4) not in calls


def test_flash_path_device_redo_corrects_as_the_loop_does_without_recompiling():
    q, k, v = _qkv(seed=5)
    clean, r0 = L.attention_core(q, k, v, policy=REDO, flash=True)
    assert r0.to_dict() == {**r0.zeros().to_dict(), "gemm_checked": 2 * B * KV}
    body = TraceCounter(lambda q, k, v, f, p: L.attention_core(q, k, v, policy=p, flash=True, faults=f))
    run = jax.jit(body, static_argnums=4)
    for seed in range(3):
        fs = GemmFaults.random(jax.random.key(seed), (B * H * T, T), 2, 1.0, bit=30)
        fo = GemmFaults.random(jax.random.key(seed + 10), (B * H * T, D), 1, 1.0, bit=30)
        out, r = run(q, k, v, {"scores": fs, "pv": fo}, REDO)
        loop_out, loop_r = run(q, k, v, {"scores": fs, "pv": fo}, POLICY)
        rd, ld = r.to_dict(), loop_r.to_dict()
        assert 1 <= rd["gemm_detected"] <= 5 and rd["gemm_corrected"] == rd["gemm_detected"]
        assert rd["gemm_uncorrectable"] == 0 and 2 <= rd["gemm_recomputed"] <= 2 * B * KV
        # The same counts as the loop's but gemm_recomputed (the loop reruns every GEMM).
        assert {**rd, "gemm_recomputed": 0} == {**ld, "gemm_recomputed": 0}
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
        np.testing.assert_array_equal(np.asarray(loop_out, np.float32), np.asarray(clean, np.float32))
    assert body.count == 2  # one trace per policy, none per fault


def test_flash_path_device_redo_gates_and_reports_as_the_loop_does():
    q, k, v = _qkv(seed=13)
    q = q.at[0, 77, 2].set(jnp.inf)
    core = jax.jit(lambda q, p: L.attention_core(q, k, v, policy=p, flash=True), static_argnums=1)
    (o1, r1), (o2, r2) = core(q, REDO), core(q, POLICY)
    rd = r1.to_dict()
    assert rd["gemm_detected"] >= 1 and rd["gemm_uncorrectable"] == rd["gemm_detected"]
    assert rd["nonfinite_gated"] == D  # the one row, every value
    assert {**rd, "gemm_recomputed": 0} == {**r2.to_dict(), "gemm_recomputed": 0}
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))


def test_the_fused_value_check_is_the_environments_where_the_config_leaves_it(monkeypatch):
    """``FlashConfig.fuse_v`` None (the default) is on unless ``PIMLAYERS_FLASH_FUSE_V=0``. Lowered
    for a GPU here (Mosaic GPU lowers without one), the fused output check transposes v before the
    kernel: one transpose more than ``fuse_v=False``. The switch is read at each call, before the
    kernel's jit: flipped between two calls of one shape, in a jit of the caller's own each time,
    the second call traces afresh and follows it (read inside the trace, it would reuse the first
    call's program from the kernel's jit cache)."""
    monkeypatch.setattr(ops._flash, "hopper", lambda: True)
    monkeypatch.delenv("PIMLAYERS_FLASH_FUSE_V", raising=False)
    check = ops._flash.fused_value_check
    assert (check(None), check(True), check(False)) == (True, True, False)

    def transposes(config=None):
        q, k, v = (jnp.zeros((1, 256, n, 64), jnp.bfloat16) for n in (4, 2, 2))
        fn = lambda q, k, v: ops.flash_attention(q, k, v, config=config)[0]
        return _gpu_text(fn, q, k, v).count("transpose")

    apart = transposes(ops.FlashConfig(fuse_v=False))
    assert transposes(ops.FlashConfig(fuse_v=True)) == transposes() == apart + 1
    monkeypatch.setenv("PIMLAYERS_FLASH_FUSE_V", "0")
    assert (check(None), check(True)) == (False, True)
    assert transposes() == apart
    assert transposes(ops.FlashConfig(fuse_v=True)) == apart + 1
    monkeypatch.setenv("PIMLAYERS_FLASH_FUSE_V", "1")  # anything but 0 leaves it on
    assert check(None) and transposes() == apart + 1
    # The entry points take the config resolved: what the environment said is in their jit's key.
    assert ops._flash.resolved(None) == ops.FlashConfig(fuse_v=True, bounds_kernel=None)
    monkeypatch.setenv("PIMLAYERS_BOUNDS_KERNEL", "0")
    want = ops.FlashConfig(fuse_v=False, bounds_kernel=False)
    assert ops._flash.resolved(ops.FlashConfig(fuse_v=False)) == want
    assert ops._flash_bwd.resolved_bwd(None) == ops.FlashBwdConfig(bounds_kernel=False)


def test_the_default_on_a_hopper_gpu_lowers_to_the_device_redo_without_a_loop(monkeypatch):
    """The attention core's default where the Hopper kernels run, lowered here for a GPU (Mosaic GPU
    and Triton lower without one): the forward's two kernel launches (first pass, redo) and the
    backward's four, the bounds once per pass (2 + 3 Triton kernels), and no while loop, so no host
    round trip; the loop policy keeps its two loops. Also under vmap(grad) of a rematerialised scan,
    as a Llama step runs it (the redo's refs live inside ``run_state``: as ``jax.new_ref`` inside
    the vmap fold, jax 0.10 failed to lower them, "No state discharge rule ... custom_vmap_call")."""
    from pimlayers.layers import attention as A

    for mod in (ops._flash, ops._flash_bwd, A):
        monkeypatch.setattr(mod, "hopper", lambda: True)
    q, k, v = _qkv(d=128)

    def loss(q, k, v, policy=POLICY):
        return jnp.sum(L.attention_core(q, k, v, policy=policy, flash=True)[0].astype(jnp.float32))

    fwd = lambda q, k, v: L.attention_core(q, k, v, policy=POLICY, flash=True)[0]
    assert lowered(fwd, q, k, v) == (2, 2, 0)
    assert lowered(jax.grad(loss, argnums=(0, 1, 2)), q, k, v) == (6, 5, 0)
    loop = functools.partial(loss, policy=FaultPolicy(recompute_kernel=False))
    assert lowered(jax.grad(loop, argnums=(0, 1, 2)), q, k, v)[2] == 2

    def scanned(q, k, v):
        body = jax.checkpoint(lambda c, _: (L.attention_core(c, k, v, policy=POLICY, flash=True)[0], None))
        return jnp.sum(jax.lax.scan(body, q, None, length=2)[0].astype(jnp.float32))

    stacked = [jnp.stack([x, x]) for x in (q, k, v)]
    mosaic, _, loops = lowered(jax.vmap(jax.grad(scanned)), *stacked)
    # Lowered at all is the point. Launches: on one device 8 (forward, its rematerialisation,
    # backward), over this suite's 8 CPU devices 6 (inside the per-device custom partitioning);
    # loops: the two scans' alone.
    assert mosaic >= 6 and loops == 2


LOWERED_FWD = [
    ops.FlashConfig(),
    ops.FlashConfig(fuse_v=False),
    ops.FlashConfig(fuse_e=False),
    ops.FlashConfig(block_kv=64, stages=4),
]


@pytest.mark.parametrize("d", [64, 128])
def test_every_kernel_variant_lowers_for_a_hopper_gpu(monkeypatch, d):
    """Mosaic GPU lowers without a GPU, so this CPU checks what jax's GPU interpreter does not: each
    forward variant, and the backward as two kernels and fused, with checks and without, lowers
    for a Hopper GPU, its register arrays sliced along their layouts' tiles and its shared memory
    within the 227 KB a CTA may have (the interpreter takes any slice and any size). Three stages
    of 128 keys a step do not fit at D = 128, as the GPU sweeps found (flash-tiling-s64): the limit
    is seen."""
    for mod in (ops._flash, ops._flash_bwd):
        monkeypatch.setattr(mod, "hopper", lambda: True)
    b, t, h, kv = 1, 512, 4, 2
    q, k = (jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16) for n in (h, kv))
    lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)

    launches = lambda fn, *args: _gpu_text(fn, *args).count("custom_call @mosaic_gpu_v2")

    for checks in (True, False):
        for cfg in LOWERED_FWD:
            fwd = lambda q, k, v, cfg=cfg, c=checks: ops.flash_attention(q, k, v, checks=c, config=cfg)[0]
            assert launches(fwd, q, k, k) == 1, cfg
        for fused in (False, True):
            cfg = ops.FlashBwdConfig(fused=fused)
            bwd = lambda *a, cfg=cfg, c=checks: ops.flash_attention_bwd(*a, checks=c, config=cfg)[:3]
            assert launches(bwd, q, k, k, q, lse, q) == (1 if fused and d == 128 else 2), (fused, checks)
    deep = lambda q, k, v: ops.flash_attention(q, k, v, config=ops.FlashConfig(stages=3))[0]
    if d == 64:  # half the bytes a row: three stages fit
        assert launches(deep, q, k, k) == 1
        return
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        launches(deep, q, k, k)


def test_kernel_paths_follow_the_default_device(monkeypatch):
    """``ops.hopper`` (the Hopper kernels) and the Triton redo's choice look at the device JAX
    computes on: on a machine whose first device is a Hopper GPU, a program placed on the CPU
    (``jax.default_device``, a device or a platform's name) takes the CPU's paths."""
    from pimlayers.ops import _dispatch, _redo_kernel

    class Hopper:
        platform, compute_capability, client = "gpu", "9.0", None

    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: [Hopper()] if backend is None else real(backend))
    assert isinstance(_dispatch.compute_device(), Hopper) and ops._fused_gemm.hopper()
    assert _redo_kernel.redo_kernel_chosen(FaultPolicy()) is (_redo_kernel.plt is not None)
    for where in (real("cpu")[0], "cpu"):
        with jax.default_device(where):
            assert _dispatch.compute_device() == real("cpu")[0]
            assert not ops._fused_gemm.hopper() and not _redo_kernel.redo_kernel_chosen(FaultPolicy())


@pytest.mark.skipif(HAS_CUDA, reason="lowers for a GPU without one; tests/test_gpu_flash.py runs it there")
def test_the_hopper_kernels_type_check_inside_shard_map(monkeypatch, cpu_mesh):
    """Inside shard_map with JAX's varying-axes checks on (the default), the Hopper kernels' paths
    trace and lower for a GPU (here without one): the attention core's forward and backward (its
    flash kernels and bounds, the rerun by the loop: 6 Mosaic GPU and 10 Triton launches in and
    around 2 while loops; with the checks off, the device redo: 6 and 5, no loop) and the
    protected GEMM's device redo (``recompute_kernel``). Each kernel's results are typed to vary
    over the mesh axes its operands do (``ops._vma``); before, Pallas refused their untyped results
    there ("manual_axis_type ... must not be None") and the backward's cotangents came back
    invariant (a custom VJP type error). The attention's device redo updates refs, which jax 0.11.2
    refuses to vary over mesh axes, so with the checks on it gives way to the loop."""
    from jax.sharding import PartitionSpec as P

    from pimlayers.layers import attention as A
    from pimlayers.ops import _protected_matmul as pm

    for mod in (ops._flash, ops._flash_bwd, ops._fused_gemm, A, pm):
        monkeypatch.setattr(mod, "hopper", lambda: True)
    n = cpu_mesh.devices.size

    q, k, v = _qkv(b=n, d=128)
    attn = lambda q, k, v: jnp.sum(
        L.attention_core(q, k, v, policy=POLICY, flash=True)[0].astype(jnp.float32)
    )
    for check_vma, want in ((True, (6, 10, 2)), (False, (6, 5, 0))):
        sm = jax.shard_map(
            lambda *a: jax.lax.psum(attn(*a), "d"),
            mesh=cpu_mesh,
            in_specs=(P("d"),) * 3,
            out_specs=P(),
            check_vma=check_vma,
        )
        assert lowered(jax.grad(sm, argnums=(0, 1, 2)), q, k, v) == want

    x, w = jnp.ones((n * 256, 256), jnp.bfloat16), jnp.ones((256, 512), jnp.bfloat16)
    policy = FaultPolicy(recompute_kernel=True)
    gemm = lambda x, w: jnp.sum(ops.protected_matmul(x, w, policy=policy)[0].astype(jnp.float32))
    sm = jax.shard_map(
        lambda *a: jax.lax.psum(gemm(*a), "d"), mesh=cpu_mesh, in_specs=(P("d"), P()), out_specs=P()
    )
    # As many redo launches as the unsplit GEMM's (the forward's and the input gradient's).
    assert (
        lowered(jax.grad(sm, argnums=(0, 1)), x, w)
        == lowered(jax.grad(gemm, argnums=(0, 1)), x, w)
        == (0, 2, 0)
    )


def test_detect_mode_reports_without_recomputing():
    q, k, v = _qkv(seed=6)
    f = GemmFaults(*(jnp.array([x]) for x in (37, 5, 30)), jnp.array([True]))
    _, r = L.attention_core(q, k, v, policy=FaultPolicy(mode="detect"), flash=True, faults={"scores": f})
    rd = r.to_dict()
    assert rd["gemm_detected"] == 1 and rd["gemm_uncorrectable"] == 1 and rd["gemm_recomputed"] == 0


@pytest.mark.parametrize("causal", [True, False])
def test_flash_path_gradients_match_the_materialised_path_and_plain_attention(causal):
    q, k, v = _qkv(seed=7)
    g = jax.random.normal(jax.random.key(8), q.shape, jnp.float32)

    def loss(q, k, v, flash):
        out = L.attention_core(q, k, v, policy=POLICY, flash=flash, causal=causal)[0]
        return jnp.sum(out.astype(jnp.float32) * g)

    def plain(q, k, v):  # f32 attention, no protection: the gradients' reference
        kh, vh = (jnp.repeat(a.astype(jnp.float32), H // KV, axis=2) for a in (k, v))
        s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kh) / np.sqrt(D)
        if causal:
            s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None, None], s, -jnp.inf)
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), vh) * g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    g1, g2 = grad(q, k, v, True), grad(q, k, v, False)
    g3 = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(q, k, v)
    for a, m, r in zip(g1, g2, g3, strict=True):
        a, m, r = (np.asarray(x, np.float32) for x in (a, m, r))
        scale = float(np.max(np.abs(r)))
        # bf16 gradients (the GEMMs' operands are bf16, as in the materialised path): within a
        # few bf16 ulps of the largest gradient, for both paths alike.
        assert np.max(np.abs(a - r)) <= 2e-2 * scale
        assert np.max(np.abs(a - m)) <= 2e-2 * scale


@pytest.mark.parametrize(("gemm", "which"), [("scores", 1), ("scores", 2), ("pv", 1), ("pv", 2)])
def test_backward_faults_are_corrected_and_reported_through_the_tap(gemm, which):
    # An exponent flip in one of the backward's four GEMMs (dq, dk; dp, dv), checked in the flash
    # path's backward as in the materialised path's; the gradients come out as without it.
    q, k, v = _qkv(seed=9)
    none = GemmFaults.none()
    f = GemmFaults(*(jnp.array([x]) for x in (11, 3, 30)), jnp.array([True]))
    sites = [none, none, none]
    sites[which] = f

    def loss(q, k, v, tap, faults):
        out, _ = L.attention_core(q, k, v, policy=POLICY, flash=True, faults=faults, tap=tap)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    *clean, _ = grad(q, k, v, ops.zero_tap(), None)
    *got, dtap = grad(q, k, v, ops.zero_tap(), {gemm: tuple(sites)})
    rd = ops.report_from_tap(dtap).to_dict()
    assert rd["gemm_detected"] == 1 and rd["gemm_uncorrectable"] == 0
    for a, c in zip(got, clean, strict=True):
        # A value corrected from its checksum (rather than recomputed) may land one bf16 ulp away.
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), atol=2e-2)


def test_flash_with_protection_off_is_jax_attention():
    # The fast unprotected peer: jax.nn.dot_product_attention (cuDNN's kernel on a GPU).
    q, k, v = _qkv(seed=14)
    for causal in (True, False):
        out, r = L.attention_core(q, k, v, policy=FaultPolicy.off(), flash=True, causal=causal)
        with jax.numpy_dtype_promotion("standard"):
            ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
        assert r.to_dict() == r.zeros().to_dict()
    # Off with gates: a NaN input's output rows are gated and counted.
    gated = FaultPolicy(mode="off", gate=True)
    out, r = L.attention_core(q.at[0, 3, 1, 0].set(jnp.nan), k, v, policy=gated, flash=True)
    assert bool(jnp.all(jnp.isfinite(out))) and r.to_dict()["nonfinite_gated"] == D
    with pytest.raises(ValueError, match="T == S"):
        L.attention_core(q, k[:, :128], v[:, :128], policy=FaultPolicy.off(), flash=True)
    with pytest.raises(ValueError, match="mask must be None"):
        L.attention_core(q, k, v, policy=FaultPolicy.off(), flash=True, mask=jnp.ones((1, 1, T, T), bool))


def test_flash_errors_name_the_obstacle():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="mask must be None"):
        L.attention_core(q, k, v, policy=POLICY, flash=True, mask=jnp.ones((1, 1, T, T), bool))
    with pytest.raises(ValueError, match="bf16"):
        f32 = [a.astype(jnp.float32) for a in (q, k, v)]
        L.attention_core(*f32, policy=POLICY, flash=True)


def test_ragged_causal_attention_runs_padded_to_the_kernels_length(monkeypatch):
    """T = 200 (not a multiple of 128): the flash path runs at 256 (zero rows appended, hidden by the
    causal mask) and returns what the materialised path returns, gradients included."""
    import pimlayers.layers.attention as A

    lengths = []

    def spy(fn):
        def call(q, *a, **kw):
            lengths.append(q.shape[1])
            return fn(q, *a, **kw)

        return call

    for name in ("flash_attention", "flash_attention_reference"):  # the kernel on a Hopper GPU
        monkeypatch.setattr(A, name, spy(getattr(A, name)))
    t = 200
    q, k, v = _qkv(t=t, seed=11)
    g = jax.random.normal(jax.random.key(12), q.shape, jnp.float32)

    def loss(q, k, v, flash):
        out, r = L.attention_core(q, k, v, policy=POLICY, flash=flash)
        return jnp.sum(out.astype(jnp.float32) * g), (out, r)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, (o1, r1)), g1 = grad(q, k, v, True)
    (_, (o2, r2)), g2 = grad(q, k, v, False)
    assert set(lengths) == {256} and o1.shape == q.shape
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2, np.float32), atol=3e-2)
    assert r1.to_dict() == {**r1.zeros().to_dict(), "gemm_checked": 2 * B * KV}
    assert r2.to_dict()["gemm_detected"] == 0
    for a, c in zip(g1, g2, strict=True):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.max(np.abs(a - c)) <= 2e-2 * float(np.max(np.abs(c)))  # a few bf16 ulps


def test_ragged_lengths_the_padding_cannot_serve_are_refused():
    q, k, v = _qkv(t=200)
    with pytest.raises(ValueError, match=r"outside the kernel's shapes"):
        L.attention_core(q, k, v, policy=POLICY, flash=True, causal=False)  # appended keys would be seen
    f = GemmFaults(*(jnp.array([x]) for x in (3, 5, 30)), jnp.array([True]))
    with pytest.raises(ValueError, match=r"any T without injected faults"):
        L.attention_core(q, k, v, policy=POLICY, flash=True, faults={"scores": f})
    # Without flash=True the same calls take the materialised path.
    out, r = L.attention_core(q, k, v, policy=POLICY, faults={"scores": f})
    assert out.shape == q.shape and r.to_dict()["gemm_detected"] == 1


def test_default_is_materialised_off_hopper():
    q, k, v = _qkv()
    if ops._fused_gemm.hopper():
        pytest.skip("on a Hopper GPU the default takes the kernel (tests/test_gpu_flash.py)")
    o1, _ = L.attention_core(q, k, v, policy=POLICY)
    o2, _ = L.attention_core(q, k, v, policy=POLICY, flash=False)
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))


def test_auto_flash_only_where_the_arrays_are_one_devices(cpu_mesh):
    # XLA cannot partition the kernel: with sharded inputs it would gather them to every device. So
    # the default takes the kernel on one device, or inside shard_map over every mesh axis.
    from jax.sharding import PartitionSpec as P

    from pimlayers.layers import attention as A

    assert jax.device_count() == 8 and not A._per_device()
    seen = []

    def body(x):
        seen.append(A._per_device())
        return x

    x = jax.device_put(jnp.ones((8, 4)), jax.NamedSharding(cpu_mesh, P("d")))
    jax.jit(jax.shard_map(body, mesh=cpu_mesh, in_specs=P("d"), out_specs=P("d")))(x)
    assert seen == [True]


@pytest.mark.parametrize("policy", [POLICY, REDO], ids=["loop", "device-redo"])
def test_flash_over_several_devices_runs_on_each_devices_batch_rows(cpu_mesh, monkeypatch, policy):
    # flash=True with the batch sharded over 8 devices: each device runs the kernel (here its XLA
    # reference) on its own batch rows, forward and backward, and the result is the one-device one;
    # with the device redo its XLA twins too (forward and backward).
    from jax.sharding import PartitionSpec as P

    from pimlayers.layers import attention as A

    seen = []
    names = ["flash_attention_reference", "flash_attention_bwd_reference"]
    if policy is REDO:
        names = ["flash_attention_with_redo_reference", "flash_attention_bwd_with_redo_reference"]
    for name in names:
        real = getattr(A, name)

        def spy(q, *a, _real=real, **kw):
            seen.append(q.shape[0])
            return _real(q, *a, **kw)

        monkeypatch.setattr(A, name, spy)
    b = 8
    q, k, v = _qkv(b=b, seed=15)
    do = jax.random.normal(jax.random.key(16), q.shape).astype(jnp.bfloat16)

    def both(q, k, v, do):
        scale = 1 / np.sqrt(D)
        out, lse, rf = A._flash_forward(q, k, v, None, scale, True, policy, True)
        grads, rb = A._flash_backward(q, k, v, out, lse, do, scale, True, policy, reference=True)
        return out, grads, rf, rb

    want = jax.jit(both)(q, k, v, do)  # arrays on one device: no partitioning
    assert set(seen) == {b}
    seen.clear()
    rows = jax.NamedSharding(cpu_mesh, P("d"))
    args = [jax.device_put(x, rows) for x in (q, k, v, do)]
    got = jax.jit(both)(*args)
    assert b // 8 in seen  # lowered per device, on its own batch rows (global shapes: abstract only)
    assert "all-gather" not in jax.jit(both).lower(*args).compile().as_text()  # nothing gathered
    for a, w in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w, np.float32), atol=2e-2)
    assert got[2].to_dict() == want[2].to_dict() and got[3].to_dict() == want[3].to_dict()


def test_gqa_attention_passes_flash_through():
    ks = jax.random.split(jax.random.key(11), 5)
    e = 64
    x = jax.random.normal(ks[0], (1, T, e)).astype(jnp.bfloat16)
    wq, wo = (jax.random.normal(kk, s) / 8 for kk, s in ((ks[1], (e, H * D)), (ks[4], (H * D, e))))
    wk, wv = (jax.random.normal(kk, (e, KV * D)) / 8 for kk in ks[2:4])
    kw = dict(num_heads=H, num_kv_heads=KV, head_dim=D, inv_freq=None, policy=POLICY, dtype=jnp.bfloat16)
    gqa = jax.jit(lambda *a, flash: L.gqa_attention(*a, flash=flash, **kw), static_argnames="flash")
    y1, _, r1 = gqa(x, wq, wk, wv, wo, flash=True)
    y2, _, r2 = gqa(x, wq, wk, wv, wo, flash=False)
    np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(y2, np.float32), atol=5e-2)
    assert r1.to_dict() == r2.to_dict()
    with pytest.raises(ValueError, match="q_positions"):  # with a cache the queries are not at 0..T-1
        L.gqa_attention(x, wq, wk, wv, wo, flash=True, cache=L.KVCache.init(1, T, KV, D, jnp.bfloat16), **kw)


def test_flash_path_under_vmap_equals_one_call_per_example():
    # Equinox layers take one sequence and are vmapped over a batch; the flash path must follow.
    q, k, v = _qkv(seed=12)
    f = lambda q, k, v: L.attention_core(q[None], k[None], v[None], policy=POLICY, flash=True)[0][0]
    batched = jax.vmap(f)(q, k, v)
    for i in range(B):
        np.testing.assert_array_equal(
            np.asarray(batched[i], np.float32), np.asarray(f(q[i], k[i], v[i]), np.float32)
        )


def test_ratios_say_how_far_past_the_bound_and_nan_is_worst():
    q, k, v = _qkv(seed=13)
    _, _, checks = _reference(q, k, v, _faults([("scores", 0, 2, 40, 27, 9)]))
    r = float(checks.scores[0, 2, 40])
    assert 1.0 < r < 1e30  # a finite ratio: how far past the bound, not just "failed"
    _, _, nan = _reference(q.at[1, 5, 3, 0].set(jnp.nan), k, v)
    assert float(nan.scores[1, 3, 5]) == float(nan.out[1, 3, 5]) == pytest.approx(ops._flash._BAD)


def test_the_front_ends_pass_flash_through():
    import equinox as eqx
    from flax import nnx

    from pimlayers.equinox import Attention as EqxAttention
    from pimlayers.flax import linen as plinen
    from pimlayers.flax import nnx as pnnx

    off = FaultPolicy.off()
    x = jax.random.normal(jax.random.key(15), (2, 16, 32))
    a, b_ = (pnnx.Attention(32, 4, 2, policy=off, flash=f, rngs=nnx.Rngs(0)) for f in (None, True))
    y_mat, y_flash = a(x), b_(x)
    np.testing.assert_allclose(np.asarray(y_flash), np.asarray(y_mat), rtol=1e-5, atol=1e-5)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    params = {n: {"kernel": getattr(a, n).kernel[...]} for n in names}
    y_linen = plinen.Attention(32, 4, 2, policy=off, flash=True).apply({"params": params}, x)
    np.testing.assert_allclose(np.asarray(y_linen), np.asarray(y_mat), rtol=1e-5, atol=1e-5)
    e = EqxAttention(32, 4, 2, key=jax.random.key(0), policy=off, flash=True)
    e = eqx.tree_at(
        lambda t: [getattr(t, n).weight for n in names], e, [params[n]["kernel"].T for n in names]
    )
    y_eqx = jax.vmap(e)(x)
    np.testing.assert_allclose(np.asarray(y_eqx), np.asarray(y_mat), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 5, 64])
def test_block_sums_are_the_blocks_sums_and_abs_sums(n):
    """The bounds' block sums (a pairwise tree of adds, an odd part carried up) against f64 sums, for
    block sizes that are and are not powers of two; f32 rounding only (6 levels at n = 64)."""
    from pimlayers.ops._flash import _block_sums

    x = jax.random.normal(jax.random.key(3), (2, 4 * n, 3, 8), jnp.float32).astype(jnp.bfloat16)
    s, a = _block_sums(x, n)
    xb = np.asarray(x, np.float64).reshape(2, 4, n, 3, 8)
    assert s.shape == a.shape == (2, 4, 3, 8) and s.dtype == a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s), xb.sum(2), rtol=0, atol=8 * 2.0**-24 * np.abs(xb).sum(2).max())
    np.testing.assert_allclose(np.asarray(a), np.abs(xb).sum(2), rtol=8 * 2.0**-24)
