"""One verified, fault-modelled, rerouted transfer inside `shard_map`: every device sends a payload
one step along a mesh axis and receives its neighbour's.

The payload travels with a checksum table (:func:`pimlayers.ops.bank_checksums` of every array, plus
the "missing upstream" flag), computed by the sender; the receiver recomputes and compares. The
`LinkState` decides, per hop and attempt, which transfers arrive corrupted (one flipped bit) or not
at all — every device draws the same uniforms, so each knows what happened on its incoming route
without a message. Retries run in a ``lax.while_loop`` whose continue flag is a ``psum`` (the same on
every device, so no collective diverges); each retry round picks one route for everyone from the
all-gathered "still missing" tokens and the link health: the route with the most expected
deliveries per hop among the devices still waiting (the direct hop while it is the best bet, a
detour when its link is dead). A payload still missing after ``max_attempts`` is reported, never used.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ops import bank_checksums
from .links import LinkState, PhotonicMesh

_BANK = 4096  # checksum granularity in bytes: every error within two 16-bit words of a bank is caught


class Stats(NamedTuple):
    """Per-device transfer counters (int32 scalars)."""

    retries: jax.Array
    failures: jax.Array
    corrupted: jax.Array
    dropped: jax.Array
    rounds: jax.Array  # retry rounds this transfer needed (the same on every device)

    @staticmethod
    def zeros() -> Stats:
        z = jnp.zeros((), jnp.int32)
        return Stats(z, z, z, z, z)

    def __add__(self, other: Stats) -> Stats:  # type: ignore[override]
        return Stats(*(a + b for a, b in zip(self, other, strict=True)))


class Ctx(NamedTuple):
    """Static routing context of one call."""

    pm: PhotonicMesh
    axes: tuple[str, ...]  # mesh axis name per PhotonicMesh axis


def my_index(ctx: Ctx):
    """This device's row-major index over the sequence axes (traced)."""
    idx = jnp.zeros((), jnp.int32)
    for name, size in zip(ctx.axes, ctx.pm.shape, strict=True):
        idx = idx * size + lax.axis_index(name).astype(jnp.int32)
    return idx


def _hop(x, hop, ctx: Ctx):
    a, s = hop
    n = ctx.pm.shape[a]
    return lax.ppermute(x, ctx.axes[a], [(i, (i + s) % n) for i in range(n)])


def table(payload, missing):
    """The checksum table a sender attaches: bank checksums of each array, then the missing flag."""
    parts = [bank_checksums(x, bank_bytes=_BANK) for x in payload]
    flag = missing.astype(jnp.uint32)
    parts.append(jnp.stack([flag, 1 - flag])[None])
    return jnp.concatenate(parts, axis=0)


def _uint(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _mix(x):
    """MurmurHash3's 32-bit finaliser: a cheap bijective mix (the fault draws are hashes of who, when
    and which link, so every device computes the same draw for a link without a message, and the
    compiled step carries no random-number generator)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _hash(key, *words):
    h = _mix(key[0] ^ _mix(key[1]))
    for w in words:
        h = _mix(h ^ _mix(jnp.asarray(w).astype(jnp.uint32) + np.uint32(0x9E3779B9)))
    return h


def _unit(h):
    """A uint32 hash to a float32 in [0, 1) (24 bits)."""
    return (h >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def _corrupt(payload, key, draw, on):
    """Flip one uniformly chosen bit of the payload where ``on`` (a traced bool)."""
    sizes = [int(np.prod(x.shape)) for x in payload]
    bits = [8 * jnp.dtype(x.dtype).itemsize for x in payload]
    total = sum(sizes)
    if total == 0:
        return payload
    pos = (_hash(key, *draw, 101) % np.uint32(total)).astype(jnp.int32)
    rnd = _hash(key, *draw, 102)
    out, start = [], 0
    for x, n, nb in zip(payload, sizes, bits, strict=True):
        local = pos - start
        hit = on & (local >= 0) & (local < n)
        u = lax.bitcast_convert_type(x.reshape(-1), _uint(x.dtype))
        bit = (rnd % np.uint32(nb)).astype(u.dtype)
        i = jnp.clip(local, 0, max(n - 1, 0))
        u = u.at[i].set(jnp.where(hit, u[i] ^ (jnp.ones((), u.dtype) << bit), u[i]))
        out.append(lax.bitcast_convert_type(u, x.dtype).reshape(x.shape))
        start += n
    return tuple(out)


def _route_faults(links: LinkState, draw, me, link_table: np.ndarray):
    """(corrupted, dropped) for the payload that lands on this device over one route."""
    lt = jnp.asarray(link_table)
    corrupt = jnp.zeros((), bool)
    dropped = jnp.zeros((), bool)
    for h in range(link_table.shape[1]):
        lk = lt[me, h]
        dead = ~links.alive[lk]
        fault = (_unit(_hash(links.key, *draw, h, lk, 0)) < links.p_fault[lk]) | dead
        lost = _unit(_hash(links.key, *draw, h, lk, 1)) < np.float32(links.mesh.drop_fraction)
        drop = dead | (fault & lost)
        dropped = dropped | drop
        corrupt = corrupt | (fault & ~drop)
    return corrupt & ~dropped, dropped


def send(payload: tuple, missing, hop: tuple[int, int], links: LinkState, ctx: Ctx, tag: int):
    """Move ``payload`` (a tuple of arrays) one ``hop`` = (axis, ±1) along the mesh, verified.

    Returns ``(received, received_missing, stats)``: the neighbour's payload, whether it is missing
    (lost here after every attempt, or already missing upstream), and this device's counters.
    ``tag`` numbers the transfer within the step so each draws its own faults.
    """
    pm = ctx.pm
    routes = pm.routes(*hop)
    tables = [pm.route_links(r) for r in routes]
    # Success probability of each route for the payload landing on each device: the route score.
    idx = [jnp.asarray(t) for t in tables]
    me = my_index(ctx)
    sent_table = table(payload, missing)

    def branch(r):
        def go(ops):
            pl, tb, ms, attempt = ops
            for h in routes[r]:
                pl, tb, ms = _hop((pl, tb, ms), h, ctx)
            draw = (tag, attempt, r)
            corrupt, dropped = _route_faults(links, draw, me, tables[r])
            pl = _corrupt(pl, links.key, (*draw, me), corrupt)
            return pl, tb, ms, dropped

        return go

    branches = [branch(r) for r in range(len(routes))]
    all_axes = ctx.axes if len(ctx.axes) > 1 else ctx.axes[0]

    def body(st):
        recv, rtab, rmiss, ok, attempt, s = st
        need = ~ok
        need_all = lax.all_gather(need, all_axes, tiled=False).reshape(-1)  # the fault tokens
        p_ok = jnp.where(links.alive, 1.0 - links.p_fault, 0.0)
        # Expected deliveries per hop spent: a long detour is taken only when it is the better deal.
        scores = jnp.stack(
            [jnp.sum(jnp.where(need_all, jnp.prod(p_ok[t], axis=1), 0.0)) / t.shape[1] for t in idx]
        )
        route = jnp.argmax(scores).astype(jnp.int32)
        pl, tb, ms, dropped = lax.switch(route, branches, (payload, sent_table, missing, attempt))
        verified = ~dropped & jnp.all(table(pl, ms) == tb)
        take = need & verified
        recv = tuple(jnp.where(take, a, b) for a, b in zip(pl, recv, strict=True))
        rmiss = jnp.where(take, ms, rmiss)
        s = Stats(
            s.retries + (need & (attempt > 0)).astype(jnp.int32),
            s.failures,
            s.corrupted + (need & ~dropped & ~verified).astype(jnp.int32),
            s.dropped + (need & dropped).astype(jnp.int32),
            s.rounds + 1,
        )
        return recv, rtab, rmiss, ok | take, attempt + 1, s

    def cond(st):
        ok, attempt = st[3], st[4]
        waiting = lax.psum((~ok).astype(jnp.int32), ctx.axes)
        return (waiting > 0) & (attempt < pm.max_attempts)

    init = (
        tuple(jnp.zeros_like(x) for x in payload),
        sent_table,
        jnp.zeros((), bool),
        jnp.zeros((), bool),
        jnp.zeros((), jnp.int32),
        Stats.zeros(),
    )
    recv, _, rmiss, ok, _, s = lax.while_loop(cond, body, init)
    s = s._replace(failures=(~ok).astype(jnp.int32))
    return recv, rmiss | ~ok, s


def return_hops(pm: PhotonicMesh, offset: tuple[int, ...]) -> list[tuple[int, int]]:
    """The shortest hops that undo a displacement ``offset`` (per axis, the shorter way round)."""
    hops: list[tuple[int, int]] = []
    for a, (o, n) in enumerate(zip(offset, pm.shape, strict=True)):
        back = (-o) % n
        if back == 0:
            continue
        hops += [(a, 1)] * back if back <= n - back else [(a, -1)] * (n - back)
    return hops
