"""The fused protected GEMM: block sums from the GEMM's epilogue, the check on them, the tile redo.

On the CPU the fused path runs with ``fused_gemm_reference`` standing in for the Hopper kernel (the
same outputs, computed by XLA); the GPU tests check the kernel against that reference and run the
same fault scenarios through it.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults
from pimlayers.ops import _fused_gemm, _fused_rows, _protected_matmul
from pimlayers.ops._fused_check import fused_flags

M, K, N = 256, 192, 512  # two row tiles, four 128-column blocks: the kernel's smallest multiples x2


def _xw(m=M, k=K, n=N, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, w


def _plain(x, w):
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@pytest.fixture
def fused(monkeypatch):
    """The fused path on this machine: the Hopper kernel on a Hopper GPU, else its reference."""
    if not _fused_gemm.hopper():
        monkeypatch.setattr(_protected_matmul, "_fused_kernel", lambda: _fused_gemm.fused_gemm_reference)
        checked = _fused_gemm.fused_gemm_checked_reference
        monkeypatch.setattr(_protected_matmul, "_fused_checked_kernel", lambda: checked)
    return _protected_matmul._fused_kernel()


FUSED = FaultPolicy(fused=True)


def _pmm(policy=FUSED):
    return jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=policy, faults=fl))


def _sites(rows, cols, bits):
    rows, cols, bits = (jnp.asarray(v, jnp.int32) for v in (rows, cols, bits))
    return GemmFaults(rows, cols, bits, jnp.ones(rows.shape, bool))


def _assert_redone(y, clean):
    """Redone values against the clean GEMM: another dot kernel may sum in another order, so to one
    bf16 rounding of the f32 result."""
    y, clean = np.asarray(y, np.float32), np.asarray(clean, np.float32)
    np.testing.assert_allclose(y, clean, rtol=2**-7, atol=1e-6)


def _big(clean, row, lo, hi):
    """A column in [lo, hi) of ``row`` whose value has magnitude in [1, 4): a flip of its sign or of
    a high exponent bit moves it by at least 1, far beyond the bound (the f32 accumulation's,
    0.013-0.017 here; the unfused check of a bf16 y also allows 2^-8 of the block's sum of |y|)."""
    v = np.abs(np.asarray(clean[row, lo:hi], np.float32))
    assert np.any((v >= 1) & (v < 4))
    return lo + int(np.argmax((v >= 1) & (v < 4)))


def test_fused_path_is_taken_and_clean_equals_plain(fused):
    x, w = _xw()
    # Taken: no recompute loop in the program (the kernel's own loops are inside its custom call);
    # the unfused path has one.
    assert _loops(lambda a, b: ops.protected_matmul(a, b, policy=FUSED), x, w) == 0
    assert _loops(lambda a, b: ops.protected_matmul(a, b, policy=FUSED, impl="reference"), x, w) == 1
    assert _loops(lambda a, b: ops.protected_matmul(a, b), x, w) == 1  # not the default
    y, r = _pmm()(x, w, None)
    assert y.dtype == jnp.bfloat16
    assert np.asarray(y).tobytes() == np.asarray(_plain(x, w)).tobytes()
    d = r.to_dict()
    assert d["gemm_checked"] == 1 and d["gemm_detected"] == 0 and d["gemm_uncorrectable"] == 0


def _loops(f, *args) -> int:
    """While loops in the lowered program (the unfused path's recompute is one)."""
    return jax.jit(f).lower(*args).as_text().count("stablehlo.while")


def test_not_taken_where_it_does_not_apply(fused):
    x, w = _xw()
    loops = lambda f: _loops(f, x, w)
    pmm = lambda a, b, p=FUSED, **kw: ops.protected_matmul(a, b, policy=p, **kw)
    assert loops(lambda a, b: pmm(a, b)) == 0
    assert loops(lambda a, b: pmm(a.astype(jnp.float32), b.astype(jnp.float32))) == 1
    assert loops(lambda a, b: pmm(a[:100], b)) == 1  # rows not a tile multiple
    assert loops(lambda a, b: pmm(a, b, FUSED.replace(block_n=64))) == 1
    assert loops(lambda a, b: pmm(a, b, FUSED.replace(gate_limit=8.0))) == 1
    assert loops(lambda a, b: pmm(a, b, impl="native")) == 1
    assert loops(lambda a, b: pmm(a, b, FaultPolicy())) == 1


def test_opt_in_elsewhere_than_hopper_is_the_default_path():
    """``fused=True`` where the kernel cannot run (no Hopper GPU) falls back to the unfused path."""
    if _fused_gemm.hopper():
        pytest.skip("on a Hopper GPU the fused path is taken")
    x, w = _xw()
    assert _loops(lambda a, b: ops.protected_matmul(a, b, policy=FUSED), x, w) == 1
    y, r = _pmm()(x, w, None)
    y0, r0 = _pmm(FaultPolicy())(x, w, None)
    assert np.asarray(y).tobytes() == np.asarray(y0).tobytes() and r.to_dict() == r0.to_dict()


def test_sums_of_the_reference_are_the_accumulators_block_sums():
    x, w = _xw()
    y, s = _fused_gemm.fused_gemm_reference(x, w)
    acc = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert s.shape == (2, N // 128, M)
    ab = acc.reshape(M, N // 128, 128)
    j = np.arange(1, 129)
    np.testing.assert_allclose(np.asarray(s[0]).T, ab.sum(-1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(s[1]).T, (ab * j).sum(-1), rtol=1e-5, atol=1e-2)
    # y is the accumulator rounded once to bf16.
    np.testing.assert_allclose(np.asarray(y, np.float32), acc, rtol=2**-8, atol=1e-5)


def test_flags_follow_the_bound():
    x, w = _xw()
    _, s = _fused_gemm.fused_gemm_reference(x, w)
    c, mag = ops.abft_checks(x, ops.abft_encode(w, 128))
    assert int(jnp.sum(fused_flags(s, c, mag, K, 8.0))) == 0
    # One block's sum moved by 3x its bound is flagged, alone; by 0.3x it passes.
    b1 = 8 * 2.0**-24 * (np.sqrt(K) + np.sqrt(128) + 2) * mag[5, 2]
    for factor, flagged in ((3.0, 1), (0.3, 0)):
        f = fused_flags(s.at[0, 2, 5].add(factor * b1), c, mag, K, 8.0)
        assert int(jnp.sum(f != 0)) == flagged and int(f[5, 2] != 0) == flagged
    assert int(fused_flags(s.at[0, 1, 7].set(jnp.nan), c, mag, K, 8.0)[7, 1]) == ops.ABFT_DETECTED
    inf = s.at[:, 1, 7].set(jnp.inf)
    assert int(fused_flags(inf, c, mag, K, 8.0)[7, 1]) == ops.ABFT_DETECTED


@pytest.mark.parametrize("bit", [30, 29, 27, 31])
def test_accumulator_faults_detected_and_redone(fused, bit):
    x, w = _xw()
    clean = _plain(x, w)
    rows, cols = [3, 3, 200, 77], [_big(clean, 3, 0, 128), _big(clean, 3, 130, 256), 300, 301]
    cols[2], cols[3] = _big(clean, 200, 256, 384), _big(clean, 77, 256, 384)
    y, r = _pmm()(x, w, _sites(rows, cols, [bit] * 4))
    d = r.to_dict()
    # Four 128 x 128 tiles hold faults: rows 0-127 in blocks 0, 1 (row 3) and 2 (row 77), rows
    # 128-255 in block 2 (row 200). Two tiles fit the redo: the first two, row 3's; rows 77 and 200
    # are reported, never silent.
    assert d["gemm_detected"] == 1 and d["gemm_recomputed"] == 1
    assert (d["gemm_corrected"], d["gemm_uncorrectable"]) == (2, 2)
    y, clean = np.asarray(y, np.float32), np.asarray(clean, np.float32)
    _assert_redone(y[3, :256], clean[3, :256])
    assert not np.array_equal(y[200, 256:384], clean[200, 256:384])
    keep = np.ones(M, bool)
    keep[[3, 200, 77]] = False
    assert np.array_equal(y[keep], clean[keep])  # nothing else touched


def test_a_whole_tile_fault_is_repaired(fused):
    """Every row of one 128 x 128 accumulator tile corrupted (one warpgroup's): redone whole."""
    x, w = _xw(seed=1)
    clean = _plain(x, w)
    rows = np.arange(128, 256)
    cols = [_big(clean, r, 384, 512) for r in rows]
    y, r = _pmm()(x, w, _sites(rows, cols, [30] * 128))
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (1, 128, 0)
    _assert_redone(y, clean)


def test_non_finite_flip_is_detected_and_redone(fused):
    x, w = _xw(seed=2)
    clean = np.asarray(_plain(x, w), np.float32)
    row, col = map(int, np.argwhere((np.abs(clean) >= 1) & (np.abs(clean) < 2))[0])
    y, r = _pmm()(x, w, _sites([row], [col], [30]))  # exponent 127 -> 255: Inf or NaN
    d = r.to_dict()
    counts = ("gemm_detected", "gemm_corrected", "gemm_uncorrectable", "nonfinite_gated")
    assert tuple(d[c] for c in counts) == (1, 1, 0, 0)
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    _assert_redone(y, clean)


def test_products_that_overflow_are_gated_where_redone_and_reported(fused):
    x, w = _xw(seed=4)
    w = jnp.abs(w)
    x = x.at[9, :].set(jnp.bfloat16(1e38))  # row 9's products overflow to +Inf in every column
    y, r = _pmm()(x, w, None)
    d = r.to_dict()
    # Row 9's four blocks are detected (their checks are not finite either). The two tiles that fit
    # the redo are gated there (256 values replaced) and still fail their check; the other two are
    # left as computed. All four are reported uncorrectable: never silent.
    assert d["gemm_uncorrectable"] == 4 and d["nonfinite_gated"] == 256
    y = np.asarray(y, np.float32)
    assert np.all(y[9, :256] == 0.0) and np.all(np.isinf(y[9, 256:]))
    assert np.array_equal(np.delete(y, 9, axis=0), np.delete(np.asarray(_plain(x, w), np.float32), 9, axis=0))


def test_without_recompute_detected_blocks_are_reported_and_left_as_written(fused):
    """``recompute=False`` (the training step's "skip" policy): the fused path is still taken, with
    no redo; every detected block is reported uncorrectable and y is the kernel's, untouched."""
    x, w = _xw()
    clean = _plain(x, w)
    skip = FUSED.replace(recompute=False)
    pmm = lambda a, b: ops.protected_matmul(a, b, policy=skip)
    assert _loops(pmm, x, w) == 0
    # No redo: no GEMM in the program beyond the product and its checks (the redo adds a third).
    dots = lambda policy: (
        jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=policy))
        .lower(x, w)
        .as_text()
        .count("stablehlo.dot_general")
    )
    assert dots(skip) == dots(FUSED) - 1
    y, r = _pmm(skip)(x, w, None)
    assert np.asarray(y).tobytes() == np.asarray(clean).tobytes()
    assert r.to_dict()["gemm_detected"] == 0 and r.to_dict()["gemm_uncorrectable"] == 0
    rows, cols = [3, 200], [_big(clean, 3, 0, 128), _big(clean, 200, 256, 384)]
    y, r = _pmm(skip)(x, w, _sites(rows, cols, [30, 30]))
    keys = ("gemm_detected", "gemm_corrected", "gemm_recomputed", "gemm_uncorrectable")
    assert tuple(r.to_dict()[c] for c in keys) == (1, 0, 0, 2)
    y, clean = np.asarray(y, np.float32), np.asarray(clean, np.float32)
    assert y[3, cols[0]] != clean[3, cols[0]] and y[200, cols[1]] != clean[200, cols[1]]
    keep = np.ones(M, bool)
    keep[rows] = False
    assert np.array_equal(y[keep], clean[keep])


PLAIN_FUSED = FUSED.replace(weighted_checks=False, locate=False)  # c1 and mag from the kernel itself


@pytest.mark.parametrize("policy", [FUSED, PLAIN_FUSED], ids=["weighted", "plain"])
def test_new_fault_patterns_do_not_recompile(fused, policy):
    x, w = _xw()
    clean = _plain(x, w)
    body = TraceCounter(lambda a, b, fl: ops.protected_matmul(a, b, policy=policy, faults=fl))
    f = jax.jit(body)
    for seed in range(3):
        faults = GemmFaults.random(jax.random.key(seed), (M, N), 4, 0.5, bit=30)
        _, r = f(x, w, faults)
        assert r.to_dict()["gemm_uncorrectable"] <= 4
    assert body.count == 1
    sites = _sites([1, 2, 3, 4], [_big(clean, r, 0, 128) for r in (1, 2, 3, 4)], [30] * 4)
    with jax.no_tracing():
        f(x, w, sites)


@pytest.mark.parametrize("policy", [FUSED, PLAIN_FUSED], ids=["weighted", "plain"])
def test_gradients_unchanged(fused, policy):
    """The backward runs the unfused checked GEMMs either way: the fused forward changes no gradient
    (compared with the unfused path of the same checks, whose backward is the same code)."""
    x, w = _xw()
    g = jax.random.normal(jax.random.key(9), (M, N))
    loss = lambda a, b, p: jnp.sum(ops.protected_matmul(a, b, policy=p)[0].astype(jnp.float32) * g)
    fused_grads = jax.jit(jax.grad(lambda a, b: loss(a, b, policy), (0, 1)))(x, w)
    unfused = policy.replace(fused=False)
    ref_grads = jax.jit(jax.grad(lambda a, b: loss(a, b, unfused), (0, 1)))(x, w)
    for a, b in zip(fused_grads, ref_grads, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 64, 256), (512, 192, 768), (1024, 4096, 1024)])
def test_kernel_matches_reference_on_hopper(shape):
    if not _fused_gemm.hopper():
        pytest.skip("the fused kernel runs on Hopper GPUs only")
    m, k, n = shape
    x, w = _xw(m, k, n, seed=m)
    y, s = jax.jit(_fused_gemm.fused_gemm)(x, w)
    y_r, s_r = jax.jit(_fused_gemm.fused_gemm_reference)(x, w)
    # Both round an f32 accumulation of exact bf16 products once, summed in different orders (cuBLAS
    # may split K): equal to a bf16 rounding, or to f32 reordering (~1e-5 of |x|·|w| ~ 40 here at
    # K = 4096) where values cancel.
    yf, yf_r = np.asarray(y, np.float32), np.asarray(y_r, np.float32)
    np.testing.assert_allclose(yf, yf_r, rtol=2**-7, atol=2e-8 * k)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=1e-5, atol=128 * 2e-8 * k)
    # The property that matters: the kernel's sums pass the check against independent checks.
    c, mag = ops.abft_checks(x, ops.abft_encode(w, 128))
    assert int(jnp.sum(fused_flags(s, c, mag, k, 8.0))) == 0
    with pytest.raises(ValueError, match="does not tile"):
        _fused_gemm.fused_gemm(x[:100], w)
    with pytest.raises(TypeError, match="expected bfloat16"):
        _fused_gemm.fused_gemm(x.astype(jnp.float32), w.astype(jnp.float32))


def _checked_inputs(x, w, lam=8.0):
    """The checked kernel's tiles for w at λ (the plain checks' terms, mag's scaled as the check's)."""
    enc = ops.abft_encode(w, 128)
    tiles, terms = _fused_gemm.check_tiles_of(enc, lam)
    return enc, tiles, terms


@pytest.mark.parametrize(("k", "lam"), [(192, 8.0), (4096, 64.0)])  # 3 + 1 terms, and 2 + 1
def test_check_tiles_give_the_plain_checks(k, lam):
    # The reference of the checked kernel (what the kernel must equal) forms abft_checks' plain
    # checks: c1 and mag of every block, from the tiles' layout (pairs of blocks, K-major).
    x, w = _xw(64, k, 512, seed=3)
    enc, tiles, terms = _checked_inputs(x, w, lam)
    assert tiles.shape == (2, 2, _fused_gemm.CS, k) and tiles.dtype == jnp.bfloat16
    y, s = _fused_gemm.fused_gemm_checked_reference(x, w, tiles, terms)
    y0, s0 = _fused_gemm.fused_gemm_reference(x, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(s[:2]), np.asarray(s0))
    c, mag = ops.abft_checks(x, enc, lam=lam, weighted=False, impl="reference")
    from benchmarks.matmul import _same_checks

    got_c = jnp.stack([s[2].T, jnp.zeros_like(s[2].T)], axis=-1)
    _same_checks("check tiles", (c, mag), (got_c, s[3].T), x, enc)
    with pytest.raises(ValueError, match="even number of blocks"):
        _fused_gemm.check_tiles(enc.sums[:, :3, 0], enc.abs_sums[:, :3], 3, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("b_t", [False, True])  # w, or (the backward's dx) wᵀ read in place
@pytest.mark.parametrize("shape", [(256, 64, 256), (512, 192, 768), (1024, 4096, 1024)])
def test_checked_kernel_matches_reference_on_hopper(shape, b_t):
    """The kernel with the checks: y and s1, s2 as the plain kernel's, c1 and mag equal to the
    reference's (f32 sums of exact products in other orders), and a clean product passes the
    plain check on them."""
    if not _fused_gemm.hopper():
        pytest.skip("the fused kernel runs on Hopper GPUs only")
    from pimlayers.ops._checks_kernel import accumulation_tolerance
    from pimlayers.ops._fused_check import sums_flags

    m, k, n = shape
    x, w = _xw(m, k, n, seed=m)
    _, tiles, terms = _checked_inputs(x, w)
    b = jnp.asarray(w.T) if b_t else w  # (the same product: b stored as (N, K))
    kernel = jax.jit(functools.partial(_fused_gemm.fused_gemm_checked, b_t=b_t), static_argnums=3)
    reference = jax.jit(
        functools.partial(_fused_gemm.fused_gemm_checked_reference, b_t=b_t), static_argnums=3
    )
    y, s = kernel(x, b, tiles, terms)
    y_r, s_r = reference(x, b, tiles, terms)
    y_w = np.asarray(_fused_gemm.fused_gemm_reference(x, w)[0], np.float32)  # the same product
    np.testing.assert_allclose(np.asarray(y_r, np.float32), y_w, rtol=2**-7, atol=2e-8 * k)
    yf, yf_r = np.asarray(y, np.float32), np.asarray(y_r, np.float32)
    np.testing.assert_allclose(yf, yf_r, rtol=2**-7, atol=2e-8 * k)
    np.testing.assert_allclose(np.asarray(s[:2]), np.asarray(s_r[:2]), rtol=1e-5, atol=128 * 2e-8 * k)
    # c1 and mag: within the f32 accumulation's reordering of their magnitude (mag itself for both:
    # |x|·|c1's terms| <= mag up to the scale).
    tol = accumulation_tolerance(k) * np.asarray(s_r[3], np.float64)
    for i in (2, 3):
        assert np.all(np.abs(np.asarray(s[i], np.float64) - np.asarray(s_r[i], np.float64)) <= tol + 1e-30), i
    zeros = jnp.zeros_like(s[0].T)
    flags = sums_flags(s[0].T, s[1].T, s[2].T, zeros, s[3].T, k, 128.0, 8.0, weighted=False)
    assert int(jnp.sum(flags)) == 0
    with pytest.raises(ValueError, match="does not tile"):
        _fused_gemm.fused_gemm_checked(x[:100], b, tiles, terms, b_t=b_t)
    with pytest.raises(ValueError, match="expected bfloat16"):
        _fused_gemm.fused_gemm_checked(x, b, tiles[:, :1], terms, b_t=b_t)
    with pytest.raises(ValueError, match="expected"):  # K not the operands' common axis
        _fused_gemm.fused_gemm_checked(x[:, :-64], b, tiles, terms, b_t=b_t)


@pytest.mark.parametrize("checked", [False, True])  # (the plain checks from the kernel itself)
@pytest.mark.parametrize("rows_each", [128, 64])
def test_each_device_multiplies_its_own_rows(cpu_mesh, monkeypatch, rows_each, checked):
    """x's rows split over 8 devices: each device's call sees its rows alone, y and the sums come
    back split as x was, and a fault on one device's rows is redone by the device redo (itself
    partitioned; the two-tile redo's gathers and slices are XLA's, which gathers y to every
    device): nothing is gathered. Where a device's share does not tile (64 rows), XLA computes that
    shard's y and sums instead."""
    calls = {"kernel": [], "reference": []}

    def recorded(name):
        def call(a, b, *rest):
            calls[name].append(a.shape)
            if checked:
                return _fused_gemm.fused_gemm_checked_reference(a, b, *rest)
            return _fused_gemm.fused_gemm_reference(a, b, *rest)

        return call

    monkeypatch.setattr(_protected_matmul, "_fused_kernel", lambda: _fused_gemm.fused_gemm_reference)
    name = "_fused_checked_kernel" if checked else "_fused_kernel"
    monkeypatch.setattr(_protected_matmul, name, lambda: recorded("kernel"))
    ref = "fused_gemm_checked_reference" if checked else "fused_gemm_reference"
    monkeypatch.setattr(_fused_rows, ref, recorded("reference"))
    policy = FUSED.replace(recompute_kernel=True)
    policy = policy.replace(weighted_checks=False, locate=False) if checked else policy
    m = rows_each * cpu_mesh.size
    x, w = _xw(m=m)
    clean = _plain(x, w)
    row = 3 * rows_each + 5  # the fourth device's
    sites = _sites([row], [_big(clean, row, 0, 128)], [30])
    xs = jax.device_put(x, NamedSharding(cpu_mesh, P("d")))
    ws = jax.device_put(w, NamedSharding(cpu_mesh, P()))
    f = _pmm(policy)
    y, r = f(xs, ws, sites)
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (1, 1, 0)
    _assert_redone(y, clean)
    assert y.sharding.spec[0] == "d"
    hlo = f.lower(xs, ws, sites).compile().as_text()
    gathers = [line for line in hlo.splitlines() if re.search(r"= (bf16|f32)\[.*all-gather\(", line)]
    assert gathers == []
    # (The kernel is also traced once at the whole shape: the program one device would run.)
    tiled = rows_each % 128 == 0
    assert (rows_each, K) in calls["kernel" if tiled else "reference"]
    assert (rows_each, K) not in calls["reference" if tiled else "kernel"]
    assert set(calls["kernel"] + calls["reference"]) <= {(rows_each, K), (m, K)}

    # Without the partitioning the call sees the whole x (here XLA's reference stands in for the
    # kernel and XLA splits it; a GPU's kernel is one opaque call, for which XLA gathers x).
    def unsplit(kernel, a, b, cfg, tiles=None, terms=0, b_t=False):
        return kernel(a, b, cfg) if tiles is None else kernel(a, b, tiles, terms, cfg, b_t)

    monkeypatch.setattr(_protected_matmul, "fused_rows", unsplit)
    calls["kernel"].clear()
    _pmm(policy).lower(xs, ws, sites).compile()
    assert calls["kernel"] == [(m, K)]


@pytest.mark.parametrize("checked", [False, True])  # (the plain checks from the kernel itself)
def test_inside_shard_map_each_device_runs_the_fused_path_on_its_rows(cpu_mesh, monkeypatch, checked):
    """Inside ``shard_map`` (JAX's varying-axes checks on): each device's fused GEMM multiplies its
    own 128 rows, a fault on one device's rows is detected and redone there (the tiles' XLA redo),
    y is the clean product and the gradients the plain GEMM's split alike (the references standing
    in for the kernel, through the same row partitioning, ``fused_rows``). Then the Hopper kernel
    itself (a stand-in Hopper device) with the device redo: traced inside ``shard_map`` at each
    device's rows and lowered for a GPU, forward and backward, no loop. (``fused_rows``'
    ``custom_partitioning`` traces the kernel on its own operands' types, without the mesh's
    varying axes, so its ``ops._vma`` typing is not what this exercises.)"""
    # On the CPU the tiles' XLA redo (the device redo kernel would run under Pallas' interpreter,
    # whose lowering jax refuses inside shard_map with the checks on: a `pad` of mixed varying axes).
    policy = PLAIN_FUSED if checked else FUSED
    name = "_fused_checked_kernel" if checked else "_fused_kernel"
    shapes = []

    def recording(kernel):
        def call(a, b, *rest):
            shapes.append(a.shape)
            return kernel(a, b, *rest)

        return lambda: call

    monkeypatch.setattr(_protected_matmul, "_fused_kernel", lambda: _fused_gemm.fused_gemm_reference)
    checked_ref = _fused_gemm.fused_gemm_checked_reference
    monkeypatch.setattr(_protected_matmul, "_fused_checked_kernel", lambda: checked_ref)
    ref = checked_ref if checked else _fused_gemm.fused_gemm_reference
    monkeypatch.setattr(_protected_matmul, name, recording(ref))
    n, rows = cpu_mesh.size, 128
    x, w = _xw(m=n * rows, k=256)
    g = jax.random.normal(jax.random.key(3), (n * rows, N)).astype(jnp.bfloat16).astype(jnp.float32)
    clean = _plain(x, w)
    hit = 3 * rows + 5  # the fourth device's rows
    col = _big(clean, hit, 0, 128)
    # One site per device, live on the fourth alone, at its local row.
    sites = _sites([hit - 3 * rows] * n, [col] * n, [30] * n)._replace(active=jnp.arange(n) == 3)

    def body(a, b, c, fl):
        y, r = ops.protected_matmul(a, b, policy=policy, faults=fl)
        counts = jax.tree.map(lambda v: jax.lax.psum(v, "d"), r)
        return y, jax.lax.psum(jnp.sum(y.astype(jnp.float32) * c), "d"), counts

    split = jax.shard_map(
        body, mesh=cpu_mesh, in_specs=(P("d"), P(), P("d"), P("d")), out_specs=(P("d"), P(), P())
    )
    y, _, r = jax.jit(split)(x, w, g, sites)
    assert (rows, 256) in shapes and (n * rows, 256) not in shapes  # each device's rows alone
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (1, 1, 0)
    _assert_redone(y, clean)

    # The gradients against the plain GEMM's split the same way (w's gradient is then a sum of the
    # devices' bf16 products either way): to a bf16 rounding, as other dot shapes sum in other orders.
    none = sites._replace(active=jnp.zeros(n, bool))
    loss = lambda a, b: split(a, b, g, none)[1]
    plain = lambda a, b, c: jax.lax.psum(jnp.sum(_plain(a, b).astype(jnp.float32) * c), "d")
    plain_split = jax.shard_map(plain, mesh=cpu_mesh, in_specs=(P("d"), P(), P("d")), out_specs=P())
    got = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda a, b: plain_split(a, b, g), (0, 1)))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-6
        )

    # The kernel itself, traced inside shard_map with the checks on and lowered for a GPU, with the
    # device redo (a Triton kernel there) as a GPU's default takes it.
    for mod in (_fused_gemm, _protected_matmul):
        monkeypatch.setattr(mod, "hopper", lambda: True)
    monkeypatch.setattr(_fused_gemm, "_sm_count", lambda: 132)
    real = _fused_gemm.fused_gemm_checked if checked else _fused_gemm.fused_gemm
    shapes.clear()
    monkeypatch.setattr(_protected_matmul, name, recording(real))
    policy = policy.replace(recompute_kernel=True)  # body reads it when traced
    text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert (rows, 256) in shapes and (n * rows, 256) not in shapes
    if checked:  # dx = dy @ wᵀ takes the checked kernel too, at each device's rows of dy
        assert (rows, N) in shapes
    assert text.count("__gpu$xla.gpu.triton") == 2  # the redo of y and of dx, no loop
    assert "stablehlo.while" not in text


def test_under_vmap_each_gemm_is_checked_and_redone_alone(fused):
    """vmap over two x with one w (the kernel vmapped whole): a fault in the second GEMM's batch
    element is redone there; the first is untouched."""
    x0, w = _xw()
    x1, _ = _xw(seed=1)
    xs = jnp.stack([x0, x1])
    clean = jnp.stack([_plain(x0, w), _plain(x1, w)])
    one = _sites([7], [_big(clean[1], 7, 0, 128)], [30])
    sites = jax.tree.map(lambda v: jnp.stack([v, v]), one)
    sites = sites._replace(active=jnp.asarray([[False], [True]]))
    y, r = jax.jit(jax.vmap(lambda a, fl: ops.protected_matmul(a, w, policy=FUSED, faults=fl)))(xs, sites)
    assert np.asarray(r.gemm_detected).tolist() == [0, 1]
    assert np.asarray(r.gemm_uncorrectable).tolist() == [0, 0]
    assert np.asarray(y[0]).tobytes() == np.asarray(clean[0]).tobytes()
    _assert_redone(y[1], clean[1])


def test_dx_takes_the_checked_kernel_with_w_in_place(fused, monkeypatch):
    """With the plain checks and the device redo, the backward's dx = dy @ wᵀ runs the checked
    fused kernel too, reading w as stored (``b_t``): gradients as the unfused path's (to a bf16
    rounding: other dot orders), and a fault in dx detected and redone (the device redo kernel,
    interpreted here)."""
    policy = PLAIN_FUSED.replace(recompute_kernel=True)
    b_ts = []
    checked = _protected_matmul._fused_checked_kernel()

    def spy(a, b, tiles, terms, config=None, b_t=False):
        b_ts.append(b_t)
        return checked(a, b, tiles, terms, config, b_t)

    monkeypatch.setattr(_protected_matmul, "_fused_checked_kernel", lambda: spy)
    x, w = _xw(k=256)  # dx has K = 256 columns: two 128-column blocks, one CTA wide
    g = jax.random.normal(jax.random.key(9), (M, N)).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(a, b, tap, faults, p):
        y, _ = ops.protected_matmul(a, b, policy=p, tap=tap, faults=faults)
        return jnp.sum(y.astype(jnp.float32) * g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)
    none = (GemmFaults.none(),) * 3
    gx, gw, gt = grad(x, w, ops.zero_tap(), none, policy)
    assert sorted(b_ts) == [False, True]  # the forward, and dx with w in place
    gx0, gw0, _ = grad(x, w, ops.zero_tap(), none, policy.replace(fused=False))
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(gx0, np.float32), rtol=2**-7, atol=1e-6)
    assert np.asarray(gw).tobytes() == np.asarray(gw0).tobytes()  # dw: the unfused path either way
    assert ops.report_from_tap(gt).to_dict()["gemm_detected"] == 0
    dx0 = np.asarray(gx, np.float32)
    hit = (
        GemmFaults.none(),
        _sites([5, 200], [_big(dx0, 5, 0, 64), _big(dx0, 200, 64, 192)], [30, 30]),
        None,
    )
    gx, _, gt = grad(x, w, ops.zero_tap(), hit, policy)
    d = ops.report_from_tap(gt).to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (1, 2, 0)
    np.testing.assert_allclose(np.asarray(gx, np.float32), dx0, rtol=2**-7, atol=1e-6)


def test_wide_products_keep_the_check_gemms(fused, monkeypatch):
    """Past ``CHECKED_MAX_N`` output columns (lowered here to 128, so this N = 256 and dx's K = 256
    are wide) the plain-checks fused path runs the fused kernel without the checks in it, c1 and mag
    from ``abft_checks``, and dx the unfused path; the checked kernel is never called."""
    policy = PLAIN_FUSED.replace(recompute_kernel=True)
    monkeypatch.setattr(_protected_matmul, "CHECKED_MAX_N", 128)
    used, calls = [], []
    checked = _protected_matmul._fused_checked_kernel()

    def spy(*args, **kwargs):
        used.append(1)
        return checked(*args, **kwargs)

    monkeypatch.setattr(_protected_matmul, "_fused_checked_kernel", lambda: spy)
    checks = _protected_matmul.abft_checks
    monkeypatch.setattr(_protected_matmul, "abft_checks", lambda *a, **k: calls.append(1) or checks(*a, **k))
    x, w = _xw(k=256)
    g = jax.random.normal(jax.random.key(9), (M, N)).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(a, b, p):
        y, _ = ops.protected_matmul(a, b, policy=p)
        return jnp.sum(y.astype(jnp.float32) * g)

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, policy)
    assert not used and calls  # the forward's checks from XLA's GEMMs, no checked kernel
    gx0, gw0 = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, policy.replace(fused=False))
    assert np.asarray(gx).tobytes() == np.asarray(gx0).tobytes()  # dx: the unfused path
    assert np.asarray(gw).tobytes() == np.asarray(gw0).tobytes()


@pytest.mark.parametrize("kernel", [False, True])  # redo_tiles, or the device redo (interpreted)
def test_projections_of_one_input_share_one_check_gemm_on_the_fused_path(fused, monkeypatch, kernel):
    """``protected_matmuls`` with ``fused=True`` (the weighted checks, which the kernel does not form):
    each product on the fused kernel, every product's checks from one check GEMM over x (as the
    unfused path shares them; before, each fused product read x for its own), read at its block
    offset; clean products equal the unshared fused path's, and a fault in the second product's
    blocks (offset 4) is found and redone."""
    monkeypatch.setattr(_protected_matmul, "checks_native_everywhere", lambda: False)
    calls = []
    checks = _protected_matmul.abft_checks
    monkeypatch.setattr(
        _protected_matmul,
        "abft_checks",
        lambda a, e, **kw: calls.append(e.abs_sums.shape[-1]) or checks(a, e, **kw),
    )
    policy = FUSED.replace(recompute_kernel=kernel)
    x, w1 = _xw()
    w2 = _xw(seed=1)[1][:, :256]
    run = jax.jit(lambda a, b, c, f2: ops.protected_matmuls(a, (b, c), policy=policy, faults=(None, f2)))
    none = GemmFaults.none()
    (y1, y2), r = run(x, w1, w2, none)
    assert calls == [4 + 2]  # one check GEMM: 4 + 2 blocks side by side
    assert r.to_dict()["gemm_detected"] == 0
    for y, w in ((y1, w1), (y2, w2)):
        alone, _ = _pmm(policy)(x, w, none)
        assert np.asarray(y).tobytes() == np.asarray(alone).tobytes()
    clean = _plain(x, w2)
    cols = [_big(clean, 7, 0, 128), _big(clean, 7, 130, 256)]  # two errors in row 7: unlocatable
    (z1, z2), r = run(x, w1, w2, _sites([7, 7], cols, [30, 30]))
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (1, 2, 0), d
    assert np.asarray(z1).tobytes() == np.asarray(y1).tobytes()
    _assert_redone(z2, clean)


# redo_tiles, the device redo (interpreted here); the checks from the kernel or from XLA's GEMMs
@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("in_kernel", [True, False])
def test_plain_checks_on_the_fused_path(fused, monkeypatch, kernel, in_kernel):
    """FaultPolicy(fused=True, weighted_checks=False, locate=False): the fused kernel's s1 against c1
    alone, c1 and mag formed by the kernel itself (``fused_gemm_checked``: no check GEMMs) or, where
    it does not run, by ``abft_checks``; clean equals the weighted fused path's output, a fault in
    two tiles is redone."""
    policy = FUSED.replace(weighted_checks=False, locate=False, recompute_kernel=kernel)
    calls = []
    checks = _protected_matmul.abft_checks
    monkeypatch.setattr(_protected_matmul, "abft_checks", lambda *a, **k: calls.append(1) or checks(*a, **k))
    if not in_kernel:
        monkeypatch.setattr(_protected_matmul, "_fused_checked_kernel", lambda: None)
    x, w = _xw()
    jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=policy)).lower(x, w)
    assert len(calls) == (0 if in_kernel else 1)
    clean = _plain(x, w)
    none = _sites([-1], [0], [0])
    y0, r0 = _pmm(policy)(x, w, none)
    ref, _ = _pmm(FUSED.replace(recompute_kernel=kernel))(x, w, none)
    assert np.asarray(y0).tobytes() == np.asarray(ref).tobytes() and r0.to_dict()["gemm_detected"] == 0
    cols = [_big(clean, 3, 0, 128), _big(clean, 3, 130, 256)]
    y, r = _pmm(policy)(x, w, _sites([3, 3], cols, [30, 30]))
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_recomputed"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (
        1,
        1,
        2,
        0,
    )
    _assert_redone(y, clean)


def _llama_block(policy, remat=False):
    """A bf16 1-layer llama3_small under ``policy`` and the tokens of its step (the same weights
    and tokens each call)."""
    from flax import nnx

    from models.llama3 import Llama3, get_config

    cfg = get_config("llama3_small", n_layers=1)
    toks = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 129)), jnp.int32)
    return Llama3(cfg, policy=policy, dtype=jnp.bfloat16, remat=remat, rngs=nnx.Rngs(0)), toks


def _llama_block_steps(policies) -> list[tuple]:
    """(loss, gradients, report) of one bf16 training step of :func:`_llama_block` per policy."""
    from flax import nnx

    def loss_of(model, toks):
        logits = model(toks[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1))

    results = []
    for p in policies:
        model, toks = _llama_block(p)
        loss, grads = nnx.jit(nnx.value_and_grad(loss_of))(model, toks)
        results.append((loss, jax.tree.leaves(nnx.state(grads, nnx.Param)), pnnx_report(model)))
    return results


def _assert_same_step(results) -> None:
    """Two steps' loss and gradients equal to bf16 rounding, as many GEMMs checked, none detected."""
    (l1, g1, r1), (l2, g2, r2) = results
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-3)
    for a, b in zip(g1, g2, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * float(np.max(np.abs(b))) + 1e-6)
    assert r1["gemm_checked"] == r2["gemm_checked"] > 0 and r1["gemm_detected"] == 0


@pytest.mark.slow
def test_the_llama_step_runs_its_gemms_checks_in_the_fused_kernel(fused, monkeypatch):
    """A Llama-3 block in bf16 under ``FaultPolicy(fused=True, weighted_checks=False, locate=False,
    recompute_kernel=True)`` (the device redo, interpreted here): the GEMMs that tile (q, o, the
    down projection and the head forward; their dx in the backward) run the checked fused kernel,
    the rest the unfused plain checks; the loss and gradients are the unfused path's to bf16
    rounding, and nothing is detected."""
    calls = []
    checked = _protected_matmul._fused_checked_kernel()

    def spy(a, b, tiles, terms, config=None, b_t=False):
        calls.append((a.shape, b_t))
        return checked(a, b, tiles, terms, config, b_t)

    monkeypatch.setattr(_protected_matmul, "_fused_checked_kernel", lambda: spy)
    policy = PLAIN_FUSED.replace(recompute_kernel=True)
    # (The unfused reference recomputes in its loop: clean, it runs nothing more, and the
    # interpreted redo kernel is what makes this test slow.)
    results = _llama_block_steps((policy, policy.replace(fused=False, recompute_kernel=False)))
    assert {b_t for _, b_t in calls} == {False, True} and all(s[0] == 128 for s, _ in calls)
    _assert_same_step(results)


def test_the_llama_step_on_the_fused_path_shares_its_check_gemms(fused, monkeypatch):
    """A Llama-3 block in bf16 under ``FaultPolicy(fused=True)`` (the weighted checks, the two-tile
    redo), as where the checks are GEMMs (a GPU): q/k/v and gate/up each take one check GEMM, as
    many as the unfused path traces; loss and gradients are the unfused path's to bf16 rounding,
    and nothing is detected."""
    monkeypatch.setattr(_protected_matmul, "checks_native_everywhere", lambda: False)
    calls = []
    checks = _protected_matmul.abft_checks
    monkeypatch.setattr(_protected_matmul, "abft_checks", lambda *a, **k: calls.append(1) or checks(*a, **k))
    counts, results = [], []
    for p in (FUSED.replace(recompute_kernel=False), FaultPolicy(recompute_kernel=False)):
        calls.clear()
        results += _llama_block_steps((p,))
        counts.append(len(calls))
    assert counts[0] == counts[1] > 0  # the fused path's check GEMMs shared as the unfused path's
    _assert_same_step(results)


def test_remat_keeping_the_gemms_reruns_no_fused_kernel_in_the_backward(fused, monkeypatch):
    """With ``remat="gemms"`` (the benchmarks' policy) the fused path keeps its products as the
    unfused path does: the rematerialised backward pass reruns none of the fused GEMMs, where full
    rematerialisation reruns the ones whose outputs the backward needs. (The fused step measured
    slower than the unfused one on an H100 and an H200; this rules out a rerun of its kernel.)"""
    from helpers import grad_jaxpr, jaxpr_eqns

    kernel = _protected_matmul._fused_kernel()

    def spy(*args, **kw):
        with jax.named_scope("fused_gemm_spy"):
            return kernel(*args, **kw)

    monkeypatch.setattr(_protected_matmul, "_fused_kernel", lambda: spy)

    def fused_runs(remat) -> tuple[int, int]:  # (forward, rematerialised backward) fused GEMMs
        jaxpr = grad_jaxpr(*_llama_block(FUSED, remat))
        # The reference stands in for the kernel here: one dot per call, named by the spy's scope.
        runs = [0, 0]
        for e, bwd in jaxpr_eqns(jaxpr.jaxpr, skip=("pallas_call",)):
            if e.primitive.name in ("dot_general", "pallas_call") and "fused_gemm_spy" in str(
                e.source_info.name_stack
            ):
                runs[bwd] += 1
        return tuple(runs)

    fwd, rerun = fused_runs("gemms")
    assert fwd >= 3 and rerun == 0  # q, o and the down projection tile (llama3_small), none rerun
    assert fused_runs(True)[1] > 0  # full remat reruns some: the count sees a rerun where one happens


def pnnx_report(model) -> dict:
    from pimlayers.flax import nnx as pnnx

    return pnnx.fault_report(model).to_dict()
