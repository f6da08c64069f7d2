"""bank_checksums: a 2 x 31-bit checksum per fixed-size bank of an array's bytes.

Math (shared with csrc/common.h): bank b's bytes are read as little-endian 16-bit words
h_0 .. h_{n-1} (a missing last byte reads as 0) and its checksum is
``S1 = sum h_i mod p`` and ``S2 = sum (i + 1) h_i mod p`` with the Mersenne prime p = 2^31 - 1.
Every error confined to any two 16-bit words of a bank changes (S1, S2) — in particular every
single- and double-bit error and every burst of up to 17 bits; any other corruption escapes with
probability about 2^-62. Both sums are associative, so the GPU kernel reads at memory bandwidth
(a CRC would be a serial chain). Positions are bank-relative, so a bank's checksum does not depend
on where the bank sits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, UInt32

from ._common import check_bank_bytes, check_byte_addressable, nbytes, to_bytes
from ._dispatch import check_impl, dispatch

__all__ = ["bank_checksums", "bank_checksums_reference", "num_banks"]

_P = np.uint32(2**31 - 1)


def num_banks(x, bank_bytes: int) -> int:
    """How many banks of ``bank_bytes`` hold ``x`` (the last one may be partial)."""
    return -(-nbytes(x) // bank_bytes)


def _mod(v):
    """v mod p for uint32 v (any value below 2^32)."""
    v = (v & _P) + (v >> 31)
    return jnp.where(v >= _P, v - _P, v)


def _addmod(a, b):
    s = a + b  # both < p, so no uint32 overflow
    return jnp.where(s >= _P, s - _P, s)


def _mulmod16(a, h):
    """(a * h) mod p for a < 2^31 and h < 2^16 in uint32 arithmetic (no 64-bit products)."""
    x = (a >> 16) * h  # < 2^31
    # x * 2^16 mod p: 2^31 = 1 (mod p), so x*2^16 = (x >> 15) + (x & 0x7fff) * 2^16.
    high = _mod((x >> 15) + ((x & np.uint32(0x7FFF)) << 16))
    low = _mod((a & np.uint32(0xFFFF)) * h)  # < 2^32
    return _addmod(high, low)


@functools.partial(jax.jit, static_argnames=("bank_bytes",))
def bank_checksums_reference(x, bank_bytes: int = 4096) -> UInt32[Array, "banks 2"]:
    """Pure-JAX twin of the native handler (bit-exact)."""
    b = to_bytes(x)
    nb = num_banks(x, bank_bytes)
    if nb == 0:
        return jnp.zeros((0, 2), jnp.uint32)
    b = jnp.pad(b, (0, nb * bank_bytes - b.shape[0])).astype(jnp.uint32)
    h = (b[0::2] | (b[1::2] << 8)).reshape(nb, bank_bytes // 2)
    s1 = lax.reduce(h, np.uint32(0), _addmod, (1,))
    pos = jnp.arange(1, bank_bytes // 2 + 1, dtype=jnp.uint32)
    s2 = lax.reduce(_mulmod16(pos[None, :], h), np.uint32(0), _addmod, (1,))
    return jnp.stack([s1, s2], axis=-1)


def _native(x, bank_bytes: int):
    out = jax.ShapeDtypeStruct((num_banks(x, bank_bytes), 2), jnp.uint32)
    call = jax.ffi.ffi_call("pimlayers_bank_checksums", out, vmap_method="broadcast_all")
    return call(x, bank_bytes=np.int64(bank_bytes))


def bank_checksums(x, *, bank_bytes: int = 4096, impl: str = "auto") -> UInt32[Array, "banks 2"]:
    """Checksums of ``x``'s bytes cut into banks of ``bank_bytes`` (a multiple of 16).

    Returns uint32 ``(num_banks, 2)``: (S1, S2) per bank, each in [0, 2^31 - 1). Any dtype of 1,
    2, 4 or 8 bytes and any shape (zero-size gives zero banks). Under ``vmap`` each example is
    banked on its own.
    """
    check_impl("bank_checksums", impl)
    check_byte_addressable("bank_checksums", x)
    check_bank_bytes("bank_checksums", bank_bytes)
    bank_bytes = int(bank_bytes)
    return dispatch(
        "bank_checksums",
        impl,
        lambda a: _native(a, bank_bytes),
        lambda a: bank_checksums_reference(a, bank_bytes),
        x,
    )
