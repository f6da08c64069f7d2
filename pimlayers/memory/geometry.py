"""HBM bank geometry and the address map from a parameter pytree's bytes to physical banks.

A device's parameter memory is modelled as ``stacks x pseudo_channels x bank_groups x banks`` physical
banks. Bytes are placed in fixed-size *stripes* (the interleave granule, ``stripe_bytes``): each leaf
starts on a fresh parity group of stripes, leaves follow one another in pytree order, and consecutive
stripes go to different banks, as an HBM memory controller interleaves consecutive address granules
over stacks, pseudo-channels, bank groups and banks so that one physical bank holds stripes of many
tensors.

Interleaving (``stripe_bank``): global stripe s sits in row ``s // nbanks`` at slot ``s % nbanks``; each
row's slots are rotated by a row-dependent amount (permutation-based interleaving, Zhang, Zhu & Zhang,
MICRO 2000: memory controllers XOR or rotate bank bits with row bits so that strided streams do not
pile onto one bank). The slot's digits, fastest first, are stack, pseudo-channel, bank group, bank.

Parity: the ``group`` consecutive stripes ``kG .. kG+G-1`` of a leaf form a parity group (exactly
:func:`pimlayers.ops.parity` with ``bank_bytes=stripe_bytes``). Because groups start on multiples of G,
``nbanks`` is a multiple of G and the per-row map is a permutation, no two members of a group share a
physical bank; the group's parity block sits in the bank of the slot G further on, so it never shares
one either (the slot G further on in the same row, ``nbanks >= G + 1``). A whole failed bank
therefore costs every group at most one member.
The constructor checks both facts over the whole map, so a geometry for which they fail is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["AddressMap", "BankAddress", "BankGeometry", "LeafPlacement"]

# An odd multiplier (2^32 / golden ratio) spreads row rotations evenly over the slots.
_ROW_HASH = 0x9E3779B1


def _positive_int(cls: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise TypeError(f"pimlayers.memory.{cls}: {name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"pimlayers.memory.{cls}: {name}={v}; expected an int >= 1")
    return int(v)


@dataclasses.dataclass(frozen=True)
class BankGeometry:
    """Physical banks of one device's HBM, the stripe (interleave granule) and the parity group size.

    Defaults model an NVIDIA H200: six HBM3e stacks (NVIDIA H200 datasheet: 141 GB, 4.8 TB/s); per
    stack 16 channels of 2 pseudo-channels, each with 4 bank groups of 4 banks (JEDEC JESD238 HBM3,
    8-high; taller stacks add stack IDs, modelled here as more banks per group if wanted). The stripe
    (4 KiB) and the parity group (8 stripes, so parity costs 1/8 of the protected bytes) are our choices,
    not the controller's: the stripe trades checksum-table size (8 bytes per stripe, 0.2% at 4 KiB)
    against how much one flip forces the repair to rebuild.

    ``bank_bytes`` is the capacity of one physical bank (24 GiB / 512 banks per stack = 48 MiB for the
    H200); a store that does not fit in ``nbanks * bank_bytes`` is refused.
    """

    stacks: int = 6
    pseudo_channels: int = 32
    bank_groups: int = 4
    banks_per_group: int = 4
    stripe_bytes: int = 4096
    group: int = 8
    bank_bytes: int = 48 * 2**20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _positive_int("BankGeometry", f.name, getattr(self, f.name)))
        if self.stripe_bytes % 16:
            raise ValueError(
                f"pimlayers.memory.BankGeometry: stripe_bytes={self.stripe_bytes}; "
                "expected a positive multiple of 16"
            )
        if self.group < 2:
            raise ValueError(
                f"pimlayers.memory.BankGeometry: group={self.group}; expected >= 2 "
                "(a parity group of one stripe would only duplicate it)"
            )
        if self.nbanks % self.group or self.nbanks < self.group + 1:
            raise ValueError(
                f"pimlayers.memory.BankGeometry: {self.nbanks} banks "
                f"({self.stacks}x{self.pseudo_channels}x{self.bank_groups}x{self.banks_per_group}) "
                f"with group={self.group}; expected a bank count that is a multiple of the group and "
                "larger than it, so no parity group has two members (or its parity) in one bank"
            )
        if self.bank_bytes < self.stripe_bytes:
            raise ValueError(
                f"pimlayers.memory.BankGeometry: bank_bytes={self.bank_bytes} is smaller than "
                f"stripe_bytes={self.stripe_bytes}"
            )

    @property
    def nbanks(self) -> int:
        return self.stacks * self.pseudo_channels * self.bank_groups * self.banks_per_group

    @property
    def capacity_bytes(self) -> int:
        return self.nbanks * self.bank_bytes

    @classmethod
    def aquabolt_xl(cls, *, stripe_bytes: int = 4096, group: int = 8) -> BankGeometry:
        """One Samsung Aquabolt-XL HBM-PIM cube (Kwon et al., ISSCC 2021; Lee et al., ISCA 2021):
        HBM2, 16 pseudo-channels of 4 bank groups x 4 banks (256 banks, 128 of the PIM units, one per
        two banks), 6 GB."""
        return cls(
            stacks=1,
            pseudo_channels=16,
            bank_groups=4,
            banks_per_group=4,
            stripe_bytes=stripe_bytes,
            group=group,
            bank_bytes=6 * 2**30 // 256,
        )

    def bank_address(self, bank: int, device: int = 0) -> BankAddress:
        """Physical coordinates of flat bank index ``bank`` (stack fastest, then pseudo-channel,
        bank group, bank)."""
        if not 0 <= bank < self.nbanks:
            raise ValueError(f"pimlayers.memory.BankGeometry: bank={bank}; expected 0..{self.nbanks - 1}")
        stack, r = bank % self.stacks, bank // self.stacks
        pc, r = r % self.pseudo_channels, r // self.pseudo_channels
        bg, b = r % self.bank_groups, r // self.bank_groups
        return BankAddress(device, stack, pc, bg, b, bank)


class BankAddress(NamedTuple):
    device: int
    stack: int
    pseudo_channel: int
    bank_group: int
    bank: int
    flat: int  # index into the store's (devices, nbanks) tables


class LeafPlacement(NamedTuple):
    """Where one leaf's local (per-device) bytes live."""

    path: str
    nbytes: int
    first_stripe: int  # global stripe index of its byte 0 (a multiple of the group)
    nstripes: int
    ngroups: int
    first_group: int  # global index of its first parity group


class AddressMap:
    """The placement of every leaf's stripes and parity blocks in one device's physical banks.

    ``stripe_bank`` (int32, one entry per data stripe, leaves in order) and ``parity_bank`` (one per
    parity group) are numpy tables the store turns into constants; ``bank_contents(b)`` lists what a
    bank holds, which is what failing a bank destroys.
    """

    def __init__(self, geometry: BankGeometry, paths: Sequence[str], nbytes: Sequence[int]) -> None:
        g = geometry
        self.geometry = g
        leaves = []
        stripe = group = 0
        for path, n in zip(paths, nbytes, strict=True):
            ns = -(-int(n) // g.stripe_bytes)
            ng = -(-ns // g.group)
            leaves.append(LeafPlacement(path, int(n), stripe, ns, ng, group))
            stripe += ng * g.group  # the next leaf starts on a fresh group
            group += ng
        self.leaves: tuple[LeafPlacement, ...] = tuple(leaves)
        self.total_stripes = stripe  # including padding stripes at group ends
        self.total_groups = group
        if (stripe + group) * g.stripe_bytes > g.capacity_bytes:
            raise ValueError(
                f"pimlayers.memory.AddressMap: {stripe} data and {group} parity stripes of "
                f"{g.stripe_bytes} B do not fit in {g.nbanks} banks of {g.bank_bytes} B"
            )
        self._data_bank = self.physical(np.arange(stripe, dtype=np.int64))
        # Group k's parity block sits in the bank of the slot G further on in its members' row.
        first = np.arange(group, dtype=np.int64) * g.group
        self._parity_bank = self.physical(first, shift=g.group)
        self._check_disjoint()

    def physical(self, s: np.ndarray, shift: int = 0) -> np.ndarray:
        """Flat physical bank of global stripe index/indices ``s`` (``shift`` slots further on in the
        same row)."""
        nb = self.geometry.nbanks
        row, slot = s // nb, (s + shift) % nb
        rot = (row * _ROW_HASH) % nb
        return ((slot + rot) % nb).astype(np.int32)

    def _check_disjoint(self) -> None:
        g = self.geometry
        for leaf in self.leaves:
            if leaf.ngroups == 0:
                continue
            lo = leaf.first_stripe
            banks = self._data_bank[lo : lo + leaf.ngroups * g.group].reshape(leaf.ngroups, g.group)
            par = self._parity_bank[leaf.first_group : leaf.first_group + leaf.ngroups]
            both = np.concatenate([banks, par[:, None]], axis=1)
            distinct = np.array([len(set(r)) for r in both.tolist()])
            if (distinct != g.group + 1).any():  # cannot happen for a valid geometry; kept as a guard
                k = int(np.flatnonzero(distinct != g.group + 1)[0])
                raise ValueError(
                    f"pimlayers.memory.AddressMap: parity group {k} of {leaf.path} shares a bank"
                )

    def stripe_bank(self, leaf: int) -> np.ndarray:
        """int32 physical bank of each of leaf ``leaf``'s stripes (its group padding excluded)."""
        p = self.leaves[leaf]
        return self._data_bank[p.first_stripe : p.first_stripe + p.nstripes]

    def parity_bank(self, leaf: int) -> np.ndarray:
        p = self.leaves[leaf]
        return self._parity_bank[p.first_group : p.first_group + p.ngroups]

    def bank_contents(self, bank: int) -> list[tuple[int, str, np.ndarray]]:
        """What physical bank ``bank`` holds: ``(leaf, "data" | "parity", indices)`` entries."""
        out = []
        for i in range(len(self.leaves)):
            s = np.flatnonzero(self.stripe_bank(i) == bank)
            if s.size:
                out.append((i, "data", s))
            q = np.flatnonzero(self.parity_bank(i) == bank)
            if q.size:
                out.append((i, "parity", q))
        return out

    def leaves_per_bank(self) -> np.ndarray:
        """How many distinct leaves have data in each bank (the interleaving at work)."""
        count = np.zeros(self.geometry.nbanks, np.int64)
        for i in range(len(self.leaves)):
            count[np.unique(self.stripe_bank(i))] += 1
        return count

    def __repr__(self) -> str:
        g = self.geometry
        used = math.ceil(self.total_stripes / g.nbanks)
        return (
            f"AddressMap({len(self.leaves)} leaves, {self.total_stripes} stripes + {self.total_groups} "
            f"parity blocks of {g.stripe_bytes} B over {g.nbanks} banks, {used} rows)"
        )
