"""CUDA handlers against their pure-JAX references on the GPU (skipped without a CUDA device)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_array

import pimlayers as pl
from pimlayers import ops

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 129, 4097, 1 << 20]


@pytest.fixture(scope="module")
def gpu():
    assert pl.native_info()["cuda"].loaded, pl.native_info()["cuda"].reason
    return jax.devices("cuda")[0]


def _on(dev, x):
    return jax.device_put(x, dev)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("n", SIZES)
def test_gate(gpu, dtype, n):
    rng = np.random.default_rng(n)
    x = np.array(random_array(rng, (3, n), jnp.float32))
    x.reshape(-1)[rng.integers(0, x.size, size=max(1, x.size // 7))] = np.nan
    x = _on(gpu, jnp.asarray(x).astype(dtype))
    y, c = jax.jit(lambda a: ops.gate(a, limit=4.0, impl="native"))(x)
    y_r, c_r = jax.jit(lambda a: ops.gate(a, limit=4.0, impl="reference"))(x)
    assert np.asarray(y).tobytes() == np.asarray(y_r).tobytes()
    assert np.array_equal(np.asarray(c), np.asarray(c_r))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8, jnp.int32])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bank", [16, 4096])
def test_checksums_parity_reconstruct(gpu, dtype, n, bank):
    x_host = random_array(np.random.default_rng(n + bank), (n,), dtype)
    x = _on(gpu, x_host)
    got = jax.jit(lambda a: ops.bank_checksums(a, bank_bytes=bank, impl="native"))(x)
    cpu = ops.bank_checksums(x_host, bank_bytes=bank, impl="native")  # the CPU handler
    assert np.array_equal(np.asarray(got), np.asarray(cpu))
    par = jax.jit(lambda a: ops.parity(a, bank_bytes=bank, group=4, impl="native"))(x)
    assert np.array_equal(np.asarray(par), np.asarray(ops.parity(x_host, bank_bytes=bank, group=4)))
    ng = par.shape[0]
    lost = np.random.default_rng(1).integers(-1, 4, size=ng).astype(np.int32)
    nb = ops.num_banks(x_host, bank)
    lost = np.where(np.arange(ng) * 4 + lost < nb, lost, -1).astype(np.int32)
    zeroed = jnp.zeros_like(x)
    fixed = jax.jit(lambda a, p, lo: ops.reconstruct(a, p, lo, bank_bytes=bank, group=4, impl="native"))(
        zeroed, par, _on(gpu, jnp.asarray(lost))
    )
    fixed_r = ops.reconstruct(
        jnp.zeros_like(x_host), par, jnp.asarray(lost), bank_bytes=bank, group=4, impl="reference"
    )
    assert np.asarray(fixed).tobytes() == np.asarray(fixed_r).tobytes()


# (64, 256, 1024): the row kernel in place (abft_check), whose corrections the finish tests do not reach.
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 129, 33), (257, 512, 4097), (64, 256, 1024)])
@pytest.mark.parametrize("block_n", [None, 128])
def test_abft(gpu, shape, block_n):
    m, k, n = shape
    rng = np.random.default_rng(m)
    x = _on(gpu, jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)))
    w = _on(gpu, jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)))
    c, mag = ops.abft_checks(x, ops.abft_encode(w, block_n))
    y = jnp.matmul(x, w, precision="highest")
    rows = rng.integers(0, m, size=min(m, 20))
    bad = y.at[rows, rng.integers(0, n, size=rows.size)].set(jnp.nan)
    bad = bad.at[rows, 0].add(1e4 * float(jnp.abs(y).max()))
    o_n, f_n = jax.jit(lambda a, b, d: ops.abft_check(a, b, d, k=k, block_n=block_n, impl="native"))(
        bad, c, mag
    )
    o_r, f_r = jax.jit(lambda a, b, d: ops.abft_check(a, b, d, k=k, block_n=block_n, impl="reference"))(
        bad, c, mag
    )
    assert np.array_equal(np.asarray(f_n), np.asarray(f_r))
    _, clean_f = ops.abft_check(y, c, mag, k=k, block_n=block_n, impl="native")
    assert not np.asarray(clean_f).any()
    np.testing.assert_allclose(
        np.asarray(o_n), np.asarray(o_r), atol=1e-2 * float(jnp.abs(y).max()), equal_nan=True
    )


def _exact_encode(w, block_n, transposed):
    """f64 block sums of w, (s1, s2, sa), and the sums of their terms' magnitudes: (*g, K, nb) each."""
    v = np.asarray(jnp.asarray(w).astype(jnp.float32), np.float64)
    v = np.swapaxes(v, -1, -2) if transposed else v
    *g, k, n = v.shape
    bn = n if block_n is None else block_n
    nb = -(-n // bn)
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, nb * bn - n)]).reshape(*g, k, nb, bn)
    pos, a = np.arange(1, bn + 1), np.abs(v)
    return (v.sum(-1), (v * pos).sum(-1), a.sum(-1)), (a.sum(-1), (a * pos).sum(-1), a.sum(-1))


# abft_encode's CUDA handler (impl="native"; also what "auto" takes on a GPU, _ENCODE_NATIVE_ON).
# Both layouts, each on its vector path (16-byte packs: (64, 1024), (2, 130, 256), (2048, 64); f32
# also (3, 65, 300) transposed) and its scalar one (widths that are not whole packs: rows starting
# off 16-byte boundaries), partial last blocks, a leading group axis, whole-row blocks of a tall w
# (the transposed kernel's narrowest column chunks) and empty inputs.
ENCODE_SHAPES = [(7, 129), (257, 4097), (3, 65, 300), (64, 1024), (2, 130, 256), (2048, 64), (0, 8), (5, 0)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", ENCODE_SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_abft_encode(gpu, dtype, shape, transposed):
    w_host = random_array(np.random.default_rng(sum(shape)), shape, dtype)
    w = _on(gpu, w_host)
    n = shape[-2] if transposed else shape[-1]
    for block_n in (None, 1, 33, 128, 256):
        got = jax.jit(lambda v, b=block_n: ops.abft_encode(v, b, transposed=transposed, impl="native"))(w)
        want = jax.jit(lambda v, b=block_n: ops.abft_encode_reference(v, b, transposed))(w)
        for g, r in zip(got, want, strict=True):
            assert g.shape == r.shape and g.dtype == r.dtype == jnp.float32, (block_n, g.shape, r.shape)
        if got.abs_sums.size == 0:
            continue
        exact, mags = _exact_encode(w_host, block_n, transposed)
        width = n if block_n is None else min(block_n, n)
        # Both are f32 sums of the same terms in different orders: each within Higham & Mary's
        # probabilistic bound (lam = 8, the check's own, abft.h) of the exact sum, so within twice
        # that of each other. A term missed, counted twice or weighted wrongly is far outside it.
        for i, (e, m) in enumerate(zip(exact, mags, strict=True)):
            tol = 8 * np.sqrt(width) * 2.0**-24 * m
            g = np.asarray(got.sums[..., i] if i < 2 else got.abs_sums, np.float64)
            r = np.asarray(want.sums[..., i] if i < 2 else want.abs_sums, np.float64)
            assert np.all(np.abs(g - e) <= tol), (block_n, i, np.max(np.abs(g - e) - tol))
            assert np.all(np.abs(g - r) <= 2 * tol), (block_n, i, np.max(np.abs(g - r) - 2 * tol))


# abft_encode_pair's CUDA handler: a 128 x 128 tile per CTA, both layouts from one read. One tile,
# several tiles each way (tiles in a row and in a column), a leading group axis, every dtype.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(128, 128), (256, 640), (384, 128), (3, 256, 384)])
def test_abft_encode_pair(gpu, dtype, shape):
    w_host = random_array(np.random.default_rng(sum(shape)), shape, dtype)
    w = _on(gpu, w_host)
    got = jax.jit(lambda v: ops.abft_encode_pair(v, 128, impl="native"))(w)
    for transposed, enc in zip((False, True), got, strict=True):
        want = jax.jit(lambda v, t=transposed: ops.abft_encode_reference(v, 128, t))(w)
        for g, r in zip(enc, want, strict=True):
            assert g.shape == r.shape and g.dtype == r.dtype == jnp.float32, (transposed, g.shape, r.shape)
        exact, mags = _exact_encode(w_host, 128, transposed)
        # As test_abft_encode: each within the probabilistic bound of the exact f64 sums, so within
        # twice that of the reference; a term missed, doubled or mis-weighted is far outside it.
        for i, (e, m) in enumerate(zip(exact, mags, strict=True)):
            tol = 8 * np.sqrt(128) * 2.0**-24 * m
            g = np.asarray(enc.sums[..., i] if i < 2 else enc.abs_sums, np.float64)
            r = np.asarray(want.sums[..., i] if i < 2 else want.abs_sums, np.float64)
            assert np.all(np.abs(g - e) <= tol), (transposed, i, np.max(np.abs(g - e) - tol))
            assert np.all(np.abs(g - r) <= 2 * tol), (transposed, i, np.max(np.abs(g - r) - 2 * tol))


def test_abft_encode_pair_native_refuses_what_it_cannot_tile(gpu):
    # Shapes the wrapper sends to abft_encode instead: the handler answers with an error, not a crash.
    def call(w, block_n):
        k, n = w.shape
        outs = tuple(
            jax.ShapeDtypeStruct(s, jnp.float32)
            for s in (
                (k, -(-n // block_n), 2),
                (k, -(-n // block_n)),
                (n, -(-k // block_n), 2),
                (n, -(-k // block_n)),
            )
        )
        fn = jax.ffi.ffi_call("pimlayers_abft_encode_pair", outs)
        return jax.jit(lambda v: fn(v, block_n=np.int64(block_n)))(w)

    with pytest.raises(Exception, match=r"abft_encode_pair: w \(128, 192\) with block_n=128; expected"):
        jax.block_until_ready(call(_on(gpu, jnp.ones((128, 192), jnp.bfloat16)), 128))
    with pytest.raises(Exception, match=r"abft_encode_pair: w \(128, 128\) with block_n=64; expected"):
        jax.block_until_ready(call(_on(gpu, jnp.ones((128, 128), jnp.bfloat16)), 64))
    s, a, st, at = call(_on(gpu, jnp.ones((128, 256), jnp.bfloat16)), 128)  # and it runs on after them
    assert np.array_equal(np.asarray(s), np.broadcast_to(np.array([128.0, 8256.0], np.float32), (128, 2, 2)))
    assert np.array_equal(np.asarray(st), np.broadcast_to(np.array([128.0, 8256.0], np.float32), (256, 1, 2)))
    assert np.array_equal(np.asarray(a), np.full((128, 2), 128.0)) and np.array_equal(
        np.asarray(at), np.full((256, 1), 128.0)
    )


def test_abft_encode_native_refuses_bad_input(gpu):
    # Inputs the wrapper never passes: the CUDA handler answers with an error, it does not abort.
    def call(w, k, nb, block_n):
        outs = (jax.ShapeDtypeStruct((k, nb, 2), jnp.float32), jax.ShapeDtypeStruct((k, nb), jnp.float32))
        fn = jax.ffi.ffi_call("pimlayers_abft_encode", outs)
        return jax.jit(lambda v: fn(v, block_n=np.int64(block_n), transposed=np.bool_(False)))(w)

    w = _on(gpu, jnp.ones((4, 8), jnp.float32))
    bad_dtype = r"pimlayers.abft_encode: w has dtype int32; expected float32, bfloat16 or float16"
    with pytest.raises(Exception, match=bad_dtype):
        jax.block_until_ready(call(_on(gpu, jnp.ones((4, 8), jnp.int32)), 4, 2, 4))
    bad_out = r"pimlayers.abft_encode: outputs \(4, 3, 2\) / \(4, 3\) do not match w \(4, 8\)"
    with pytest.raises(Exception, match=bad_out):
        jax.block_until_ready(call(w, 4, 3, 4))
    with pytest.raises(Exception, match=r"pimlayers.abft_encode: w \(4, 8\), block_n=0; expected"):
        jax.block_until_ready(call(w, 4, 2, 0))
    sums, abs_sums = call(w, 4, 2, 4)  # and the handler runs on after them
    assert np.array_equal(np.asarray(sums), np.broadcast_to(np.array([4.0, 10.0], np.float32), (4, 2, 2)))
    assert np.array_equal(np.asarray(abs_sums), np.full((4, 2), 4.0, np.float32))


# Row kernel (f32, rows and blocks multiples of 128 columns: whole 512-column chunks, a tail chunk,
# blocks spanning chunks) and the warp kernel (ragged widths, bf16 input).
@pytest.mark.parametrize(
    ("m", "k", "n", "block_n", "in_dtype"),
    [
        (64, 256, 14336, None, jnp.float32),
        (64, 256, 14336, 128, jnp.float32),
        (33, 128, 1152, 128, jnp.float32),
        (33, 128, 1152, 384, jnp.float32),
        (9, 64, 200, 32, jnp.float32),
        (9, 64, 256, 128, jnp.bfloat16),
    ],
)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_abft_finish(gpu, m, k, n, block_n, in_dtype, out_dtype):
    rng = np.random.default_rng(n + m)
    x = _on(gpu, jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)))
    w = _on(gpu, jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)))
    c, mag = ops.abft_checks(x, ops.abft_encode(w, block_n))
    y = jnp.matmul(x, w, precision="highest").astype(in_dtype)
    bad = np.array(y.astype(jnp.float32))
    rows = rng.choice(m, size=min(m, 8), replace=False)
    bad[rows, rng.integers(0, n, rows.size)] += 1e3
    bad[rows[0], 1] = np.nan
    bad[rows[1], 2] = bad[rows[1], 3] = np.inf  # two in one block: detected, gated
    bad = _on(gpu, jnp.asarray(bad).astype(in_dtype))
    kw = dict(k=k, block_n=block_n, out_dtype=out_dtype, fill=0.0)
    o_n, f_n, n_n = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="native", **kw))(bad, c, mag)
    o_r, f_r, n_r = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="reference", **kw))(bad, c, mag)
    assert np.array_equal(np.asarray(f_n), np.asarray(f_r))
    assert np.array_equal(np.asarray(n_n), np.asarray(n_r)) and int(n_n[rows[1]].sum()) == 2
    np.testing.assert_allclose(np.asarray(o_n, np.float32), np.asarray(o_r, np.float32), rtol=1e-2, atol=1e-2)
    clean, f_c, n_c = ops.abft_finish(y, c, mag, impl="native", **kw)
    assert not np.asarray(f_c).any() and not np.asarray(n_c).any()
    assert np.asarray(clean).tobytes() == np.asarray(y.astype(out_dtype)).tobytes()


# The tile kernel (128-column blocks checked in place, every bf16 product of the training step): a
# product with a fault in three tiles of four, so most warps meet more tiles to decide than their
# queue holds (32: the H200 keeps ~3,200 warps resident, each takes 16 tiles a trip, and 4096 x 5120
# is 163,840 tiles: ~48 a warp, ~36 of them faulty) and find the rest again by their flags; and a
# small one whose tiles are not a whole number of a warp's 16. Located NaNs and errors (rebuilt),
# two non-finite values in a tile (detected, gated), values past the gate's limit; bf16 and f16;
# against the reference.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("limit", [None, 3.0])
@pytest.mark.parametrize(("m", "n", "share"), [(4096, 5120, 1.0), (37, 1280, 0.3)])
def test_abft_finish_tiles(gpu, dtype, limit, m, n, share):
    rng = np.random.default_rng(m + n)
    k = 64
    x = _on(gpu, jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)))
    w = _on(gpu, jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)))
    c, mag = ops.abft_checks(x, ops.abft_encode(w, 128))
    y = np.array(jnp.matmul(x, w, precision="highest"))
    tiles = y.reshape(-1, 128)  # tile t is check block t (rows of whole tiles)
    hit = np.flatnonzero(rng.random(tiles.shape[0]) < share)
    kind, col = rng.integers(0, 4, hit.size), rng.integers(0, 128, hit.size)
    tiles[hit[kind == 0], col[kind == 0]] = np.nan
    tiles[hit[kind == 1], col[kind == 1]] += 1e3
    tiles[hit[kind == 2], col[kind == 2]] = np.inf
    tiles[hit[kind == 2], (col[kind == 2] + 1) % 128] = np.nan  # kind 3: left clean
    bad = _on(gpu, jnp.asarray(y).astype(dtype))
    kw = dict(k=k, block_n=128, out_dtype=dtype, fill=0.0, limit=limit)
    o_n, f_n, n_n = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="native", **kw))(bad, c, mag)
    o_r, f_r, n_r = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="reference", **kw))(bad, c, mag)
    f_n, f_r = np.asarray(f_n), np.asarray(f_r)
    assert np.array_equal(f_n, f_r)
    assert (f_n == ops.ABFT_CORRECTED).any() and (f_n == ops.ABFT_DETECTED).any()
    assert np.array_equal(np.asarray(n_n), np.asarray(n_r)) and int(np.asarray(n_n).sum()) > 0
    a, b = np.asarray(o_n, np.float32), np.asarray(o_r, np.float32)
    # Rebuilt values differ by the sums' rounding (f64 native, f32 reference) before the cast.
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)
    assert np.array_equal(np.isnan(a), np.isnan(b))


# A shared check GEMM's checks (three products' side by side) read at a block offset, on each kernel:
# the tile kernel (bf16 in place, 128 columns), the row kernel (256-column blocks; out of place)
# and the warp kernel (ragged): the same outputs as with the product's own checks sliced out.
@pytest.mark.parametrize(
    ("dtype", "out_dtype", "n", "block_n"),
    [
        (jnp.bfloat16, jnp.bfloat16, 1280, 128),
        (jnp.float32, jnp.float32, 1024, 256),
        (jnp.float32, jnp.bfloat16, 1024, 128),
        (jnp.bfloat16, jnp.bfloat16, 200, 32),
    ],
)
def test_abft_finish_block_offset(gpu, dtype, out_dtype, n, block_n):
    # x and the weights in f32, the product cast to dtype after it is formed (as the tile test does):
    # no bf16 GEMM, whose autotuning compute-sanitizer cannot run (tests/sanitize_gpu.py).
    rng = np.random.default_rng(n)
    m, k = 300, 64
    x = _on(gpu, jnp.asarray(rng.standard_normal((m, k)), jnp.float32))
    ws = [_on(gpu, jnp.asarray(rng.standard_normal((k, c)) / 8, jnp.float32)) for c in (384, n, 96)]
    encs = [ops.abft_encode(w, block_n) for w in ws]
    both = ops.WeightChecksums(
        jnp.concatenate([e.sums for e in encs], axis=-2), jnp.concatenate([e.abs_sums for e in encs], axis=-1)
    )
    c, mag = ops.abft_checks(x, both)
    off, nb = encs[0].abs_sums.shape[-1], encs[1].abs_sums.shape[-1]
    y = np.array(jnp.matmul(x, ws[1], precision="highest"))
    hit = rng.choice(m, 40, replace=False)
    y[hit[:20], rng.integers(0, n, 20)] += 1e3  # located and rebuilt
    y[hit[20:30], rng.integers(0, n, 10)] = np.nan
    y[hit[30:], 0] = y[hit[30:], 1] = np.inf  # two in a block: detected, gated
    y = _on(gpu, jnp.asarray(y).astype(dtype))
    kw = dict(k=k, block_n=block_n, out_dtype=out_dtype, impl="native")
    got = jax.jit(lambda a, cc, mm: ops.abft_finish(a, cc, mm, block_offset=off, **kw))(y, c, mag)
    own = (c[:, off : off + nb], mag[:, off : off + nb])
    want = jax.jit(lambda a, cc, mm: ops.abft_finish(a, cc, mm, **kw))(y, *own)
    for a, b in zip(got, want, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    flags = np.asarray(got[1])
    assert (flags == ops.ABFT_CORRECTED).sum() >= 15 and (flags == ops.ABFT_DETECTED).sum() >= 10


# FaultPolicy(weighted_checks=False): checks without c2 (its slot NaN here: never read) on each
# kernel: the tile kernel (bf16 in place, 128 columns), the row kernel (f32, 128-column blocks, out of
# place) and the warp kernel (ragged). Every fault detected, none located; the same flags, counts and
# values as the reference; a clean product untouched.
@pytest.mark.parametrize(
    ("dtype", "out_dtype", "m", "n", "block_n"),
    [
        (jnp.bfloat16, jnp.bfloat16, 4096, 5120, 128),
        (jnp.float32, jnp.bfloat16, 64, 14336, 128),
        (jnp.bfloat16, jnp.bfloat16, 33, 200, 32),
    ],
)
def test_abft_finish_without_weighted_checks(gpu, dtype, out_dtype, m, n, block_n):
    rng = np.random.default_rng(m + n)
    k = 64
    x = _on(gpu, jnp.asarray(rng.standard_normal((m, k)), jnp.float32))
    w = _on(gpu, jnp.asarray(rng.standard_normal((k, n)) / 8, jnp.float32))
    c, mag = ops.abft_checks(x, ops.abft_encode(w, block_n), weighted=False)
    c = c.at[..., 1].set(jnp.nan)
    y0 = np.array(jnp.matmul(x, w, precision="highest"))
    clean = _on(gpu, jnp.asarray(y0).astype(dtype))  # y0 is never written (a transfer may read it late)
    y = y0.copy()
    hit = rng.choice(m, min(m, 30), replace=False)
    y[hit[:10], rng.integers(0, n, 10)] += 1e3  # the weighted check would locate these
    y[hit[10:20], rng.integers(0, n, 10)] = np.nan
    y[hit[20:], 0] = y[hit[20:], 1] = np.inf  # two in a block: detected, gated
    bad = _on(gpu, jnp.asarray(y).astype(dtype))
    kw = dict(k=k, block_n=block_n, out_dtype=out_dtype, correct=False, weighted=False, fill=0.0)
    o_n, f_n, n_n = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="native", **kw))(bad, c, mag)
    o_r, f_r, n_r = jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl="reference", **kw))(bad, c, mag)
    f_n = np.asarray(f_n)
    assert np.array_equal(f_n, np.asarray(f_r)) and np.array_equal(np.asarray(n_n), np.asarray(n_r))
    assert not (f_n == ops.ABFT_CORRECTED).any() and (f_n == ops.ABFT_DETECTED).sum() == np.unique(hit).size
    np.testing.assert_allclose(np.asarray(o_n, np.float32), np.asarray(o_r, np.float32), rtol=1e-2, atol=1e-2)
    out, flags, counts = ops.abft_finish(clean, c, mag, impl="native", **kw)
    assert not np.asarray(flags).any() and not np.asarray(counts).any()
    assert np.asarray(out).tobytes() == np.asarray(clean.astype(out_dtype)).tobytes()


# bank_guard at the store's scale (64 MiB) and ragged sizes. Banks of 4112 bytes take two chunks
# (sums added atomically), 2^18 bytes 64 chunks, 16 bytes one part-idle warp.
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.bfloat16])
@pytest.mark.parametrize("nbytes", [2, 4098, (1 << 20) + 6, 1 << 26])
@pytest.mark.parametrize(("bank", "group"), [(16, 3), (4096, 8), (4112, 3), (1 << 18, 2)])
def test_bank_guard(gpu, dtype, nbytes, bank, group):
    x_host = random_array(np.random.default_rng(nbytes + bank), (nbytes // jnp.dtype(dtype).itemsize,), dtype)
    x = _on(gpu, x_host)
    kw = dict(bank_bytes=bank, group=group, parity_sums=True)
    got = jax.jit(lambda a: ops.bank_guard(a, **kw, impl="native"))(x)
    ref = jax.jit(lambda a: ops.bank_guard(a, **kw, impl="reference"))(x)
    auto = jax.jit(lambda a: ops.bank_guard(a, **kw))(x)  # the separate ops for banks under 2 KiB
    for g, r, a in zip(got, ref, auto, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(r)) and np.array_equal(np.asarray(a), np.asarray(r))
    if nbytes < 1 << 21:  # the CPU handler agrees too
        cpu = ops.bank_guard(jax.device_put(x_host, jax.devices("cpu")[0]), **kw, impl="native")
        assert all(np.array_equal(np.asarray(g), np.asarray(c)) for g, c in zip(got, cpu, strict=True))


# Many leaves in one call: ragged sizes and dtypes, more leaves than one launch's table (32), and
# banks of one chunk, two chunks (4112) and many (2^16), groups beyond one pass of 8 members (11).
MANY_SIZES = [0, 2, 6, 4098, 77 * 4, (1 << 20) + 6, 4096 * 8 * 3, 1 << 24]


def _many_leaves(seed: int, count: int):
    rng = np.random.default_rng(seed)
    dtypes = [jnp.uint8, jnp.bfloat16, jnp.float32, jnp.int8]
    out = []
    for i in range(count):
        d = dtypes[i % len(dtypes)]
        nbytes = MANY_SIZES[(i + 1) % len(MANY_SIZES)]  # the empty one is not first
        out.append(random_array(rng, (nbytes // jnp.dtype(d).itemsize,), d))
    return out


@pytest.mark.parametrize("count", [1, 9, 40])
@pytest.mark.parametrize(("bank", "group"), [(16, 3), (4096, 8), (4112, 3), (4096, 11), (1 << 16, 2)])
def test_bank_guard_and_verify_many(gpu, count, bank, group):
    host = _many_leaves(count + bank + group, count)
    xs = [_on(gpu, x) for x in host]
    kw = dict(bank_bytes=bank, group=group)
    got = jax.jit(lambda a: ops.bank_guard_many(a, **kw, impl="native"))(xs)
    ref = jax.jit(lambda a: ops.bank_guard_many(a, **kw, impl="reference"))(xs)
    for g3, r3 in zip(got, ref, strict=True):
        assert all(np.array_equal(np.asarray(g), np.asarray(r)) for g, r in zip(g3, r3, strict=True))
    # Flip one bit in every other non-empty leaf and one parity bit of the last non-empty leaf.
    flipped = []
    for i, x in enumerate(host):
        b = np.array(x)
        if i % 2 == 0 and b.size:
            b.reshape(-1).view(np.uint8)[b.nbytes // 2] ^= 1
        flipped.append(b)
    changed = sum(1 for i, x in enumerate(host) if i % 2 == 0 and x.size)
    guards = [tuple(g) for g in got]
    j = [i for i, x in enumerate(host) if x.size][-1]
    guards[j] = (guards[j][0], guards[j][1].at[0, 0].set(guards[j][1][0, 0] ^ 4), guards[j][2])
    ys = [_on(gpu, x) for x in flipped]
    v = jax.jit(lambda a, g: ops.bank_verify_many(a, g, **kw, impl="native"))(ys, guards)
    r = jax.jit(lambda a, g: ops.bank_verify_many(a, g, **kw, impl="reference"))(ys, guards)
    for field in range(3):
        for a, b in zip(v[field], r[field], strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert int(v.count) == int(r.count) == changed + 1  # one bank per flipped leaf, one parity row


@pytest.mark.parametrize(("bank", "group"), [(16, 3), (4096, 8), (4112, 3), (1 << 16, 2)])
def test_verify_many_casts_as_xla_converts(gpu, bank, group):
    """The verify kernels' bfloat16 copies of float32 leaves (ragged: 1-3 values past a vector, a
    partial group; the fast kernel at (4096, 8), the general one elsewhere) equal XLA's convert
    on the GPU bit for bit, with every other leaf cast by XLA; a flipped bit is flagged and copied
    as read."""
    rng = np.random.default_rng(bank + group)
    xs = _many_leaves(bank + group, 9)
    for n in (1, 3, 1025, 4096 * 8 + 7, (1 << 22) + 2):  # float32 counts
        xs.append(jnp.asarray((rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32)))
    xs[-1] = xs[-1].at[:4].set(jnp.array([np.inf, -np.inf, 1.0 + 2.0**-8, -0.0], jnp.float32))
    guards = jax.jit(lambda a: ops.bank_guard_many(a, bank_bytes=bank, group=group))(xs)
    b = np.array(xs[-2])
    b.view(np.uint8)[b.nbytes // 2] ^= 0x40
    ys = [_on(gpu, x) for x in xs[:-2]] + [_on(gpu, b), _on(gpu, xs[-1])]
    cast = [jnp.bfloat16] * len(ys)
    f = jax.jit(
        lambda a, g: ops.bank_verify_many(a, g, bank_bytes=bank, group=group, cast=cast, impl="native")
    )
    v = f(ys, guards)
    assert int(v.count) == 1
    for y, c in zip(ys, v.cast, strict=True):
        want = np.asarray(jax.jit(lambda a: a.astype(jnp.bfloat16))(y))
        assert c.dtype == jnp.bfloat16 and np.array_equal(np.asarray(c).view(np.uint16), want.view(np.uint16))


def test_bank_guard_vmap_unaligned_examples(gpu):
    # 77 float32 = 308 bytes per example: every example after the first starts off a 16-byte boundary.
    x = _on(gpu, random_array(np.random.default_rng(12), (5, 77), jnp.float32))
    kw = dict(bank_bytes=32, group=3, parity_sums=True)
    got = jax.jit(jax.vmap(lambda a: ops.bank_guard(a, **kw, impl="native")))(x)
    ref = jax.jit(jax.vmap(lambda a: ops.bank_guard(a, **kw, impl="reference")))(x)
    for g, r in zip(got, ref, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(r))
