"""bank_guard: bank checksums and group parity of an array in one read of its bytes.

Bit-exact with ``(bank_checksums(x, bank_bytes), parity(x, bank_bytes, group))`` (same bank layout,
same zero-padded partial last bank and partial last group), but the native kernels read x once
instead of twice. With ``parity_sums=True`` it also returns ``bank_checksums(parity, bank_bytes)``,
the checksum of every parity row, computed from the parity while it is still in registers: that is
everything encode-on-write stores (pimlayers.memory), for one read of the parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, UInt8, UInt32

from ._checksum import bank_checksums, bank_checksums_reference, num_banks
from ._common import check_bank_bytes, check_byte_addressable
from ._dispatch import check_impl, dispatch
from ._parity import _check_group, num_groups, parity, parity_reference

__all__ = ["bank_guard", "bank_guard_reference"]

# On the H200 (1 GiB, groups of 8) the fused kernel beat the separate ops from 2 KiB banks up
# (2048: 2.44 vs 2.91 reads of x; 4096: 1.68 vs 2.49) and lost below (1024: 4.32 vs 4.12; 512: 8.12
# vs 6.37): its CTAs then move too few bytes each. "auto" on CUDA keeps the separate ops there.
_CUDA_FUSED_MIN_BANK = 2048

Guard = tuple[UInt32[Array, "banks 2"], UInt8[Array, "groups bank"]]
GuardWithParitySums = tuple[UInt32[Array, "banks 2"], UInt8[Array, "groups bank"], UInt32[Array, "groups 2"]]


@functools.partial(jax.jit, static_argnames=("bank_bytes", "group", "parity_sums"))
def bank_guard_reference(
    x, bank_bytes: int = 4096, group: int = 8, parity_sums: bool = False
) -> Guard | GuardWithParitySums:
    """Pure-JAX twin of the native handlers: the two ops' references (bit-exact)."""
    sums = bank_checksums_reference(x, bank_bytes)
    par = parity_reference(x, bank_bytes, group)
    if parity_sums:
        return sums, par, bank_checksums_reference(par, bank_bytes)
    return sums, par


def _native(x, bank_bytes: int, group: int, parity_sums: bool):
    ng = num_groups(x, bank_bytes, group)
    out = (
        jax.ShapeDtypeStruct((num_banks(x, bank_bytes), 2), jnp.uint32),
        jax.ShapeDtypeStruct((ng, bank_bytes), jnp.uint8),
        jax.ShapeDtypeStruct((ng, 2), jnp.uint32),  # made in the same pass whether asked for or not
    )
    call = jax.ffi.ffi_call("pimlayers_bank_guard", out, vmap_method="broadcast_all")
    sums, par, psums = call(x, bank_bytes=np.int64(bank_bytes), group=np.int64(group))
    return (sums, par, psums) if parity_sums else (sums, par)


def _separate(x, bank_bytes: int, group: int, parity_sums: bool):
    """The ops bank_guard fuses, each with its own dispatch (bit-exact with the fused kernel)."""
    sums = bank_checksums(x, bank_bytes=bank_bytes)
    par = parity(x, bank_bytes=bank_bytes, group=group)
    return (sums, par, bank_checksums(par, bank_bytes=bank_bytes)) if parity_sums else (sums, par)


def bank_guard(
    x, *, bank_bytes: int = 4096, group: int = 8, parity_sums: bool = False, impl: str = "auto"
) -> Guard | GuardWithParitySums:
    """``(bank_checksums(x), parity(x))`` of ``x``'s banks in one read of x.

    Returns uint32 ``(num_banks, 2)`` checksums and uint8 ``(num_groups, bank_bytes)`` parity, and
    with ``parity_sums=True`` also uint32 ``(num_groups, 2)``, the checksum of each parity row. Any
    dtype of 1, 2, 4 or 8 bytes and any shape (zero-size gives zero banks and groups); ``bank_bytes``
    a multiple of 16. Under ``vmap`` each example is banked on its own. With ``impl="auto"`` on
    CUDA, banks under 2 KiB take the separate ops (measured faster there; same bits).
    """
    check_impl("bank_guard", impl)
    check_byte_addressable("bank_guard", x)
    check_bank_bytes("bank_guard", bank_bytes)
    _check_group("bank_guard", group)
    if not isinstance(parity_sums, bool):
        raise TypeError(f"pimlayers.bank_guard: parity_sums={parity_sums!r}; expected True or False")
    bank_bytes, group = int(bank_bytes), int(group)
    if impl == "auto" and bank_bytes < _CUDA_FUSED_MIN_BANK:
        return dispatch(
            "bank_guard",
            impl,
            lambda a: _native(a, bank_bytes, group, parity_sums),
            lambda a: _separate(a, bank_bytes, group, parity_sums),
            x,
            native_on=("cpu",),
        )
    return dispatch(
        "bank_guard",
        impl,
        lambda a: _native(a, bank_bytes, group, parity_sums),
        lambda a: bank_guard_reference(a, bank_bytes, group, parity_sums),
        x,
    )
