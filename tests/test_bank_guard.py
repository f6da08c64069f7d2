"""bank_guard: native vs reference vs the two ops it fuses vs an independent numpy model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter, random_array
from jax.sharding import PartitionSpec as P

from pimlayers import ops

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.int32]
# (bank_bytes, group): 4112 = 257 * 16 is no power of two (on the GPU: a bank of two chunks).
LAYOUTS = [(16, 1), (16, 3), (256, 3), (256, 8), (4096, 8), (4112, 3)]
# Every dtype on two layouts and every layout on three dtypes (dtypes change only the byte view).
CASES = sorted(
    {(d, b, g) for d in DTYPES for b, g in [(256, 3), (4112, 3)]}
    | {(d, b, g) for d in (jnp.float32, jnp.bfloat16, jnp.int8) for b, g in LAYOUTS},
    key=lambda c: (c[1], c[2], jnp.dtype(c[0]).name),
)
P31 = 2**31 - 1


def model(data: bytes, bank_bytes: int, group: int):
    """(sums, parity, parity sums) in numpy, straight from the definitions (zero-padded banks)."""
    nb = -(-len(data) // bank_bytes)
    ng = -(-nb // group)
    raw = np.zeros(ng * group * bank_bytes, np.uint8)
    raw[: len(data)] = np.frombuffer(data, np.uint8)
    par = np.bitwise_xor.reduce(raw.reshape(ng, group, bank_bytes), axis=1)

    def sums(rows):  # uint64 is exact here: sum (i + 1) h_i < 2^11 * 2^11 * 2^16 for these banks
        h = rows[:, 0::2].astype(np.uint64) | (rows[:, 1::2].astype(np.uint64) << np.uint64(8))
        pos = np.arange(1, h.shape[1] + 1, dtype=np.uint64)
        out = np.stack([h.sum(axis=1) % P31, (h * pos).sum(axis=1) % P31], axis=-1)
        return out.astype(np.uint32).reshape(-1, 2)

    return sums(raw.reshape(-1, bank_bytes)[:nb]), par, sums(par)


def _sizes(bank: int, group: int, itemsize: int) -> list[int]:
    """Byte counts: empty, one element, under one bank, a partial last bank, a partial last group,
    whole groups."""
    span = bank * group
    return [0, itemsize, bank - itemsize, bank + 3 * itemsize, span + bank + itemsize, 2 * span]


@pytest.mark.parametrize(("dtype", "bank", "group"), CASES)
def test_native_reference_two_ops_and_model_agree(dtype, bank, group):
    rng = np.random.default_rng(bank + group)
    itemsize = jnp.dtype(dtype).itemsize
    kw = dict(bank_bytes=bank, group=group)

    @jax.jit  # one compile per size for all four
    def run(a):
        native = ops.bank_guard(a, **kw, parity_sums=True, impl="native")
        ref = ops.bank_guard(a, **kw, parity_sums=True, impl="reference")
        sums, par = ops.bank_guard(a, **kw)  # the default: two outputs
        # Exactly the two ops it fuses, and the parity rows' own checksums.
        two_par = ops.parity(a, **kw)
        two_ops = (
            ops.bank_checksums(a, bank_bytes=bank),
            two_par,
            ops.bank_checksums(two_par, bank_bytes=bank),
        )
        return native, ref, (sums, par), two_ops

    for nbytes in _sizes(bank, group, itemsize):
        x = random_array(rng, (nbytes // itemsize,), dtype)
        native, ref, default, two_ops = run(x)
        want = model(np.asarray(x).tobytes(), bank, group)
        nb, ng = ops.num_banks(x, bank), ops.num_groups(x, bank, group)
        assert [(o.shape, o.dtype) for o in native] == [
            ((nb, 2), jnp.uint32),
            ((ng, bank), jnp.uint8),
            ((ng, 2), jnp.uint32),
        ]
        for name, *outs in zip(("sums", "parity", "parity sums"), native, ref, two_ops, want, strict=True):
            for o in outs[:-1]:
                assert np.array_equal(np.asarray(o), outs[-1]), (name, nbytes)
        assert len(default) == 2
        assert all(np.array_equal(np.asarray(d), w) for d, w in zip(default, want[:2], strict=True))


def test_shapes_of_any_rank_are_their_bytes():
    x = random_array(np.random.default_rng(1), (2, 3, 5, 7), jnp.bfloat16)
    for impl in ("native", "reference"):
        got = jax.jit(lambda a, i=impl: ops.bank_guard(a, bank_bytes=32, group=3, parity_sums=True, impl=i))(
            x
        )
        want = model(np.asarray(x).tobytes(), 32, 3)
        assert all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want, strict=True))


def test_large_bank_and_large_values_use_the_modular_arithmetic():
    # All-ones words maximise every sum; two banks of 2^18 bytes, one group.
    x = jnp.full((1 << 18,), 0xFFFF, jnp.uint16)
    want = np.asarray(ops.bank_checksums(x, bank_bytes=1 << 18, impl="native"))  # tested on its own
    for impl in ("native", "reference"):
        sums, par, psums = jax.jit(
            lambda a, i=impl: ops.bank_guard(a, bank_bytes=1 << 18, group=2, parity_sums=True, impl=i)
        )(x)
        assert np.array_equal(np.asarray(sums), want)
        assert not np.asarray(par).any()  # two equal banks XOR to zero
        assert not np.asarray(psums).any()


def test_vmap_banks_each_example_on_its_own():
    # 77 float32 = 308 bytes per example: examples after the first start off any 16-byte boundary.
    x = random_array(np.random.default_rng(2), (3, 77), jnp.float32)
    for impl in ("native", "reference"):
        one = lambda a, i=impl: ops.bank_guard(a, bank_bytes=32, group=3, parity_sums=True, impl=i)
        batched = jax.jit(jax.vmap(one))(x)
        for i in range(3):
            want = model(np.asarray(x[i]).tobytes(), 32, 3)
            assert all(np.array_equal(np.asarray(b[i]), w) for b, w in zip(batched, want, strict=True))


def test_inside_shard_map(cpu_mesh):
    n = cpu_mesh.devices.size
    x = random_array(np.random.default_rng(3), (n, 1000), jnp.bfloat16)
    f = jax.shard_map(
        lambda a: jax.tree.map(
            lambda o: o[None], ops.bank_guard(a[0], bank_bytes=256, group=3, parity_sums=True)
        ),
        mesh=cpu_mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    got = jax.jit(f)(x)
    for i in range(n):
        want = model(np.asarray(x[i]).tobytes(), 256, 3)
        assert all(np.array_equal(np.asarray(g[i]), w) for g, w in zip(got, want, strict=True))


def test_new_data_never_recompiles():
    body = TraceCounter(lambda a: ops.bank_guard(a, bank_bytes=256, group=8))
    f = jax.jit(body)
    rng = np.random.default_rng(4)
    for _ in range(4):
        x = random_array(rng, (3000,), jnp.float32)
        sums, par = f(x)
        want = model(np.asarray(x).tobytes(), 256, 8)
        assert np.array_equal(np.asarray(sums), want[0]) and np.array_equal(np.asarray(par), want[1])
    assert body.count == 1


def test_bad_input_errors():
    x = jnp.ones(100)
    with pytest.raises(
        TypeError, match=r"bank_guard: x has dtype complex64; expected a bool, integer or float"
    ):
        ops.bank_guard(jnp.ones(3, jnp.complex64))
    for bad in (4, 4100, 0):  # bank_checksums and parity take multiples of 16 only
        with pytest.raises(
            ValueError, match=rf"bank_guard: bank_bytes={bad}; expected a positive multiple of 16"
        ):
            ops.bank_guard(x, bank_bytes=bad)
    with pytest.raises(TypeError, match=r"bank_guard: bank_bytes must be an int, got float"):
        ops.bank_guard(x, bank_bytes=64.0)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=r"bank_guard: group=.*; expected an int >= 1"):
            ops.bank_guard(x, bank_bytes=64, group=bad)
    with pytest.raises(TypeError, match=r"bank_guard: parity_sums=1; expected True or False"):
        ops.bank_guard(x, parity_sums=1)
    with pytest.raises(ValueError, match=r"bank_guard: impl='fast'; expected one of"):
        ops.bank_guard(x, impl="fast")


def test_native_handler_returns_shape_errors():
    # Outputs the wrapper would never ask for: the handler answers with an error, it does not abort.
    x = jnp.ones(100)
    call = jax.ffi.ffi_call(
        "pimlayers_bank_guard",
        (
            jax.ShapeDtypeStruct((25, 2), jnp.uint32),  # 400 bytes in banks of 16: 25 banks
            jax.ShapeDtypeStruct((9, 16), jnp.uint8),  # 25 banks in groups of 3: 9 groups
            jax.ShapeDtypeStruct((8, 2), jnp.uint32),  # wrong: 9 rows
        ),
    )
    with pytest.raises(Exception, match=r"pimlayers.bank_guard: parity sums is uint32\(8, 2\); expected"):
        jax.block_until_ready(call(x, bank_bytes=np.int64(16), group=np.int64(3)))
    with pytest.raises(Exception, match=r"pimlayers.bank_guard: bank_bytes=8; expected a positive multiple"):
        jax.block_until_ready(call(x, bank_bytes=np.int64(8), group=np.int64(3)))
