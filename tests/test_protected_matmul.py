"""protected_matmul: equal to the plain product, faults detected/corrected/recomputed, never silent."""

import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter, jaxpr_eqns
from jax.ad_checkpoint import print_saved_residuals

import pimlayers as pl
from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults

HI = jax.lax.Precision.HIGHEST
ROW = FaultPolicy(block_n=None)  # whole-row checksums, where a test bounds errors per row


def _xw(m, k, n, dtype=jnp.float32, scale=1.0, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(kx, (m, k)) * scale).astype(dtype)
    w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(dtype)
    return x, w


def _plain(x, w):
    """The unprotected product as a plain layer computes it: bf16 operands in one bf16-out GEMM (XLA
    rounds its f32 accumulator once; flax's Linear is this dot), other dtypes accumulated in f32 and
    cast. Which f32 order a bf16-out GEMM sums in is the backend's: on a CPU with AMX-BF16, XLA's
    bf16-out dot and its f32-out dot sum in different orders, so an f32 product cast afterwards is
    not the plain bf16 product bit for bit there (a value near cancellation moved by one bf16 ulp)."""
    dt = jnp.result_type(x, w)
    if dt == jnp.bfloat16:
        return jnp.matmul(x, w, precision=HI, preferred_element_type=jnp.bfloat16)
    return jnp.matmul(x, w, precision=HI, preferred_element_type=jnp.float32).astype(dt)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 129, 33), (3, 5, 64, 100)])
def test_clean_equals_plain_and_reports_nothing(dtype, shape):
    *lead, k, n = shape
    x, w = _xw(int(np.prod(lead)), k, n, dtype)
    x = x.reshape(*lead, k)
    for mode in ("off", "detect", "correct"):
        y, r = jax.jit(lambda a, b, m=mode: ops.protected_matmul(a, b, policy=pl.FaultPolicy(mode=m)))(x, w)
        assert y.shape == (*lead, n) and y.dtype == dtype
        # Same f32 accumulation, same rounding: bit-identical to the plain product.
        assert np.asarray(y).tobytes() == np.asarray(_plain(x, w)).tobytes()
        d = r.to_dict()
        assert d["gemm_checked"] == (mode != "off") and d["gemm_detected"] == 0 and d["nonfinite_gated"] == 0


@pytest.mark.parametrize("block_n", [None, 32])
def test_injected_faults_corrected_and_counted(block_n):
    x, w = _xw(64, 128, 96)
    policy = pl.FaultPolicy(block_n=block_n)
    enc = ops.abft_encode(w, block_n)
    clean = _plain(x, w)
    # An error below the detection bound (a low mantissa bit) is indistinguishable from rounding and
    # passes; the stated guarantee is "within the bound of the clean product".
    _, mag = ops.abft_checks(x, enc)
    bound = float(8 * 2.0**-24 * (np.sqrt(128) + np.sqrt(96) + 2) * jnp.max(mag))
    f = jax.jit(lambda a, b, e, fl: ops.protected_matmul(a, b, e, policy=policy, faults=fl))
    for seed, bit in enumerate([30, 29, 27, 31, 22, 10]):
        faults = GemmFaults.random(jax.random.key(seed), (64, 96), 8, 1.0, bit=bit)
        y, r = f(x, w, enc, faults)
        d = r.to_dict()
        assert d["gemm_uncorrectable"] == 0
        # Whatever was detected was repaired: the output is the clean product within the bound.
        np.testing.assert_allclose(np.asarray(y), np.asarray(clean), atol=2 * bound, rtol=0)
        if bit >= 27:  # exponent/sign flips of O(1) values are far above the bound
            assert d["gemm_detected"] == 1 and d["gemm_corrected"] >= 1


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_two_errors_of_very_different_size_in_one_row_are_not_miscorrected(impl):
    """Bit 30 (x2^128) and bit 24 (x2) in one row: the weighted checksum points at the big one's
    column, but the remainder shows a second error, so the block is recomputed, not "corrected"."""
    x, w = _xw(16, 64, 40)
    enc = ops.abft_encode(w, None)
    clean = _plain(x, w)
    z = jnp.zeros((2,), jnp.int32)
    faults = GemmFaults(
        z + 3, jnp.array([5, 30], jnp.int32), jnp.array([30, 24], jnp.int32), jnp.ones((2,), bool)
    )
    y, r = jax.jit(lambda a, b, e, fl: ops.protected_matmul(a, b, e, faults=fl, impl=impl))(x, w, enc, faults)
    d = r.to_dict()
    assert d["gemm_detected"] == 1 and d["gemm_recomputed"] == 1 and d["gemm_uncorrectable"] == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(clean), atol=1e-4, rtol=1e-5)
    # The check alone says "detected", never "corrected", for that row.
    c, mag = ops.abft_checks(x, enc)
    bad = np.asarray(clean).copy()
    for col, bit in ((5, 30), (30, 24)):
        bad[3, col] = np.frombuffer(
            (np.float32(bad[3, col]).view(np.uint32) ^ np.uint32(1 << bit)).tobytes(), np.float32
        )[0]
    _, flags = ops.abft_check(jnp.asarray(bad), c, mag, k=64, impl=impl)
    assert int(np.asarray(flags)[3, 0]) == ops.ABFT_DETECTED


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_fused_low_precision_operand_is_checked_as_the_gemm_saw_it(dtype):
    # Under jit XLA may fuse an operand's producer (SwiGLU's silu(g) * u) into each consumer and
    # simplify away its rounding to bf16 in one of them; the checksum then verified a different
    # operand than the GEMM multiplied, and every down projection was a false detection.
    from pimlayers.layers import llama_mlp

    ks = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(ks[0], (1, 256, 64), jnp.float32).astype(dtype)
    wg, wu = (0.02 * jax.random.normal(k, (64, 160), jnp.float32) for k in ks[1:3])
    wd = 0.02 * jax.random.normal(ks[3], (160, 64), jnp.float32)

    def f(x, wg, wu, wd, tap):
        y, rep = llama_mlp(x, wg, wu, wd, dtype=dtype, tap=tap)
        return jnp.sum(y.astype(jnp.float32)), rep

    (_, rep), dtap = jax.jit(jax.value_and_grad(f, argnums=4, has_aux=True))(x, wg, wu, wd, ops.zero_tap())
    back = ops.report_from_tap(dtap)
    assert int(rep.gemm_checked) == 3 and int(back.gemm_checked) == 6
    assert int(rep.gemm_detected) == 0 and int(back.gemm_detected) == 0


def _flip(v: float, bit: int) -> float:
    flipped = np.float32(v).view(np.uint32) ^ np.uint32(1 << bit)
    return float(np.frombuffer(flipped.tobytes(), np.float32)[0])


def _pairs(row, cols, bits):
    k = len(cols)
    as32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return GemmFaults(jnp.full((k,), row, jnp.int32), as32(cols), as32(bits), jnp.ones((k,), bool))


def _undecidable(x, w, policy, row, lo, hi):
    """Two sites in columns [lo, hi) of ``row`` and bits whose flips the check detects but cannot
    locate (checked with ``abft_check``): such a block must be recomputed. Two errors of one size
    can pass for one error midway between them, so the search confirms each candidate."""
    enc = ops.abft_encode(w, policy.block_n)
    c, mag = ops.abft_checks(x, enc)
    clean = np.asarray(_plain(x, w))
    top = [int(v) for v in np.argsort(-np.abs(clean[row, lo:hi]))[:4] + lo]
    for i, j in ((0, 1), (0, 2), (1, 2), (0, 3)):
        cols, bits = (top[i], top[j]), (22, 21)
        bad = clean.copy()
        for col, bit in zip(cols, bits, strict=True):
            bad[row, col] = _flip(bad[row, col], bit)
        _, flags = ops.abft_check(jnp.asarray(bad), c, mag, k=x.shape[1], block_n=policy.block_n)
        if int(np.asarray(flags)[row, lo // policy.block_n]) == ops.ABFT_DETECTED:
            return cols, bits
    raise AssertionError(f"no undecidable pair of sites found in row {row}, columns {lo}..{hi}")


def _assert_redone(y, clean):
    """The redone dot products against the clean GEMM, to f32 rounding: a gathered block is another
    dot kernel, whose summation order depends on the backend and on its code generation (a GPU's f32
    GEMM; on the CPU, LLVM at -O0, as the suite runs, sums these in another order than at -O3)."""
    np.testing.assert_allclose(np.asarray(y), np.asarray(clean), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lo", [0, 96])  # a full block, and the partial last one (96..99)
def test_unlocatable_blocks_are_recomputed_without_a_branch(lo):
    x, w = _xw(16, 64, 100)
    policy = pl.FaultPolicy(block_n=32, recompute_blocks=32)
    clean = _plain(x, w)
    cols, bits = _undecidable(x, w, policy, 3, lo, min(lo + 32, 100))
    f = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=policy, faults=fl))
    y, r = f(x, w, _pairs(3, cols, bits))
    d = r.to_dict()
    counts = ("gemm_detected", "gemm_recomputed", "gemm_corrected", "gemm_uncorrectable")
    assert tuple(d[c] for c in counts) == (1, 1, 1, 0)
    _assert_redone(y, clean)

    # The block redo takes no branch (no host round trip on a GPU); the default recompute is one loop
    # of 0 or 1 trips. (The native dispatch's platform switch is a cond too, resolved at compile
    # time: count against no recompute.)
    def branches(p):
        s = str(jax.make_jaxpr(lambda a, b: ops.protected_matmul(a, b, policy=p))(x, w))
        return s.count("cond["), s.count("while[")

    assert branches(policy) == branches(policy.replace(recompute=False))
    default = pl.FaultPolicy(block_n=32)
    assert branches(default)[1] == branches(default.replace(recompute=False))[1] + 1
    y2, r2 = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=default, faults=fl))(
        x, w, _pairs(3, cols, bits)
    )
    assert r2.to_dict()["gemm_recomputed"] == 1
    _assert_redone(y2, clean)


def _twin_columns(dtype):
    """x, w whose product has columns 2 and 6 equal (w's columns equal), and faults flipping one bit
    of both in row 1: two equal errors at columns of even 1-based sum (3 + 7), which the two
    checksums take for one error midway, at column 4 (tests/test_abft.py)."""
    x, w = _xw(8, 64, 32, dtype)
    w = w.at[:, 6].set(w[:, 2])
    y = np.asarray(_plain(x, w), np.float32)
    assert y[1, 2] == y[1, 6] and abs(y[1, 2]) > 0.1
    bit = 27  # an exponent bit (of the f32 view, as GemmFaults counts): far past the bound
    return x, w, _pairs(1, (2, 6), (bit, bit))


@pytest.mark.parametrize(
    ("dtype", "policy"),
    [
        (jnp.float32, pl.FaultPolicy(block_n=32, locate=False)),  # the recompute loop
        (jnp.float32, pl.FaultPolicy(block_n=32, locate=False, recompute_blocks=8)),
        (jnp.bfloat16, pl.FaultPolicy(block_n=32, locate=False, recompute_kernel=True)),  # device redo
    ],
)
def test_without_location_two_equal_errors_are_recomputed_not_miscorrected(dtype, policy):
    x, w, faults = _twin_columns(dtype)
    enc = ops.abft_encode(w, 32)
    clean = np.asarray(_plain(x, w), np.float32)
    run = lambda p: jax.jit(lambda a, b, e, fl: ops.protected_matmul(a, b, e, policy=p, faults=fl))
    if dtype == jnp.float32:  # (in bf16 the location's own test, against y's rounding, refuses it)
        # Locating (the default) "corrects" the block into a wrong one: the known limit.
        y0, r0 = run(policy.replace(locate=True, recompute_blocks=None))(x, w, enc, faults)
        assert r0.to_dict()["gemm_corrected"] == 1 and r0.to_dict()["gemm_recomputed"] == 0
        assert not np.allclose(np.asarray(y0)[1], clean[1], rtol=1e-2, atol=1e-2)
    # Without location the block is recomputed and comes back clean.
    y, r = run(policy)(x, w, enc, faults)
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_recomputed"], d["gemm_uncorrectable"]) == (
        1,
        1,
        1,
        0,
    )
    np.testing.assert_allclose(np.asarray(y, np.float32), clean, rtol=1e-5, atol=1e-6)


def test_without_location_a_single_error_is_recomputed_too_and_the_policy_says_how():
    x, w = _xw(16, 64, 48)
    faults = _pairs(3, (5,), (30,))
    y, r = ops.protected_matmul(x, w, policy=pl.FaultPolicy(block_n=16, locate=False), faults=faults)
    assert r.to_dict()["gemm_recomputed"] == 1 and r.to_dict()["gemm_uncorrectable"] == 0
    _, r1 = ops.protected_matmul(x, w, policy=pl.FaultPolicy(block_n=16), faults=faults)
    assert r1.to_dict()["gemm_recomputed"] == 0 and r1.to_dict()["gemm_corrected"] == 1  # located
    np.testing.assert_allclose(np.asarray(y), np.asarray(_plain(x, w)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"locate=False.*recompute=False"):
        pl.FaultPolicy(locate=False, recompute=False)
    with pytest.raises(TypeError, match="locate"):
        pl.FaultPolicy(locate="no")
    assert pl.FaultPolicy(mode="detect", locate=False, recompute=False).locate is False


def test_recompute_capacity_overflow_is_reported_uncorrectable():
    x, w = _xw(16, 64, 128)
    policy = pl.FaultPolicy(block_n=32, recompute_blocks=2)  # room for two blocks
    clean = np.asarray(_plain(x, w))
    # Three blocks of row 7 with two comparable errors each (undecidable); capacity for two.
    sites = [_undecidable(x, w, policy, 7, lo, lo + 32) for lo in (0, 32, 64)]
    faults = _pairs(7, [c for cs, _ in sites for c in cs], [b for _, bs in sites for b in bs])
    y, r = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=policy, faults=fl))(x, w, faults)
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_recomputed"], d["gemm_uncorrectable"]) == (1, 1, 1)
    assert d["gemm_corrected"] == 2
    y = np.asarray(y)
    _assert_redone(y[:, :64], clean[:, :64])  # the first two flagged blocks, redone
    assert not np.array_equal(y[7, 64:96], clean[7, 64:96])  # the third: left as found, reported
    assert np.array_equal(np.delete(y, 7, axis=0), np.delete(clean, 7, axis=0))


def test_block_redo_counts_each_gated_value_once():
    """Products that overflow in several blocks: each redone block's gated values counted once."""
    x, w = _xw(16, 64, 100)
    w = jnp.abs(w)
    x = x.at[5].set(1e38)  # row 5 overflows to +Inf in all 100 columns (4 blocks of 32: 32+32+32+4)
    policy = pl.FaultPolicy(block_n=32, recompute_blocks=32)
    y, r = jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=policy))(x, w)
    d = r.to_dict()
    # The four blocks are redone, still overflow (reported) and are gated: 100 values, once.
    assert (d["gemm_recomputed"], d["gemm_uncorrectable"], d["nonfinite_gated"]) == (1, 4, 100)
    assert np.all(np.asarray(y)[5] == 0.0)


def test_a_recomputed_block_replaces_its_gated_count():
    """A flip to Inf plus a second error in one block: the first pass gates the Inf and cannot
    locate; the recompute restores the block, so nothing stays counted as gated."""
    x, w = _xw(16, 64, 96, seed=3)
    clean = np.asarray(_plain(x, w))
    row, col = map(int, np.argwhere((np.abs(clean) >= 1) & (np.abs(clean) < 2))[0])
    assert not np.isfinite(_flip(clean[row, col], 30))  # exponent 127 -> 255
    other = (col // 32) * 32 + (col % 32 + 7) % 32  # same block of 32
    faults = _pairs(row, (col, other), (30, 24))
    policy = pl.FaultPolicy(block_n=32, recompute_blocks=32)
    y, r = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=policy, faults=fl))(x, w, faults)
    d = r.to_dict()
    assert d["gemm_recomputed"] == 1 and d["gemm_uncorrectable"] == 0 and d["nonfinite_gated"] == 0
    _assert_redone(y, clean)
    # Without the recompute the Inf is gated (counted) and the block reported.
    no = policy.replace(recompute=False)
    y2, r2 = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=no, faults=fl))(x, w, faults)
    assert r2.to_dict()["nonfinite_gated"] == 1 and r2.to_dict()["gemm_uncorrectable"] == 1
    assert np.isfinite(np.asarray(y2)).all()


def test_detect_mode_reports_and_does_not_touch():
    x, w = _xw(16, 32, 24)
    faults = GemmFaults.random(jax.random.key(0), (16, 24), 4, 1.0, bit=30)
    y, r = ops.protected_matmul(x, w, policy=pl.FaultPolicy(mode="detect", gate=False), faults=faults)
    d = r.to_dict()
    assert d["gemm_detected"] == 1 and d["gemm_corrected"] == 0 and d["gemm_uncorrectable"] >= 1
    assert not np.allclose(np.asarray(y), np.asarray(_plain(x, w)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_product_reaches_the_in_place_check_without_a_copy(dtype):
    # A (1, M, N) product reshaped on its way to the in-place abft_finish was copied first by XLA (a
    # fusion of only a bitcast and a copy: a pass over y); the finish now takes the (M, N) product
    # itself. Whatever feeds each finish (the step's, the recompute's) must do more than copy y
    # (bf16 on a CPU: the convert from the GEMM's f32, with the copy fused into it).
    m, n = 64, 256
    x, w = jnp.ones((m, 128), dtype), jnp.ones((128, n), dtype)
    f = jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=FaultPolicy(block_n=128)))
    hlo = f.lower(x, w).compile().as_text()
    defs = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (.*)$", hlo, re.M))
    finishes = [v for v in defs.values() if "abft_finish" in v and "custom-call(" in v]
    assert finishes  # the step's and the recompute's
    for finish in finishes:
        src = defs[re.search(r"custom-call\(%([^,)]+)", finish).group(1)]  # what makes its operand y
        body = re.search(r"calls=%([^,\s]+)", src)
        ops_in = set()
        if body:  # a fusion: the opcodes of its computation
            comp = hlo[hlo.index(f"%{body.group(1)} (") :].split("\n}")[0]
            ops_in = set(re.findall(r"= \S+ (\w[\w-]*)\(", comp)) - {"parameter"}
        assert not (src.split("(")[0].endswith(" copy") or (ops_in and ops_in <= {"bitcast", "copy"})), src


def test_no_recompile_when_faults_come_and_go():
    x, w = _xw(32, 64, 48)
    body = TraceCounter(lambda a, b, fl: ops.protected_matmul(a, b, faults=fl))
    f = jax.jit(body)
    for seed in range(6):
        rate = 0.0 if seed % 2 else 1.0
        _, r = f(x, w, GemmFaults.random(jax.random.key(seed), (32, 48), 4, rate, bit=30))
        assert r.to_dict()["gemm_detected"] == (0 if seed % 2 else 1)
    assert body.count == 1


def test_gradients_match_plain_and_backward_faults_are_reported():
    x, w = _xw(24, 40, 36)

    def loss(a, b, tap, faults):
        y, _ = ops.protected_matmul(a, b, tap=tap, faults=faults)
        return jnp.sum(jnp.sin(y))

    gx0, gw0 = jax.grad(lambda a, b: jnp.sum(jnp.sin(_plain(a, b))), argnums=(0, 1))(x, w)
    none = (GemmFaults.none(), GemmFaults.none(), GemmFaults.none())
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one program for both fault patterns
    gx, gw, gt = grad(x, w, ops.zero_tap(), none)
    np.testing.assert_allclose(gx, gx0, atol=1e-5)
    np.testing.assert_allclose(gw, gw0, atol=1e-5)
    assert ops.report_from_tap(gt).to_dict()["gemm_checked"] == 2  # dx and dw
    hit = (
        GemmFaults.none(),
        GemmFaults.random(jax.random.key(1), (24, 40), 3, 1.0, bit=30),
        GemmFaults.random(jax.random.key(2), (40, 36), 3, 1.0, bit=30),
    )
    gx, gw, gt = grad(x, w, ops.zero_tap(), hit)
    d = ops.report_from_tap(gt).to_dict()
    assert d["gemm_detected"] == 2 and d["gemm_uncorrectable"] == 0
    np.testing.assert_allclose(gx, gx0, atol=1e-5)
    np.testing.assert_allclose(gw, gw0, atol=1e-5)


def test_the_backward_checks_dx_with_the_transposed_checksums_of_the_forward():
    # Without given checksums the forward encodes w's and wᵀ's together (ops.abft_encode_pair) and
    # the backward's dx check takes wᵀ's from it: gradients and reports as when the backward encodes
    # wᵀ itself (given checksums), clean and with faults in dx. A rematerialisation policy that
    # saves ops.TRANSPOSED_CHECKSUMS keeps the backward from encoding w again.
    policy = FaultPolicy(block_n=128)
    x, w = _xw(64, 256, 384)
    enc = ops.abft_encode(w, 128)

    def loss(a, b, tap, faults, given):
        y, _ = ops.protected_matmul(a, b, enc if given else None, policy=policy, tap=tap, faults=faults)
        return jnp.sum(jnp.sin(y))

    hit = (
        GemmFaults.none(),
        GemmFaults.random(jax.random.key(3), (64, 256), 3, 1.0, bit=30),
        GemmFaults.none(),
    )
    for faults in ((GemmFaults.none(),) * 3, hit):
        got, want = (
            jax.grad(functools.partial(loss, faults=faults, given=g), argnums=(0, 1, 2))(x, w, ops.zero_tap())
            for g in (False, True)
        )
        for a, b in zip(got, want, strict=True):
            if jax.default_backend() == "cpu":  # the pair is the two encodes there
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:  # a GPU's one-read pair sums in another order: corrections may round apart
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        detected = ops.report_from_tap(got[2]).to_dict()["gemm_detected"]
        assert detected == (faults is hit)

    def saved(names):
        f = jax.checkpoint(functools.partial(loss, faults=None, given=False), policy=save_only(*names))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, x, w, ops.zero_tap())
        return out.getvalue().count(f"named '{ops.TRANSPOSED_CHECKSUMS}'")

    save_only = jax.checkpoint_policies.save_only_these_names
    # The policy keeps wᵀ's sums and abs sums from the forward; without it they are recomputed.
    assert saved([ops.TRANSPOSED_CHECKSUMS]) == 2 and saved([]) == 0
    # A forward pass alone encodes w once: wᵀ's checksums are formed only where a gradient is taken.
    # (Counted on a CPU-only process: with a GPU each op's jaxpr holds a branch per platform.)
    if jax.default_backend() == "cpu":
        fwd = jax.make_jaxpr(functools.partial(loss, faults=None, given=False))(x, w, ops.zero_tap())
        assert str(fwd).count("pimlayers_abft_encode") == 1


def test_nan_and_inf_stay_out_of_values_and_gradients():
    x, w = _xw(8, 16, 12)
    x = x.at[0, 0].set(jnp.nan).at[3, 5].set(jnp.inf)  # whole rows go non-finite: nothing to correct

    def loss(a, b):
        y, _ = ops.protected_matmul(a, b)
        return jnp.sum(y**2)

    y, r = ops.protected_matmul(x, w)
    assert np.isfinite(np.asarray(y)).all() and r.to_dict()["nonfinite_gated"] == 24
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    assert np.isfinite(np.asarray(gx)).all() and np.isfinite(np.asarray(gw)).all()


def test_seeded_campaign_every_error_above_the_bound_is_caught():
    """2,000 seeded single-bit faults on ragged GEMMs at scales 1e-3..1e3 (the 10^4 campaign over
    Llama-3 shapes runs on the GPU: benchmarks/abft_campaign.py)."""
    rng = np.random.default_rng(0)
    caught = 0
    for trial in range(8):
        m, k, n = (int(v) for v in (rng.integers(1, 40), rng.integers(1, 200), rng.integers(1, 130)))
        x, w = _xw(m, k, n, seed=trial, scale=10.0 ** rng.uniform(-3, 3))
        enc = ops.abft_encode(w)
        _, mag = ops.abft_checks(x, enc)
        clean = np.asarray(jnp.matmul(x, w, precision=HI))
        bound = 8 * 2.0**-24 * (np.sqrt(k) + np.sqrt(n) + 2) * np.asarray(mag)[:, 0]
        keys = jax.random.split(jax.random.key(trial), 250)
        faults = jax.vmap(lambda kk, m=m, n=n: GemmFaults.random(kk, (m, n), 1, 1.0))(keys)
        ys, rs = jax.jit(
            jax.vmap(lambda fl, x=x, w=w, enc=enc: ops.protected_matmul(x, w, enc, policy=ROW, faults=fl))
        )(faults)
        rows, cols = np.asarray(faults.rows[:, 0]), np.asarray(faults.cols[:, 0])
        bits = np.asarray(faults.bits[:, 0]).astype(np.uint32)
        hit = (clean[rows, cols].view(np.uint32) ^ (np.uint32(1) << bits)).view(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.abs(hit.astype(np.float64) - clean[rows, cols])
        above = ~np.isfinite(err) | (err > bound[rows])
        detected = np.asarray(rs.gemm_detected) == 1
        assert np.all(detected[above]), f"missed {np.flatnonzero(above & ~detected)[:5]}"
        assert not np.asarray(rs.gemm_uncorrectable).any()
        # Every output equals the clean product within the bound: repaired, or the error was below it.
        assert np.all(np.abs(np.asarray(ys) - clean[None]) <= 2 * bound[None, :, None] + 1e-30)
        caught += int(above.sum())
    assert caught > 500  # the campaign exercised the detector, not only harmless low bits


def test_bad_input():
    x, w = _xw(4, 8, 6)
    with pytest.raises(ValueError, match=r"x \(4, 8\) @ w \(7, 6\); expected x \(..., K\) and w \(K, N\)"):
        ops.protected_matmul(x, w[:7])
    with pytest.raises(TypeError, match=r"x has dtype int32"):
        ops.protected_matmul(jnp.ones((4, 8), jnp.int32), w)
    with pytest.raises(ValueError, match=r"re-encode w with abft_encode\(w, block_n=128\)"):
        ops.protected_matmul(x, w, ops.abft_encode(w, 2))


def _margin_loss(policy):
    def loss(a, b, faults):
        y, _ = ops.protected_matmul(a, b, policy=policy, faults=faults)
        return jnp.sum(jnp.sin(y))

    return loss


def test_check_margins_records_each_gemm_and_the_dw_bound_uses_lam_dw():
    x, w = _xw(24, 40, 36)
    none = (GemmFaults.none(), GemmFaults.none(), GemmFaults.none())
    logs = {}
    for lam_dw in (8.0, 64.0):
        with ops.check_margins() as log:
            g = jax.jit(jax.grad(_margin_loss(FaultPolicy(block_n=16, lam_dw=lam_dw)), argnums=(0, 1)))
            jax.block_until_ready(g(x, w, none))
            jax.effects_barrier()
        logs[lam_dw] = {m.role: m for m in log}
    assert set(logs[8.0]) == {"y", "dx", "dw"}
    for m in logs[8.0].values():
        assert 0 < m.ratio < 1 and m.over == 0 and m.nonfinite_checks == m.nonfinite_y == 0
    # Same data, same residuals: only dw's bound moved, by the ratio of the two factors.
    assert logs[8.0]["y"].ratio == logs[64.0]["y"].ratio
    assert logs[8.0]["dw"].ratio == pytest.approx(8.0 * logs[64.0]["dw"].ratio, rel=1e-5)
    assert logs[8.0]["dw"].shape == (1, 40, 24, 36)  # x^T (40, 24) @ dy (24, 36)


def test_check_margins_sees_an_injected_error_and_stays_off_outside():
    x, w = _xw(24, 40, 36)
    hit = GemmFaults.random(jax.random.key(3), (24, 36), 1, 1.0, bit=30)
    f = jax.jit(lambda a, b, faults: ops.protected_matmul(a, b, faults=faults))
    with ops.check_margins() as log:
        jax.block_until_ready(f(x, w, hit))
        jax.effects_barrier()
    (m,) = log
    assert m.role == "y" and m.ratio > 1 and m.over == 1
    assert "ratio" in log.table() and log.worst(1) == [m]
    g = jax.jit(lambda a, b, faults: ops.protected_matmul(a, b, faults=faults))
    jax.block_until_ready(g(x, w, hit))  # traced outside: records nothing, and nothing fails
    jax.effects_barrier()
    assert len(log) == 1


@pytest.mark.parametrize("recompute_blocks", [None, 8])
def test_backward_errors_that_cannot_be_located_are_recomputed(recompute_blocks):
    """Two errors in one block of dx and of dw: detected, not locatable, recomputed from the operands
    as the backward holds them (wᵀ and xᵀ read in place), by the branch or the block redo."""
    x, w = _xw(24, 40, 36)
    policy = FaultPolicy(block_n=16, recompute_blocks=recompute_blocks)

    def loss(a, b, tap, faults):
        y, _ = ops.protected_matmul(a, b, tap=tap, faults=faults, policy=policy)
        return jnp.sum(jnp.sin(y))

    gx0, gw0 = jax.grad(lambda a, b: jnp.sum(jnp.sin(_plain(a, b))), argnums=(0, 1))(x, w)
    hit = (GemmFaults.none(), _pairs(5, (17, 20), (30, 29)), _pairs(11, (3, 9), (30, 28)))
    gx, gw, gt = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, ops.zero_tap(), hit)
    d = ops.report_from_tap(gt).to_dict()
    assert d["gemm_detected"] == 2 and d["gemm_recomputed"] == 2 and d["gemm_uncorrectable"] == 0
    np.testing.assert_allclose(gx, gx0, atol=1e-5)
    np.testing.assert_allclose(gw, gw0, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bmm_grads_equal_the_bmm_backward_and_report_its_faults(dtype):
    # protected_bmm_grads is protected_bmm's own backward, called without the forward.
    ka, kb, kd = jax.random.split(jax.random.key(5), 3)
    a = jax.random.normal(ka, (2, 3, 40, 24)).astype(dtype)
    b = jax.random.normal(kb, (2, 3, 24, 56)).astype(dtype)
    dy = jax.random.normal(kd, (2, 3, 40, 56)).astype(dtype)
    pol = FaultPolicy()
    _, vjp = jax.vjp(lambda a, b: ops.protected_bmm(a, b, policy=pol)[0], a, b)
    want = vjp(dy)
    da, db, r = ops.protected_bmm_grads(a, b, dy, policy=pol)
    np.testing.assert_array_equal(np.asarray(da, np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(db, np.float32), np.asarray(want[1], np.float32))
    assert r.to_dict()["gemm_checked"] == 2 * 2 * 3 and r.to_dict()["gemm_detected"] == 0
    none = GemmFaults.none()
    flip = GemmFaults(*(jnp.array([x]) for x in (7, 5, 30)), jnp.array([True]))
    da2, db2, r2 = ops.protected_bmm_grads(a, b, dy, policy=pol, faults=(none, flip, flip))
    rd = r2.to_dict()
    assert rd["gemm_detected"] == 2 and rd["gemm_uncorrectable"] == 0
    np.testing.assert_allclose(np.asarray(da2, np.float32), np.asarray(da, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(db2, np.float32), np.asarray(db, np.float32), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="dy"):
        ops.protected_bmm_grads(a, b, dy[..., :8], policy=pol)
    with pytest.raises(ValueError, match="same leading axes"):
        ops.protected_bmm_grads(a, b[:1], dy, policy=pol)


def _sites(m, n, seed, bit=30):
    return GemmFaults.random(jax.random.key(seed), (m, n), 2, 1.0, bit=bit)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_protected_matmuls_equal_separate_products_with_their_faults(dtype):
    """protected_matmuls (one check GEMM for several weights) gives each product, its gradients and
    the forward and backward reports that separate protected_matmul calls give, with exponent
    flips in different weights' forward, dx and dw products corrected the same way. Only the
    number of GEMMs checked in the backward differs: x's gradient is one summed GEMM there, three
    separate ones (then added) here; it is accumulated in f32 and rounded once, so for bf16 it
    differs from the separate sum of three rounded products within their rounding."""
    m, k, ns = 48, 64, (96, 32, 32)  # x's gradient one GEMM: copies of 17920 values save 18432
    kx, *kw = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(kx, (2, m // 2, k), jnp.float32).astype(dtype)
    ws = [(jax.random.normal(key, (k, n)) / np.sqrt(k)).astype(dtype) for key, n in zip(kw, ns, strict=True)]
    faults = (
        (_sites(m, ns[0], 1), None, _sites(k, ns[0], 2)),  # forward and dw of the first weight
        None,
        (None, _sites(m, k, 3), None),  # dx of the third
    )

    def loss(fn, x, ws, tap):
        ys, rep = fn(x, ws, tap)
        return sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in ys), (ys, rep)

    def shared(x, ws, tap):
        return ops.protected_matmuls(x, ws, faults=faults, tap=tap)

    def separate(x, ws, tap):
        outs = [ops.protected_matmul(x, w, faults=f, tap=tap) for w, f in zip(ws, faults, strict=True)]
        rep = outs[0][1] + outs[1][1] + outs[2][1]
        return tuple(y for y, _ in outs), rep

    grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2), has_aux=True))
    (gx, gw, gt), (ys, rep) = grad(shared)(x, ws, ops.zero_tap())
    (hx, hw, ht), (zs, rep0) = grad(separate)(x, ws, ops.zero_tap())
    for y, z, w in zip(ys, zs, ws, strict=True):
        assert y.shape == (2, m // 2, w.shape[1]) and y.dtype == dtype
        np.testing.assert_array_equal(y, z)
    assert rep.to_dict() == rep0.to_dict()
    d = rep.to_dict()  # two sites (two blocks) in one GEMM, each corrected in place
    assert (d["gemm_checked"], d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (
        3,
        1,
        2,
        0,
    )
    back, back0 = ops.report_from_tap(gt).to_dict(), ops.report_from_tap(ht).to_dict()
    assert back0["gemm_checked"] == 6 and back["gemm_checked"] == 4  # 3 dw and 1 summed dx
    # The summed dx holds other values at the flipped sites than the third weight's own dx: where
    # that one could not locate its flips (recomputed it, f32), the sum located them.
    assert back["gemm_recomputed"] <= back0["gemm_recomputed"]
    assert {**back, "gemm_checked": 6, "gemm_recomputed": back0["gemm_recomputed"]} == back0
    assert (back["gemm_detected"], back["gemm_corrected"], back["gemm_uncorrectable"]) == (2, 4, 0)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(hx, np.float32), **tol)
    for a, b in zip(gw, hw, strict=True):
        np.testing.assert_array_equal(a, b)


def test_protected_matmuls_dx_is_one_gemm_over_the_weights_side_by_side():
    """x's gradient through several weights is one GEMM: [dy_1 dy_2 dy_3] @ [w_1 w_2 w_3]ᵀ, its
    contraction the weights' summed width, accumulated in f32 and rounded to bf16 once (the exact
    sum rounded, within one rounding of f32's accumulation); a flip in it, placed by any weight's dx
    sites, is corrected and reported once. (Where the copies cost less than the products saved:
    here 30720 values copied for 2 x 8192.)"""
    m, k, ns = 64, 128, (96, 32, 32)
    kx, kc, *kw = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    ws = [
        (jax.random.normal(key, (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
        for key, n in zip(kw, ns, strict=True)
    ]
    cts = [
        jax.random.normal(key, (m, n)).astype(jnp.bfloat16)
        for key, n in zip(jax.random.split(kc, 3), ns, strict=True)
    ]

    def loss(x, ws, tap, faults=None):
        ys, _ = ops.protected_matmuls(x, ws, faults=faults, tap=tap)
        return sum(
            jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)) for y, c in zip(ys, cts, strict=True)
        )

    grad = jax.jit(jax.grad(loss, argnums=(0, 2)))
    gx, gt = grad(x, ws, ops.zero_tap())
    exact = sum(np.asarray(c, np.float64) @ np.asarray(w, np.float64).T for c, w in zip(cts, ws, strict=True))
    assert gx.dtype == jnp.bfloat16
    got = np.asarray(gx, np.float64)
    # One rounding to bf16 (2^-8 relative) of an f32 sum that is exact up to 2^-24·Σ|terms|·√K.
    scale = sum(
        np.abs(np.asarray(c, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
        for c, w in zip(cts, ws, strict=True)
    )
    assert np.all(np.abs(got - exact) <= 2.0**-8 * np.abs(exact) + 1e-5 * scale)
    back = ops.report_from_tap(gt).to_dict()
    assert back["gemm_checked"] == 4 and back["gemm_detected"] == 0  # the summed dx and 3 dw
    # Every dot that writes an (m, k) product contracts over the summed width: the first product
    # and (where the recompute is a loop: a CPU) its recompute on the slow path, no per-weight dx.
    jaxpr = jax.make_jaxpr(jax.grad(loss))(x, ws, ops.zero_tap())
    dots = [e for e, _ in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    widths = [
        e.invars[0].aval.shape[e.params["dimension_numbers"][0][0][0]]
        for e in dots
        if e.outvars[0].aval.shape[-2:] == (m, k)
    ]
    assert widths in ([sum(ns)] * 2, [sum(ns)])
    # A flip in the second weight's dx sites lands in the summed product: corrected, reported once.
    faults = (None, (None, _sites(m, k, 3), None), None)
    gx2, gt2 = jax.jit(jax.grad(functools.partial(loss, faults=faults), argnums=(0, 2)))(
        x, ws, ops.zero_tap()
    )
    # (A value corrected in place in a bf16 product is rebuilt from its block's checksum: close to
    # the clean one within the block's rounding, as in the test above.)
    np.testing.assert_allclose(np.asarray(gx2, np.float32), np.asarray(gx, np.float32), rtol=2e-2, atol=2e-2)
    assert np.mean(np.asarray(gx2) != np.asarray(gx)) < 0.01
    back2 = ops.report_from_tap(gt2).to_dict()
    assert (back2["gemm_checked"], back2["gemm_detected"], back2["gemm_uncorrectable"]) == (4, 1, 0)
    assert back2["gemm_corrected"] >= 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_protected_matmuls_are_one_gemm_each_way_where_dx_is(dtype):
    """Where x's gradient is one GEMM over the weights side by side and every weight's width holds
    whole checksum blocks, the forward products are one checked GEMM too, x @ [w_1 w_2 w_3], and so
    are the weight gradients, xᵀ @ [dy_1 dy_2 dy_3], each split into the weights' columns: the
    values of the separate products (each column's dot is the same one), flips in the first and
    third weights' forward and dw sites corrected at their own places and reported as the separate
    products report them (detections count products: one here, two there), one GEMM checked
    forward and two backward (the summed dx and the merged dw) where separate calls check three
    and six."""
    m, k, ns = 64, 128, (96, 32, 32)
    pol = FaultPolicy(block_n=32)
    kx, kc, *kw = jax.random.split(jax.random.key(9), 5)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    ws = [(jax.random.normal(key, (k, n)) / np.sqrt(k)).astype(dtype) for key, n in zip(kw, ns, strict=True)]
    cts = [jax.random.normal(key, (m, n)) for key, n in zip(jax.random.split(kc, 3), ns, strict=True)]
    faults = (
        (_sites(m, ns[0], 1), None, _sites(k, ns[0], 2)),
        None,
        (_sites(m, ns[2], 4), None, _sites(k, ns[2], 5)),
    )

    def loss(fn, x, ws, tap, faults):
        ys, rep = fn(x, ws, tap, faults)
        return sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(ys, cts, strict=True)), (ys, rep)

    def shared(x, ws, tap, faults):
        return ops.protected_matmuls(x, ws, policy=pol, faults=faults, tap=tap)

    def separate(x, ws, tap, faults):
        outs = [
            ops.protected_matmul(x, w, policy=pol, faults=f, tap=tap) for w, f in zip(ws, faults, strict=True)
        ]
        return [y for y, _ in outs], outs[0][1] + outs[1][1] + outs[2][1]

    def grad(fn, f):
        return jax.jit(jax.grad(functools.partial(loss, fn, faults=f), argnums=(1, 2), has_aux=True))

    (gw, gt), (ys, rep) = grad(shared, faults)(x, ws, ops.zero_tap())
    (hw, ht), (zs, rep0) = grad(separate, faults)(x, ws, ops.zero_tap())
    (clean, _), (ys0, _) = grad(separate, (None,) * 3)(x, ws, ops.zero_tap())
    fwd, fwd0 = rep.to_dict(), rep0.to_dict()
    back, back0 = ops.report_from_tap(gt).to_dict(), ops.report_from_tap(ht).to_dict()
    assert (fwd["gemm_checked"], fwd0["gemm_checked"], back["gemm_checked"], back0["gemm_checked"]) == (
        1,
        3,
        2,
        6,
    )
    # Detections count products: the one merged product held both weights' flipped blocks.
    for d, d0 in ((fwd, fwd0), (back, back0)):
        assert (d["gemm_detected"], d0["gemm_detected"]) == (1, 2)
        assert d["gemm_corrected"] == d0["gemm_corrected"] >= 2 and d["gemm_uncorrectable"] == 0
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got, want, c, shape in zip(
        (*ys, *gw), (*zs, *hw), (*ys0, *clean), [(m, n) for n in ns] + [w.shape for w in ws], strict=True
    ):
        assert got.shape == shape and got.dtype == dtype
        got, want, c = (np.asarray(v, np.float32) for v in (got, want, c))
        np.testing.assert_allclose(got, want, **tol)
        if dtype == jnp.float32:
            np.testing.assert_allclose(got, c, **tol)
        else:  # a value corrected in a bf16 product is rebuilt from its block's checksum: close to
            # the clean one within the block's rounding, which can pass 2% of a small value
            assert np.mean(~np.isclose(got, c, **tol)) < 0.01
    # Detected only (nothing corrected), each flip stays where it landed: in its own weight's
    # product or gradient, at the site the separate product has it.
    pol = FaultPolicy(block_n=32, mode="detect")
    (gw, _), (ys, _) = grad(shared, faults)(x, ws, ops.zero_tap())
    (hw, _), (zs, _) = grad(separate, faults)(x, ws, ops.zero_tap())
    hit = lambda a, c: np.argwhere(np.abs(np.asarray(a, np.float32) - np.asarray(c, np.float32)) > 1.0)
    for i, (a, b, c) in enumerate(zip((*ys, *gw), (*zs, *hw), (*ys0, *clean), strict=True)):
        assert np.array_equal(hit(a, c), hit(b, c)) and (len(hit(a, c)) > 0) == (i % 3 != 1)
    # One dot writes every product, (m, ΣN), and one every weight gradient, (k, ΣN).
    jaxpr = jax.make_jaxpr(jax.grad(lambda *v: loss(shared, *v, faults=None)[0], argnums=1))(
        x, ws, ops.zero_tap()
    )
    outs = [
        e.outvars[0].aval.shape[-2:] for e, _ in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
    ]
    assert (m, sum(ns)) in outs and (k, sum(ns)) in outs
    assert not any((r, n) in outs for r in (m, k) for n in (96, 32))


def test_protected_matmuls_name_the_merged_product_whole_for_remat():
    """``checkpoint=NAME``: a rematerialisation policy saving NAME keeps the merged forward product
    whole, (1, m, ΣN), one array, where naming the three slices kept each as a copy of its own; where
    the products are separate GEMMs (16 columns do not hold 32-column blocks whole) it keeps each."""
    m, k = 64, 128
    kx, *kw = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(kx, (m, k), jnp.float32)

    def saved(ns):
        ws = [jax.random.normal(key, (k, n)) / np.sqrt(k) for key, n in zip(kw, ns, strict=True)]

        def loss(x, ws):
            ys, _ = ops.protected_matmuls(x, ws, policy=FaultPolicy(block_n=32), checkpoint="proj")
            return sum(jnp.sum(jnp.sin(y)) for y in ys)

        f = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names("proj"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, x, ws)
        return sorted(re.findall(r"f32\[([\d,]+)\] named 'proj'", out.getvalue()))

    assert saved((96, 32, 32)) == ["1,64,160"]
    assert saved((96, 16, 16)) == ["1,64,16", "1,64,16", "1,64,96"]


def test_protected_matmuls_merged_products_split_over_devices(cpu_mesh):
    """The merged products (forward and weight gradients, as above) with x's rows split over 8
    devices: the products, gradients and reports of one device, the flips corrected where they
    landed, and x's product is not gathered (each device checks its own rows)."""
    from helpers import all_gathers
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m, k, ns = 256, 128, (96, 32, 32)
    pol = FaultPolicy(block_n=32)
    kx, kc, *kw = jax.random.split(jax.random.key(11), 5)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    ws = [jax.random.normal(key, (k, n)) / np.sqrt(k) for key, n in zip(kw, ns, strict=True)]
    cts = [jax.random.normal(key, (m, n)) for key, n in zip(jax.random.split(kc, 3), ns, strict=True)]
    faults = ((_sites(m, ns[0], 1), None, _sites(k, ns[0], 2)), None, (_sites(m, ns[2], 4), None, None))

    def loss(x, ws, tap):
        ys, rep = ops.protected_matmuls(x, ws, policy=pol, faults=faults, tap=tap)
        return sum(jnp.sum(y * c) for y, c in zip(ys, cts, strict=True)), (ys, rep)

    f = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True))
    (gw, gt), (ys, rep) = f(x, ws, ops.zero_tap())
    xs = jax.device_put(x, NamedSharding(cpu_mesh, P("d")))
    wss = [jax.device_put(w, NamedSharding(cpu_mesh, P())) for w in ws]
    (hw, ht), (zs, rep8) = f(xs, wss, ops.zero_tap())
    assert rep8.to_dict() == rep.to_dict() and rep.to_dict()["gemm_corrected"] >= 2
    back, back8 = ops.report_from_tap(gt).to_dict(), ops.report_from_tap(ht).to_dict()
    assert back8 == back and back["gemm_checked"] == 2 and back["gemm_corrected"] >= 1
    for a, b in zip((*ys, *gw), (*zs, *hw), strict=True):  # dw's split contraction: another order
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    fwd = jax.jit(lambda x, ws: ops.protected_matmuls(x, ws, policy=pol)[0])
    gathered = all_gathers(fwd.lower(xs, wss).compile().as_text())
    assert [t for t, _ in gathered if t.startswith("f32")] == []  # (asked for whole, each product shows)


def test_protected_matmuls_read_x_once_for_all_checks(monkeypatch):
    """Where the checks are GEMMs (a GPU: here with the native checks said absent), the forward
    forms every weight's checks with one abft_checks call on x, the backward every weight
    gradient's with one on xᵀ (dx's checks stay per weight where each dx is its own GEMM: here the
    summed one would copy more than it saves). Where they are native (a CPU-only process), each
    product has its own."""
    from pimlayers.ops import _protected_matmul as pm

    monkeypatch.setattr(pm, "checks_native_everywhere", lambda: False)
    calls = []
    real = pm.abft_checks

    def counting(a, enc, **kw):
        calls.append((kw.get("transposed", False), enc.abs_sums.shape[-1]))
        return real(a, enc, **kw)

    monkeypatch.setattr(pm, "abft_checks", counting)
    x, w1 = _xw(16, 32, 64)
    w2 = _xw(16, 32, 32, seed=1)[1]
    f = lambda x, a, b: sum(jnp.sum(y) for y in ops.protected_matmuls(x, (a, b), policy=ROW)[0])
    jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, w1, w2)
    # Whole rows: one block per product. Forward: x against both (2 blocks); backward: dx per
    # weight (x's K = 32 columns: one block each), dw: xᵀ against both dy's (2 blocks).
    assert sorted(calls) == sorted([(False, 2), (False, 1), (False, 1), (True, 2)])
    calls.clear()
    monkeypatch.setattr(pm, "checks_native_everywhere", lambda: True)
    jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, w1, w2)
    assert sorted(calls) == sorted([(False, 1)] * 4 + [(True, 1)] * 2)


@pytest.mark.usefixtures("on_cpu")
def test_native_checks_are_ordered_after_their_product():
    """In a CPU-only process the native checks read x through an optimization barrier that also
    holds the product, after the GEMM, so XLA cannot run them beside it (they take the whole thread
    pool); the barrier changes no value."""
    from pimlayers.ops._abft import checks_native_everywhere

    assert checks_native_everywhere()  # the test process: CPU devices only, native module built
    x, w = _xw(16, 32, 64)
    text = jax.jit(lambda x, w: ops.protected_matmul(x, w, policy=ROW)[0]).lower(x, w).as_text()
    lines = [ln.strip() for ln in text.splitlines()]
    dot = next(i for i, ln in enumerate(lines) if "stablehlo.dot_general" in ln)
    checks = next(i for i, ln in enumerate(lines) if "@pimlayers_abft_checks(" in ln)
    x_in = re.search(r"@pimlayers_abft_checks\((%\w+)#(\d+)", lines[checks])
    assert x_in, lines[checks]
    barrier = next(
        i
        for i, ln in enumerate(lines)
        if ln.startswith(f"{x_in.group(1)}:2 = stablehlo.optimization_barrier")
    )
    assert dot < barrier < checks
    y, rep = ops.protected_matmul(x, w, policy=ROW)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    assert rep.to_dict()["gemm_detected"] == 0


def test_shared_checks_are_read_in_place_by_each_products_finish(monkeypatch):
    """With one check GEMM for two weights (2 + 1 column blocks), each product's finish takes the
    whole checks at its block offset (0 and 2): nothing slices them apart (each slice was a copy
    kernel on the GPU), in the forward and in the weight gradients' shared check."""
    from pimlayers.ops import _protected_matmul as pm

    monkeypatch.setattr(pm, "checks_native_everywhere", lambda: False)  # as on a GPU
    x = jnp.ones((16, 64), jnp.bfloat16)
    ws = (jnp.ones((64, 256), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16))
    policy = FaultPolicy(block_n=128)

    def f(x, a, b):
        return sum(jnp.sum(y.astype(jnp.float32)) for y in ops.protected_matmuls(x, (a, b), policy=policy)[0])

    for fn, k in ((f, 64), (jax.grad(f, argnums=(1, 2)), 16)):  # forward (K = 64); dw (K = M = 16)
        hlo = jax.jit(fn).lower(x, *ws).as_text()
        calls = [ln for ln in hlo.splitlines() if "pimlayers_abft_finish(" in ln and f"k = {k} :" in ln]
        offsets = sorted({int(re.search(r"block_offset = (\d+)", ln).group(1)) for ln in calls})
        assert offsets == [0, 2], (k, offsets)
        rows = 16 if k == 64 else 64
        assert all(f"tensor<{rows}x3x2xf32>" in ln for ln in calls), calls
    assert "split" not in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, *ws))


def test_the_mlp_checks_gate_and_up_with_one_call(monkeypatch):
    """llama_mlp's gate and up projections share x: their checks come from one abft_checks call
    (with both weights' blocks), the down projection's from its own."""
    from pimlayers.layers import llama_mlp
    from pimlayers.ops import _protected_matmul as pm

    calls = []
    real = pm.abft_checks
    monkeypatch.setattr(pm, "checks_native_everywhere", lambda: False)  # as on a GPU
    monkeypatch.setattr(
        pm, "abft_checks", lambda a, enc, **kw: calls.append(enc.abs_sums.shape) or real(a, enc, **kw)
    )
    x = jnp.ones((2, 8, 64), jnp.bfloat16)
    wg, wu, wd = jnp.ones((64, 256)), jnp.ones((64, 256)), jnp.ones((256, 64))
    jax.make_jaxpr(lambda *a: llama_mlp(*a, dtype=jnp.bfloat16))(x, wg, wu, wd)
    assert sorted(calls) == [(1, 64, 4), (1, 256, 1)]  # (G, K, blocks): gate + up 2 x 2, down 1


def test_protected_matmuls_refuse_mismatched_inputs():
    x, w = _xw(4, 8, 16)
    with pytest.raises(ValueError, match=r"protected_matmuls: 2 weights, 1 checksums"):
        ops.protected_matmuls(x, (w, w), encs=(None,))
    with pytest.raises(ValueError, match=r"protected_matmuls: 0 weights"):
        ops.protected_matmuls(x, ())
    with pytest.raises(TypeError, match=r"protected_matmuls: weights of dtypes \['float32', 'bfloat16'\]"):
        ops.protected_matmuls(x, (w, w.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"x \(4, 8\) @ w \(9, 16\); expected x \(\.\.\., K\)"):
        ops.protected_matmuls(x, (w, jnp.ones((9, 16))))


def test_inside_shard_map_forward_and_gradient_checked_and_corrected(cpu_mesh):
    """Rows split over a mesh, the weight replicated: inside shard_map the protected GEMM and its
    recompute loop run under JAX's varying-axes checks (the loop's carry varies as its input does),
    a fault on one device's rows is corrected there and counted once by the psum'd report, and the
    gradient, with the checks on (the replicated weight cast to varying before the custom VJP:
    ``ops._vma``, so its cotangent is summed over the devices) and off, is the unsplit GEMM's."""
    from jax.sharding import PartitionSpec as P

    n = cpu_mesh.devices.size
    ks = jax.random.split(jax.random.key(7), 2)
    x = jax.random.normal(ks[0], (8 * n, 32))
    w = jax.random.normal(ks[1], (32, 48))

    def local(xs, w, fire):
        faults = GemmFaults.random(jax.random.key(1), (8, 48), 1, 1.0, bit=30)
        hit = faults._replace(active=faults.active & (fire[0] > 0))
        y, rep = ops.protected_matmul(xs, w, faults=(hit, None, None))
        return y, jax.lax.psum(rep.gemm_detected, "d"), jax.lax.psum(rep.gemm_corrected, "d")

    fire = jnp.zeros((n,), jnp.int32).at[n // 2].set(1)  # one device's rows hit
    sm = jax.shard_map(local, mesh=cpu_mesh, in_specs=(P("d"), P(), P("d")), out_specs=(P("d"), P(), P()))
    y, detected, corrected = jax.jit(sm)(x, w, fire)
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-4)
    assert (int(detected), int(corrected)) == (1, 1)

    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    for check_vma in (True, False):
        loss = jax.shard_map(
            lambda xs, w: jax.lax.psum(jnp.sum(jnp.sin(ops.protected_matmul(xs, w)[0])), "d"),
            mesh=cpu_mesh,
            in_specs=(P("d"), P()),
            out_specs=P(),
            check_vma=check_vma,
        )
        got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_vary_alike_casts_only_inside_shard_map_and_only_floats(cpu_mesh):
    """``ops._vma``: outside shard_map the operands come back as they were (the same objects);
    inside, a replicated float operand is cast to vary as the split one does, an integer one is
    left (its float0 zero cotangent is formed from it and varies as it does)."""
    from jax.sharding import PartitionSpec as P

    from pimlayers.ops._vma import _varying, vary_alike, zero_cotangent

    x, w, sites = jnp.ones((8, 4)), jnp.ones((4, 3)), jnp.zeros((2,), jnp.int32)
    same = vary_alike(x, w, sites)
    assert all(a is b for a, b in zip(same, (x, w, sites), strict=True))
    assert zero_cotangent(sites).dtype == jax.dtypes.float0 and zero_cotangent(w).dtype == w.dtype
    seen = {}

    def local(x, w, sites):
        x2, w2, s2 = vary_alike(x, w, sites)
        seen.update(w=_varying(w), w2=_varying(w2), s2=_varying(s2), z=_varying(zero_cotangent(x)))
        return x2 @ w2

    jax.jit(jax.shard_map(local, mesh=cpu_mesh, in_specs=(P("d"), P(), P()), out_specs=P("d")))(x, w, sites)
    assert seen == dict(w=frozenset(), w2=frozenset({"d"}), s2=frozenset(), z=frozenset({"d"}))
