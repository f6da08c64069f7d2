"""The fused GEMM on several devices: each device multiplies its own rows of x.

XLA's partitioner cannot split the fused kernel (one opaque call): under data parallelism it would
gather x to every device and run the whole GEMM on each, n times the work. :func:`fused_rows` wraps
the call in ``custom_partitioning``: x's rows (M) keep the sharding they arrive with, the weight is
whole on each device, y's rows and the block sums' last axis (the sums are (2, N / 128, M)) follow
x's. A device whose share of the rows the kernel does not tile (M / devices not a multiple of its
CTA's rows) computes the same two outputs with XLA (``fused_gemm_reference``) instead.

On one device it lowers to the plain call; under ``vmap`` the kernel is vmapped whole (not split).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._fused_gemm import FusedConfig, fused_gemm_reference, fused_gemm_supported
from ._rows import axes_of, custom_partitioned, lead_spec

__all__ = ["fused_rows"]


def fused_rows(kernel: Callable, a, b, config: FusedConfig):
    """``kernel(a, b, config) -> (y (M, N), sums (2, N / 128, M))`` on each device's rows of ``a``."""

    def fn(a, b):
        return kernel(a, b, config)

    def split(mesh, arg_shapes):
        (m_s,) = lead_spec(arg_shapes[0].sharding, 1)
        ins = (PartitionSpec(m_s, None), PartitionSpec(None, None))
        outs = (PartitionSpec(m_s, None), PartitionSpec(None, None, m_s))
        return ins, outs, math.prod(mesh.shape[ax] for ax in axes_of(m_s))

    def partition(mesh, arg_shapes, result_shape):
        ins, outs, parts = split(mesh, arg_shapes)
        (m, k), n = arg_shapes[0].shape, arg_shapes[1].shape[1]
        tiles = fused_gemm_supported(-(-m // parts), k, n, arg_shapes[0].dtype, config)
        local = fn if tiles else (lambda a, b: fused_gemm_reference(a, b, config))
        named = lambda ss: tuple(NamedSharding(mesh, s) for s in ss)
        return mesh, local, named(outs), named(ins)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (Shardy reads the rule below)
        return tuple(NamedSharding(mesh, s) for s in split(mesh, arg_shapes)[1])

    wrapped = custom_partitioned(fn, partition, infer, "m k, k n -> m n, t b m", ("k", "n", "t", "b"))
    batched = jax.custom_batching.custom_vmap(wrapped)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, a, b):
        out = jax.vmap(fn, in_axes=tuple(0 if x else None for x in in_batched))(a, b)
        return out, (True, True)

    return batched(a, b)
