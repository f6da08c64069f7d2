"""GEMM fault injection that acts inside the compiled computation.

A `GemmFaults` is data (arrays), so a new fault pattern, rate or seed never recompiles: it lists up
to F sites (row, column, bit) of a GEMM's f32 accumulator and which of them fire. Protected ops flip
those bits after the matrix product and before their checks — the way a transient error in a matrix
unit or its output registers would appear.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int32

__all__ = ["GemmFaults", "flip_sites", "inject_gemm_faults"]


class GemmFaults(NamedTuple):
    rows: Int32[Array, " f"]  # row of the (flattened to 2-D) GEMM output
    cols: Int32[Array, " f"]
    bits: Int32[Array, " f"]  # bit of the f32 value to flip (31 sign, 30..23 exponent, 22..0 mantissa)
    active: Bool[Array, " f"]

    @staticmethod
    def none(sites: int = 1) -> GemmFaults:
        z = jnp.zeros((sites,), jnp.int32)
        return GemmFaults(z, z, z, jnp.zeros((sites,), bool))

    @staticmethod
    def random(
        key, shape: tuple[int, int], sites: int, rate: float | jax.Array = 1.0, bit=None
    ) -> GemmFaults:
        """`sites` candidate sites uniformly over an (M, N) output, each firing with probability `rate`;
        `bit` None draws a random bit per site (any of the 32)."""
        kr, kc, kb, ka = jax.random.split(key, 4)
        m, n = shape
        rows = jax.random.randint(kr, (sites,), 0, max(m, 1), jnp.int32)
        cols = jax.random.randint(kc, (sites,), 0, max(n, 1), jnp.int32)
        if bit is None:
            bits = jax.random.randint(kb, (sites,), 0, 32, jnp.int32)
        else:
            bits = jnp.broadcast_to(jnp.asarray(bit, jnp.int32), (sites,))
        active = (jax.random.uniform(ka, (sites,)) < rate) & (m > 0) & (n > 0)
        return GemmFaults(rows, cols, bits, active)


def flip_sites(old: Float[Array, " f"], faults: GemmFaults) -> Float[Array, " f"]:
    """The sites' f32 values with their active bits flipped (inactive sites unchanged)."""
    mask = jnp.where(
        faults.active, jnp.left_shift(jnp.uint32(1), faults.bits.astype(jnp.uint32)), jnp.uint32(0)
    )
    return lax.bitcast_convert_type(lax.bitcast_convert_type(old, jnp.uint32) ^ mask, jnp.float32)


def inject_gemm_faults(y: Float[Array, "m n"], faults: GemmFaults | None) -> Float[Array, "m n"]:
    """Flip the active sites' bits of a GEMM's f32 accumulator (a no-op for None).

    ``y`` is the GEMM's output: f32, or bf16/f16 when the GEMM rounded its accumulator on the way out
    (the protected GEMMs check a bf16 product where it lies). Then each site's stored value is
    widened to f32 (exact), the f32 bit flipped and the result rounded back, as the GEMM's epilogue
    would have rounded the corrupted accumulator: a flip below the storage precision vanishes. Only
    the F sites are touched (gather, scatter), never the whole output.
    """
    if faults is None:
        return y
    # Gather, XOR, scatter: a site drawn twice flips once (its last draw wins).
    new = flip_sites(y[faults.rows, faults.cols].astype(jnp.float32), faults).astype(y.dtype)
    return y.at[faults.rows, faults.cols].set(new, mode="drop")
