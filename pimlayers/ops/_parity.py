"""XOR parity over groups of consecutive banks, and the bit-exact rebuild of one lost bank per group.

Group g holds banks ``g*group .. g*group + group - 1`` of x's bytes (see bank_checksums for the bank
layout; a partial last bank reads as zero-padded). ``parity[g]`` is the XOR of its members, so any
one member is the XOR of the parity and the others. Which physical bank each member sits in is the
memory layer's business: it arranges the bytes so that no two members share one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int32, UInt8

from ._checksum import num_banks
from ._common import check_bank_bytes, check_byte_addressable, from_bytes, to_bytes
from ._dispatch import check_impl, dispatch

__all__ = ["num_groups", "parity", "parity_reference", "reconstruct", "reconstruct_reference"]


def num_groups(x, bank_bytes: int, group: int) -> int:
    return -(-num_banks(x, bank_bytes) // group)


def _check_group(op: str, group) -> None:
    if not isinstance(group, int | np.integer) or isinstance(group, bool) or group < 1:
        raise ValueError(f"pimlayers.{op}: group={group!r}; expected an int >= 1 (banks per parity group)")


def _grouped(x, bank_bytes: int, group: int):
    """x's bytes as (ngroups, group, bank_bytes) uint8, zero-padded."""
    b = to_bytes(x)
    ng = num_groups(x, bank_bytes, group)
    return jnp.pad(b, (0, ng * group * bank_bytes - b.shape[0])).reshape(ng, group, bank_bytes)


@functools.partial(jax.jit, static_argnames=("bank_bytes", "group"))
def parity_reference(x, bank_bytes: int = 4096, group: int = 8) -> UInt8[Array, "groups bank"]:
    return lax.reduce(_grouped(x, bank_bytes, group), np.uint8(0), lax.bitwise_xor, (1,))


def reconstruct_reference(x, par, lost, bank_bytes: int = 4096, group: int = 8):
    g = _grouped(x, bank_bytes, group)
    ng = g.shape[0]
    nb = num_banks(x, bank_bytes)
    member = jnp.arange(group, dtype=jnp.int32)
    valid = (lost >= 0) & (lost < group) & (jnp.arange(ng, dtype=jnp.int32) * group + lost < nb)
    is_lost = (member[None, :] == lost[:, None]) & valid[:, None]  # (ng, group)
    others = lax.reduce(jnp.where(is_lost[..., None], np.uint8(0), g), np.uint8(0), lax.bitwise_xor, (1,))
    rebuilt = par ^ others
    g = jnp.where(is_lost[..., None], rebuilt[:, None, :], g)
    return from_bytes(g.reshape(-1)[: to_bytes(x).shape[0]], x)


def _parity_native(x, bank_bytes: int, group: int):
    out = jax.ShapeDtypeStruct((num_groups(x, bank_bytes, group), bank_bytes), jnp.uint8)
    call = jax.ffi.ffi_call("pimlayers_parity", out, vmap_method="broadcast_all")
    return call(x, bank_bytes=np.int64(bank_bytes), group=np.int64(group))


def _reconstruct_native(x, par, lost, bank_bytes: int, group: int):
    call = jax.ffi.ffi_call(
        "pimlayers_reconstruct",
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        vmap_method="broadcast_all",
        input_output_aliases={0: 0},  # repair in place when the caller donates x
    )
    return call(x, par, lost, bank_bytes=np.int64(bank_bytes), group=np.int64(group))


def parity(x, *, bank_bytes: int = 4096, group: int = 8, impl: str = "auto") -> UInt8[Array, "groups bank"]:
    """XOR parity of ``x``'s banks in groups of ``group``: uint8 ``(num_groups, bank_bytes)``."""
    check_impl("parity", impl)
    check_byte_addressable("parity", x)
    check_bank_bytes("parity", bank_bytes)
    _check_group("parity", group)
    bank_bytes, group = int(bank_bytes), int(group)
    return dispatch(
        "parity",
        impl,
        lambda a: _parity_native(a, bank_bytes, group),
        lambda a: parity_reference(a, bank_bytes, group),
        x,
        # On the H200 the native kernel (0.296 ms/GiB) did not beat XLA's reduction (0.285 ms), so
        # "auto" keeps XLA there (docs/benchmarks.md).
        native_on=("cpu",),
    )


def reconstruct(
    x,
    par: UInt8[Array, "groups bank"],
    lost: Int32[Array, " groups"],
    *,
    bank_bytes: int = 4096,
    group: int = 8,
    impl: str = "auto",
):
    """Rebuild, bit-exactly, bank ``g*group + lost[g]`` of every group g with ``lost[g] >= 0``.

    ``lost`` is data (int32, one entry per group, -1 for "nothing lost"), so a new fault pattern
    never recompiles. Entries that name no bank are ignored on device; concrete ones are checked
    here. With ``jax.jit(..., donate_argnums=0)`` the repair writes into x's buffer.
    """
    check_impl("reconstruct", impl)
    check_byte_addressable("reconstruct", x)
    check_bank_bytes("reconstruct", bank_bytes)
    _check_group("reconstruct", group)
    bank_bytes, group = int(bank_bytes), int(group)
    ng = num_groups(x, bank_bytes, group)
    if par.shape != (ng, bank_bytes) or par.dtype != jnp.uint8:
        raise ValueError(
            f"pimlayers.reconstruct: parity has {par.dtype} {tuple(par.shape)}; "
            f"expected uint8 ({ng}, {bank_bytes})"
        )
    if lost.shape != (ng,) or lost.dtype != jnp.int32:
        raise ValueError(
            f"pimlayers.reconstruct: lost has {lost.dtype} {tuple(lost.shape)}; expected int32 ({ng},)"
        )
    if not isinstance(lost, jax.core.Tracer):
        bad = np.asarray(lost)
        nb = num_banks(x, bank_bytes)
        idx = np.arange(ng) * group + bad
        wrong = (bad < -1) | (bad >= group) | ((bad >= 0) & (idx >= nb))
        if wrong.any():
            g = int(np.flatnonzero(wrong)[0])
            raise ValueError(
                f"pimlayers.reconstruct: lost[{g}]={int(bad[g])} names no bank of group {g}; "
                f"expected -1 or 0..{min(group, nb - g * group) - 1}"
            )
    return dispatch(
        "reconstruct",
        impl,
        lambda a, p, lo: _reconstruct_native(a, p, lo, bank_bytes, group),
        lambda a, p, lo: reconstruct_reference(a, p, lo, bank_bytes, group),
        x,
        par,
        lost,
    )
