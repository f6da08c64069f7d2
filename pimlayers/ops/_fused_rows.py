"""The fused GEMM on several devices: each device multiplies its own rows of x.

XLA's partitioner cannot split the fused kernel (one opaque call): under data parallelism it would
gather x to every device and run the whole GEMM on each, n times the work. :func:`fused_rows` wraps
the call in ``custom_partitioning``: x's rows (M) keep the sharding they arrive with, the weight is
whole on each device, y's rows and the block sums' last axis (the sums are (2, N / 128, M), or
(4, N / 128, M) with the checked kernel's c1 and mag, whose check tiles are whole on each device
too) follow x's. A device whose share of the rows the kernel does not tile (M / devices not a
multiple of its CTA's rows) computes the same outputs with XLA (the kernel's reference) instead.

On one device it lowers to the plain call; under ``vmap`` the kernel is vmapped whole (not split).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._fused_gemm import (
    FusedConfig,
    fused_gemm_checked_reference,
    fused_gemm_checked_supported,
    fused_gemm_reference,
    fused_gemm_supported,
)
from ._rows import axes_of, custom_partitioned, lead_spec

__all__ = ["fused_rows"]


def fused_rows(kernel: Callable, a, b, config: FusedConfig, tiles=None, terms: int = 0, b_t: bool = False):
    """``kernel(a, b, config) -> (y (M, N), sums (2, N / 128, M))`` on each device's rows of ``a``;
    with ``tiles`` (the checked kernel's, ``_fused_gemm.check_tiles``: whole on each device, as the
    weight) ``kernel(a, b, tiles, terms, config, b_t) -> (y, sums (4, N / 128, M))``, ``b_t``: b
    stored as (N, K)."""
    checked = tiles is not None
    if b_t and not checked:
        raise ValueError("pimlayers.fused_rows: a transposed b takes the checked kernel only (tiles)")

    def fn(a, b, *t):
        return kernel(a, b, *t, terms, config, b_t) if checked else kernel(a, b, config)

    def reference(a, b, *t):
        if checked:
            return fused_gemm_checked_reference(a, b, *t, terms, config, b_t)
        return fused_gemm_reference(a, b, config)

    def split(mesh, arg_shapes):
        (m_s,) = lead_spec(arg_shapes[0].sharding, 1)
        ins = (PartitionSpec(m_s, None), PartitionSpec(None, None))
        ins += (PartitionSpec(None, None, None, None),) if checked else ()
        outs = (PartitionSpec(m_s, None), PartitionSpec(None, None, m_s))
        return ins, outs, math.prod(mesh.shape[ax] for ax in axes_of(m_s))

    def partition(mesh, arg_shapes, result_shape):
        ins, outs, parts = split(mesh, arg_shapes)
        (m, k), n = arg_shapes[0].shape, arg_shapes[1].shape[0 if b_t else 1]
        supported = fused_gemm_checked_supported if checked else fused_gemm_supported
        local = fn if supported(-(-m // parts), k, n, arg_shapes[0].dtype, config) else reference
        named = lambda ss: tuple(NamedSharding(mesh, s) for s in ss)
        return mesh, local, named(outs), named(ins)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (Shardy reads the rule below)
        return tuple(NamedSharding(mesh, s) for s in split(mesh, arg_shapes)[1])

    b_dims = "n k" if b_t else "k n"
    rule = f"m k, {b_dims}, p h c k -> m n, t b m" if checked else "m k, k n -> m n, t b m"
    # (Factors in their order of first appearance in the rule: Shardy wants them sorted.)
    whole = ("k", "n", "p", "h", "c", "t", "b") if checked else ("k", "n", "t", "b")
    wrapped = custom_partitioned(fn, partition, infer, rule, whole)
    batched = jax.custom_batching.custom_vmap(wrapped)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *args):
        out = jax.vmap(fn, in_axes=tuple(0 if x else None for x in in_batched))(*args)
        return out, (True, True)

    operands = (a, b, tiles) if checked else (a, b)
    return batched(*operands)
