"""Row-parallel native calls: an FFI op whose rows are independent runs on each device's rows.

XLA's SPMD partitioner knows nothing of a custom call, so without help it gathers every operand
to every device and runs the op on the whole array there. For the protected GEMM's check and
finish that meant, under data parallelism over n devices, n times the check work per device plus
an all-gather of the f32 product: on two H200s the protected 8-layer training step ran at 0.49 of
the one-GPU tokens/s per GPU, where the unprotected step kept 0.91 (docs/benchmarks.md).

:func:`row_parallel` wraps such a call in ``custom_partitioning``: the operands' leading axes (the
rows, ``*m`` in the ops' signatures) keep whatever sharding they arrive with, the trailing axes
(a row's columns, its blocks) stay whole on each device, and each device runs the native call on
its own rows. On one device, and inside a ``shard_map`` that is manual over every mesh axis, it
lowers to the plain call. ``vmap`` adds a leading row axis (the ops' ``broadcast_all`` rule).

:func:`row_sums` does the same for a reduction over a GEMM's rows (its counts): each device sums
its own rows and one all-reduce adds the sums.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

__all__ = [
    "axes_of",
    "custom_partitioned",
    "fold_vmap",
    "lead_spec",
    "row_parallel",
    "row_sums",
    "unfold_vmap",
]


def row_parallel(fn: Callable[..., Any], trailing_in: Sequence[int], trailing_out: Sequence[int]):
    """``fn(*args)`` partitioned over its operands' shared leading axes.

    Args:
      fn: the native call; every result has the first operand's leading axes, and a row's result
        depends on that row of the operands alone. Another operand's leading axes are a prefix of
        the first's (none: an operand every row shares, such as a weight's checksums, whole on
        every device; some: shared by the rows under those axes, split as they are).
      trailing_in: per operand, how many trailing axes are a row's own (never split).
      trailing_out: the same per result, in the order ``fn`` returns them (a tuple).
    """
    trailing_in, trailing_out = tuple(trailing_in), tuple(trailing_out)

    def call(*args):
        lead = args[0].ndim - trailing_in[0]
        if lead <= 0:
            return fn(*args)
        leads = tuple(a.ndim - t for a, t in zip(args, trailing_in, strict=True))
        for a, n in zip(args[1:], leads[1:], strict=True):
            if not 0 <= n <= lead or tuple(a.shape[:n]) != tuple(args[0].shape[:n]):
                raise ValueError(
                    f"pimlayers: an operand of shape {tuple(a.shape)} does not share the leading axes "
                    f"of the first, {tuple(args[0].shape[:lead])}"
                )
        return _partitioned(fn, lead, leads, trailing_in, trailing_out)(*args)

    batched = jax.custom_batching.custom_vmap(call)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *args):
        # custom_vmap hands batched operands with the batch axis first: it becomes one more
        # leading row axis, as the FFI calls' broadcast_all rule would have it.
        args = [
            a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched, strict=True)
        ]
        out = batched(*args)
        return out, jax.tree.map(lambda _: True, out)

    return batched


def _partitioned(fn, lead: int, leads: tuple[int, ...], trailing_in: tuple[int, ...], trailing_out):
    def like_first(mesh, arg_shapes, leads_of, trailing: tuple[int, ...]):
        # The first operand's row sharding, for each operand/result its own leading axes of it;
        # their own axes whole.
        spec = lead_spec(arg_shapes[0].sharding, lead)
        return tuple(
            NamedSharding(mesh, PartitionSpec(*spec[:n], *(None,) * t))
            for n, t in zip(leads_of, trailing, strict=True)
        )

    outs_lead = (lead,) * len(trailing_out)

    def partition(mesh, arg_shapes, result_shape):
        results = like_first(mesh, arg_shapes, outs_lead, trailing_out)
        return mesh, fn, results, like_first(mesh, arg_shapes, leads, trailing_in)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (Shardy reads the rule below)
        return like_first(mesh, arg_shapes, outs_lead, trailing_out)

    # Shardy: the leading axes are factors shared by every operand that has them (l0, l1, ...),
    # every trailing axis its own factor that must stay whole on each device.
    letters = (f"f{i}" for i in itertools.count())  # as many factor names as the operands need
    own: list[str] = []

    def operand(n: int, trailing: int) -> str:
        names = [next(letters) for _ in range(trailing)]
        own.extend(names)
        return " ".join([*(f"l{i}" for i in range(n)), *names])

    ins = ", ".join(operand(n, t) for n, t in zip(leads, trailing_in, strict=True))
    outs = ", ".join(operand(lead, t) for t in trailing_out)
    return custom_partitioned(fn, partition, infer, f"{ins} -> {outs}", own)


def lead_spec(sharding, lead: int) -> tuple:
    """The first ``lead`` entries of a NamedSharding's spec (replicated for anything else)."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    spec = spec + (None,) * max(0, lead - len(spec))
    return spec[:lead]


def row_sums(fn: Callable[..., tuple]):
    """``fn(*args)``: operands (G, R, ...) sharing (G, R), results (G,) each that sum a term over a
    GEMM's rows (``_protected_matmul._tally``'s counts), partitioned as each device's rows summed
    locally and the sums added over the devices that split R: one all-reduce of the results.

    Left to XLA, the variadic reduction such an ``fn`` is (one pass over its operands) became an
    all-gather of every device's partial sums per result, three or four tiny collectives per
    protected GEMM (120 in a 2-layer training step on 8 CPU devices). Whole on each device:
    a row's trailing axes. On one device it lowers to ``fn``; ``vmap`` folds its axis into G.
    """

    def specs(mesh, arg_shapes):
        g_s, r_s = lead_spec(arg_shapes[0].sharding, 2)
        ins = tuple(NamedSharding(mesh, PartitionSpec(g_s, r_s, *(None,) * (a.ndim - 2))) for a in arg_shapes)
        return ins, NamedSharding(mesh, PartitionSpec(g_s)), axes_of(r_s)

    def partition(mesh, arg_shapes, result_shape):
        ins, out, r_axes = specs(mesh, arg_shapes)

        def local(*args):
            sums = fn(*args)
            return tuple(lax.psum(v, r_axes) for v in sums) if r_axes else sums

        return mesh, local, tuple(out for _ in result_shape), ins

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (Shardy reads the rule below)
        return tuple(specs(mesh, arg_shapes)[1] for _ in result_shape)

    def call(*args):
        trailing = [f"f{i}" for i in range(sum(a.ndim - 2 for a in args))]
        it = iter(trailing)
        ins = ", ".join(" ".join(["g", "r", *(next(it) for _ in range(a.ndim - 2))]) for a in args)
        outs = ", ".join("g" for _ in jax.eval_shape(fn, *args))
        return custom_partitioned(fn, partition, infer, f"{ins} -> {outs}", trailing)(*args)

    batched = jax.custom_batching.custom_vmap(call)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *args):
        out = batched(*fold_vmap(axis_size, in_batched, args))
        return tuple(unfold_vmap(axis_size, v) for v in out), tuple(True for _ in out)

    return batched


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def fold_vmap(axis_size: int, in_batched, args) -> list:
    """A ``custom_vmap`` rule's operands with the vmapped axis folded into their leading axis (G):
    (axis_size, G, ...) -> (axis_size·G, ...), unbatched operands broadcast to the axis first."""
    out = []
    for a, batched in zip(args, in_batched, strict=True):
        a = a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
        out.append(a.reshape(-1, *a.shape[2:]))
    return out


def unfold_vmap(axis_size: int, v: jax.Array) -> jax.Array:
    """A result of the folded call back to (axis_size, G, ...)."""
    return v.reshape(axis_size, -1, *v.shape[1:])


def custom_partitioned(fn: Callable, partition: Callable, infer: Callable, rule: str, whole: Sequence[str]):
    """``custom_partitioning(fn)`` with its ``partition`` callback, GSPMD's ``infer`` and Shardy's
    sharding ``rule``, whose factors ``whole`` stay whole on each device; a user's sharding of the
    results is taken as it is."""
    wrapped = custom_partitioning(fn)
    wrapped.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
        sharding_rule=rule,
        need_replication_factors=tuple(whole),
    )
    return wrapped
