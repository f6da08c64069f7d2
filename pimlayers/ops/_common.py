"""Validation and byte views shared by the ops' wrappers and references."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Unit roundoff (half an ulp of 1.0) of each float format.
UNIT_ROUNDOFF = {
    jnp.dtype(jnp.float32): 2.0**-24,
    jnp.dtype(jnp.bfloat16): 2.0**-8,
    jnp.dtype(jnp.float16): 2.0**-11,
}


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def check_float(op: str, name: str, x) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"pimlayers.{op}: {name} has dtype {dtype_name(x.dtype)}; expected float32, bfloat16 or float16"
        )


def check_byte_addressable(op: str, x) -> None:
    dt = jnp.dtype(x.dtype)
    numeric = dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)
    sub_byte = dt.name in ("int2", "uint2", "int4", "uint4", "float4_e2m1fn")
    if not numeric or sub_byte or dt.itemsize not in (1, 2, 4, 8):
        raise TypeError(
            f"pimlayers.{op}: x has dtype {dt.name}; "
            "expected a bool, integer or float dtype of 1, 2, 4 or 8 bytes"
        )


def check_bank_bytes(op: str, bank_bytes: int) -> None:
    if not isinstance(bank_bytes, int | np.integer) or isinstance(bank_bytes, bool):
        raise TypeError(f"pimlayers.{op}: bank_bytes must be an int, got {type(bank_bytes).__name__}")
    if bank_bytes <= 0 or bank_bytes % 16 or bank_bytes > 2**31:
        raise ValueError(
            f"pimlayers.{op}: bank_bytes={bank_bytes}; expected a positive multiple of 16 of at most 2**31"
        )


def nbytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def to_bytes(x) -> jnp.ndarray:
    """x's bytes in memory order (little-endian), as a flat uint8 vector."""
    flat = x.reshape(-1)
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if flat.dtype.itemsize == 1:
        return lax.bitcast_convert_type(flat, jnp.uint8)
    return lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)


def from_bytes(b, like) -> jnp.ndarray:
    """Inverse of :func:`to_bytes`: a flat uint8 vector back to ``like``'s dtype and shape."""
    dt = jnp.dtype(like.dtype)
    if dt == jnp.bool_:
        return (b != 0).reshape(like.shape)
    if dt.itemsize == 1:
        return lax.bitcast_convert_type(b, dt).reshape(like.shape)
    return lax.bitcast_convert_type(b.reshape(-1, dt.itemsize), dt).reshape(like.shape)


def first_true(mask: jax.Array, cap: int) -> jax.Array:
    """Indices (int32, (cap,)) of the first ``cap`` True entries of a 1-D mask; entries past the
    mask's count are arbitrary (the caller masks them).

    Two levels instead of ``jnp.nonzero(size=...)``, whose scatter touches every element (measured
    on an H200: +0.6 ms on an 8192 x 14336 GEMM's 917,504 block flags): the mask is summed per
    chunk of ~sqrt(n / cap) (one pass that fuses with the flag comparison), the running count over
    chunks locates each wanted entry's chunk, and a cumsum inside the ``cap`` chunks so found
    locates it there. Everything after the first pass is O(n / chunk + cap * chunk) small arrays.
    """
    n = mask.shape[0]
    chunk = max(1, math.isqrt(max(n // cap, 1)))
    nc = -(-n // chunk)
    m = jnp.pad(mask, (0, nc * chunk - n)).reshape(nc, chunk).astype(jnp.int32)
    per = jnp.sum(m, axis=1, dtype=jnp.int32)
    upto = jnp.cumsum(per)  # entries in chunks 0..c
    want = jnp.arange(cap, dtype=jnp.int32)
    # compare_all: one elementwise pass; the default "scan" method is a sequential loop.
    c = jnp.searchsorted(upto, want, side="right", method="compare_all")
    c = jnp.minimum(c, nc - 1).astype(jnp.int32)
    rank = want - (upto[c] - per[c])  # the wanted entry's rank inside chunk c
    inside = jnp.cumsum(m[c], axis=1)  # (cap, chunk)
    pos = jnp.argmax(inside > rank[:, None], axis=1).astype(jnp.int32)
    return c * chunk + pos


def config_resolved(resolve):
    """Decorates a jitted op whose static ``config`` has fields the environment decides when left at
    None (``PIMLAYERS_FLASH_FUSE_V``, ``PIMLAYERS_BOUNDS_KERNEL``): ``resolve(config)`` makes them
    explicit before the jit sees the config, so the jit's cache keys on what the environment said
    at the call. Read inside the trace instead, a switch flipped between two calls of one shape
    would reuse the first call's program, in this op's cache and in every jit that calls it."""

    def deco(jitted):
        @functools.wraps(jitted)
        def call(*args, config=None, **kwargs):
            return jitted(*args, config=resolve(config), **kwargs)

        return call

    return deco
