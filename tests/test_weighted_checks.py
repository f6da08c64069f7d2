"""``FaultPolicy(weighted_checks=False)``: the plain checks c1 alone, no position-weighted c2.

A block is then judged on r1 = Σ y - c1 alone and nothing is located: every detected block is
recomputed (the loop, the device redo or ``recompute_blocks``). What it saves is check-GEMM work: on
a GPU 4 bf16 columns per 128-column block instead of 7. What it gives up is c2's second test, which
sees two errors of one block that cancel in the plain sum when |e|·|j_a - j_b| exceeds its bound,
128·B1 (shown below, at the finish).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jaxpr_eqns
from test_redo_kernel import _close, _pmm, _two_in_a_block, _xw

from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults
from pimlayers.ops._abft import ABFT_CLEAN, ABFT_DETECTED
from pimlayers.ops._fused_check import sums_flags

PLAIN = FaultPolicy(weighted_checks=False, locate=False)
COUNTS = ("gemm_detected", "gemm_corrected", "gemm_recomputed", "gemm_uncorrectable")


def test_policy_needs_locate_off_to_drop_the_weighted_checks():
    with pytest.raises(ValueError, match=r"weighted_checks=False.*locate=False"):
        FaultPolicy(weighted_checks=False)
    with pytest.raises(TypeError, match="weighted_checks must be a bool"):
        FaultPolicy(weighted_checks=1, locate=False)
    assert not PLAIN.weighted_checks and not PLAIN.locate
    FaultPolicy(mode="detect", weighted_checks=False)  # nothing is located in detect mode


def _enc_case(m=48, k=200, n=300, dtype=jnp.float32, seed=0):
    x, w = _xw(m, k, n, seed=seed, dtype=dtype)
    return x, w, ops.abft_encode(w, 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_checks_form_c1_alone(dtype, impl):
    """c1 and mag bit for bit the weighted checks', c2 zero (the native CPU pass forms it and zeroes
    it; XLA's never forms it)."""
    x, _, enc = _enc_case(dtype=dtype)
    c, mag = ops.abft_checks(x, enc, impl=impl, lam=8.0)
    c1, mag1 = ops.abft_checks(x, enc, impl=impl, lam=8.0, weighted=False)
    np.testing.assert_array_equal(np.asarray(c1[..., 0]), np.asarray(c[..., 0]))
    np.testing.assert_array_equal(np.asarray(mag1), np.asarray(mag))
    assert c1.shape == c.shape and not np.asarray(c1[..., 1]).any()
    # Transposed (the backward's xᵀ read in place) too.
    ct, _ = ops.abft_checks(x.T, enc, transposed=True, impl=impl, lam=8.0)
    ct1, _ = ops.abft_checks(x.T, enc, transposed=True, impl=impl, lam=8.0, weighted=False)
    np.testing.assert_array_equal(np.asarray(ct1[..., 0]), np.asarray(ct[..., 0]))
    assert not np.asarray(ct1[..., 1]).any()
    with pytest.raises(TypeError, match="weighted"):
        ops.abft_checks(x, enc, weighted="no")


def _check_columns(weighted: bool, m=256, k=512, n=1024) -> int:
    """Columns of the check GEMMs a GPU runs (bf16 x: XLA's split dots, ``impl="reference"``, which
    is what ``auto`` picks on a GPU), from the traced program."""
    x, _, enc = _enc_case(m, k, n, dtype=jnp.bfloat16)
    fn = lambda a: ops.abft_checks(a, enc, lam=8.0, weighted=weighted, impl="reference")
    eqns = jaxpr_eqns(jax.make_jaxpr(fn)(x).jaxpr)
    dots = [e.outvars[0].aval.shape for e, _ in eqns if e.primitive.name == "dot_general"]
    assert dots and all(shape[0] == m for shape in dots), dots
    return sum(shape[1] for shape in dots)


def test_a_gpus_check_gemms_carry_four_columns_per_block_instead_of_seven():
    nb = 1024 // 128
    assert _check_columns(True) == 7 * nb  # c1, c2: 3 bf16 terms each; mag: 1
    assert _check_columns(False) == 4 * nb


def _finish(y, c, mag, weighted, impl, correct=False):
    return ops.abft_finish(
        y, c, mag, k=200, block_n=128, correct=correct, weighted=weighted, impl=impl, out_dtype=jnp.float32
    )


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_finish_reads_no_c2_and_sends_every_detection_to_recompute(impl):
    x, w, enc = _enc_case()
    y = jnp.matmul(x, w, precision="highest")
    c, mag = ops.abft_checks(x, enc, weighted=False)
    junk = c.at[..., 1].set(jnp.nan)  # not read: a clean product passes whatever c2 holds
    out, flags, _ = _finish(y, junk, mag, False, impl)
    assert not np.asarray(flags).any()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(y))
    # One large error: the weighted check locates and rebuilds it; the plain one detects it only.
    bad = y.at[7, 140].add(100.0)
    cw, magw = ops.abft_checks(x, enc)
    _, fw, _ = _finish(bad, cw, magw, True, impl, correct=True)
    out, flags, _ = _finish(bad, junk, mag, False, impl)
    assert int(fw[7, 1]) == 1 and int(flags[7, 1]) == ABFT_DETECTED
    assert int(np.count_nonzero(np.asarray(flags))) == 1
    np.testing.assert_array_equal(np.asarray(out), np.asarray(bad))  # left for the recompute
    with pytest.raises(ValueError, match="correct=True with weighted=False"):
        _finish(bad, junk, mag, False, impl, correct=True)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_two_errors_that_cancel_in_the_plain_sum_pass_without_c2(impl):
    """What c2 adds: +e and -e in one block leave r1 within its bound; r2 = (j_a - j_b) e does not."""
    x, w, enc = _enc_case()
    y = jnp.matmul(x, w, precision="highest")
    bad = y.at[5, 3].add(0.5).at[5, 10].add(-0.5)
    cw, magw = ops.abft_checks(x, enc)
    _, with_c2, _ = _finish(bad, cw, magw, True, impl)
    c1, mag1 = ops.abft_checks(x, enc, weighted=False)
    _, without, _ = _finish(bad, c1, mag1, False, impl)
    assert int(with_c2[5, 0]) == ABFT_DETECTED
    assert int(without[5, 0]) == ABFT_CLEAN


def test_native_and_reference_flags_agree_on_random_faults():
    x, w, enc = _enc_case(m=64, k=256, n=384, seed=3)
    y = jnp.matmul(x, w, precision="highest")
    rng = np.random.default_rng(0)
    rows, cols = rng.integers(0, 64, 40), rng.integers(0, 384, 40)
    bad = y.at[rows, cols].add(jnp.asarray(rng.choice([-1.0, 1.0], 40) * 2.0 ** rng.integers(-8, 4, 40)))
    bad = bad.at[9, 17].set(jnp.inf)
    c, mag = ops.abft_checks(x, enc, weighted=False)
    got = [_finish(bad, c, mag, False, impl) for impl in ("auto", "reference")]
    for a, b in zip(*got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(np.count_nonzero(np.asarray(got[0][1]) == ABFT_DETECTED)) > 20


def test_fused_sums_check_reads_no_c2():
    s1 = jnp.array([1.0, 2.0, 3.0]).reshape(1, 3)
    mag = jnp.ones_like(s1)
    c2 = jnp.full_like(s1, jnp.nan)
    flags = sums_flags(s1, s1 * 7, s1.at[0, 1].add(1.0), c2, mag, 64, 128.0, 8.0, weighted=False)
    np.testing.assert_array_equal(np.asarray(flags), [[ABFT_CLEAN, ABFT_DETECTED, ABFT_CLEAN]])
    assert (np.asarray(sums_flags(s1, s1 * 7, s1, c2, mag, 64, 128.0, 8.0)) == ABFT_DETECTED).all()


def _single(clean, row=11, col=None):
    """One exponent flip (bit 30) of a value of 0.3-3 in ``row`` (at ``col``, or the first such
    column): an error the weighted check locates."""
    i32 = lambda v: jnp.asarray([v], jnp.int32)
    v = np.abs(np.asarray(clean, np.float32)[row])
    col = int(np.flatnonzero((v > 0.3) & (v < 3.0))[0]) if col is None else col
    assert 0.3 < v[col] < 3.0
    return GemmFaults(i32(row), i32(col), i32(30), jnp.ones((1,), bool))


# The loop (bf16, f32) and the device redo (bf16 only: f32 GEMMs keep the loop; interpreted here).
@pytest.mark.parametrize(
    ("kernel", "dtype"), [(False, jnp.bfloat16), (False, jnp.float32), (True, jnp.bfloat16)]
)
def test_protected_matmul_recomputes_what_the_plain_check_detects(kernel, dtype):
    x, w = _xw(96, 80, 300, dtype=dtype)
    clean = jnp.matmul(x, w, preferred_element_type=dtype, precision="highest")
    policy = PLAIN.replace(recompute_kernel=kernel)
    y, r = _pmm(policy)(x, w)
    assert tuple(r.to_dict()[c] for c in COUNTS) == (0, 0, 0, 0)
    ref, _ = _pmm(FaultPolicy(recompute_kernel=kernel))(x, w)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))
    # A single error: located and rebuilt in place by default, recomputed here.
    y, r = _pmm(FaultPolicy(recompute_kernel=kernel))(x, w, _single(clean))
    assert tuple(r.to_dict()[c] for c in COUNTS) == (1, 1, 0, 0)
    y, r = _pmm(policy)(x, w, _single(clean))
    assert tuple(r.to_dict()[c] for c in COUNTS) == (1, 1, 1, 0)
    _close(y, clean)
    y, r = _pmm(policy)(x, w, _two_in_a_block(clean, 17))
    assert tuple(r.to_dict()[c] for c in COUNTS) == (1, 1, 1, 0)
    _close(y, clean)


def test_recompute_blocks_rechecks_on_c1_alone():
    """``recompute_blocks`` (the branch-free block redo through XLA) under the plain checks: a single
    error and an unlocatable pair redone, checked again on c1 alone."""
    x, w = _xw(96, 80, 300)
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16, precision="highest")
    policy = PLAIN.replace(recompute_blocks=4, recompute_kernel=False)
    for faults in (_single(clean), _two_in_a_block(clean, 17)):
        y, r = _pmm(policy)(x, w, faults)
        assert tuple(r.to_dict()[c] for c in COUNTS) == (1, 1, 1, 0)
        _close(y, clean)


def test_backward_gemms_check_c1_alone_and_recompute():
    """dx and dw under the plain checks: clean gradients equal the default's; a pair of errors in
    each is recomputed (nothing located), no recompile between fault patterns."""
    x, w = _xw(48, 40, 72, seed=2)
    policy = PLAIN.replace(block_n=16)

    def loss(a, b, tap, faults, p):
        y, _ = ops.protected_matmul(a, b, tap=tap, faults=faults, policy=p)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)
    none = (GemmFaults.none(),) * 3
    want = grad(x, w, ops.zero_tap(), none, FaultPolicy(block_n=16))
    got = grad(x, w, ops.zero_tap(), none, policy)
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dy = jnp.cos(jnp.matmul(x, w, preferred_element_type=jnp.float32))
    dx = jnp.matmul(dy, w.T.astype(jnp.float32))
    dw = jnp.matmul(x.T.astype(jnp.float32), dy)
    for i, (rx, rw) in enumerate([(5, 11), (20, 3)]):  # the first call compiles, the second reuses it
        hit = (GemmFaults.none(), _two_in_a_block(dx, rx, 16), _two_in_a_block(dw, rw, 16))
        with jax.no_tracing() if i else contextlib.nullcontext():
            gx, gw, gt = grad(x, w, ops.zero_tap(), hit, policy)
        d = ops.report_from_tap(gt).to_dict()
        assert d["gemm_detected"] == 2 and d["gemm_recomputed"] == 2 and d["gemm_uncorrectable"] == 0
        _close(gx, want[0])
        _close(gw, want[1])


def test_margins_of_clean_gemms_read_c1_alone():
    """check_margins under the plain checks: a clean product's ratio is its r1's (c2, zero here, is
    not held against s2), well below 1."""
    x, w = _xw(64, 128, 256)
    with ops.check_margins() as log:
        jax.block_until_ready(jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=PLAIN))(x, w))
    assert log and all(r.over == 0 and r.ratio < 0.5 for r in log)
