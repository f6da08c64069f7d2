"""bank_checksums: native vs reference vs an independent big-integer model; what it detects."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RAGGED_SHAPES, random_array
from jax.sharding import PartitionSpec as P

from pimlayers import ops

DTYPES = [
    jnp.float32,
    jnp.bfloat16,
    jnp.float16,
    jnp.int8,
    jnp.uint8,
    jnp.int16,
    jnp.int32,
    jnp.uint32,
    jnp.bool_,
]
P31 = 2**31 - 1


def model(data: bytes, bank_bytes: int) -> np.ndarray:
    """The checksum in Python integers, straight from its definition."""
    out = []
    for start in range(0, len(data), bank_bytes):
        bank = data[start : start + bank_bytes]
        if len(bank) % 2:
            bank += b"\0"
        words = np.frombuffer(bank, dtype="<u2").astype(object)
        s1 = int(sum(words)) % P31
        s2 = int(sum((i + 1) * int(h) for i, h in enumerate(words))) % P31
        out.append((s1, s2))
    return np.array(out, dtype=np.uint32).reshape(-1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_native_reference_and_model_agree(dtype, shape):
    x = random_array(np.random.default_rng(3), shape, dtype)
    got = jax.jit(lambda a: ops.bank_checksums(a, bank_bytes=48, impl="native"))(x)
    ref = ops.bank_checksums(x, bank_bytes=48, impl="reference")
    want = model(np.asarray(x).tobytes(), 48)
    assert got.shape == (ops.num_banks(x, 48), 2) and got.dtype == jnp.uint32
    assert np.array_equal(np.asarray(got), want)
    assert np.array_equal(np.asarray(ref), want)


def test_large_bank_and_large_values_use_the_modular_arithmetic():
    # All-ones words maximise every sum: 0xffff * (1 + 2 + ... + n) overflows 64 bits without reduction.
    x = jnp.full((1 << 17,), 0xFFFF, jnp.uint16)
    want = model(np.asarray(x).tobytes(), 1 << 18)
    for impl in ("native", "reference"):
        assert np.array_equal(np.asarray(ops.bank_checksums(x, bank_bytes=1 << 18, impl=impl)), want)


def _flips(base: np.ndarray, positions) -> np.ndarray:
    """A batch of copies of `base` (uint8) with the given bit positions flipped (one row per pattern)."""
    out = np.repeat(base[None], len(positions), axis=0)
    for row, bits in enumerate(positions):
        for b in bits:
            out[row, b // 8] ^= np.uint8(1 << (b % 8))
    return out


def test_every_single_and_double_bit_flip_and_short_burst_is_detected():
    rng = np.random.default_rng(4)
    bank = 64
    base = rng.integers(0, 256, size=bank, dtype=np.uint8)
    nbits = bank * 8
    singles = [(b,) for b in range(nbits)]
    doubles = [(a, b) for a in range(nbits) for b in range(a + 1, nbits) if (a * 7 + b) % 5 == 0]
    bursts = [tuple(range(s, s + ln)) for ln in (3, 8, 16, 17) for s in range(nbits - ln + 1)]
    patterns = singles + doubles + bursts
    batch = jnp.asarray(_flips(base, patterns))
    clean = ops.bank_checksums(jnp.asarray(base), bank_bytes=bank)
    sums = jax.vmap(lambda a: ops.bank_checksums(a, bank_bytes=bank))(batch)
    changed = np.any(np.asarray(sums) != np.asarray(clean)[None], axis=(1, 2))
    assert len(patterns) > 10_000
    assert changed.all(), f"undetected: {[patterns[i] for i in np.flatnonzero(~changed)[:5]]}"


def test_vmap_banks_each_example_on_its_own():
    x = random_array(np.random.default_rng(5), (3, 77), jnp.float32)
    batched = jax.vmap(lambda a: ops.bank_checksums(a, bank_bytes=32))(x)
    for i in range(3):
        assert np.array_equal(np.asarray(batched[i]), np.asarray(ops.bank_checksums(x[i], bank_bytes=32)))


def test_inside_shard_map(cpu_mesh):
    n = cpu_mesh.devices.size
    x = random_array(np.random.default_rng(6), (n, 1000), jnp.bfloat16)
    f = jax.shard_map(
        lambda a: ops.bank_checksums(a, bank_bytes=256)[None],
        mesh=cpu_mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    got = jax.jit(f)(x)
    for i in range(n):
        assert np.array_equal(np.asarray(got[i]), model(np.asarray(x[i : i + 1]).tobytes(), 256))


def test_bad_input_errors():
    with pytest.raises(TypeError, match=r"x has dtype complex64; expected a bool, integer or float"):
        ops.bank_checksums(jnp.ones(3, jnp.complex64))
    with pytest.raises(ValueError, match=r"bank_bytes=100; expected a positive multiple of 16"):
        ops.bank_checksums(jnp.ones(3), bank_bytes=100)
    with pytest.raises(TypeError, match=r"bank_bytes must be an int"):
        ops.bank_checksums(jnp.ones(3), bank_bytes=64.0)
