"""routed_attention: context-parallel grouped-query attention whose KV transfers are verified,
fault-modelled and rerouted (ring, bidirectional ring, 2-D torus), with all-gather as the baseline.

The sequence is sharded over the mesh axis (or the two axes of a torus). Each device keeps its
queries and passes key/value blocks around (Liu et al. 2023, "Ring Attention"); each block's partial
softmax is merged with an online softmax, so the result is the attention over the whole sequence.
Causal load balancing: "zigzag" gives device d chunks d and 2n-1-d of 2n (every device then does the
same work, and every off-diagonal block is exactly half visible, so it runs as one unmasked GEMM of
half the size); "striped" gives device d tokens d, d+n, ... (Brandon et al. 2023; every block is
masked); "contiguous" skips the invisible blocks and leaves devices unbalanced.

Every transfer goes through :func:`pimlayers.routing._transfer.send` (checksums, link model,
retries over other routes). The backward pass (custom VJP) sends the blocks round the same streams
again with their dK/dV accumulators, which then travel home by the shortest way; its link and GEMM
counters come out as the cotangent of ``tap`` (see :func:`pimlayers.ops.report_from_tap`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ..faults import FaultPolicy, FaultReport
from ..layers._common import policy_or_default
from ..ops import zero_tap
from ..ops._protected_matmul import _to_tap
from . import _blocks as blk
from ._transfer import Ctx, Stats, my_index, return_hops, send, table
from .links import LinkState, PhotonicMesh

__all__ = [
    "LAYOUTS",
    "SCHEDULES",
    "RouteReport",
    "layout_permutation",
    "local_attention",
    "routed_attention",
    "streams",
]

SCHEDULES = ("ring", "bidir", "torus", "allgather")
LAYOUTS = ("zigzag", "striped", "contiguous")


class RouteReport(NamedTuple):
    """What the transfers of one routed_attention call went through (summed over devices)."""

    faults: FaultReport  # link_retries, link_failures, and the local GEMMs' ABFT counters
    corrupted: Int[Array, ""]  # receipts whose checksum disagreed (then fetched again)
    dropped: Int[Array, ""]  # transfers that never arrived (then fetched again)
    rounds: Int[Array, ""]  # transfer rounds run: first attempts plus retry rounds, over all transfers
    incomplete: Bool[Array, " t"]  # query positions that miss a key/value block they should see


class _Cfg(NamedTuple):
    ctx: Ctx
    schedule: str
    layout: str
    causal: bool
    scale: float
    policy: FaultPolicy
    tl: int  # local sequence length


def streams(schedule: str, pm: PhotonicMesh) -> list[list[tuple[int, int]]]:
    """The hops each circulating stream of KV blocks makes, as (axis, direction) per round."""
    n = pm.ndev
    if schedule == "ring":
        return [[(0, 1)] * (n - 1)]
    if schedule == "bidir":
        return [[(0, 1)] * (n // 2), [(0, -1)] * ((n - 1) // 2)]
    if schedule == "torus":
        r, c = pm.shape
        hops: list[tuple[int, int]] = []
        for row in range(r):
            hops += [(1, 1)] * (c - 1)
            if row < r - 1:
                hops.append((0, 1))
        return [hops]
    return []


def _offsets(stream, naxes: int) -> list[tuple[int, ...]]:
    out, cur = [], [0] * naxes
    for a, s in stream:
        cur[a] += s
        out.append(tuple(cur))
    return out


def _check_coverage(schedule: str, pm: PhotonicMesh) -> None:
    """Every block must reach every device exactly once (a static property of the schedule)."""
    seen = {tuple([0] * pm.naxes)}
    for st in streams(schedule, pm):
        for off in _offsets(st, pm.naxes):
            seen.add(tuple(o % s for o, s in zip(off, pm.shape, strict=True)))
    count = 1 + sum(len(st) for st in streams(schedule, pm))
    if schedule != "allgather" and (len(seen) != pm.ndev or count != pm.ndev):
        raise AssertionError(f"schedule {schedule} on {pm.shape} does not visit every block once")


def _origin(ctx: Ctx, offset) -> jax.Array:
    idx = jnp.zeros((), jnp.int32)
    for name, size, off in zip(ctx.axes, ctx.pm.shape, offset, strict=True):
        coord = (lax.axis_index(name).astype(jnp.int32) - off) % size
        idx = idx * size + coord
    return idx


def _positions(layout: str, idx, n: int, tl: int) -> Int[Array, " t"]:
    """Global positions of device ``idx``'s tokens (idx may be traced)."""
    ar = jnp.arange(tl, dtype=jnp.int32)
    if layout == "contiguous" or n == 1:
        return idx * tl + ar
    if layout == "striped":
        return ar * n + idx
    c = tl // 2
    return jnp.where(ar < c, idx * c + ar, (2 * n - 1 - idx) * c + ar - c)


def layout_permutation(layout: str, t: int, n: int) -> np.ndarray:
    """Token order that puts each device's tokens contiguously (its shard of the sequence axis)."""
    if n == 1 or layout == "contiguous":
        return np.arange(t)
    tl = t // n
    if layout == "striped":
        return np.concatenate([np.arange(d, t, n) for d in range(n)])
    c = tl // 2
    return np.concatenate(
        [np.r_[d * c : (d + 1) * c, (2 * n - 1 - d) * c : (2 * n - d) * c] for d in range(n)]
    )


def _group(x, kvh):
    b, t, h, d = x.shape
    return x.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)


def _ungroup(x5):
    b, kvh, g, t, d = x5.shape
    return x5.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * g, d)


def _pad_rows(part, c: int, front: bool):
    """Pad (o, m, l) along the row axis with the merge identity (c rows, before or after)."""
    o, m, rowsum = part[:3]
    po = [(0, 0)] * o.ndim
    pm_ = [(0, 0)] * m.ndim
    po[3] = (c, 0) if front else (0, c)
    pm_[3] = (c, 0) if front else (0, c)
    return (jnp.pad(o, po), jnp.pad(m, pm_, constant_values=blk.NEG), jnp.pad(rowsum, pm_), part[3])


# The own (diagonal) block of a causal layout whose first half precedes its second (contiguous and
# zig-zag) is cut in halves: first-half queries never see second-half keys, so that quarter is
# skipped, the off-diagonal quarter runs unmasked, and each diagonal quarter is cut again — 3/4 of
# the block's work after one cut, 5/8 after two. Cuts stop at _MIN_CHUNK rows (smaller GEMMs cost
# more in launches and merges than the skipped quarter saves) and after _MAX_CUTS.
_MIN_CHUNK, _MAX_CUTS = 128, 2


def _cuts(cfg: _Cfg, tl: int) -> int:
    if not cfg.causal or cfg.layout == "striped":
        return 0
    n = 0
    while n < _MAX_CUTS and tl % 2 == 0 and tl // 2 >= _MIN_CHUNK:
        tl, n = tl // 2, n + 1
    return n


def _rows(x, sl: slice, axis: int = 3):
    return x[(slice(None),) * axis + (sl,)]


def _own_forward(fwd, q5, kb, vb, qpos, kpos, cuts: int):
    """(o, m, l, report) of a causal diagonal block, its invisible quarter skipped (see _cuts)."""
    if cuts == 0:
        return fwd(q5, kb, vb, qpos, kpos, masked=True)
    c = q5.shape[3] // 2
    lo, hi = slice(None, c), slice(c, None)
    first = _own_forward(fwd, _rows(q5, lo), kb[:, lo], vb[:, lo], qpos[lo], kpos[lo], cuts - 1)
    left = fwd(_rows(q5, hi), kb[:, lo], vb[:, lo], qpos[hi], kpos[lo], masked=False)
    diag = _own_forward(fwd, _rows(q5, hi), kb[:, hi], vb[:, hi], qpos[hi], kpos[hi], cuts - 1)
    second = blk.merge(left[:3], diag[:3])
    joined = [jnp.concatenate([a, b], axis=3) for a, b in zip(first[:3], second, strict=True)]
    return (*joined, first[3] + left[3] + diag[3])


def _own_backward(bwd, q5, kb, vb, do5, lse, dsum, qpos, kpos, cuts: int):
    """(dq5, dk, dv, report) of `_own_forward`'s block."""
    if cuts == 0:
        return bwd(q5, kb, vb, do5, lse, dsum, qpos, kpos, masked=True)
    c = q5.shape[3] // 2
    lo, hi = slice(None, c), slice(c, None)
    rq = lambda sl: (_rows(q5, sl), _rows(do5, sl), _rows(lse, sl), _rows(dsum, sl))
    qa, doa, la, da = rq(lo)
    qb, dob, lb, db = rq(hi)
    first = _own_backward(bwd, qa, kb[:, lo], vb[:, lo], doa, la, da, qpos[lo], kpos[lo], cuts - 1)
    left = bwd(qb, kb[:, lo], vb[:, lo], dob, lb, db, qpos[hi], kpos[lo], masked=False)
    diag = _own_backward(bwd, qb, kb[:, hi], vb[:, hi], dob, lb, db, qpos[hi], kpos[hi], cuts - 1)
    dq = jnp.concatenate([first[0], left[0] + diag[0]], axis=3)
    dk = jnp.concatenate([first[1] + left[1], diag[1]], axis=1)
    dv = jnp.concatenate([first[2] + left[2], diag[2]], axis=1)
    return dq, dk, dv, first[3] + left[3] + diag[3]


def _attend(cfg: _Cfg, q5, kb, vb, j, o, qpos, kpos, *, own: bool):
    """Partial attention (o, m, l, report) of the local queries against the block from device o."""
    fwd = functools.partial(blk.block_forward, scale=cfg.scale, policy=cfg.policy)
    if not cfg.causal:
        return fwd(q5, kb, vb, qpos, kpos, masked=False)
    if own:
        return _own_forward(fwd, q5, kb, vb, qpos, kpos, _cuts(cfg, cfg.tl))
    if cfg.layout == "striped":
        return fwd(q5, kb, vb, qpos, kpos, masked=True)
    c = cfg.tl // 2
    if cfg.layout == "contiguous":
        lower = lambda: fwd(q5, kb, vb, qpos, kpos, masked=False)
        upper = lambda: (*blk.empty(q5), FaultReport.zeros())
    else:  # zigzag: an earlier device's first chunk is wholly visible; a later device's second half sees all
        lower = lambda: fwd(q5, kb[:, :c], vb[:, :c], qpos, kpos[:c], masked=False)
        upper = lambda: _pad_rows(fwd(q5[:, :, :, c:], kb, vb, qpos[c:], kpos, masked=False), c, True)
    return lax.cond(o < j, lower, upper)


def _battend(cfg: _Cfg, q5, kb, vb, do5, lse, dsum, j, o, qpos, kpos, *, own: bool):
    """The backward of `_attend`: (dq5 share, dk, dv, report), f32."""
    bwd = functools.partial(blk.block_backward, scale=cfg.scale, policy=cfg.policy)
    if not cfg.causal:
        return bwd(q5, kb, vb, do5, lse, dsum, qpos, kpos, masked=False)
    if own:
        return _own_backward(bwd, q5, kb, vb, do5, lse, dsum, qpos, kpos, _cuts(cfg, cfg.tl))
    if cfg.layout == "striped":
        return bwd(q5, kb, vb, do5, lse, dsum, qpos, kpos, masked=True)
    c = cfg.tl // 2
    zeros_q = jnp.zeros(q5.shape, jnp.float32)
    zeros_k = jnp.zeros(kb.shape, jnp.float32)
    if cfg.layout == "contiguous":
        lower = lambda: bwd(q5, kb, vb, do5, lse, dsum, qpos, kpos, masked=False)
        upper = lambda: (zeros_q, zeros_k, zeros_k, FaultReport.zeros())
    else:

        def lower():
            dq, dk, dv, r = bwd(q5, kb[:, :c], vb[:, :c], do5, lse, dsum, qpos, kpos[:c], masked=False)
            pad = [(0, 0), (0, c), (0, 0), (0, 0)]
            return dq, jnp.pad(dk, pad), jnp.pad(dv, pad), r

        def upper():
            sl = (slice(None),) * 3 + (slice(c, None),)
            dq, dk, dv, r = bwd(q5[sl], kb, vb, do5[sl], lse[sl], dsum[sl], qpos[c:], kpos, masked=False)
            return jnp.pad(dq, [(0, 0)] * 3 + [(c, 0), (0, 0)]), dk, dv, r

    return lax.cond(o < j, lower, upper)


def _affected(cfg: _Cfg, qpos, kpos):
    """Query rows that would see at least one key of a block (so lose something when it is missing)."""
    if not cfg.causal:
        return jnp.ones(qpos.shape, bool)
    return qpos >= jnp.min(kpos)


def _finish(acc, dtype):
    o, m, rowsum = acc
    safe = jnp.where(rowsum > 0, rowsum, 1.0)
    out5 = jnp.where((rowsum > 0)[..., None], o / safe[..., None], 0.0)
    lse = jnp.where(rowsum > 0, m + jnp.log(safe), blk.NEG)
    return _ungroup(out5).astype(dtype), lse


def _report(stats: Stats, rep: FaultReport) -> FaultReport:
    return rep + FaultReport(link_retries=stats.retries, link_failures=stats.failures)


# ---------------------------------------------------------------- per-device forward and backward


def _circulate(cfg: _Cfg, links: LinkState, cur, carry, visit, tag0: int):
    """Run every stream's rounds: send each stream's payload one hop, then ``visit`` what arrived.

    ``cur``: per stream (payload tuple, missing flag). ``visit(carry, payload, missing, origin)``
    returns ``(carry, payload to send on)``. Rounds that every stream has run in a ``fori_loop``
    (one copy of the transfer and the block kernel in the program, whatever the device count);
    a longer stream's extra rounds (bidir with n even) are unrolled. Returns ``(cur, carry, stats)``.
    """
    ctx = cfg.ctx
    pm = ctx.pm
    sts = streams(cfg.schedule, pm)
    nst = len(sts)
    lens = [len(st) for st in sts]

    def one(r, si, cur_si, carry, stats):
        st = sts[si]
        kinds = sorted(set(st))
        payload, miss = cur_si
        tag = tag0 + r * nst + si
        go = [functools.partial(_send_hop, hop=h, links=links, ctx=ctx) for h in kinds]
        if len(kinds) == 1:
            recv, rmiss, s = go[0](payload, miss, tag)
        else:
            kind = jnp.asarray([kinds.index(h) for h in st], jnp.int32)[r]
            recv, rmiss, s = lax.switch(kind, go, payload, miss, tag)
        offset = jnp.asarray(_offsets(st, pm.naxes), jnp.int32)[r]
        carry, onward = visit(carry, recv, rmiss, _origin(ctx, offset))
        return (onward, rmiss), carry, stats + s

    def body(r, c):
        cur, carry, stats = c
        cur = list(cur)
        for si in range(nst):
            cur[si], carry, stats = one(r, si, cur[si], carry, stats)
        return cur, carry, stats

    common = min(lens, default=0)
    c = (list(cur), carry, Stats.zeros())
    if common:
        c = lax.fori_loop(0, common, body, c)
    cur, carry, stats = c
    cur = list(cur)
    for r in range(common, max(lens, default=0)):
        for si in range(nst):
            if r < lens[si]:
                cur[si], carry, stats = one(r, si, cur[si], carry, stats)
    return cur, carry, stats


def _send_hop(payload, miss, tag, *, hop, links, ctx):
    return send(payload, miss, hop, links, ctx, tag)


def _fwd_local(cfg: _Cfg, q, k, v, links: LinkState):
    pm = cfg.ctx.pm
    kvh = k.shape[2]
    q5 = _group(q, kvh)
    j = my_index(cfg.ctx)
    qpos = _positions(cfg.layout, j, pm.ndev, cfg.tl)
    if cfg.schedule == "allgather":
        return _fwd_allgather(cfg, q5, k, v, j, qpos, q.dtype)
    own = _attend(cfg, q5, k, v, j, j, qpos, qpos, own=True)

    def visit(carry, recv, rmiss, o):
        acc, rep, incomplete = carry
        kpos = _positions(cfg.layout, o, pm.ndev, cfg.tl)
        part = _attend(cfg, q5, recv[0], recv[1], j, o, qpos, kpos, own=False)
        part3 = jax.tree.map(lambda e, p_: jnp.where(rmiss, e, p_), blk.empty(q5), part[:3])
        incomplete = incomplete | (rmiss & _affected(cfg, qpos, kpos))
        return (blk.merge(acc, part3), rep + part[3], incomplete), recv

    n_streams = len(streams(cfg.schedule, pm))
    cur = [((k, v), jnp.zeros((), bool)) for _ in range(n_streams)]
    carry = (blk.merge(blk.empty(q5), own[:3]), own[3], jnp.zeros((cfg.tl,), bool))
    _, (acc, rep, incomplete), stats = _circulate(cfg, links, cur, carry, visit, 0)
    out, lse = _finish(acc, q.dtype)
    return out, lse, incomplete, stats, rep


def _fwd_allgather(cfg: _Cfg, q5, k, v, j, qpos, dtype):
    """Baseline: gather every block at once (verified; no link model), then attend block by block."""
    ctx = cfg.ctx
    pm = ctx.pm
    axes = ctx.axes if len(ctx.axes) > 1 else ctx.axes[0]
    tab = table((k, v), jnp.zeros((), bool))
    ks, vs, tabs = (lax.all_gather(x, axes) for x in (k, v, tab))

    def body(o, carry):
        acc, rep, incomplete, failures = carry
        kb, vb = ks[o], vs[o]
        bad = jnp.any(table((kb, vb), jnp.zeros((), bool)) != tabs[o])
        kpos = _positions(cfg.layout, o, pm.ndev, cfg.tl)
        part = lax.cond(
            j == o,
            lambda: _attend(cfg, q5, kb, vb, j, o, qpos, kpos, own=True),
            lambda: _attend(cfg, q5, kb, vb, j, o, qpos, kpos, own=False),
        )
        part3 = jax.tree.map(lambda e, p_: jnp.where(bad, e, p_), blk.empty(q5), part[:3])
        incomplete = incomplete | (bad & _affected(cfg, qpos, kpos))
        return blk.merge(acc, part3), rep + part[3], incomplete, failures + bad.astype(jnp.int32)

    init = (blk.empty(q5), FaultReport.zeros(), jnp.zeros((cfg.tl,), bool), jnp.zeros((), jnp.int32))
    acc, rep, incomplete, failures = lax.fori_loop(0, pm.ndev, body, init)
    out, lse = _finish(acc, dtype)
    return out, lse, incomplete, Stats.zeros()._replace(failures=failures), rep


def _bwd_local(cfg: _Cfg, q, k, v, out, lse, do, links: LinkState):
    ctx = cfg.ctx
    pm = ctx.pm
    kvh = k.shape[2]
    q5, do5 = _group(q, kvh), _group(do, kvh)
    dsum = jnp.sum(do5.astype(jnp.float32) * _group(out, kvh).astype(jnp.float32), axis=-1)
    j = my_index(ctx)
    qpos = _positions(cfg.layout, j, pm.ndev, cfg.tl)
    if cfg.schedule == "allgather":
        return _bwd_allgather(cfg, q5, k, v, do5, lse, dsum, j, qpos, q.dtype)
    dq, dk, dv, rep = _battend(cfg, q5, k, v, do5, lse, dsum, j, j, qpos, qpos, own=True)

    def visit(carry, recv, rmiss, o):
        dq, rep = carry
        kb, vb, ak, av = recv
        kpos = _positions(cfg.layout, o, pm.ndev, cfg.tl)
        dq_p, dk_p, dv_p, rp = _battend(cfg, q5, kb, vb, do5, lse, dsum, j, o, qpos, kpos, own=False)
        keep = lambda x: jnp.where(rmiss, 0.0, x)
        return (dq + keep(dq_p), rep + rp), (kb, vb, ak + keep(dk_p), av + keep(dv_p))

    sts = streams(cfg.schedule, pm)
    z = jnp.zeros(k.shape, jnp.float32)
    cur = [((k, v, z, z), jnp.zeros((), bool)) for _ in sts]
    tag = 1 << 20  # the backward's transfers draw their own faults
    cur, (dq, rep), stats = _circulate(cfg, links, cur, (dq, rep), visit, tag)
    tag += 1 << 19
    for si, st in enumerate(sts):  # the accumulators go home by the shortest way
        if not st:
            continue
        (_, _, ak, av), miss = cur[si]
        hops = return_hops(pm, _offsets(st, pm.naxes)[-1])
        for hop in sorted(set(hops)):  # runs of one hop kind, each a loop

            def home(i, c, hop=hop, tag=tag):
                (ak, av), miss, stats = c
                (ak, av), miss, s = send((ak, av), miss, hop, links, ctx, tag + i)
                return (ak, av), miss, stats + s

            ((ak, av), miss, stats) = lax.fori_loop(0, hops.count(hop), home, ((ak, av), miss, stats))
            tag += hops.count(hop)
        dk = dk + jnp.where(miss, 0.0, ak)
        dv = dv + jnp.where(miss, 0.0, av)
    return _ungroup(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), _report(stats, rep)


def _bwd_allgather(cfg: _Cfg, q5, k, v, do5, lse, dsum, j, qpos, dtype):
    ctx = cfg.ctx
    pm = ctx.pm
    axes = ctx.axes if len(ctx.axes) > 1 else ctx.axes[0]
    ks, vs = lax.all_gather(k, axes), lax.all_gather(v, axes)

    def body(o, carry):
        dq, dks, dvs, rep = carry
        kpos = _positions(cfg.layout, o, pm.ndev, cfg.tl)
        args = (cfg, q5, ks[o], vs[o], do5, lse, dsum, j, o, qpos, kpos)
        dq_p, dk_p, dv_p, rp = lax.cond(
            j == o, lambda: _battend(*args, own=True), lambda: _battend(*args, own=False)
        )
        return dq + dq_p, dks.at[o].set(dk_p), dvs.at[o].set(dv_p), rep + rp

    z = jnp.zeros(ks.shape, jnp.float32)
    init = (jnp.zeros(q5.shape, jnp.float32), z, z, FaultReport.zeros())
    dq, dks, dvs, rep = lax.fori_loop(0, pm.ndev, body, init)
    # Each device's share of every block's dK/dV, summed onto the block's owner.
    dk = lax.psum_scatter(dks, axes, scatter_dimension=0, tiled=False)
    dv = lax.psum_scatter(dvs, axes, scatter_dimension=0, tiled=False)
    return _ungroup(dq).astype(dtype), dk.astype(k.dtype), dv.astype(v.dtype), rep


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local(cfg: _Cfg, q, k, v, links: LinkState, tap):
    out, _, incomplete, stats, rep = _fwd_local(cfg, q, k, v, links)
    return out, incomplete, stats, rep


def _local_fwd(cfg, q, k, v, links, tap):
    out, lse, incomplete, stats, rep = _fwd_local(cfg, q, k, v, links)
    return (out, incomplete, stats, rep), (q, k, v, out, lse, links)


def _local_bwd(cfg, res, cts):
    q, k, v, out, lse, links = res
    dq, dk, dv, rep = _bwd_local(cfg, q, k, v, out, lse, cts[0], links)
    zero_links = jax.tree.map(_zero_cotangent, links)
    return dq, dk, dv, zero_links, _to_tap(rep)  # shard_map sums the per-device taps


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


_local.defvjp(_local_fwd, _local_bwd)


# ---------------------------------------------------------------- the public functions


def local_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t kv d"],
    v: Float[Array, "b t kv d"],
    *,
    causal: bool = True,
    scale: float | None = None,
    policy: FaultPolicy | None = None,
    tap: jax.Array | None = None,
) -> tuple[Float[Array, "b t h d"], FaultReport]:
    """The local kernel alone — what each device runs on its own block, forward and backward (every
    GEMM verified) — on one device without any routing. ``routed_attention`` on a one-device mesh
    runs exactly these kernels inside its ``shard_map``."""
    policy = policy_or_default(policy)
    t, d = q.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    pm = PhotonicMesh((1,))
    cfg = _Cfg(Ctx(pm, ("_",)), "ring", "contiguous", bool(causal), scale, policy, t)
    tap = zero_tap() if tap is None else tap
    return _local_kernel(cfg, q, k, v, tap)


def _own_fwd(cfg: _Cfg, q, k, v):
    kvh = k.shape[2]
    q5 = _group(q, kvh)
    pos = jnp.arange(cfg.tl, dtype=jnp.int32)
    o, m, rowsum, rep = _attend(cfg, q5, k, v, 0, 0, pos, pos, own=True)
    out, lse = _finish((o, m, rowsum), q.dtype)
    return out, lse, rep


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local_kernel(cfg: _Cfg, q, k, v, tap):
    out, _, rep = _own_fwd(cfg, q, k, v)
    return out, rep


def _local_kernel_fwd(cfg, q, k, v, tap):
    out, lse, rep = _own_fwd(cfg, q, k, v)
    return (out, rep), (q, k, v, out, lse)


def _local_kernel_bwd(cfg, res, cts):
    q, k, v, out, lse = res
    kvh = k.shape[2]
    q5, do5 = _group(q, kvh), _group(cts[0], kvh)
    dsum = jnp.sum(do5.astype(jnp.float32) * _group(out, kvh).astype(jnp.float32), axis=-1)
    pos = jnp.arange(cfg.tl, dtype=jnp.int32)
    dq, dk, dv, rep = _battend(cfg, q5, k, v, do5, lse, dsum, 0, 0, pos, pos, own=True)
    return _ungroup(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), _to_tap(rep)


_local_kernel.defvjp(_local_kernel_fwd, _local_kernel_bwd)


def routed_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t kv d"],
    v: Float[Array, "b t kv d"],
    *,
    mesh: Mesh,
    axis: str | tuple[str, str],
    causal: bool = True,
    links: LinkState | None = None,
    schedule: str = "ring",
    layout: str = "zigzag",
    scale: float | None = None,
    policy: FaultPolicy | None = None,
    reorder: bool = True,
    tap: jax.Array | None = None,
) -> tuple[Float[Array, "b t h d"], RouteReport]:
    """Causal (or full) GQA self-attention with the sequence sharded over ``axis`` of ``mesh``.

    Returns ``(out, report)``; ``out`` equals ``jax.nn.dot_product_attention(q, k, v, is_causal=causal)``
    up to rounding wherever ``report.incomplete`` is False. ``links`` (from `PhotonicMesh.state`)
    models the interconnect; None means perfect links. ``schedule``: "ring", "bidir" (both
    directions at once, half the rounds), "torus" (``axis`` names two mesh axes) or "allgather".
    ``layout``: causal load balancing (module docstring). ``reorder=False`` when the tokens are
    already in the layout's order (:func:`layout_permutation`); otherwise they are permuted here and
    back. Differentiable in q, k, v; the backward pass's faults arrive as the gradient of ``tap``.
    """
    name = "pimlayers.routed_attention"
    policy = policy_or_default(policy)
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or any(a not in mesh.shape for a in axes):
        raise ValueError(f"{name}: axis={axis!r}; expected mesh axis names among {tuple(mesh.shape)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{name}: schedule={schedule!r}; expected one of {SCHEDULES}")
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout={layout!r}; expected one of {LAYOUTS}")
    if schedule == "torus" and len(axes) != 2:
        raise ValueError(f"{name}: schedule='torus' needs axis=(row_axis, col_axis); got {axis!r}")
    if schedule in ("ring", "bidir") and len(axes) != 1:
        raise ValueError(f"{name}: schedule={schedule!r} runs over one mesh axis; got {axis!r}")
    for nm, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}: {nm} has shape {getattr(x, 'shape', None)}; expected (B, T, heads, D)")
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if k.shape != (b, t, kvh, d) or v.shape != k.shape:
        raise ValueError(
            f"{name}: q {q.shape}, k {k.shape}, v {v.shape}; expected k and v (B={b}, T={t}, KV, D={d})"
        )
    if h % kvh:
        raise ValueError(f"{name}: {h} query heads cannot share {kvh} KV heads; H must be a multiple of KV")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(
            f"{name}: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; expected one float dtype"
        )
    shape = tuple(int(mesh.shape[a]) for a in axes)
    n = math.prod(shape)
    per = 2 * n if (layout == "zigzag" and n > 1) else n
    if t % per:
        raise ValueError(
            f"{name}: sequence length {t} is not divisible by {per} ({n} devices"
            f"{' x 2 zigzag chunks' if per != n else ''}); pad the sequence"
        )
    if links is None:
        links = PhotonicMesh(shape).state(fault_rate=0.0)
    if not isinstance(links, LinkState):
        raise TypeError(
            f"{name}: links must be a pimlayers.routing.LinkState (PhotonicMesh.state()); got {links!r}"
        )
    if links.mesh.shape != shape:
        raise ValueError(
            f"{name}: links model a mesh of {links.mesh.shape}; the sequence axes {axes} have {shape}"
        )
    _check_coverage(schedule, links.mesh)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cfg = _Cfg(Ctx(links.mesh, axes), schedule, layout, bool(causal), scale, policy, t // n)
    tap = zero_tap() if tap is None else tap
    perm = layout_permutation(layout, t, n)
    permuted = reorder and not np.array_equal(perm, np.arange(t))
    if permuted:
        q, k, v = (x[:, perm] for x in (q, k, v))
    seq = axes[0] if len(axes) == 1 else axes

    def per_device(q, k, v, links, tap):
        out, incomplete, stats, rep = _local(cfg, q, k, v, links, tap)
        stats = Stats(
            *(lax.psum(x, axes) for x in stats[:4]), lax.psum(stats.rounds, axes) // n
        )  # same everywhere
        return out, incomplete, stats, rep.psum(axes)

    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(None, seq), P(None, seq), P(None, seq), P(), P()),
        out_specs=(P(None, seq), P(seq), P(), P()),
        check_vma=False,
    )
    out, incomplete, stats, rep = fn(q, k, v, links, tap)
    if permuted:
        inv = np.argsort(perm)
        out, incomplete = out[:, inv], incomplete[inv]
    rep = _report(stats, rep)
    return out, RouteReport(rep, stats.corrupted, stats.dropped, stats.rounds, incomplete)
