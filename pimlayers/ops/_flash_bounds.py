"""The verified flash forward's checksum and bound tiles in one pass over k and v (Pallas, Triton).

``flash_bounds`` (``_flash``) builds the tiles the forward kernel reads with XLA: on an H200 (B = 1,
T = 8192, 8 KV heads, D = 128) seven kernels, 25 µs of device time, for 34 MB of k and v that one
read moves in ~9 µs. Here the same tiles come from two small kernels: the first reads each
(batch, KV head, key block) of k and v once and writes the block's tiles, ks [hi, lo, 0...] and
vs [hi, lo, ones, -, -, 0...], folding the block's Σ|k| column sums and largest Σ|v| row sum into
per-head maxima (one zeroed buffer) with atomic max: Pallas' f32 atomic max is an integer atomic on
the bits, which order non-negative floats as their values and put a (positive) NaN above +Inf, so
a NaN propagates as with XLA's max. The second kernel writes km [hi, lo, 0...] of c_qk·kmax and
rows 3, 4 of every vs tile with c_pv·vmax, in place.

The sums are f32 reductions over the block (Triton's: a tree), where ``flash_bounds`` adds the same
values in another order: the two agree to f32 rounding, inside the checks' slack (``_c_block``).
The default on a GPU (``FlashConfig(bounds_kernel=None)``; ``False`` asks for XLA's): on an H100
(2026-12-05) 0.017 ms of device time against XLA's 0.024 (``python -m benchmarks.run --suite
bounds``), compute-sanitizer memcheck and racecheck clean (``python tests/sanitize_gpu.py bounds``).
On a CPU XLA's tiles are the default; ``bounds_kernel=True`` runs this kernel in Pallas' interpreter
there (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._flash import _split
from ._vma import typed_like, vary_alike, vary_as


def _rows(n: int, cols: int, *values):
    """(n, cols) bf16: row i = values[i] (a (cols,) array or a scalar) for i < len(values), then 0.
    ``_flash._tile``'s rows, built with selects: Pallas' Triton lowering concatenates only two
    arrays along their last axis."""
    row = lax.broadcasted_iota(jnp.int32, (n, cols), 0)
    out = jnp.zeros((n, cols), jnp.bfloat16)
    for i, val in enumerate(values):
        val = jnp.broadcast_to(jnp.asarray(val, jnp.bfloat16), (cols,))[None, :]
        out = jnp.where(row == i, val, out)
    return out


def _blocks_kernel(k_ref, v_ref, maxima_in, ks_ref, vs_ref, maxima_ref, *, cs: int):
    del maxima_in  # aliased to maxima_ref: row 0 kmax (D), row 1 [vmax, 0...]; zeros at first
    kb = k_ref[...].astype(jnp.float32)  # (bk, D)
    vb = v_ref[...].astype(jnp.float32)  # (bk, D)
    ks_hi, ks_lo = _split(jnp.sum(kb, axis=0))
    ks_ref[...] = _rows(cs, kb.shape[1], ks_hi, ks_lo)
    vs_hi, vs_lo = _split(jnp.sum(vb, axis=1))
    vs_ref[...] = _rows(cs, vb.shape[0], vs_hi, vs_lo, 1.0)
    plt.atomic_max(maxima_ref, (pl.dslice(0, 1), slice(None)), jnp.sum(jnp.abs(kb), axis=0)[None, :])
    vmax = jnp.max(jnp.sum(jnp.abs(vb), axis=1), keepdims=True)[None, :]  # (1, 1)
    plt.atomic_max(maxima_ref, (pl.dslice(1, 1), pl.dslice(0, 1)), vmax)


def _finish_kernel(maxima_ref, vs_in, km_ref, vs_ref, *, cs: int, c_qk: float, c_pv: float):
    km_hi, km_lo = _split(c_qk * maxima_ref[0, :])
    km_ref[...] = _rows(cs, km_hi.shape[0], km_hi, km_lo)
    vm_hi, vm_lo = _split(c_pv * maxima_ref[1, pl.dslice(0, 1)])  # (1,)
    tile = vs_in[...]
    row = lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    tile = jnp.where(row == 3, vm_hi[0], jnp.where(row == 4, vm_lo[0], tile))  # vmax in every column
    vs_ref[...] = tile


@functools.partial(jax.jit, static_argnames=("bk", "cs", "c_qk", "c_pv", "interpret"))
def flash_bounds_kernel(k, v, *, bk: int, cs: int, c_qk: float, c_pv: float, interpret: bool = False):
    """(ks, vs, km) of ``_flash.flash_bounds`` for k, v (B, S, KV, D) bf16, S a multiple of bk."""
    b, s, kvh, d = k.shape
    nb = s // bk
    sq = pl.Squeezed() if hasattr(pl, "Squeezed") else None
    grid = (b, kvh, nb)
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))
    kv_spec = pl.BlockSpec((sq, bk, sq, d), lambda i, h, j: (i, j, h, 0))
    maxima_spec = pl.BlockSpec((sq, sq, 2, d), lambda i, h, j: (i, h, 0, 0))
    # One zero buffer for both maxima: one fill before the kernels, not two.
    zeros = jnp.zeros((b, kvh, 2, d), jnp.float32)
    _, zeros = vary_alike(k, zeros)  # inside shard_map: the maxima vary as k does (ops._vma)
    ks, vs, maxima = pl.pallas_call(
        functools.partial(_blocks_kernel, cs=cs),
        grid=grid,
        in_specs=[kv_spec, kv_spec, maxima_spec],
        out_specs=[
            pl.BlockSpec((sq, sq, sq, cs, d), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((sq, sq, sq, cs, bk), lambda i, h, j: (i, h, j, 0, 0)),
            maxima_spec,
        ],
        out_shape=typed_like(
            [
                jax.ShapeDtypeStruct((b, kvh, nb, cs, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, kvh, nb, cs, bk), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, kvh, 2, d), jnp.float32),
            ],
            k,
            v,
        ),
        input_output_aliases={2: 2},
        interpret=interpret,
        name="pimlayers_flash_bounds_blocks",
        **params,
    )(k, v, zeros)
    ks, vs, maxima = vary_as((ks, vs, maxima), k, v)  # inside shard_map: ops._vma
    km, vs = pl.pallas_call(
        functools.partial(_finish_kernel, cs=cs, c_qk=c_qk, c_pv=c_pv),
        grid=grid,
        in_specs=[maxima_spec, pl.BlockSpec((sq, sq, sq, cs, bk), lambda i, h, j: (i, h, j, 0, 0))],
        out_specs=[
            # Every key block of a head writes the same km tile (its values depend on the head only).
            pl.BlockSpec((sq, sq, cs, d), lambda i, h, j: (i, h, 0, 0)),
            pl.BlockSpec((sq, sq, sq, cs, bk), lambda i, h, j: (i, h, j, 0, 0)),
        ],
        out_shape=typed_like(
            [
                jax.ShapeDtypeStruct((b, kvh, cs, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, kvh, nb, cs, bk), jnp.bfloat16),
            ],
            maxima,
            vs,
        ),
        input_output_aliases={1: 1},
        interpret=interpret,
        name="pimlayers_flash_bounds_finish",
        **params,
    )(maxima, vs)
    return vary_as((ks, vs, km), k, v)
