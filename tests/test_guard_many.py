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
        jax.block_until_ready(verify(x, g[1], g[0], g[2], bank_bytes=np.int64(64), group=np.int64(2)))
