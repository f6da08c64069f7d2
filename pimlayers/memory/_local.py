"""Per-device protection math: what one device computes on its own shard of the parameters.

Everything here runs inside ``shard_map`` (or on a single device as a one-device mesh) and reads each
leaf where it lies. Per leaf, one device keeps:

- ``sums``   uint32 (stripes, 2): the checksum of every stripe (``ops.bank_checksums``);
- ``parity`` uint8 (groups, stripe_bytes): XOR of each parity group's stripes (``ops.parity``);
- ``psums``  uint32 (groups, 2): the checksum of each parity block, so a flipped parity bit is found
  and refreshed rather than used to "repair" good data.

All three are written together by ``ops.bank_guard`` in one read of the leaf (encode on write);
``encode_leaves`` and ``check_leaves`` do every leaf of a device in one call.

Stripe and group counts are per leaf; the fault tables of a leaf are boolean masks of those lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import ops
from .geometry import AddressMap, BankGeometry


class LeafGuard(NamedTuple):
    sums: jax.Array
    parity: jax.Array
    psums: jax.Array


def encode_leaves(leaves, geo: BankGeometry) -> tuple[LeafGuard, ...]:
    """Checksums, parity and parity checksums of every leaf, in one read of each and one call
    (``ops.bank_guard_many``: one kernel launch on a GPU)."""
    out = ops.bank_guard_many(list(leaves), bank_bytes=geo.stripe_bytes, group=geo.group)
    return tuple(LeafGuard(*g) for g in out)


def check_leaves(leaves, guards, geo: BankGeometry, cast=None):
    """Per leaf (its checksums now, faulty stripes, faulty parity blocks), the int32 count of
    faulty stripes and parity blocks over all leaves, and (``cast``: one dtype per leaf) each leaf
    in its dtype, as read: one read of every leaf and of its parity, in one call
    (``ops.bank_verify_many``)."""
    v = ops.bank_verify_many(
        list(leaves),
        [(g.sums, g.parity, g.psums) for g in guards],
        bank_bytes=geo.stripe_bytes,
        group=geo.group,
        cast=cast,
    )
    return list(zip(v.now, v.bad, v.bad_parity, strict=True)), v.count, v.cast


def _per_group(mask, ngroups: int, group: int):
    return jnp.pad(mask, (0, ngroups * group - mask.shape[0])).reshape(ngroups, group)


class LeafRepair(NamedTuple):
    x: jax.Array
    guard: LeafGuard
    faulty: jax.Array  # int32 counts: stripes + parity blocks whose checksum disagreed
    repaired: jax.Array
    uncorrectable: jax.Array
    left_bad: jax.Array  # bool (stripes,): stripes still faulty after the repair


def repair_leaf(x, guard: LeafGuard, old_sums, bad, bad_par, geo: BankGeometry) -> LeafRepair:
    """Rebuild every group's one faulty stripe from parity, bit-exactly, in x's buffer.

    Per group: one faulty data stripe and a good parity block → rebuilt; a faulty parity block and good
    data → parity recomputed; anything more (two stripes, or a stripe and the parity) → uncorrectable,
    left as found and still flagged. A rebuilt stripe is verified against its stored checksum; one that
    comes back *unchanged* had a flipped checksum entry, not flipped data, and its entry is refreshed.
    """
    s, g = geo.stripe_bytes, geo.group
    ng = guard.parity.shape[0]
    ns = bad.shape[0]
    gbad = _per_group(bad, ng, g)
    nbad = jnp.sum(gbad, axis=1, dtype=jnp.int32)
    rebuild = (nbad == 1) & ~bad_par
    lost = jnp.where(rebuild, jnp.argmax(gbad, axis=1).astype(jnp.int32), jnp.int32(-1))
    dead_group = (nbad >= 2) | ((nbad == 1) & bad_par)
    x2 = ops.reconstruct(x, guard.parity, lost, bank_bytes=s, group=g)
    # One read of x2 for its checksums, its parity and that parity's checksums (used where refreshed).
    new_sums, fresh, fresh_psums = ops.bank_guard(x2, bank_bytes=s, group=g, parity_sums=True)
    rebuilt = bad & jnp.repeat(rebuild, g, total_repeat_length=ng * g)[:ns]
    verified = jnp.all(new_sums == guard.sums, axis=-1)
    entry_flip = jnp.all(new_sums == old_sums, axis=-1)  # the data was right; the entry was not
    good_rebuild = rebuilt & (verified | entry_flip)
    left_bad = bad & ~good_rebuild
    keep_old = jnp.repeat(dead_group, g, total_repeat_length=ng * g)[:ns] | left_bad
    sums = jnp.where(keep_old[:, None], guard.sums, new_sums)
    # A faulty parity block over clean data is recomputed; over faulty data it is all we have, kept.
    refresh = bad_par & (nbad == 0)
    par = jnp.where(refresh[:, None], fresh, guard.parity)
    psums = jnp.where(refresh[:, None], fresh_psums, guard.psums)  # a parity row's checksum is per row
    faulty = jnp.sum(bad, dtype=jnp.int32) + jnp.sum(bad_par, dtype=jnp.int32)
    repaired = jnp.sum(good_rebuild, dtype=jnp.int32) + jnp.sum(refresh, dtype=jnp.int32)
    return LeafRepair(x2, LeafGuard(sums, par, psums), faulty, repaired, faulty - repaired, left_bad)


class BankLayout(NamedTuple):
    """Where one device's stripes and parity blocks sit, as :func:`bank_table` reads it (static).

    Global stripe s is slot ``s % nbanks`` of row ``s // nbanks``, and a row's slot t is physical
    bank ``(t + rot[row]) % nbanks`` (``AddressMap.physical``); leaf i's stripes are
    ``first[i] .. first[i] + nstripes[i] - 1``, its parity groups ``first[i] // group ..`` (leaves
    start on fresh groups)."""

    nbanks: int
    group: int
    rot: np.ndarray  # int32 (rows,): each row's rotation
    first: tuple[int, ...]  # per leaf: its first global stripe
    nstripes: tuple[int, ...]
    ngroups: tuple[int, ...]

    @classmethod
    def of(cls, amap: AddressMap) -> BankLayout:
        g = amap.geometry
        rows = max(1, -(-amap.total_stripes // g.nbanks))
        rot = np.asarray(amap.physical(np.arange(rows, dtype=np.int64) * g.nbanks), np.int32)
        leaves = amap.leaves
        return cls(
            g.nbanks,
            g.group,
            rot,
            tuple(p.first_stripe for p in leaves),
            tuple(p.nstripes for p in leaves),
            tuple(p.ngroups for p in leaves),
        )


def _global(masks, starts, total: int):
    """int32 (total,): each mask placed at its start, zeros elsewhere (starts ascending, disjoint)."""
    parts, pos = [], 0
    for m, s in zip(masks, starts, strict=True):
        if s > pos:
            parts.append(jnp.zeros((s - pos,), jnp.int32))
        parts.append(m.astype(jnp.int32))
        pos = s + m.shape[0]
    if total > pos:
        parts.append(jnp.zeros((total - pos,), jnp.int32))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def bank_table(bads, bad_pars, layout: BankLayout):
    """Faulty stripes and parity blocks per physical bank, int32 (nbanks,), from every leaf's masks.

    Branch-free and without a scatter: the masks are laid out as the address map places them, one
    row of ``nbanks`` slots per interleave row (a parity block counts at the slot ``group`` further
    on in its members' row), each row is rotated onto physical banks (a gather by a per-row shift)
    and the rows are summed: one pass over ~1 byte per 4 KiB stripe. It replaces scatter-adds that
    ran behind a ``lax.cond`` on the count, whose predicate a GPU's host must read (a wait for the
    scrub's kernel) before the scrub's program can go on.
    """
    nb, g = layout.nbanks, layout.group
    got = ([int(b.shape[0]) for b in bads], [int(p.shape[0]) for p in bad_pars])
    if got != (list(layout.nstripes), list(layout.ngroups)):
        raise ValueError(
            f"pimlayers.memory.bank_table: masks of {got[0]} stripes and {got[1]} parity groups; the "
            f"layout has {list(layout.nstripes)} and {list(layout.ngroups)}"
        )
    rows = layout.rot.shape[0]
    m = _global(bads, layout.first, rows * nb).reshape(rows, nb)
    gpr = nb // g  # parity groups per row (nbanks is a multiple of the group)
    pm = _global(bad_pars, [f // g for f in layout.first], rows * gpr).reshape(rows, gpr)
    # Group j's parity block counts at group j + 1's first slot (wrapping within the row).
    pm = jnp.roll(pm, 1, axis=1)
    m = m + jnp.pad(pm[:, :, None], ((0, 0), (0, 0), (0, g - 1))).reshape(rows, nb)
    # Bank b of row r is slot (b - rot[r]) mod nbanks.
    idx = (jnp.arange(nb, dtype=jnp.int32)[None, :] - jnp.asarray(layout.rot)[:, None]) % nb
    return jnp.sum(jnp.take_along_axis(m, idx, axis=1), axis=0, dtype=jnp.int32)


# --- cross-device parity (RAID-5 style over one mesh axis of A devices) ---
#
# Device i's local bytes are cut into A - 1 chunks; chunk c goes to holder (i + 1 + c) mod A, which
# keeps the XOR of the chunks it holds. Every device holds 1/(A - 1) of its shard in parity, and a
# lost device k's chunk for holder j is holder j's parity XOR the other senders' chunks for j.


def _chunks(b, a: int):
    c = -(-b.shape[0] // (a - 1))
    return jnp.pad(b, (0, c * (a - 1) - b.shape[0])).reshape(a - 1, c)


def _outbox(chunks, a: int, me):
    """(A, C): row j is the chunk device ``me`` sends to holder j (zeros for j == me)."""
    j = jnp.arange(a, dtype=jnp.int32)
    c = (j - me - 1) % a  # == A - 1 exactly for j == me: the zero row appended below
    rows = jnp.concatenate([chunks, jnp.zeros((1, chunks.shape[1]), jnp.uint8)], axis=0)
    return rows[c]


def _xor_rows(m):
    return lax.reduce(m, jnp.uint8(0), lax.bitwise_xor, (0,))


def xparity_encode(b, axis: str, a: int):
    """This device's cross-device parity block from every device's local bytes ``b`` (uint8 (L,))."""
    me = lax.axis_index(axis)
    inbox = lax.all_to_all(_outbox(_chunks(b, a), a, me), axis, 0, 0, tiled=False)
    return _xor_rows(inbox)


def xparity_rebuild(b, xpar, lost, axis: str, a: int):
    """Bytes of device ``lost``'s shard, rebuilt from the others (on device ``lost``; elsewhere b).

    ``lost`` is data (int32 scalar, the index along ``axis``; -1 for none), so a different lost
    device never recompiles. Two all-to-alls: the survivors' chunks to each holder, then each
    holder's rebuilt chunk to the lost device.
    """
    me = lax.axis_index(axis)
    src = jnp.arange(a, dtype=jnp.int32)
    inbox = lax.all_to_all(_outbox(_chunks(b, a), a, me), axis, 0, 0, tiled=False)
    inbox = jnp.where((src == lost)[:, None], jnp.uint8(0), inbox)
    mine = xpar ^ _xor_rows(inbox)  # on holder j != lost: the lost device's chunk for j
    out = jnp.where((src == lost)[:, None], mine[None, :], jnp.uint8(0))
    back = lax.all_to_all(out, axis, 0, 0, tiled=False)  # on `lost`: row j from holder j
    chunks = back[(me + 1 + jnp.arange(a - 1, dtype=jnp.int32)) % a]
    rebuilt = chunks.reshape(-1)[: b.shape[0]]
    return jnp.where(me == lost, rebuilt, b)
