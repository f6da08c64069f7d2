"""parity / reconstruct: bit-exact rebuild of one lost bank per group, in place, without recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RAGGED_SHAPES, TraceCounter, random_array
from jax.sharding import PartitionSpec as P

from pimlayers import ops

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.int32, jnp.bool_]


def _destroy(x, bank: int, bank_bytes: int, rng) -> jnp.ndarray:
    """x with every byte of `bank` overwritten by random bytes (a dead bank)."""
    raw = np.frombuffer(np.asarray(x).tobytes(), np.uint8).copy()
    lo, hi = bank * bank_bytes, min((bank + 1) * bank_bytes, raw.size)
    raw[lo:hi] = rng.integers(0, 256, size=hi - lo, dtype=np.uint8)
    return jnp.asarray(raw.view(np.asarray(x).dtype).reshape(x.shape))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_parity_native_matches_reference(dtype, shape):
    x = random_array(np.random.default_rng(7), shape, dtype)
    got = jax.jit(lambda a: ops.parity(a, bank_bytes=32, group=3, impl="native"))(x)
    ref = ops.parity(x, bank_bytes=32, group=3, impl="reference")
    assert got.shape == (ops.num_groups(x, 32, 3), 32)
    assert np.array_equal(np.asarray(got), np.asarray(ref))
    raw = np.frombuffer(np.asarray(x).tobytes(), np.uint8)
    if raw.size:  # independent: XOR of the member banks in numpy
        padded = np.zeros(got.shape[0] * 3 * 32, np.uint8)
        padded[: raw.size] = raw
        assert np.array_equal(np.bitwise_xor.reduce(padded.reshape(-1, 3, 32), axis=1), np.asarray(got))


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8])
def test_any_one_lost_bank_per_group_is_rebuilt_bit_exactly(impl, dtype):
    rng = np.random.default_rng(8)
    x = random_array(rng, (1000 + 3,), dtype)  # the last bank is partial
    bank, group = 64, 4
    par = ops.parity(x, bank_bytes=bank, group=group)
    ng, nb = par.shape[0], ops.num_banks(x, bank)
    for trial in range(20):
        lost = np.full(ng, -1, np.int32)
        damaged = x
        for g in range(ng):
            if rng.random() < 0.7:
                members = min(group, nb - g * group)
                lost[g] = rng.integers(0, members)
                damaged = _destroy(damaged, g * group + int(lost[g]), bank, rng)
        fixed = ops.reconstruct(damaged, par, jnp.asarray(lost), bank_bytes=bank, group=group, impl=impl)
        assert np.asarray(fixed).tobytes() == np.asarray(x).tobytes(), trial


def test_repair_is_in_place_and_never_recompiles():
    x = random_array(np.random.default_rng(9), (4096,), jnp.float32)
    par = ops.parity(x, bank_bytes=256, group=8)
    body = TraceCounter(lambda a, p, lo: ops.reconstruct(a, p, lo, bank_bytes=256, group=8))
    repair = jax.jit(body, donate_argnums=0)
    rng = np.random.default_rng(10)
    for _ in range(6):
        bank = int(rng.integers(0, ops.num_banks(x, 256)))
        damaged = _destroy(x, bank, 256, rng)
        lost = np.full(par.shape[0], -1, np.int32)
        lost[bank // 8] = bank % 8
        ptr = damaged.unsafe_buffer_pointer()
        fixed = repair(damaged, par, jnp.asarray(lost))
        assert fixed.unsafe_buffer_pointer() == ptr  # the donated buffer was repaired in place
        assert np.array_equal(np.asarray(fixed), np.asarray(x))
    assert body.count == 1


def test_vmap_and_shard_map(cpu_mesh):
    n = cpu_mesh.devices.size
    x = random_array(np.random.default_rng(11), (n, 300), jnp.int32)
    par_v = jax.vmap(lambda a: ops.parity(a, bank_bytes=64, group=2))(x)
    f = jax.shard_map(
        lambda a: ops.parity(a[0], bank_bytes=64, group=2)[None],
        mesh=cpu_mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    par_s = jax.jit(f)(x)
    for i in range(n):
        want = np.asarray(ops.parity(x[i], bank_bytes=64, group=2, impl="reference"))
        assert np.array_equal(np.asarray(par_v[i]), want) and np.array_equal(np.asarray(par_s[i]), want)
    lost = jnp.zeros((n, par_v.shape[1]), jnp.int32)  # every group lost its first bank
    damaged = x.at[:, :16].set(0)
    fixed = jax.vmap(lambda a, p, lo: ops.reconstruct(a, p, lo, bank_bytes=64, group=2))(damaged, par_v, lost)
    assert np.array_equal(np.asarray(fixed), np.asarray(x))


def test_bad_input_errors():
    x = jnp.ones(100)
    par = ops.parity(x, bank_bytes=64, group=2)
    with pytest.raises(ValueError, match=r"group=0; expected an int >= 1"):
        ops.parity(x, bank_bytes=64, group=0)
    with pytest.raises(ValueError, match=r"lost\[1\]=2 names no bank of group 1; expected -1 or 0..1"):
        ops.reconstruct(x, par, jnp.array([-1, 2, -1, -1], jnp.int32)[: par.shape[0]], bank_bytes=64, group=2)
    with pytest.raises(ValueError, match=r"parity has uint8 \(3, 64\); expected uint8"):
        ops.reconstruct(x, par[:3], jnp.full(par.shape[0], -1, jnp.int32), bank_bytes=64, group=2)
    with pytest.raises(ValueError, match=r"lost has int32 \(1,\); expected int32"):
        ops.reconstruct(x, par, jnp.zeros(1, jnp.int32), bank_bytes=64, group=2)
