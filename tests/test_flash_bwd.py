"""The verified flash attention backward: its XLA reference, its checks, errors, and the layer's
rerun on a detected fault.

On the CPU ``flash_attention_bwd_reference`` stands in for the two Hopper kernels (the same
gradients, ratios and injected flips, from XLA with every product materialised); the GPU tests
(``tests/test_gpu_flash_bwd.py``) check the kernels against it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimlayers import ops
from pimlayers.faults import FaultPolicy
from pimlayers.layers import attention as A

B, T, H, KV, D = 1, 256, 4, 2, 64


def _inputs(b=B, t=T, h=H, kv=KV, d=D, causal=True, seed=0, scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda key, n: (scale * jax.random.normal(key, (b, t, n, d))).astype(jnp.bfloat16)
    q, k, v, do = mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv), mk(ks[3], h)
    out, lse, _ = _forward(q, k, v, causal=causal)
    return q, k, v, out, lse, do


# Under jit, as the layers call it: eagerly each of its ops compiles on its own (several times slower).
_forward = jax.jit(ops.flash_attention_reference, static_argnames="causal")
_backward = jax.jit(ops.flash_attention_bwd_reference, static_argnames="causal")


def _plain_grads(q, k, v, do, causal):
    """Autodiff of plain f32 attention from the same bf16 values."""
    f32 = lambda x: x.astype(jnp.float32)
    t, h, kv, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]

    def attn(q, k, v):
        kh, vh = jnp.repeat(k, h // kv, 2), jnp.repeat(v, h // kv, 2)
        s = jnp.einsum("bthd,bshd->bhts", q, kh, precision="highest") / math.sqrt(d)
        if causal:
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), vh, precision="highest")

    _, vjp = jax.vjp(attn, f32(q), f32(k), f32(v))
    return vjp(f32(do))


def _site(gemm, rows, bit, col, b=B, h=H, kv=KV, t=T):
    shape = (b, h, t) if gemm in ("scores", "dp", "dq") else (b, kv, t)
    bits, cols = np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
    for r in rows:
        bits[0, 1, r], cols[0, 1, r] = bit, col(r)
    return ops.FlashBwdFaults(**{gemm: (jnp.asarray(bits), jnp.asarray(cols))})


# A flipped value's column: a visible key (scores, dp), a query that sees the key (scores_t, dp_t),
# a column of D (dq, dk, dv).
COLS = {"scores": lambda r: r - 3, "dp": lambda r: r // 2, "scores_t": lambda r: 250, "dp_t": lambda r: r + 1}


@pytest.mark.parametrize(("h", "kv", "causal"), [(4, 2, True), (4, 4, False), (6, 1, True)])
def test_reference_matches_autodiff_of_plain_attention(h, kv, causal):
    q, k, v, out, lse, do = _inputs(h=h, kv=kv, causal=causal, seed=1)
    got = _backward(q, k, v, out, lse, do, causal=causal)
    plain = jax.jit(_plain_grads, static_argnums=4)(q, k, v, do, causal)
    for a, w in zip(got[:3], plain, strict=True):
        w = np.asarray(w)
        # bf16 gradients from bf16 p and ds: within a few bf16 ulps of the largest gradient.
        assert np.max(np.abs(np.asarray(a, np.float32) - w)) <= 2e-2 * np.max(np.abs(w))


@pytest.mark.parametrize("scale", [1e-2, 1.0, 8.0])
def test_clean_ratios_stay_well_inside_their_bounds(scale):
    args = _inputs(seed=2, scale=scale)
    checks = _backward(*args)[3]
    for name, r in checks._asdict().items():
        assert 0.0 <= float(r.max()) < 0.25, (name, float(r.max()))


@pytest.mark.parametrize("gemm", ops.FlashBwdFaults._fields)
def test_flips_are_flagged_on_their_rows_only(gemm):
    args = _inputs(seed=3)
    rows = [40, 130, 255] if gemm in ("scores", "dp", "dq") else [3, 129, 200]
    f = _site(gemm, rows, 30, COLS.get(gemm, lambda r: r % D))
    checks = _backward(*args, f)[3]
    sites = {(0, 1, r) for r in rows}
    q_side = ("scores", "dp", "dq")
    for name, r in checks._asdict().items():
        flagged = {tuple(i) for i in np.argwhere(~(np.asarray(r) <= 1.0)).tolist()}
        if name == gemm:
            assert flagged == sites
        elif (name in q_side) == (gemm in q_side):
            # Downstream in the same kernel a flipped score can turn p, ds non-finite, which the
            # later check flags too, on the same rows; never elsewhere.
            assert flagged <= sites, name
        else:
            assert flagged == set(), name  # the other kernel recomputes its own products


def test_a_mantissa_flip_past_the_rounding_is_flagged():
    # Bit 20 of dk's accumulator: 2^-3 of the value's exponent, far past the rounding but far from
    # an exponent flip's blow-up; the measured |ds|·‖q‖₁ bound must still see it.
    args = _inputs(seed=4)
    f = _site("dk", [100], 20, lambda r: 7)
    r = _backward(*args, f)[3].dk
    assert float(r[0, 1, 100]) > 1.0


def test_dk_magnitude_block_maxima_cover_every_query_of_their_block():
    # The dk/dv kernel bounds Σ |ds|·‖q‖₁ per query block by Σ |ds| times the block's ``qm`` (on
    # the tensor cores, from the tile's row 5): at least every row's ‖q‖₁ after its rounding to
    # bf16, and no looser than that rounding's slack.
    from pimlayers.ops._flash_bwd import _QM_ROW, FlashBwdConfig, flash_bwd_bounds

    q, k, v, _, _, do = _inputs(seed=6)
    cfg = FlashBwdConfig()
    qm = flash_bwd_bounds(q, k, v, do, lam=8.0, config=cfg)["qm"]
    assert qm.shape == (B, H, T // cfg.block_q, 8, cfg.block_q) and qm.dtype == q.dtype
    tile = np.asarray(qm, np.float32)
    assert np.all(np.delete(tile, _QM_ROW, axis=-2) == 0)  # the other rows: the other checks' columns
    row = tile[..., _QM_ROW, :]
    assert np.all(row == row[..., :1])  # one value per block, in every query's column
    q1 = np.abs(np.asarray(q, np.float32)).sum(-1).transpose(0, 2, 1)  # (B, H, T)
    blocks = q1.reshape(B, H, T // cfg.block_q, cfg.block_q)
    got = row[..., 0]
    assert np.all(got >= blocks.max(-1))
    assert np.all(got <= blocks.max(-1) * (1 + 2.0**-6))
    # How much looser than the per-query sum: for Gaussian q about 1.2x the block's mean ‖q‖₁.
    assert 1.05 < float(np.mean(got / blocks.mean(-1))) < 1.35


def test_nan_in_the_cotangent_is_flagged():
    q, k, v, out, lse, do = _inputs(seed=5)
    do = do.at[0, 17, 2].set(jnp.nan)
    ch = _backward(q, k, v, out, lse, do)[3]
    assert float(ch.dp[0, 2, 17]) > 1.0  # a NaN difference is written as the worst ratio


def test_errors_name_what_came_and_what_was_expected():
    q, k, v, out, lse, do = _inputs()
    with pytest.raises(ValueError, match="lse"):
        ops.flash_attention_bwd(q, k, v, out, lse[:, :, :-1], do)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.flash_attention_bwd(q.astype(jnp.float16), k, v, out, lse, do)
    with pytest.raises(ValueError, match="outside the kernels' shapes"):
        ops.flash_attention_bwd_reference(
            q[:, :200], k[:, :200], v[:, :200], out[:, :200], lse[..., :200], do[:, :200]
        )
    with pytest.raises(ValueError, match="checks=True"):
        ops.flash_attention_bwd(q, k, v, out, lse, do, _site("dq", [1], 3, lambda r: 0), checks=False)
    with pytest.raises(ValueError, match=r"faults\.dk"):
        bad = ops.FlashBwdFaults(dk=(jnp.zeros((B, H, T), jnp.int32),) * 2)  # query rows, not key rows
        ops.flash_attention_bwd_reference(q, k, v, out, lse, do, bad)
    with pytest.raises(TypeError, match="FlashBwdFaults"):
        ops.flash_attention_bwd_reference(q, k, v, out, lse, do, {"dq": None})
    if not ops._fused_gemm.hopper():
        with pytest.raises(NotImplementedError, match="flash_attention_bwd_reference"):
            ops.flash_attention_bwd(q, k, v, out, lse, do)


def test_supported_shapes():
    ok = ops.flash_bwd_supported
    assert ok((1, 256, 4, 128), (1, 256, 2, 128), jnp.bfloat16, True)
    assert not ok((1, 256, 4, 128), (1, 256, 2, 128), jnp.float16, True)  # bf16 only
    assert not ok((1, 192, 4, 128), (1, 192, 2, 128), jnp.bfloat16, False)  # T, S multiples of 128
    assert not ok((1, 256, 4, 128), (1, 512, 2, 128), jnp.bfloat16, True)  # causal: T == S
    assert not ok((1, 256, 3, 128), (1, 256, 2, 128), jnp.bfloat16, True)  # H a multiple of KV
    assert not ok((1, 256, 4, 96), (1, 256, 2, 96), jnp.bfloat16, True)  # D 64 or 128


def test_layer_backward_reruns_on_a_detected_fault():
    # The layer's backward through the kernels' rerun loop, XLA standing in for the kernels: a flip
    # is detected, both kernels rerun fault-free, the gradients come out as without it.
    q, k, v, out, lse, do = _inputs(seed=6)
    pol = FaultPolicy()
    run = jax.jit(
        lambda f: A._flash_backward(q, k, v, out, lse, do, 1 / math.sqrt(D), True, pol, f, reference=True)
    )
    clean, r0 = run(None)
    got, r1 = run(_site("dv", [77], 30, lambda r: 5))
    r0, r1 = r0.to_dict(), r1.to_dict()
    assert r0["gemm_checked"] == 7 * B * KV and r0["gemm_detected"] == 0 and r0["gemm_recomputed"] == 0
    assert r1["gemm_detected"] == 1 and r1["gemm_corrected"] == 1 and r1["gemm_uncorrectable"] == 0
    assert r1["gemm_recomputed"] == 7 * B * KV
    for a, c in zip(got, clean, strict=True):
        # XLA compiles the rerun inside the loop with other fusions: one bf16 ulp may differ.
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), atol=2e-2)
    detect = FaultPolicy(mode="detect")
    _, r2 = jax.jit(
        lambda f: A._flash_backward(q, k, v, out, lse, do, 1 / math.sqrt(D), True, detect, f, reference=True)
    )(_site("dq", [9], 30, lambda r: 1))
    assert r2.to_dict()["gemm_uncorrectable"] == 1 and r2.to_dict()["gemm_recomputed"] == 0


def _both(site_a, site_b):
    """Two GEMMs' FlashBwdFaults (from ``_site``) as one."""
    return ops.FlashBwdFaults(
        **{n: a or b for n, a, b in zip(ops.FlashBwdFaults._fields, site_a, site_b, strict=True)}
    )


def test_redo_reference_redoes_the_flagged_blocks():
    q, k, v, out, lse, do = _inputs(t=384, seed=8)
    faults = _both(_site("dv", [77], 30, lambda r: 5, t=384), _site("dq", [300], 30, lambda r: 1, t=384))
    redo = jax.jit(ops.flash_attention_bwd_with_redo_reference)
    dq, dk, dv, first, final = redo(q, k, v, out, lse, do, faults)
    flags_q, flags_k = ops.redo_flags_bwd(first)
    want_q, want_k = np.zeros((B, H, 3), np.int32), np.zeros((B, KV, 3), np.int32)
    want_q[0, 1, 2] = want_k[0, 1, 0] = 1  # query row 300 of head 1; key row 77 of KV head 1
    np.testing.assert_array_equal(np.asarray(flags_q), want_q)
    np.testing.assert_array_equal(np.asarray(flags_k), want_k)
    assert all(float(np.max(np.asarray(r))) <= 1.0 for r in final)
    clean = _backward(q, k, v, out, lse, do)
    for got, want in zip((dq, dk, dv), clean[:3], strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
    faulty = _backward(q, k, v, out, lse, do, faults)
    assert float(np.max(np.abs(np.asarray(faulty[2], np.float32) - np.asarray(clean[2], np.float32)))) > 1.0
    with pytest.raises(ValueError, match="fused kernel"):
        ops.flash_attention_bwd_with_redo_reference(
            *_inputs(d=128), config=ops.FlashBwdConfig(fused=True)
        )  # fmt: skip


@pytest.mark.parametrize(("gemm", "row", "kernel_gemms"), [("dv", 77, 4), ("dq", 9, 3), ("scores_t", 200, 4)])
def test_layer_backward_device_redo_corrects_as_the_loop_does(gemm, row, kernel_gemms):
    # XLA's twin of the device redo: the failing CTAs' rows recomputed, the counts as the loop's but
    # gemm_recomputed (the GEMMs of the one kernel that reran, for the one (batch, KV head) group).
    q, k, v, out, lse, do = _inputs(seed=6)
    col = COLS.get(gemm, lambda r: 5)
    run = jax.jit(
        lambda f, p: A._flash_backward(q, k, v, out, lse, do, 1 / math.sqrt(D), True, p, f, reference=True),
        static_argnums=1,
    )
    redo, loop = FaultPolicy(recompute_kernel=True), FaultPolicy()
    clean, r0 = run(None, redo)
    assert r0.to_dict()["gemm_recomputed"] == 0 and r0.to_dict()["gemm_detected"] == 0
    f = _site(gemm, [row], 30, col)
    (got, r1), (got_loop, r2) = run(f, redo), run(f, loop)
    r1, r2 = r1.to_dict(), r2.to_dict()
    assert r1["gemm_detected"] == 1 and r1["gemm_corrected"] == 1 and r1["gemm_uncorrectable"] == 0
    assert r1["gemm_recomputed"] == kernel_gemms and r2["gemm_recomputed"] == 7 * B * KV
    assert {**r1, "gemm_recomputed": 0} == {**r2, "gemm_recomputed": 0}
    for a, c, lp in zip(got, clean, got_loop, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), atol=2e-2)
        np.testing.assert_allclose(np.asarray(lp, np.float32), np.asarray(c, np.float32), atol=2e-2)


def test_fused_config_checks_five_gemms_with_the_same_bounds():
    # The fused kernel runs no query-row s and dp: its reference reports them as None, rejects
    # faults there, and gives every other GEMM the two kernels' ratios (the same sums and bounds).
    from pimlayers.ops._flash_bwd import bwd_gemms

    args = _inputs(d=128, seed=9)
    fused, two = ops.FlashBwdConfig(fused=True), ops.FlashBwdConfig(fused=False)
    assert bwd_gemms(128, fused) == ("dq", "scores_t", "dp_t", "dv", "dk")
    assert len(bwd_gemms(64, fused)) == 7  # D = 64: the two kernels
    site = _site("dk", [40], 30, lambda r: 3)
    got = ops.flash_attention_bwd_reference(*args, site, config=fused)
    want = ops.flash_attention_bwd_reference(*args, site, config=two)
    assert got[3].scores is None and got[3].dp is None
    for name in bwd_gemms(128, fused):
        np.testing.assert_array_equal(np.asarray(getattr(got[3], name)), np.asarray(getattr(want[3], name)))
    assert float(got[3].dk[0, 1, 40]) > 1.0
    with pytest.raises(ValueError, match=r"faults\.scores.*fused"):
        ops.flash_attention_bwd_reference(*args, _site("scores", [5], 30, lambda r: 1), config=fused)


@pytest.mark.parametrize(
    ("shape", "with_out"),
    [((1, 256, 4, 2, 64), True), ((2, 384, 3, 1, 128), True), ((1, 256, 4, 2, 64), False)],
)
def test_bounds_kernel_is_xlas(shape, with_out):
    """The three-pass Pallas bounds (run by Pallas' interpreter here) against XLA's: the same arrays,
    sums within f32 rounding (another order), constant rows equal."""
    from benchmarks.bounds import _same_bwd
    from pimlayers.ops._flash_bwd import FlashBwdConfig, flash_bwd_bounds

    b, t, h, kv, d = shape
    q, k, v, out, _, do = _inputs(b, t, h, kv, d, seed=8, scale=3.0)
    out = out if with_out else None
    cfg = FlashBwdConfig(bounds_kernel=True)
    got = jax.jit(lambda *xs: flash_bwd_bounds(*xs[:4], lam=8.0, config=cfg, out=xs[4]))(q, k, v, do, out)
    want = flash_bwd_bounds(q, k, v, do, lam=8.0, out=out, config=FlashBwdConfig(bounds_kernel=False))
    assert ("delta" in got) == with_out
    _same_bwd(got, want)


def test_bounds_kernel_carries_a_nan_into_its_groups_bounds():
    from pimlayers.ops._flash_bwd import FlashBwdConfig, flash_bwd_bounds

    q, k, v, out, _, do = _inputs(seed=9)
    k = k.at[0, 70, 1, 5].set(jnp.nan)  # KV head 1: query heads 2 and 3
    bd = flash_bwd_bounds(q, k, v, do, lam=8.0, out=out, config=FlashBwdConfig(bounds_kernel=True))
    tol_s = np.asarray(bd["tol_s"])
    assert np.isnan(tol_s[0, 2:]).all() and np.isfinite(tol_s[0, :2]).all()
    assert np.isnan(np.asarray(bd["tol_st"])[0, 1, 70]) and np.isfinite(np.asarray(bd["tol_dpt"])).all()
    assert np.isnan(np.asarray(bd["ks"], np.float32)[0, 1, 1, :2, 5]).all()  # key block 1 of head 1


def test_bounds_kernel_lowers_to_three_triton_kernels_for_a_gpu():
    """The kernels a GPU would run, lowered here (no GPU needed): three Triton calls, no interpreter."""
    from pimlayers.ops._flash_bwd import FlashBwdConfig, flash_bwd_bounds

    x, kv = jnp.zeros((1, 1024, 32, 128), jnp.bfloat16), jnp.zeros((1, 1024, 8, 128), jnp.bfloat16)
    cfg = FlashBwdConfig(bounds_kernel=True)
    f = jax.jit(lambda q, k, v, do, out: flash_bwd_bounds(q, k, v, do, lam=8.0, config=cfg, out=out))
    text = f.trace(x, kv, kv, x, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    for name in ("keys", "queries", "key_rows"):
        assert f"pimlayers_flash_bwd_bounds_{name}" in text


def test_the_default_bounds_are_the_triton_kernels_on_a_gpu_and_xlas_elsewhere():
    """FlashBwdConfig() lowers to the three Triton kernels for a GPU, to none for a CPU, where its
    arrays are XLA's bit for bit; bounds_kernel=False lowers to XLA's for a GPU too."""
    from pimlayers.ops._flash_bwd import FlashBwdConfig, flash_bwd_bounds

    q, k, v, out, _, do = _inputs(seed=11)
    bounds = lambda cfg: jax.jit(lambda *xs: flash_bwd_bounds(*xs[:4], lam=8.0, config=cfg, out=xs[4]))
    lowered = lambda cfg, platform: (
        bounds(cfg).trace(q, k, v, do, out).lower(lowering_platforms=(platform,)).as_text()
    )
    assert lowered(FlashBwdConfig(), "cuda").count("__gpu$xla.gpu.triton") == 3
    assert "triton" not in lowered(FlashBwdConfig(bounds_kernel=False), "cuda")
    assert "triton" not in lowered(FlashBwdConfig(), "cpu")
    got = bounds(FlashBwdConfig())(q, k, v, do, out)
    want = bounds(FlashBwdConfig(bounds_kernel=False))(q, k, v, do, out)
    assert set(got) == set(want)
    assert all(np.array_equal(np.asarray(got[n]), np.asarray(want[n])) for n in got)


def test_bounds_kernel_under_vmap_is_one_call_per_example():
    """The backward's bounds kernels batched by vmap (Pallas' batching rule, its interpreter here)
    give each example's own arrays, as on one GPU where they are the default."""
    from pimlayers.ops._flash_bwd import FlashBwdConfig, flash_bwd_bounds

    per = [_inputs(1, 128, 4, 2, 64, seed=20 + i) for i in range(2)]
    q, k, v, out, _, do = (jnp.stack(xs) for xs in zip(*per, strict=True))
    cfg = FlashBwdConfig(bounds_kernel=True)
    f = lambda q, k, v, do, out: flash_bwd_bounds(q, k, v, do, lam=8.0, config=cfg, out=out)
    got = jax.jit(jax.vmap(f))(q, k, v, do, out)
    for i in range(2):
        want = jax.jit(f)(q[i], k[i], v[i], do[i], out[i])
        for n, w in want.items():
            a = np.asarray(got[n])[i] if np.ndim(got[n]) else np.asarray(got[n])
            assert np.array_equal(a, np.asarray(w)), n


def test_reference_with_the_bounds_kernel_flags_the_same_rows():
    from pimlayers.ops._flash_bwd import FlashBwdConfig

    args = _inputs(seed=10)
    cfg = FlashBwdConfig(bounds_kernel=True)
    with_kernel = jax.jit(functools.partial(ops.flash_attention_bwd_reference, config=cfg))
    for a, w in zip(with_kernel(*args)[:3], _backward(*args)[:3], strict=True):
        # δ from the kernel's sum (another order): gradients within a bf16 rounding of the largest.
        a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(a - w)) <= 2.0**-8 * np.max(np.abs(w))
    faults = _site("dq", [17, 200], 30, lambda r: 5)
    got, want = with_kernel(*args, faults)[3], _backward(*args, faults)[3]
    flagged = lambda r: {tuple(i) for i in np.argwhere(~(np.asarray(r) <= 1.0)).tolist()}
    for name in ops.FlashBwdChecks._fields:
        assert flagged(getattr(got, name)) == flagged(getattr(want, name)), name
    assert flagged(got.dq) == {(0, 1, 17), (0, 1, 200)}
