"""The verified flash attention backward kernels on a Hopper GPU against their XLA reference (skipped
elsewhere)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimlayers import ops
from pimlayers.ops._flash_bwd import bwd_gemms

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hopper():
    if not ops._fused_gemm.hopper():
        pytest.skip("the flash backward kernels need a Hopper GPU (sm_90)")


SHAPES = [  # (B, T, H, KV, D, causal)
    (1, 256, 4, 2, 128, True),
    (2, 256, 4, 4, 64, True),
    (1, 512, 8, 2, 128, False),
    (1, 384, 6, 3, 128, True),
    (1, 1024, 4, 1, 128, True),
]


# What makes the backward's out and logsumexp: the forward kernel on a GPU; the interpreted run
# (tests/test_interpreted_kernels.py) sets its XLA twin, as the backward takes any forward's results
# and the interpreted forward would cost each backward case ~11 s of a CI worker's time.
FORWARD = ops.flash_attention


def _inputs(b, t, h, kv, d, causal, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda key, n: jax.random.normal(key, (b, t, n, d)).astype(jnp.bfloat16)
    q, k, v, do = mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv), mk(ks[3], h)
    out, lse, _ = FORWARD(q, k, v, causal=causal)
    return q, k, v, out, lse, do


def _close(a, b, rel):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= rel * max(float(np.max(np.abs(b))), 1e-6), np.max(np.abs(a - b))


TWO, FUSED = ops.FlashBwdConfig(fused=False), ops.FlashBwdConfig(fused=True)
CONFIGS = pytest.mark.parametrize("cfg", [TWO, FUSED], ids=["two-kernels", "fused"])


@CONFIGS
@pytest.mark.parametrize("shape", SHAPES)
def test_bwd_kernels_match_the_reference(hopper, shape, cfg):
    *dims, causal = shape
    args = _inputs(*dims, causal)
    got = ops.flash_attention_bwd(*args, causal=causal, config=cfg)
    want = ops.flash_attention_bwd_reference(*args, causal=causal, config=cfg)
    for a, b in zip(got[:3], want[:3], strict=True):
        _close(a, b, 2e-2)  # a few bf16 ulps of the largest gradient: summation orders differ
    gemms = bwd_gemms(dims[-1], cfg)
    assert len(gemms) == (5 if cfg.fused and dims[-1] == 128 else 7)
    for name, r in got[3]._asdict().items():
        if name not in gemms:
            assert r is None and getattr(want[3], name) is None
            continue
        assert float(r.max()) < 0.25, (name, float(r.max()))  # clean: well inside the bound
        assert float(getattr(want[3], name).max()) < 0.25
    plain = ops.flash_attention_bwd(*args, causal=causal, checks=False, config=cfg)
    assert plain[3] is None
    for a, b in zip(plain[:3], want[:3], strict=True):
        _close(a, b, 2e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_kernel_matches_the_two_kernels(hopper, causal):
    # The same gradients from one kernel as from two, on a longer sequence (many reduce-adds into
    # each query block's dq) with GQA groups of 4.
    args = _inputs(2, 2048, 16, 4, 128, causal, seed=5)
    two = ops.flash_attention_bwd(*args, causal=causal, config=TWO)
    one = ops.flash_attention_bwd(*args, causal=causal, config=FUSED)
    for a, b in zip(one[:3], two[:3], strict=True):
        _close(a, b, 1e-2)
    np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(two[1]))  # dk, dv: the same code
    np.testing.assert_array_equal(np.asarray(one[2]), np.asarray(two[2]))
    for name in ("dq", "scores_t", "dp_t", "dv", "dk"):
        assert float(getattr(one[3], name).max()) < 0.25, name


def test_bwd_kernels_match_autodiff_of_plain_attention(hopper):
    b, t, h, kv, d = 1, 1024, 8, 2, 128
    q, k, v, out, lse, do = _inputs(b, t, h, kv, d, True, seed=3)
    f32 = lambda x: x.astype(jnp.float32)

    def attn(q, k, v):
        kh, vh = jnp.repeat(k, h // kv, 2), jnp.repeat(v, h // kv, 2)
        s = jnp.einsum("bthd,bshd->bhts", q, kh, precision="highest") / math.sqrt(d)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), vh, precision="highest")

    _, vjp = jax.vjp(attn, f32(q), f32(k), f32(v))
    for a, w in zip(ops.flash_attention_bwd(q, k, v, out, lse, do)[:3], vjp(f32(do)), strict=True):
        _close(a, w, 2e-2)


GEMMS = [(g, TWO) for g in ops.FlashBwdFaults._fields] + [(g, FUSED) for g in bwd_gemms(128, FUSED)]
GEMM_IDS = [f"{g}-{'fused' if c.fused else 'two'}" for g, c in GEMMS]


@pytest.mark.parametrize(("gemm", "cfg"), GEMMS, ids=GEMM_IDS)
@pytest.mark.parametrize("bit", [30, 24])
def test_bwd_kernels_flag_the_flipped_rows(hopper, gemm, cfg, bit, shape=(1, 512, 8, 2, 128, True)):
    """``shape``: (B, T, H, KV, D, causal) with H, KV >= 2 and T >= 128 (the interpreted tests run
    a smaller one than the GPU's). Every GEMM the build runs gets a site array, all -1 (no flip)
    but ``gemm``'s: the faults' structure, and so the jitted program, is the same for every case of
    a build (the bits and columns are data), where a structure per GEMM compiled the kernels anew
    for each of the fourteen cases (on an H100 this file's first eight tests, each its own program,
    took 220 s, 2026-12-05)."""
    b, t, h, kv, d, causal = shape
    args = _inputs(b, t, h, kv, d, causal, seed=1)
    q_gemms = ("scores", "dp", "dq")  # sites per query row; the others per key row
    q_side = gemm in q_gemms
    shape_of = lambda g: (b, h, t) if g in q_gemms else (b, kv, t)
    sites = shape_of(gemm)
    # Late query rows that see many keys (the dq kernel's GEMMs), early key rows that many queries
    # see (the dk/dv kernel's): at T = 512, rows 300, 301, 511 and 3, 200, 301.
    rows = [t * 300 // 512, t * 300 // 512 + 1, t - 1] if q_side else [3, t * 200 // 512, t * 301 // 512]
    bits = np.full(sites, -1, np.int32)
    cols = np.zeros(sites, np.int32)
    for r in rows:
        bits[0, 1, r] = bit
        # a visible key (scores, dp), a query that sees this key (scores_t, dp_t), a column of D
        cols[0, 1, r] = {"scores": r - 7, "dp": r // 2, "scores_t": t * 400 // 512, "dp_t": r + 9}.get(
            gemm, r % d
        )
    none = {
        g: (jnp.full(shape_of(g), -1, jnp.int32), jnp.zeros(shape_of(g), jnp.int32))
        for g in bwd_gemms(d, cfg)
    }
    f = ops.FlashBwdFaults(**(none | {gemm: (jnp.asarray(bits), jnp.asarray(cols))}))
    got = ops.flash_attention_bwd(*args, f, causal=causal, config=cfg)[3]
    want = ops.flash_attention_bwd_reference(*args, f, causal=causal, config=cfg)[3]
    flagged = {tuple(i) for i in np.argwhere(~(np.asarray(getattr(got, gemm)) <= 1.0)).tolist()}
    expect = {tuple(i) for i in np.argwhere(~(np.asarray(getattr(want, gemm)) <= 1.0)).tolist()}
    assert flagged == expect
    if bit == 30:  # an exponent bit: every site is far past its bound
        assert flagged == {(0, 1, r) for r in rows}


def test_layer_backward_takes_the_kernels_and_reruns_on_a_fault(hopper):
    from pimlayers.faults import FaultPolicy
    from pimlayers.layers import attention as A

    b, t, h, kv, d = 1, 512, 8, 2, 128
    q, k, v, out, lse, do = _inputs(b, t, h, kv, d, True, seed=7)
    pol = FaultPolicy()
    run = jax.jit(lambda f: A._flash_backward(q, k, v, out, lse, do, 1 / math.sqrt(d), True, pol, f))
    clean, r0 = run(None)
    bits, cols = np.full((b, kv, t), -1, np.int32), np.zeros((b, kv, t), np.int32)
    bits[0, 1, 300], cols[0, 1, 300] = 30, 17
    got, r1 = run(ops.FlashBwdFaults(dv=(jnp.asarray(bits), jnp.asarray(cols))))
    r0, r1 = r0.to_dict(), r1.to_dict()
    n = len(bwd_gemms(d))  # the default kernels' GEMMs per (batch, KV head)
    assert r0["gemm_checked"] == n * b * kv and r0["gemm_detected"] == 0
    # The device redo (the default): the dk/dv kernel's four GEMMs of the one (batch, KV head) group,
    # its flagged CTA recomputed by the kernel itself, so the gradients come out bit for bit.
    assert r1["gemm_detected"] == 1 and r1["gemm_corrected"] == 1 and r1["gemm_recomputed"] == 4
    for a, c in zip(got, clean, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    loop = FaultPolicy(recompute_kernel=False)
    run_loop = jax.jit(lambda f: A._flash_backward(q, k, v, out, lse, do, 1 / math.sqrt(d), True, loop, f))
    got, r2 = run_loop(ops.FlashBwdFaults(dv=(jnp.asarray(bits), jnp.asarray(cols))))
    assert r2.to_dict() == {**r1, "gemm_recomputed": n * b * kv}
    for a, c in zip(got, clean, strict=True):
        _close(a, c, 1e-2)

    # attention_core's gradient on a Hopper GPU goes through the kernels: the tap counts their
    # GEMMs per (batch, KV head) besides the forward's two.
    from pimlayers import layers as L

    def loss(q, k, v, tap):
        o, _ = L.attention_core(q, k, v, policy=pol, tap=tap)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    *_, dtap = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, ops.zero_tap())
    rd = ops.report_from_tap(dtap).to_dict()
    assert rd["gemm_checked"] == n * b * kv and rd["gemm_detected"] == 0


def test_operands_rounded_inside_the_same_jit_pass_their_checks(hopper):
    # q, k, v, dout computed in f32 and rounded to bf16 inside the caller's jit, as RoPE'd and
    # rematerialised activations are: the checksums must be of the rounded values. Without the
    # operands pinned (flash_bounds), XLA fused the f32 producer into the sums of a Llama training
    # step's recomputed forward and elided the rounding, and every group's scores check failed.
    b, t, h, kv, d = 1, 1024, 8, 2, 128
    ks = jax.random.split(jax.random.key(8), 4)
    xs = [jax.random.normal(kk, (b, t, n, d)) for kk, n in zip(ks, (h, kv, kv, h), strict=True)]

    @jax.jit
    def run(xq, xk, xv, xd):
        q, k, v, do = ((1.37 * x).astype(jnp.bfloat16) for x in (xq, xk, xv, xd))
        out, lse, fwd = ops.flash_attention(q, k, v)
        return fwd, ops.flash_attention_bwd(q, k, v, out, lse, do)[3]

    fwd, bwd = run(*xs)
    for name, r in (*fwd._asdict().items(), *bwd._asdict().items()):
        if r is not None:  # the fused backward checks five of the seven
            assert float(r.max()) < 0.25, (name, float(r.max()))


@pytest.mark.parametrize("shape", [(1, 8192, 32, 8, 128), (2, 384, 3, 1, 64)])
def test_bounds_kernel_is_xlas_on_the_gpu(hopper, shape):
    """The Triton bounds kernels (the default on a GPU) against XLA's (sums within f32 rounding;
    constant rows equal)."""
    from benchmarks.bounds import _same_bwd
    from pimlayers.ops._flash_bwd import flash_bwd_bounds

    q, k, v, out, _, do = _inputs(*shape, causal=True, seed=7)
    bounds = lambda cfg: jax.jit(lambda *xs: flash_bwd_bounds(*xs[:4], lam=8.0, config=cfg, out=xs[4]))(
        q, k, v, do, out
    )
    got, want = bounds(ops.FlashBwdConfig()), bounds(ops.FlashBwdConfig(bounds_kernel=False))
    _same_bwd(got, want)
    forced = bounds(ops.FlashBwdConfig(bounds_kernel=True))
    assert all(np.array_equal(np.asarray(got[n]), np.asarray(forced[n])) for n in got)


def test_bwd_kernels_with_xlas_bounds_match_the_reference(hopper):
    args = _inputs(1, 512, 8, 2, 128, True, seed=8)
    cfg = ops.FlashBwdConfig(bounds_kernel=False)
    got = ops.flash_attention_bwd(*args, config=cfg)
    want = ops.flash_attention_bwd_reference(*args)
    for a, w in zip(got[:3], want[:3], strict=True):
        _close(a, w, 2e-2)
    for name, r in got[3]._asdict().items():
        assert 0.0 <= float(r.max()) < 0.25, name


REDO_SHAPES = [(1, 384, 6, 3, 128, True), (2, 256, 4, 2, 64, False)]


@pytest.mark.parametrize("shape", REDO_SHAPES)
def test_bwd_redo_recomputes_the_flagged_blocks(hopper, shape):
    """Flips in both kernels: the redo's gradients are the clean kernels' bit for bit (the flagged
    CTAs recomputed by the same kernels, the others the first pass's), its final ratios pass, and
    the XLA twin agrees."""
    b, t, h, kv, d, causal = shape
    q, k, v, out, lse, do = _inputs(b, t, h, kv, d, causal, seed=11)
    site = lambda shape_, at, col: tuple(jnp.asarray(x) for x in _one_site(shape_, at, col))
    faults = ops.FlashBwdFaults(
        dq=site((b, h, t), (b - 1, h - 1, t - 1), 3), dv=site((b, kv, t), (0, kv - 1, 40), 9)
    )
    dq, dk, dv, first, final = ops.flash_attention_bwd_with_redo(q, k, v, out, lse, do, faults, causal=causal)
    flags_q, flags_k = ops.redo_flags_bwd(first)
    assert int(np.sum(np.asarray(flags_q))) == 1 and int(np.sum(np.asarray(flags_k))) == 1
    assert all(float(np.max(np.asarray(r))) <= 1.0 for r in final)
    clean = ops.flash_attention_bwd(q, k, v, out, lse, do, causal=causal)
    for got, want in zip((dq, dk, dv), clean[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    ref = ops.flash_attention_bwd_with_redo_reference(q, k, v, out, lse, do, faults, causal=causal)
    for got, want in zip((dq, dk, dv), ref[:3], strict=True):
        _close(got, want, 1e-2)


def _one_site(shape, at, col):
    bits, cols = np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
    bits[at], cols[at] = 30, col
    return bits, cols


def test_bwd_redo_under_vmap(hopper):
    b, t, h, kv, d = 1, 256, 4, 2, 128
    xs = [_inputs(b, t, h, kv, d, True, seed=20 + i) for i in range(3)]
    stacked = [jnp.stack(a) for a in zip(*xs, strict=True)]
    faults = ops.FlashBwdFaults(dk=tuple(jnp.asarray(x) for x in _one_site((b, kv, t), (0, 1, 100), 4)))
    got = jax.vmap(lambda *a: ops.flash_attention_bwd_with_redo(*a, faults)[:3])(*stacked)
    for i in range(3):
        want = ops.flash_attention_bwd(*xs[i])[:3]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g[i], np.float32), np.asarray(w, np.float32))
