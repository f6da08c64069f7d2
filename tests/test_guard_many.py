"""bank_guard_many / bank_verify_many: native vs reference vs an independent numpy model, on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter, random_array
from test_bank_guard import model

from pimlayers import ops

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.float16, jnp.int32]
# (bank_bytes, group): one-vector banks, a bank of two GPU chunks (4112), a group beyond one pass of
# eight members (11), the default.
LAYOUTS = [(16, 1), (16, 3), (256, 11), (4096, 8), (4112, 3)]


def _leaves(seed: int, count: int, bank: int, group: int):
    """Ragged leaves: empty, one element, partial banks, partial groups, whole groups, 2-D."""
    rng = np.random.default_rng(seed)
    span = bank * group
    sizes = [0, 1, 3, bank + 5, span + bank + 7, 2 * span]
    out = []
    for i in range(count):
        d = DTYPES[i % len(DTYPES)]
        n = max(sizes[i % len(sizes)] // jnp.dtype(d).itemsize, 0)
        shape = (n,) if i % 3 else (1, n)
        out.append(random_array(rng, shape, d))
    return out


def _flip(x, byte: int):
    b = np.array(x)
    b.reshape(-1).view(np.uint8)[byte] ^= 1 << (byte % 8)
    return jnp.asarray(b)


@pytest.mark.parametrize(("bank", "group"), LAYOUTS)
def test_guard_many_matches_model_and_reference(bank, group):
    xs = _leaves(bank + group, 8, bank, group)
    native = jax.jit(lambda a: ops.bank_guard_many(a, bank_bytes=bank, group=group, impl="native"))(xs)
    ref = jax.jit(lambda a: ops.bank_guard_many(a, bank_bytes=bank, group=group, impl="reference"))(xs)
    auto = ops.bank_guard_many(xs, bank_bytes=bank, group=group)
    assert len(native) == len(xs)
    for x, n3, r3, a3 in zip(xs, native, ref, auto, strict=True):
        want = model(np.asarray(x).tobytes(), bank, group)
        for n, r, a, w in zip(n3, r3, a3, want, strict=True):
            assert np.array_equal(np.asarray(n), w) and np.array_equal(np.asarray(r), w)
            assert np.array_equal(np.asarray(a), w)


@pytest.mark.parametrize(("bank", "group"), LAYOUTS)
def test_verify_many_flags_exactly_the_changed_banks(bank, group):
    xs = _leaves(2 * bank + group, 8, bank, group)
    guards = ops.bank_guard_many(xs, bank_bytes=bank, group=group)
    rng = np.random.default_rng(bank)
    # One flipped bit in every other non-empty leaf; one flipped parity bit in the last non-empty leaf;
    # one stored checksum entry changed in the first non-empty leaf.
    bad_xs, want_bank = [], []
    for i, x in enumerate(xs):
        nbytes = x.size * x.dtype.itemsize
        m = np.zeros(ops.num_banks(x, bank), bool)
        if i % 2 == 0 and nbytes:
            byte = int(rng.integers(nbytes))
            x = _flip(x, byte)
            m[byte // bank] = True
        bad_xs.append(x)
        want_bank.append(m)
    nonempty = [i for i, x in enumerate(xs) if x.size]
    guards = [tuple(g) for g in guards]
    last, first = nonempty[-1], nonempty[0]
    s, p, ps = guards[last]
    guards[last] = (s, p.at[-1, 3].set(p[-1, 3] ^ 0x10), ps)
    s, p, ps = guards[first]
    guards[first] = (s.at[0, 1].set(s[0, 1] ^ 1), p, ps)
    want_bank[first][0] = True
    want_par = [np.zeros(ops.num_groups(x, bank, group), bool) for x in xs]
    want_par[last][-1] = True

    for impl in ("native", "reference"):
        v = jax.jit(lambda a, g, i=impl: ops.bank_verify_many(a, g, bank_bytes=bank, group=group, impl=i))(
            bad_xs, guards
        )
        for x, now, bad, badp, wb, wp in zip(
            bad_xs, v.now, v.bad, v.bad_parity, want_bank, want_par, strict=True
        ):
            assert np.array_equal(np.asarray(now), model(np.asarray(x).tobytes(), bank, group)[0])
            assert np.array_equal(np.asarray(bad), wb), impl
            assert np.array_equal(np.asarray(badp), wp), impl
        assert int(v.count) == sum(int(w.sum()) for w in want_bank + want_par), impl


def test_clean_leaves_verify_clean_and_fault_patterns_never_recompile():
    xs = _leaves(5, 6, 256, 8)
    guards = ops.bank_guard_many(xs, bank_bytes=256, group=8)
    body = TraceCounter(lambda a, g: ops.bank_verify_many(a, g, bank_bytes=256, group=8))
    f = jax.jit(body)
    assert int(f(xs, guards).count) == 0
    rng = np.random.default_rng(6)
    for _ in range(3):  # a different flipped byte each time: data, not a new program
        j = int(rng.integers(1, len(xs)))
        nbytes = xs[j].size * xs[j].dtype.itemsize
        ys = list(xs)
        ys[j] = _flip(xs[j], int(rng.integers(nbytes)))
        assert int(f(ys, guards).count) == 1
    assert body.count == 1


def test_store_scrub_and_encode_agree_with_one_op_per_leaf():
    """The store's one-call encode equals bank_guard per leaf (what it ran before)."""
    xs = _leaves(7, 5, 4096, 8)
    many = ops.bank_guard_many(xs)
    for x, g in zip(xs, many, strict=True):
        one = ops.bank_guard(x, parity_sums=True)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(g, one, strict=True))


def test_vmap_runs_each_example():
    x = random_array(np.random.default_rng(8), (3, 300), jnp.bfloat16)
    y = random_array(np.random.default_rng(9), (3, 50), jnp.float32)
    got = jax.jit(jax.vmap(lambda a, b: ops.bank_guard_many([a, b], bank_bytes=64, group=3)))(x, y)
    for i in range(3):
        for leaf, g3 in ((x[i], got[0]), (y[i], got[1])):
            want = model(np.asarray(leaf).tobytes(), 64, 3)
            assert all(np.array_equal(np.asarray(g[i]), w) for g, w in zip(g3, want, strict=True))


def test_empty_list():
    assert ops.bank_guard_many([]) == ()
    v = ops.bank_verify_many([], [])
    assert v.now == () and int(v.count) == 0


def test_bad_input_errors():
    x = jnp.ones(100)
    with pytest.raises(TypeError, match=r"bank_guard_many: xs is a ArrayImpl; expected a list or tuple"):
        ops.bank_guard_many(x)
    with pytest.raises(TypeError, match=r"bank_guard_many: xs\[1\] is a int; expected an array"):
        ops.bank_guard_many([x, 3])
    with pytest.raises(TypeError, match=r"bank_guard_many: x has dtype complex64"):
        ops.bank_guard_many([x, jnp.ones(3, jnp.complex64)])
    with pytest.raises(
        ValueError, match=r"bank_guard_many: bank_bytes=24; expected a positive multiple of 16"
    ):
        ops.bank_guard_many([x], bank_bytes=24)
    with pytest.raises(ValueError, match=r"bank_verify_many: group=0; expected an int >= 1"):
        ops.bank_verify_many([x], [], group=0)
    g = ops.bank_guard_many([x], bank_bytes=64, group=2)
    with pytest.raises(
        ValueError, match=r"bank_verify_many: 2 arrays but guards is 1; expected one per array"
    ):
        ops.bank_verify_many([x, x], g, bank_bytes=64, group=2)
    with pytest.raises(ValueError, match=r"guards\[0\] is not a \(sums, parity, psums\) triple"):
        ops.bank_verify_many([x], [g[0][:2]], bank_bytes=64, group=2)
    with pytest.raises(
        ValueError, match=r"guards\[0\].sums is uint32\[7, 2\]; expected uint32\[13, 2\] for xs\[0\]"
    ):
        ops.bank_verify_many([x], g, bank_bytes=32, group=2)
    with pytest.raises(ValueError, match=r"guards\[0\].parity is uint8\[4, 64\]; expected uint8\[2, 64\]"):
        ops.bank_verify_many([x], g, bank_bytes=64, group=4)


def test_native_handlers_return_shape_errors():
    # Outputs the wrapper would never ask for: the handlers answer with an error, they do not abort.
    x = jnp.ones(100)
    u32, u8 = jnp.uint32, jnp.uint8
    call = jax.ffi.ffi_call(
        "pimlayers_bank_guard_many",
        (
            jax.ShapeDtypeStruct((6, 2), u32),
            jax.ShapeDtypeStruct((4, 64), u8),
            jax.ShapeDtypeStruct((4, 2), u32),
        ),
    )
    with pytest.raises(
        Exception, match=r"bank_guard_many: sums of array 0 is uint32\(6, 2\); expected uint32\(7, 2\)"
    ):
        jax.block_until_ready(call(x, bank_bytes=np.int64(64), group=np.int64(2)))
    short = jax.ffi.ffi_call("pimlayers_bank_guard_many", (jax.ShapeDtypeStruct((7, 2), u32),))
    with pytest.raises(
        Exception, match=r"bank_guard_many: 1 arrays and 1 results; expected 3 results per array"
    ):
        jax.block_until_ready(short(x, bank_bytes=np.int64(64), group=np.int64(2)))
    verify = jax.ffi.ffi_call(
        "pimlayers_bank_verify_many",
        (jax.ShapeDtypeStruct((7, 2), u32), jax.ShapeDtypeStruct((7,), jnp.bool_),
         jax.ShapeDtypeStruct((4,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.float32)),
    )  # fmt: skip
    g = ops.bank_guard_many([x], bank_bytes=64, group=2)[0]
    with pytest.raises(
        Exception, match=r"bank_verify_many: the count is float32\(\); expected an int32 scalar"
    ):
        jax.block_until_ready(
            verify(
                x, g[1], g[0], g[2], bank_bytes=np.int64(64), group=np.int64(2), casts=np.zeros(1, np.int64)
            )
        )


def _cast_cases(seed: int, bank: int, group: int):
    """Ragged float32 leaves (empty, partial banks and groups, 1-3 values past a 16-byte vector)
    holding every rounding case, beside leaves of other dtypes."""
    rng = np.random.default_rng(seed)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, 1e-45, -3e-39, 3.4e38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
         1.0 + 2.0**-8 + 2.0**-20, 65504.0, 2.0**-126],
        np.float32,
    )  # fmt: skip
    out = []
    for n in (0, 1, 3, bank // 4 + 1, (bank * group) // 4 + 7, 2 * bank * group // 4 + 2):
        x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-8, 8, n)
        x[: min(n, special.size)] = special[: min(n, special.size)]
        out.append(jnp.asarray(x.reshape((1, n) if n % 2 else (n,))))
    out.insert(2, random_array(rng, (5, 7), jnp.bfloat16))
    out.insert(4, random_array(rng, (33,), jnp.int8))
    return out


@pytest.mark.parametrize(("bank", "group"), [(16, 1), (256, 11), (4096, 8), (4112, 3)])
def test_verify_many_casts_float32_leaves_as_xla_converts(bank, group):
    """The native kernels' bfloat16 copies equal XLA's convert bit for bit, ties and specials
    included; leaves of other dtypes or asked for their own dtype come back as XLA casts them."""
    xs = _cast_cases(bank * group, bank, group)
    guards = ops.bank_guard_many(xs, bank_bytes=bank, group=group)
    cast = [jnp.bfloat16] * len(xs)
    cast[-1] = None  # the last float32 leaf as it is
    cast[4] = jnp.float32  # int8 -> float32: XLA's convert
    for impl in ("native", "reference"):
        v = jax.jit(
            lambda a, g, i=impl: ops.bank_verify_many(a, g, bank_bytes=bank, group=group, cast=cast, impl=i)
        )(xs, guards)
        assert int(v.count) == 0
        assert len(v.cast) == len(xs)
        for x, c, d in zip(xs, v.cast, cast, strict=True):
            want = np.asarray(x.astype(x.dtype if d is None else d))
            assert c.shape == x.shape and c.dtype == want.dtype, impl
            assert np.array_equal(np.asarray(c).view(np.uint8), want.view(np.uint8)), impl


def test_verify_many_cast_of_a_nan_is_a_nan():
    x = jnp.asarray(
        np.array([np.nan, -np.nan, 1.0, np.float32(np.uint32(0x7F800001).view(np.float32))], np.float32)
    )
    g = ops.bank_guard_many([x], bank_bytes=16, group=1)
    v = ops.bank_verify_many([x], g, bank_bytes=16, group=1, cast=[jnp.bfloat16], impl="native")
    c = np.asarray(v.cast[0], np.float32)
    assert np.isnan(c[[0, 1, 3]]).all() and c[2] == 1.0


def test_verify_many_cast_errors():
    x = jnp.ones(100)
    g = ops.bank_guard_many([x], bank_bytes=64, group=2)
    with pytest.raises(ValueError, match=r"bank_verify_many: 1 arrays but cast is 2; expected one dtype"):
        ops.bank_verify_many([x], g, bank_bytes=64, group=2, cast=[None, None])
    with pytest.raises(
        TypeError, match=r"bank_verify_many: cast\[0\] is 'nodtype'; expected a dtype or None"
    ):
        ops.bank_verify_many([x], g, bank_bytes=64, group=2, cast=["nodtype"])
    assert ops.bank_verify_many([], [], cast=[]).cast == ()


def test_native_verify_cast_errors():
    # Flags and outputs the wrapper would never pass: errors from the handler, not a crash.
    x, b = jnp.ones(100), jnp.ones(100, jnp.bfloat16)
    g = ops.bank_guard_many([x], bank_bytes=64, group=2)[0]
    gb = ops.bank_guard_many([b], bank_bytes=64, group=2)[0]
    base = [jax.ShapeDtypeStruct((7, 2), jnp.uint32), jax.ShapeDtypeStruct((7,), jnp.bool_),
            jax.ShapeDtypeStruct((4,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32)]  # fmt: skip
    kw = dict(bank_bytes=np.int64(64), group=np.int64(2))

    def run(outs, arr, guard, flags):
        call = jax.ffi.ffi_call("pimlayers_bank_verify_many", outs)
        return jax.block_until_ready(
            call(arr, guard[1], guard[0], guard[2], casts=np.asarray(flags, np.int64), **kw)
        )

    bf = jax.ShapeDtypeStruct((100,), jnp.bfloat16)
    with pytest.raises(Exception, match=r"bank_verify_many: cast flag 0 is 2; expected 0 or 1"):
        run([*base, bf], x, g, [2])
    with pytest.raises(
        Exception, match=r"4 operands and 2 cast flags; expected 4 operands and one flag per array"
    ):
        run(base, x, g, [0, 0])
    with pytest.raises(Exception, match=r"1 arrays, 1 cast and 4 results; expected 3 results per array"):
        run(base, x, g, [1])
    with pytest.raises(Exception, match=r"the cast of array 0 is float32\(100,\); expected bfloat16\(100,\)"):
        run([*base, jax.ShapeDtypeStruct((100,), jnp.float32)], x, g, [1])
    base_b = [jax.ShapeDtypeStruct((4, 2), jnp.uint32), jax.ShapeDtypeStruct((4,), jnp.bool_),
              jax.ShapeDtypeStruct((2,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32)]  # fmt: skip
    with pytest.raises(Exception, match=r"array 0 is bfloat16; a cast reads float32"):
        run([*base_b, bf], b, gb, [1])
