"""The device redo (``FaultPolicy(recompute_kernel=True)``): detected blocks recomputed in place by one
kernel launched over every tile, with no branch and no capacity.

On the CPU the kernel runs under Pallas' interpreter; it is lowered for a GPU here too (one Triton
call, no loop or branch around it), and runs on one in ``tests/test_gpu_redo_kernel.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import host_control_flow, jaxpr_eqns

from pimlayers import ops
from pimlayers.faults import FaultPolicy, GemmFaults
from pimlayers.ops import _fused_gemm, _protected_matmul, _redo_kernel
from pimlayers.ops._abft import ABFT_CLEAN, ABFT_CORRECTED, ABFT_DETECTED, WeightChecksums
from pimlayers.ops._redo_kernel import redo_detected, redo_kernel_applies

KERNEL = FaultPolicy(recompute_kernel=True)


def _case(g, r, k, n, block_n, dtype, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (g, r, k)).astype(dtype)
    b = (jax.random.normal(kb, (g, k, n)) / np.sqrt(k)).astype(dtype)
    enc = [ops.abft_encode(b[i], block_n) for i in range(g)]
    enc = WeightChecksums(jnp.stack([e.sums for e in enc]), jnp.stack([e.abs_sums for e in enc]))
    c, mag = ops.abft_checks(a, enc)
    return a, b, c, mag


def _redo(a, b, c, mag, y, flags, counts, **kw):
    kw = dict(block_n=None, lam=8.0, gate=True, fill=0.0, limit=None) | kw
    return jax.jit(lambda *x: redo_detected(*x, **kw))(a, b, c, mag, y, flags, counts)


@pytest.mark.parametrize(
    ("g", "r", "k", "n", "block_n", "a_t", "b_t", "out"),
    [
        (1, 200, 100, 300, 128, False, False, jnp.bfloat16),  # ragged rows, K, last block
        (1, 130, 70, 90, None, True, False, jnp.float32),  # whole rows, xᵀ stored (dw's layout)
        (2, 64, 64, 256, 32, False, True, jnp.bfloat16),  # two GEMMs, wᵀ stored (dx's layout)
        (1, 129, 65, 257, None, True, True, jnp.float16),
        (3, 40, 200, 384, 256, False, False, jnp.bfloat16),  # two column tiles per block
        (1, 130, 64, 2200, 128, False, False, jnp.bfloat16),  # 18 blocks: two programs per row tile
        (1, 40, 64, 2100, None, False, True, jnp.bfloat16),  # a whole row: 17 tiles in one program
    ],
)
def test_only_detected_blocks_are_rewritten_with_the_recomputed_product(g, r, k, n, block_n, a_t, b_t, out):
    dtype = jnp.float16 if out == jnp.float16 else jnp.bfloat16
    a, b, c, mag = _case(g, r, k, n, block_n, dtype)
    want = np.asarray(jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(out), np.float32)
    nb = mag.shape[-1]
    bw = n if block_n is None else block_n
    rng = np.random.default_rng(1)
    flags = np.zeros((g, r, nb), np.int32)
    counts = np.zeros((g, r, nb), np.int32)
    y = want.copy()
    detected = [(0, 5, 0), (g - 1, r - 1, nb - 1), (0, min(r - 1, 128), nb // 2)]
    for gi, ri, bi in detected:
        flags[gi, ri, bi] = ABFT_DETECTED
        counts[gi, ri, bi] = 1
        block = y[gi, ri, bi * bw : (bi + 1) * bw]
        block[:] = rng.standard_normal(block.shape) * 1e3  # garbage where the block lies
    flags[0, 7, 0] = ABFT_CORRECTED  # corrected in place by the first pass: left alone
    y[0, 7, 0] = 42.0
    aa = jnp.swapaxes(a, 1, 2) if a_t else a
    bb = jnp.swapaxes(b, 1, 2) if b_t else b
    args = (aa, bb, c, mag, jnp.asarray(y, out), jnp.asarray(flags), jnp.asarray(counts))
    got, gated, still, redone = _redo(*args, block_n=block_n, a_t=a_t, b_t=b_t)
    assert got.dtype == out and got.shape == (g, r, n)
    got = np.asarray(got, np.float32)
    hit = np.zeros((g, r, n), bool)
    for gi, ri, bi in set(detected):
        hit[gi, ri, bi * bw : (bi + 1) * bw] = True
    # Elsewhere bit for bit what came in (y is aliased; only detected rows are stored).
    assert np.array_equal(got[~hit], y[~hit])
    # The detected blocks: the product again, summed in 64-wide K slices (another f32 order than
    # XLA's dot): within one rounding of the output dtype.
    eps = float(jnp.finfo(out).eps)
    np.testing.assert_allclose(got[hit], want[hit], rtol=eps, atol=1e-5)
    assert int(still) == 0
    assert int(gated) == -len(set(detected))  # each redone block's count (1) replaced by its new 0
    assert int(redone) == len({d[0] for d in detected})


def test_checks_shared_with_other_products_are_read_at_the_block_offset():
    """One check GEMM for several products (attention's q, k, v): this product's blocks lie from an
    offset on. The redo reads them there; read from 0 (another product's), every redone block fails."""
    a, b, c, mag = _case(1, 64, 96, 256, 128, jnp.bfloat16)
    other = jnp.full((1, 64, 3), 1e3, jnp.float32)  # another product's 3 blocks, first
    c2, mag2 = jnp.concatenate([jnp.stack([other, other], -1), c], 2), jnp.concatenate([other, mag], 2)
    y = jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
    flags = jnp.zeros(mag.shape, jnp.int32).at[0, 9, 1].set(ABFT_DETECTED).at[0, 40, 0].set(ABFT_DETECTED)
    zeros = jnp.zeros_like(flags)
    for off, still in ((3, 0), (0, 2)):
        kw = dict(block_n=128, block_offset=off)
        got, _, st, redone = _redo(a, b, c2, mag2, y.at[0, 9].set(5.0), flags, zeros, **kw)
        assert (int(st), int(redone)) == (still, 1)
    _close(got[0, 9, 128:], y[0, 9, 128:])


@pytest.mark.parametrize("detected", [False, True])
def test_the_kernels_tally_of_the_first_pass_is_the_protected_gemms(detected):
    """``tally=True``: the programs count the first pass's flags and gated values of their blocks
    (every block once: 18 blocks, two programs per row tile, ragged rows), equal to
    ``_protected_matmul._tally``'s reduction, whether or not a block is redone."""
    a, b, c, mag = _case(2, 130, 64, 2200, 128, jnp.bfloat16)
    y = jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
    rng = np.random.default_rng(3)
    flags = rng.choice([ABFT_CLEAN, ABFT_CORRECTED, ABFT_DETECTED], mag.shape, p=[0.9, 0.07, 0.03])
    if not detected:
        flags = np.where(flags == ABFT_DETECTED, ABFT_CORRECTED, flags)
    counts = np.where(rng.random(mag.shape) < 0.05, rng.integers(1, 9, mag.shape), 0)
    flags, counts = jnp.asarray(flags, jnp.int32), jnp.asarray(counts, jnp.int32)
    *_, redone, tally = _redo(a, b, c, mag, y, flags, counts, block_n=128, tally=True)
    want = _protected_matmul._tally(flags, counts)
    assert [np.asarray(t).tolist() for t in tally] == [np.asarray(t).tolist() for t in want]
    assert int(redone) == (2 if detected else 0)  # both GEMMs hold a detected block, or neither


def test_a_clean_product_is_untouched_and_nothing_is_reported():
    a, b, c, mag = _case(1, 96, 64, 160, 32, jnp.bfloat16)
    y = jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
    zeros = jnp.zeros(mag.shape, jnp.int32)
    got, gated, still, redone = _redo(a, b, c, mag, y, zeros, zeros, block_n=32)
    assert np.asarray(got).tobytes() == np.asarray(y).tobytes()
    assert (int(gated), int(still), int(redone)) == (0, 0, 0)


@pytest.mark.parametrize("gate", [True, False])
def test_a_redo_that_still_fails_is_reported_and_gated(gate):
    """Row 9's products overflow: its blocks are recomputed, still not finite: uncorrectable, and
    gated (filled, counted) where the gate is on, written as computed where it is off."""
    a, b, c, mag = _case(1, 64, 64, 256, 128, jnp.bfloat16)
    b = jnp.abs(b)
    a = a.at[0, 9].set(jnp.bfloat16(1e38))
    c, mag = ops.abft_checks(a, WeightChecksums(*(v[None] for v in ops.abft_encode(b[0], 128))))
    y = jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
    flags = jnp.zeros(mag.shape, jnp.int32).at[0, 9].set(ABFT_DETECTED)
    zeros = jnp.zeros_like(flags)
    got, gated, still, redone = _redo(a, b, c, mag, y, flags, zeros, block_n=128, gate=gate, fill=-1.0)
    assert int(still) == 2 and int(redone) == 1
    row = np.asarray(got, np.float32)[0, 9]
    if gate:
        assert int(gated) == 256 and np.all(row == -1.0)
    else:
        assert int(gated) == 0 and np.all(np.isinf(row))


def test_the_gate_limit_applies_to_redone_values():
    a, b, c, mag = _case(1, 32, 64, 128, 128, jnp.bfloat16, seed=3)
    y = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    flags = jnp.zeros(mag.shape, jnp.int32).at[0, 4].set(ABFT_DETECTED)
    got, gated, still, _ = _redo(a, b, c, mag, y, flags, jnp.zeros_like(flags), block_n=128, limit=1.0)
    over = np.abs(np.asarray(y)[0, 4]) > 1.0
    assert over.any() and int(gated) == int(over.sum()) and int(still) == 0
    assert np.all(np.asarray(got)[0, 4][over] == 0.0)
    assert np.array_equal(np.asarray(got)[0, 4][~over], np.asarray(y)[0, 4][~over])


def test_where_the_kernel_applies():
    bf, f32 = jnp.zeros((1, 1), jnp.bfloat16), jnp.zeros((1, 1), jnp.float32)
    assert redo_kernel_applies(bf, bf, jnp.float32, None, 8, 8, 100)
    assert redo_kernel_applies(bf, bf, jnp.bfloat16, 384, 8, 8, 1000)
    assert redo_kernel_applies(bf, bf, jnp.bfloat16, 32, 8, 8, 1000)
    assert redo_kernel_applies(bf, bf, jnp.bfloat16, 100, 8, 8, 60)  # one block wider than N
    assert not redo_kernel_applies(f32, f32, jnp.float32, None, 8, 8, 8)  # f32: the loop
    assert not redo_kernel_applies(bf, f32, jnp.float32, None, 8, 8, 8)
    assert not redo_kernel_applies(bf, bf, jnp.bfloat16, 100, 8, 8, 1000)  # no tile divides 100
    assert not redo_kernel_applies(bf, bf, jnp.bfloat16, 8, 8, 8, 1000)
    assert not redo_kernel_applies(bf, bf, jnp.bfloat16, None, 0, 8, 8)


class _Device:
    def __init__(self, platform, cc=None, version="cuda 13.0"):
        self.platform, self.client = platform, type("Client", (), {"platform_version": version})()
        if cc is not None:
            self.compute_capability = cc


@pytest.mark.parametrize(
    ("device", "runs"),
    [
        (_Device("cpu"), True),  # the interpreter (tests)
        (_Device("gpu", "9.0"), True),
        (_Device("gpu", "8.0"), True),
        (_Device("gpu", "7.5"), False),  # Triton's bf16 dots need sm_80
        (_Device("gpu", None, "rocm 6.2"), False),
        (_Device("tpu"), False),
        (None, False),
    ],
)
def test_where_no_device_runs_the_kernel_the_loop_recomputes(monkeypatch, device, runs):
    monkeypatch.setattr(_redo_kernel, "_first_device", lambda: device)
    bf = jnp.zeros((1, 1), jnp.bfloat16)
    assert redo_kernel_applies(bf, bf, jnp.bfloat16, None, 8, 8, 100) is runs


def _xw(m, k, n, seed=0, dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)).astype(dtype)
    return x, (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(dtype)


def _pmm(policy):
    """protected_matmul under jit, faults as data."""
    return jax.jit(lambda a, b, fl=None: ops.protected_matmul(a, b, policy=policy, faults=fl))


def _flow(policy, x, w):
    """The host's loops and branches in protected_matmul's program (``helpers.host_control_flow``)."""
    return host_control_flow(jax.make_jaxpr(lambda a, b: ops.protected_matmul(a, b, policy=policy)[0])(x, w))


def _pairs(row, cols, bits):
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return GemmFaults(i32([row] * len(cols)), i32(cols), i32(bits), jnp.ones((len(cols),), bool))


def _close(y, want):
    y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(y, want, rtol=2**-7, atol=1e-5)


def _two_in_a_block(clean, row, n=32, last=None):
    """Two columns in [0, n) of the first row from ``row`` (to ``last``) holding two values of one
    sign in 1.1-1.9 in magnitude: flipping exponent bit 29 there (2^127 -> 2^63) zeroes both, two
    errors of 1-2 in one block that no check locates (their weighted residual fits no single
    column, and both are far below the size it locates). One sign: opposite errors would cancel
    in the block's sum. Clear of the binade's ends, so bit 29 is set in both."""
    v = np.asarray(clean, np.float32)
    for r in range(row, v.shape[0] if last is None else last):
        for sign in (1.0, -1.0):
            cols = np.flatnonzero((sign * v[r, :n] >= 1.1) & (sign * v[r, :n] < 1.9))[:2]
            if len(cols) == 2:
                return _pairs(r, cols.tolist(), (29, 29))
    raise AssertionError(f"no row from {row} with two such values in its first {n} columns")


@pytest.mark.parametrize("block_n", [None, 32, 128])
def test_protected_matmul_redoes_unlocatable_errors_on_the_kernel(block_n):
    """Two errors in one block (not locatable): the loop would recompute the GEMM; the kernel redoes
    that block alone, and the result is the clean product."""
    x, w = _xw(96, 80, 300)
    policy = KERNEL.replace(block_n=block_n)
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
    faults = _two_in_a_block(clean, 17)
    counts = ("gemm_detected", "gemm_recomputed", "gemm_corrected", "gemm_uncorrectable")
    for p in (policy, policy.replace(recompute_kernel=False)):  # the kernel, then the loop: the same
        y, r = _pmm(p)(x, w, faults)
        assert tuple(r.to_dict()[c] for c in counts) == (1, 1, 1, 0)
        _close(y, clean)
    # Without any recompute the block is reported, not repaired: the faults are real.
    y, r = _pmm(policy.replace(recompute=False))(x, w, faults)
    assert r.to_dict()["gemm_uncorrectable"] == 1


def test_no_branch_and_no_recompile_across_fault_patterns():
    x, w = _xw(64, 64, 128)
    none = _flow(KERNEL.replace(recompute=False), x, w)
    loop = FaultPolicy(recompute_kernel=False)
    assert _flow(KERNEL, x, w) == none and _flow(loop, x, w)["while"] == none["while"] + 1
    g = _pmm(KERNEL)
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
    g(x, w, _two_in_a_block(clean, 0))  # the one compilation: later patterns are data
    with jax.no_tracing():
        for row in (3, 40, 63):
            y, r = g(x, w, _two_in_a_block(clean, row))
            assert r.to_dict()["gemm_uncorrectable"] == 0 and r.to_dict()["gemm_recomputed"] == 1
            _close(y, clean)


def test_lowered_for_a_gpu_it_is_one_triton_call_and_no_loop():
    x, w = _xw(256, 128, 512)
    f = jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=KERNEL)[0])
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "pimlayers_redo_detected" in text
    # (Its platform switch lowers to a case on a constant index, which XLA folds away.)
    assert "stablehlo.while" not in text
    loop = jax.jit(lambda a, b: ops.protected_matmul(a, b)[0]).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "stablehlo.while" in loop.as_text()


def test_backward_errors_are_redone_on_the_kernel():
    """dx (wᵀ read in place) and dw (xᵀ read in place), each with an unlocatable pair of errors."""
    x, w = _xw(48, 40, 72, seed=2)
    policy = KERNEL.replace(block_n=16)

    def loss(a, b, tap, faults):
        y, _ = ops.protected_matmul(a, b, tap=tap, faults=faults, policy=policy)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    ref = lambda p: jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, ops.zero_tap(), p)
    clean = ref((GemmFaults.none(),) * 3)
    # dx (48 x 40) and dw (40 x 72): two values of a row zeroed in each (bit 29), in 16-column
    # blocks; found on f32 products near the GEMMs' own (the sites are clear of the binade's ends).
    dy = jnp.cos(jnp.matmul(x, w, preferred_element_type=jnp.float32))
    dx = jnp.matmul(dy, w.T.astype(jnp.float32))
    dw = jnp.matmul(x.T.astype(jnp.float32), dy)
    hit = (GemmFaults.none(), _two_in_a_block(dx, 5, 16), _two_in_a_block(dw, 11, 16))
    gx, gw, gt = ref(hit)
    d = ops.report_from_tap(gt).to_dict()
    assert d["gemm_detected"] == 2 and d["gemm_recomputed"] == 2 and d["gemm_uncorrectable"] == 0
    _close(gx, clean[0])
    _close(gw, clean[1])


def test_batched_gemms_redo_only_the_gemm_that_needs_it():
    ka, kb = jax.random.split(jax.random.key(4))
    a = jax.random.normal(ka, (2, 3, 40, 24)).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (2, 3, 24, 56)) / np.sqrt(24)).astype(jnp.bfloat16)
    clean = jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
    # Sites index the (G x R, N) product: rows 40-79 are GEMM 1's.
    flip = _two_in_a_block(clean.reshape(6 * 40, 56), 40, 16, last=80)
    y, r = jax.jit(lambda a, b: ops.protected_bmm(a, b, policy=KERNEL.replace(block_n=16), faults=flip))(a, b)
    d = r.to_dict()
    assert d["gemm_checked"] == 6 and d["gemm_recomputed"] == 1 and d["gemm_uncorrectable"] == 0
    _close(y, clean)


def test_under_vmap_only_the_faulty_gemm_is_redone():
    """vmap over three GEMMs (the kernel batched: one more grid axis), faults in the second only."""
    pairs = [_xw(64, 64, 256, seed=s) for s in range(3)]
    x, w = jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
    one = _two_in_a_block(clean[1], 0)
    sites = jax.tree.map(lambda v: jnp.stack([v] * 3), one)
    sites = sites._replace(active=jnp.asarray([[False] * 2, [True] * 2, [False] * 2]))
    f = jax.vmap(lambda a, b, fl: ops.protected_matmul(a, b, policy=KERNEL, faults=fl))
    y, r = jax.jit(f)(x, w, sites)
    assert np.asarray(r.gemm_recomputed).tolist() == [0, 1, 0]
    assert np.asarray(r.gemm_uncorrectable).tolist() == [0, 0, 0]
    _close(y, clean)
    text = jax.jit(f).trace(x, w, sites).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.while" not in text


def test_f32_gemms_keep_the_loop():
    x, w = _xw(32, 32, 64, dtype=jnp.float32)
    assert _flow(KERNEL, x, w)["while"] == 1


@pytest.fixture
def fused(monkeypatch):
    """The fused path on this machine: the Hopper kernel on a Hopper GPU, else its reference."""
    if not _fused_gemm.hopper():
        monkeypatch.setattr(_protected_matmul, "_fused_kernel", lambda: _fused_gemm.fused_gemm_reference)


def test_the_fused_path_redoes_every_detected_tile_on_the_kernel(fused):
    """The fused path's own redo holds two tiles; on the kernel four faulty tiles are all redone."""
    x, w = _xw(256, 192, 512)
    clean = np.asarray(jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32)
    rows, cols = [3, 3, 200, 77], [10, 140, 300, 301]
    sites = GemmFaults(*(jnp.asarray(v, jnp.int32) for v in (rows, cols, [30] * 4)), jnp.ones((4,), bool))
    policy = FaultPolicy(fused=True, recompute_kernel=True)
    y, r = _pmm(policy)(x, w, sites)
    d = r.to_dict()
    assert (d["gemm_detected"], d["gemm_corrected"], d["gemm_uncorrectable"]) == (1, 4, 0)
    _close(y, clean)


def test_policy_takes_one_branch_free_redo():
    with pytest.raises(ValueError, match="recompute_blocks=4 and recompute_kernel=True"):
        FaultPolicy(recompute_blocks=4, recompute_kernel=True)
    with pytest.raises(TypeError, match="recompute_kernel must be a bool or None; got int 1"):
        FaultPolicy(recompute_kernel=1)
    # the default (None) defers to recompute_blocks
    assert FaultPolicy(recompute_blocks=4).recompute_kernel is None


@pytest.mark.parametrize(
    ("device", "chosen"),
    [
        (_Device("cpu"), False),  # the loop costs no host round trip there; the kernel is interpreted
        (_Device("gpu", "9.0"), True),
        (_Device("gpu", "8.0"), True),
        (_Device("gpu", "7.5"), False),
        (_Device("gpu", None, "rocm 6.2"), False),
        (None, False),
    ],
)
def test_the_default_takes_the_kernel_on_the_gpus_that_run_it(monkeypatch, device, chosen):
    """recompute_kernel=None: the device redo on an NVIDIA GPU of sm_80 or newer, the loop elsewhere;
    recompute_blocks or recompute_kernel=False keep their own redo there too. Read from the traced
    program: the kernel leaves no loop for the host and a Pallas call; the loop, one while."""
    monkeypatch.setattr(_redo_kernel, "_first_device", lambda: device)
    assert _redo_kernel.redo_kernel_chosen(FaultPolicy()) is chosen
    assert not _redo_kernel.redo_kernel_chosen(FaultPolicy(recompute_blocks=4))
    x, w = _xw(64, 64, 256)
    pallas = lambda p: any(  # (a Triton call and, for other platforms, its interpreted twin)
        e.primitive.name == "pallas_call"
        for e, _ in jaxpr_eqns(
            jax.make_jaxpr(lambda a, b: ops.protected_matmul(a, b, policy=p)[0])(x, w).jaxpr
        )
    )
    assert (_flow(FaultPolicy(), x, w)["while"], pallas(FaultPolicy())) == (
        (0, True) if chosen else (1, False)
    )
    for loop in (FaultPolicy(recompute_kernel=False), FaultPolicy(recompute_blocks=4)):
        assert not pallas(loop)
    runs = chosen or (device is not None and device.platform == "cpu")  # True: wherever it runs
    assert pallas(FaultPolicy(recompute_kernel=True)) is runs
