"""The device redo on several devices: each device redoes the detected blocks of its own rows.

XLA's partitioner knows nothing of the redo kernel (one opaque call) and would gather every operand
to every device to run it on the whole product: under data parallelism, x, the product, its
checks, flags and counts, every GEMM, every step, detected or not. :func:`partitioned` wraps the
call (``fn(a, b, flags, counts, c, mag, y) -> (y, stats)``, ``_redo_kernel``'s) in
``custom_partitioning``:

- The product's GEMM and row axes (G, R) keep the sharding the product arrives with; each device
  redoes its own rows, reading its rows of a, the checks, flags and counts, and writes its rows'
  stats. A row's columns and the weight's trailing axes are whole on each device, as the check
  ops have them (``_rows``).
- Where the contraction K arrives split over mesh axes, no device holds what recomputing a block
  takes: a weight gradient xᵀ·dy under data parallelism (K is the tokens). Gathering x and dy for
  every such GEMM would cost more than the GEMM, so they stay split; the devices sum whether any of
  them holds a detected block (an all-reduce of one integer) and only then gather the operands over
  K and redo, under a branch. That branch is the default loop's host round trip (a GPU reads its
  predicate), in this case alone; the forward and dx, whose K is whole, keep no branch.
- xᵀ stored (the weight gradient's a, (G, K, R)): its R axis is gathered with K in that branch and
  the device's rows sliced out, so K and the product's rows may be split over the same mesh axis
  (FSDP reduce-scatters dw over the axis that splits the tokens).

On one device, and inside a ``shard_map`` manual over every mesh axis, it lowers to the plain
call. ``vmap`` folds its axis into G (the kernel's own batch axis).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Int32

from ._abft import ABFT_CLEAN, ABFT_CORRECTED, ABFT_DETECTED
from ._rows import axes_of, custom_partitioned, fold_vmap, lead_spec, unfold_vmap

__all__ = ["REDO_STATS", "STATS", "partitioned", "tally_columns", "tally_parts"]

# The redo kernel's stats per row and program: blocks still failing, values gated by the redo, the
# first pass's there, blocks redone (REDO_STATS); then the first pass's own tally of the program's
# blocks, as ``_protected_matmul._tally`` sums it: blocks corrected in place, detected, flagged at
# all, values gated.
STATS = 8
REDO_STATS = 4


def tally_parts(flags: Int32[Array, "*s"], counts: Int32[Array, "*s"]) -> tuple[Int32[Array, "*s"], ...]:
    """The first pass's tally per block, as int32: corrected in place, detected (pending), flagged
    at all, values gated. ``_protected_matmul._tally``, :func:`tally_columns` and the redo kernel's
    programs sum these."""
    i32 = lambda t: t.astype(jnp.int32)
    return i32(flags == ABFT_CORRECTED), i32(flags == ABFT_DETECTED), i32(flags != ABFT_CLEAN), counts


def tally_columns(flags: Int32[Array, "g r nb"], counts: Int32[Array, "g r nb"], groups: int) -> jax.Array:
    """Stats (G, R, groups, 8) holding only the first pass's tally, each row's in group 0: what the
    kernel's programs write where nothing is redone, for a caller that skips the kernel then
    (:func:`partitioned`'s split contraction)."""
    parts = tally_parts(flags, counts)
    row = jnp.stack([jnp.sum(c, axis=-1, dtype=jnp.int32) for c in parts], axis=-1)  # (G, R, 4)
    out = jnp.zeros((*flags.shape[:2], groups, STATS), jnp.int32)
    return out.at[:, :, 0, REDO_STATS:].set(row)


_A, _B, _FLAGS, _COUNTS, _C, _MAG, _Y = range(7)  # the operands' places


def partitioned(fn: Callable, a_t: bool, b_t: bool) -> Callable:
    """``fn(a, b, flags, counts, c, mag, y) -> (y, stats)`` run on each device's rows of y.

    Shapes: a (G, R, K), or (G, K, R) with ``a_t``; b (G, K, N), or (G, N, K) with ``b_t``; flags and
    counts (G, R, nb); c (G, R, nb2, 2); mag (G, R, nb2); y (G, R, N); stats (G, R, groups, 8).
    """
    k_a, k_b = (1 if a_t else 2), (2 if b_t else 1)  # the contraction's axis in a and in b

    def specs(mesh, arg_shapes):
        """(operand specs, result specs, the mesh axes that split K, those that split R)."""
        g_s, r_s = lead_spec(arg_shapes[_Y].sharding, 2)
        k_s = lead_spec(arg_shapes[_A].sharding, 3)[k_a]
        taken = set(axes_of(g_s)) | (set() if a_t else set(axes_of(r_s)))
        if set(axes_of(k_s)) & taken:
            k_s = None  # an axis cannot split two of a's dimensions: K is gathered (by XLA)
        rows = lambda t: PartitionSpec(g_s, r_s, *(None,) * t)
        a = [g_s, r_s, None]
        if a_t:  # (G, K, R): R whole where K is split (sliced in the branch), else as y's rows
            a = [g_s, None, None if k_s else r_s]
        a[k_a] = k_s
        b = [g_s, None, None]
        b[k_b] = k_s
        ins = (PartitionSpec(*a), PartitionSpec(*b), rows(1), rows(1), rows(2), rows(1), rows(1))
        outs = (rows(1), rows(2))
        return ins, outs, axes_of(k_s), axes_of(r_s)

    def partition(mesh, arg_shapes, result_shape):
        ins, outs, k_axes, r_axes = specs(mesh, arg_shapes)
        named = lambda ss: tuple(NamedSharding(mesh, s) for s in ss)
        if not k_axes:
            return mesh, fn, named(outs), named(ins)
        every = tuple(mesh.axis_names)

        def split_k(a, b, flags, counts, c, mag, y):
            def redo(ops):
                a, b, flags, counts, c, mag, y = ops
                a = lax.all_gather(a, k_axes, axis=k_a, tiled=True)
                b = lax.all_gather(b, k_axes, axis=k_b, tiled=True)
                if a_t and r_axes:  # this device's rows of the gathered (G, K, R)
                    rl = y.shape[1]
                    a = lax.dynamic_slice_in_dim(a, lax.axis_index(r_axes) * rl, rl, axis=2)
                return fn(a, b, flags, counts, c, mag, y)

            ops = (a, b, flags, counts, c, mag, y)
            stats = jax.eval_shape(redo, ops)[1]
            # Every device takes the same branch: the gathers inside it are collectives.
            mine = jnp.any(flags == ABFT_DETECTED).astype(jnp.int32)
            anywhere = lax.psum(mine, every) > 0
            # Nothing redone anywhere: the first pass's tally alone, as the kernel's programs count it.
            idle = lambda o: (o[-1], tally_columns(o[2], o[3], stats.shape[2]))
            return lax.cond(anywhere, redo, idle, ops)

        return mesh, split_k, named(outs), named(ins)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (Shardy reads the rule below)
        g_s, r_s = lead_spec(arg_shapes[_Y].sharding, 2)
        return tuple(NamedSharding(mesh, PartitionSpec(g_s, r_s)) for _ in range(2))

    # Shardy: G and R shared by the product, its checks and a; K by a and b; everything else whole.
    a_rule = "g k r" if a_t else "g r k"
    b_rule = "g n k" if b_t else "g k n"
    rule = f"{a_rule}, {b_rule}, g r p, g r p, g r q t, g r q, g r n -> g r n, g r u v"
    wrapped = custom_partitioned(fn, partition, infer, rule, ("n", "p", "q", "t", "u", "v"))
    batched = jax.custom_batching.custom_vmap(wrapped)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *args):  # the vmapped axis joins G (every operand has G first)
        out = batched(*fold_vmap(axis_size, in_batched, args))
        return tuple(unfold_vmap(axis_size, v) for v in out), (True, True)

    return batched
