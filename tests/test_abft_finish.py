"""abft_finish (check + correct + gate + cast in one pass) and the bf16 split checks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimlayers import ops

HI = jax.lax.Precision.HIGHEST


def _gemm(rng, m, k, n, block_n):
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k))
    c, mag = ops.abft_checks(x, ops.abft_encode(w, block_n))
    return jnp.matmul(x, w, precision=HI), c, mag


def _faulty(rng, y):
    """Located errors, non-finite values, a value that overflows bf16/f16, two errors in one row."""
    m, n = y.shape
    bad = np.array(y)
    for r in range(0, m, 4):
        bad[r, rng.integers(n)] += 1e3 * rng.choice([-1, 1])
    bad[1, 3] = np.nan
    bad[2, n - 1] = np.inf
    bad[3, 0] = 3.4e38  # finite in f32, Inf once cast to bf16 or f16
    bad[5, 1] = np.nan
    bad[5, n // 2] = -np.inf
    bad[6, 2] += 50.0
    bad[6, n - 2] -= 7.0
    bad[7, 0] = bad[7, 1] = 3.4e38  # two in one block: detected, not located, gated where they overflow
    return jnp.asarray(bad)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_n", [None, 32, 128])
@pytest.mark.parametrize(("gate", "limit"), [(True, None), (True, 40.0), (False, None)])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_native_equals_reference(monkeypatch, isa, in_dtype, out_dtype, block_n, gate, limit):
    """y in f32 (cast by the pass) or bf16 (a bf16 GEMM's product; in place when out is bf16); the
    block sums a block at a time ("avx2") and a row at a time (AVX-512, where the CPU has it)."""
    monkeypatch.setenv("PIMLAYERS_CPU_ISA", isa)
    rng = np.random.default_rng(7)
    y, c, mag = _gemm(rng, 24, 64, 200, block_n)
    bad = _faulty(rng, y).astype(in_dtype)
    kw = dict(k=64, block_n=block_n, out_dtype=out_dtype, gate=gate, fill=-1.0, limit=limit)
    o_n, f_n, n_n = ops.abft_finish(bad, c, mag, impl="native", **kw)
    o_r, f_r, n_r = ops.abft_finish(bad, c, mag, impl="reference", **kw)
    assert o_n.dtype == out_dtype and o_n.shape == y.shape and n_n.shape == f_n.shape == (24, c.shape[1])
    assert np.array_equal(np.asarray(f_n), np.asarray(f_r))
    assert np.array_equal(np.asarray(n_n), np.asarray(n_r))
    assert (np.asarray(f_n) == ops.ABFT_CORRECTED).any() and (np.asarray(f_n) == ops.ABFT_DETECTED).any()
    if gate and (out_dtype != jnp.float32 or limit is not None or in_dtype != jnp.float32):
        assert np.asarray(n_n)[7].sum() == 2
    # Rebuilt values differ by the sums' rounding (f64 native, f32 reference) before the cast.
    a, b = np.asarray(o_n, np.float32), np.asarray(o_r, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)
    assert np.array_equal(np.isnan(a), np.isnan(b))


@pytest.mark.parametrize("block_n", [None, 128])
def test_rows_split_over_threads_equal_the_reference(block_n):
    """Outputs of more than 2^15 values are checked in row chunks by XLA's intra-op threads (CPU):
    601 rows x 320 columns (an uneven split), faults every fourth row, some gated."""
    rng = np.random.default_rng(11)
    y, c, mag = _gemm(rng, 601, 48, 320, block_n)
    bad = _faulty(rng, y).at[300, 3].set(jnp.inf).at[599, 17].set(jnp.nan)
    kw = dict(k=48, block_n=block_n, out_dtype=jnp.bfloat16, gate=True, fill=0.0, limit=None)
    got = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="native", **kw))(bad, c, mag)
    want = ops.abft_finish(bad, c, mag, impl="reference", **kw)
    for g, w in zip(got[1:], want[1:], strict=True):  # flags and gated counts, block by block
        assert np.array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=1e-2, atol=1e-3
    )
    assert (np.asarray(got[1]) != 0).sum() >= 150
    # The in-place check splits the same way.
    _, flags = ops.abft_check(bad, c, mag, k=48, block_n=block_n, impl="native")
    assert np.array_equal(np.asarray(flags), np.asarray(want[1]))


def test_clean_output_is_the_cast_and_nothing_is_counted():
    y, c, mag = _gemm(np.random.default_rng(8), 16, 96, 384, 128)
    for impl in ("native", "reference"):
        out, flags, counts = ops.abft_finish(y, c, mag, k=96, block_n=128, out_dtype=jnp.bfloat16, impl=impl)
        assert np.asarray(out).tobytes() == np.asarray(y.astype(jnp.bfloat16)).tobytes()
        assert not np.asarray(flags).any() and not np.asarray(counts).any()


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_a_located_nan_is_rebuilt_not_gated_and_two_are_gated(impl):
    y, c, mag = _gemm(np.random.default_rng(9), 4, 32, 64, None)
    bad = y.at[0, 5].set(jnp.nan).at[1, 7].set(jnp.nan).at[1, 9].set(jnp.inf)
    out, flags, counts = ops.abft_finish(bad, c, mag, k=32, out_dtype=jnp.bfloat16, fill=0.0, impl=impl)
    assert np.asarray(flags)[:, 0].tolist() == [ops.ABFT_CORRECTED, ops.ABFT_DETECTED, 0, 0]
    assert np.asarray(counts)[:, 0].tolist() == [0, 2, 0, 0]  # the rebuilt NaN is a value again, not gated
    assert abs(float(out[0, 5]) - float(y[0, 5])) <= 1e-2 * (1 + abs(float(y[0, 5])))
    assert float(out[1, 7]) == 0.0 and float(out[1, 9]) == 0.0


def test_protected_matmul_gates_in_the_same_pass():
    x = jnp.asarray(np.random.default_rng(10).standard_normal((8, 32)), jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(11).standard_normal((32, 256)) / 6, jnp.bfloat16)
    y, report = ops.protected_matmul(x, w)
    want = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    assert y.dtype == jnp.bfloat16 and np.asarray(y).tobytes() == np.asarray(want).tobytes()
    assert int(report.gemm_detected) == 0 and int(report.nonfinite_gated) == 0


def test_a_bf16_product_is_checked_in_place_without_a_copy():
    """A bf16 GEMM's output checked where it lies: the compiled program aliases the check's output
    to the product (no copy of it), and a fault in it is still found and rebuilt."""
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 256)) / 10, jnp.bfloat16)
    c, mag = ops.abft_checks(x, ops.abft_encode(w, 128))

    def step(x, w, c, mag, hit):
        y = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
        y = y.at[5, 7].add(hit)  # a fault (0: none), as data
        return ops.abft_finish(y, c, mag, k=96, block_n=128, impl="native")

    f = jax.jit(step)
    hlo = f.lower(x, w, c, mag, jnp.bfloat16(0)).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]  # the program's own instructions (fusions' bodies elsewhere)
    assert "output_to_operand_aliasing={{0}: (0, {})}" in entry
    assert not re.search(r"= bf16\[64,256\]\{[^}]*\} copy\(", entry), "the product was copied"
    clean, f0, n0 = f(x, w, c, mag, jnp.bfloat16(0))
    out, f1, n1 = f(x, w, c, mag, jnp.bfloat16(1e4))  # located: > 4·128·bound
    assert not np.asarray(f0).any() and not np.asarray(n0).any() and not np.asarray(n1).any()
    assert np.asarray(f1)[5].tolist() == [ops.ABFT_CORRECTED, ops.ABFT_CLEAN]
    # Rebuilt from the checksum: within the bound (bf16's rounding of the block's 127 other values).
    assert abs(float(out[5, 7]) - float(clean[5, 7])) <= 2.0**-8 * float(
        jnp.abs(clean[5, :128].astype(jnp.float32)).sum()
    )
    assert np.array_equal(np.delete(np.asarray(out), 7, axis=1), np.delete(np.asarray(clean), 7, axis=1))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("block_n", [None, 128])
def test_split_checks_match_the_f32_checks(block_n, jit):
    """bf16 x: the checks ride on bf16 GEMMs of split checksum columns; they equal the f32 ones,
    also under jit (where XLA may elide a bf16 round trip: the split uses bit arithmetic)."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((32, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 384)) / 20, jnp.bfloat16)
    enc = ops.abft_encode(w, block_n)
    c, mag = (jax.jit(ops.abft_checks) if jit else ops.abft_checks)(x, enc)
    xf = x.astype(jnp.float32)
    nb = enc.abs_sums.shape[-1]
    c_want = jnp.matmul(xf, enc.sums.reshape(512, nb * 2), precision=HI).reshape(32, nb, 2)
    mag_want = jnp.matmul(jnp.abs(xf), enc.abs_sums, precision=HI)
    # Both are f32 sums of the same exact products: they differ by accumulation rounding, far
    # inside the detection bound (lam * u * sqrt(K) * mag = 8 * 6e-8 * 23 * mag = 1.1e-5 mag).
    assert np.all(np.abs(np.asarray(c - c_want)) <= 1e-6 * np.asarray(mag_want)[..., None] * 512**0.5)
    np.testing.assert_allclose(np.asarray(mag), np.asarray(mag_want), rtol=1e-4)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize(
    ("dtype", "n", "block_n"), [(jnp.bfloat16, 384, 128), (jnp.float32, 300, 128), (jnp.float32, 70, 16)]
)
def test_block_offset_reads_the_products_blocks_of_wider_checks(impl, dtype, n, block_n):
    """Checks of three products side by side (one shared check GEMM): the finish of the middle one
    at its block offset is the finish with its own checks sliced out, faults and all."""
    k = 64
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (2, 40, k), jnp.float32).astype(dtype)
    ws = [
        jax.random.normal(jax.random.fold_in(kw, i), (k, m), jnp.float32).astype(dtype)
        for i, m in enumerate((96, n, 160))
    ]
    encs = [ops.abft_encode(w, block_n) for w in ws]
    both = ops.WeightChecksums(
        jnp.concatenate([e.sums for e in encs], axis=-2), jnp.concatenate([e.abs_sums for e in encs], axis=-1)
    )
    c, mag = ops.abft_checks(x, both)
    off, nb = encs[0].abs_sums.shape[-1], encs[1].abs_sums.shape[-1]
    y = jnp.matmul(x, ws[1], precision="highest", preferred_element_type=jnp.float32).astype(dtype)
    y = y.at[0, 3, 5].set(1e4).at[1, 7, n - 1].set(jnp.nan).at[1, 8, 2].add(3.0)  # located, gated, small
    kw_ = dict(k=k, block_n=block_n, impl=impl)
    got = jax.jit(lambda v, cc, mm: ops.abft_finish(v, cc, mm, block_offset=off, **kw_))(y, c, mag)
    want = jax.jit(
        lambda v, cc, mm: ops.abft_finish(v, cc[..., off : off + nb, :], mm[..., off : off + nb], **kw_)
    )(y, c, mag)
    assert got[1].shape == want[1].shape == (2, 40, nb)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    flags = np.asarray(got[1])
    assert flags[0, 3, 0] == ops.ABFT_CORRECTED and flags[1, 7, -1] != ops.ABFT_CLEAN
    assert (flags != ops.ABFT_CLEAN).sum() == 3


def test_bad_input():
    y, c, mag = jnp.zeros((2, 8)), jnp.zeros((2, 1, 2)), jnp.zeros((2, 1))
    with pytest.raises(ValueError, match=r"out_dtype=int32; expected float32, bfloat16 or float16"):
        ops.abft_finish(y, c, mag, k=1, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"limit=-1.0; expected None or a number >= 0"):
        ops.abft_finish(y, c, mag, k=1, limit=-1.0)
    with pytest.raises(ValueError, match=r"checks has float32 \(2, 0, 2\); expected float32 \(2, 1, 2\)"):
        ops.abft_finish(y, jnp.zeros((2, 0, 2)), mag, k=1)
    # Wider checks (a shared check GEMM's) are taken, but mag must hold as many blocks.
    with pytest.raises(ValueError, match=r"mag has float32 \(2, 1\); expected float32 \(2, 2\)"):
        ops.abft_finish(y, jnp.zeros((2, 2, 2)), mag, k=1)
    with pytest.raises(
        ValueError,
        match=r"checks has float32 \(2, 2, 2\); expected float32 \(2, 3, 2\) .* "
        r"block_offset=2",
    ):
        ops.abft_finish(y, jnp.zeros((2, 2, 2)), jnp.zeros((2, 2)), k=1, block_offset=2)
    with pytest.raises(ValueError, match=r"block_offset=-1; expected an int >= 0"):
        ops.abft_finish(y, c, mag, k=1, block_offset=-1)
    with pytest.raises(ValueError, match=r"checks has float32 \(2, 2, 2\); expected float32 \(2, 1, 2\)"):
        ops.abft_check(y, jnp.zeros((2, 2, 2)), mag, k=1)  # abft_check takes y's blocks alone
    with pytest.raises(TypeError, match=r"y has dtype int32"):
        ops.abft_finish(y.astype(jnp.int32), c, mag, k=1)


def test_split_parts_are_exact_bf16_values_that_sum_to_the_f32_value():
    from pimlayers.ops._abft import _bf16_head

    v = jnp.asarray(
        np.random.default_rng(13).standard_normal(4096) * 10.0 ** np.arange(-8, 8).repeat(256), jnp.float32
    )

    @jax.jit
    def split(v):
        parts, rest = [], v
        for _ in range(3):
            head = _bf16_head(rest)
            parts.append(head)
            rest = rest - head
        return jnp.stack(parts), rest

    parts, rest = split(v)
    # Each part is a bf16 value (its low 16 bits are zero) within half a bf16 ulp (2^-8 relative)
    # of what it rounds: after three parts the residual is at most 2^-24 of the value.
    assert not (np.asarray(parts).view(np.uint32) & 0xFFFF).any()
    assert np.all(np.abs(np.asarray(rest)) <= 2.0**-24 * np.abs(np.asarray(v)))
    total = np.asarray(parts, np.float64).sum(0) + np.asarray(rest, np.float64)
    assert np.array_equal(total, np.asarray(v, np.float64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_n", [None, 128])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_in_place_gate_skips_only_blocks_with_nothing_to_gate(monkeypatch, isa, dtype, block_n):
    monkeypatch.setenv("PIMLAYERS_CPU_ISA", isa)
    # In place (out_dtype = y's), a block whose largest |value| from the sums' pass is within the
    # limit gets no gate pass: clean values past the limit must still be gated, and nothing else.
    rng = np.random.default_rng(11)
    y, c, mag = _gemm(rng, 8, 64, 300, block_n)
    y = y.astype(dtype)
    a = np.asarray(y, np.float32)
    lim = float(np.quantile(np.abs(a), 0.99))  # ~24 clean values past it, in some blocks only
    kw = dict(k=64, block_n=block_n, out_dtype=dtype, gate=True, fill=0.0, impl="native")
    o, f, n = ops.abft_finish(y, c, mag, limit=lim, **kw)
    over = np.abs(a) > lim
    width = 300 if block_n is None else block_n
    per_block = np.add.reduceat(over, np.arange(0, 300, width), axis=1)
    assert not np.asarray(f).any() and np.array_equal(np.asarray(n), per_block)
    assert np.array_equal(np.asarray(o, np.float32), np.where(over, 0.0, a))
    o, f, n = ops.abft_finish(y, c, mag, limit=None, **kw)
    assert not np.asarray(n).any() and np.array_equal(np.asarray(o, np.float32), a)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_a_block_of_subnormal_values_flushed_by_the_gemm_is_not_a_fault(impl):
    """A GEMM may flush subnormal products to zero where the checks keep them (or the other way round):
    a row of subnormal inputs then gives checks of ~1e-40 against a product of exactly 0, and a mag
    whose relative bound underflows to 0. The bound's floor, (K + n + 2) FLT_MIN, passes that row
    (in the CPU training step such rows of attention's dS skipped a third of the steps); an error
    that matters in the same row is still found and rebuilt."""
    rng = np.random.default_rng(0)
    k, n = 64, 128
    x = rng.standard_normal((8, k)).astype(np.float64)
    x[0] *= 1e-40  # subnormal in f32
    w = rng.standard_normal((k, n)) / 8
    enc = ops.abft_encode(jnp.asarray(w, jnp.float32), 128)
    sums = np.asarray(enc.sums, np.float64).reshape(k, 2)
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # x as the f32 GEMM reads it
    c = jnp.asarray((xf @ sums).reshape(8, 1, 2), jnp.float32)
    mag = jnp.asarray(np.abs(xf) @ np.asarray(enc.abs_sums, np.float64), jnp.float32)
    # Without the floor the row's bound (its relative part) is far below its checks: a detection.
    relative = 8.0 * 2.0**-24 * (np.sqrt(k) + np.sqrt(n) + 2.0) * float(mag[0, 0])
    assert 0 < relative < abs(float(c[0, 0, 0])) < 1e-35
    y = jnp.asarray(xf @ w, jnp.float32).at[0].set(0.0)  # the GEMM flushed row 0's products
    kw = dict(k=k, block_n=128, impl=impl)
    out, flags, _ = jax.jit(lambda v: ops.abft_finish(v, c, mag, **kw))(y)
    assert not np.asarray(flags).any()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(y))
    bad = y.at[0, 5].set(0.5)  # a real error in that row: located and rebuilt (to ~0)
    out, flags, _ = jax.jit(lambda v: ops.abft_finish(v, c, mag, **kw))(bad)
    assert int(flags[0, 0]) == ops.ABFT_CORRECTED and abs(float(out[0, 5])) < 1e-30


@pytest.mark.parametrize("terms", [1, 2, 3])
def test_split_parts_lay_out_each_term_as_its_own_columns(terms):
    # _split_parts forms the terms in one elementwise map (one kernel on a GPU): bit for bit the
    # casts of the heads side by side, term-major, as the check GEMMs' columns are read back.
    from pimlayers.ops._abft import _bf16_head, _split_parts

    rng = np.random.default_rng(terms)
    v = rng.standard_normal((3, 5, 7)) * 10.0 ** rng.integers(-6, 6, (3, 5, 7))
    v = jnp.asarray(v, jnp.float32).at[0, 0, :3].set(jnp.asarray([0.0, -0.0, 1e-40]))
    heads, rest = [], v
    for _ in range(terms):
        head = _bf16_head(rest)
        heads.append(head.astype(jnp.bfloat16))
        rest = rest - head
    expected = np.concatenate([np.asarray(h) for h in heads], axis=-1)
    got = jax.jit(_split_parts, static_argnums=1)(v, terms)
    assert got.shape == (3, 5, 7 * terms) and got.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got).view(np.uint16), expected.view(np.uint16))
