"""The verified flash backward's checksum tiles and bounds in three passes (Pallas, Triton).

``flash_bwd_bounds`` (``_flash_bwd``) builds them with XLA: on an H200 (B = 1, T = 8192, 32/8 heads,
D = 128) 19 kernels, 0.24 ms of device time, 3.5 times one read of q, k, v, do and out (every
operand is read twice there, once for its blocks' sums over rows and once for its rows' sums over
D, in separate passes). Here one program per block reads the block once and forms both:

1. keys (``_keys_kernel``), per (batch, KV head, key block): the ks and vs tiles (the block's sum
   over rows), the kd tile (each key's sum over D and its L1 norm) and the block's Σ|k| and Σ|v|
   over rows, whose maxima over blocks (XLA, a few KB) are the query rows' bound factors;
2. queries (``_queries_kernel``), per (batch, head, query block): the qs, dos, qd and dod tiles,
   the block's largest ‖q‖₁ (the dk magnitude's), the bounds tol_s = c_b |q|·kmax and
   tol_dp = c_b |do|·vmax, δ = rowsum(do ∘ out), and the block's Σ|q|, Σ|do|, whose maxima over
   blocks and the group's heads are the key rows' bound factors;
3. keys again (``_key_rows_kernel``): tol_st = c_q |k|·qmax, tol_dpt = c_q |v|·domax.

k and v are read twice (their rows' bounds need q's and do's block maxima, and q's need k's), q, do
and out once: 268 MB at that shape, where one read of the five is 235. The sums are f32 reductions
in Triton's order where XLA's are a pairwise tree (block sums) and a reduction (rows): the two agree
to f32 rounding, inside the checks' slack (``_c_block``, ``_c_sum``). The tiles' constant rows are
equal bit for bit. The default on a GPU (``FlashBwdConfig(bounds_kernel=None)``; ``False`` asks for
XLA's): on an H100 (2026-12-05) 0.165 ms of device time against XLA's 0.263 (``python -m
benchmarks.run --suite bounds``), the verified backward 4.21 ms against 4.38 with XLA's (``--suite
peers``), compute-sanitizer memcheck and racecheck clean (``python tests/sanitize_gpu.py bounds``).
On a CPU XLA's arrays are the default; ``bounds_kernel=True`` runs these kernels in Pallas'
interpreter there (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._flash import _split
from ._flash_bounds import _rows
from ._vma import typed_like, vary_as

__all__ = ["flash_bwd_bounds_kernel"]

# A dod / kd tile's third row: each row's L1 norm rounded up to bf16 (x (1 + 2^-7), then to the
# nearest, is at least the norm), as ``_flash_bwd._tile_mag``.
_UP = 1 + 2.0**-7


def _keys_kernel(k_ref, v_ref, ks_ref, vs_ref, kd_ref, kabs_ref, vabs_ref, *, cs: int):
    kb = k_ref[...].astype(jnp.float32)  # (bk, D)
    vb = v_ref[...].astype(jnp.float32)
    ks_ref[...] = _rows(cs, kb.shape[1], *_split(jnp.sum(kb, axis=0)))
    vs_ref[...] = _rows(cs, vb.shape[1], *_split(jnp.sum(vb, axis=0)))
    k1 = jnp.sum(jnp.abs(kb), axis=1)  # (bk,) each key's L1 norm
    kd_ref[...] = _rows(cs, kb.shape[0], *_split(jnp.sum(kb, axis=1)), k1 * _UP)
    kabs_ref[...] = jnp.sum(jnp.abs(kb), axis=0)
    vabs_ref[...] = jnp.sum(jnp.abs(vb), axis=0)


def _queries_kernel(*refs, cs: int, c_b: float, with_out: bool):
    q_ref, do_ref = refs[:2]
    out_ref = refs[2] if with_out else None
    kmax_ref, vmax_ref = refs[2 + with_out : 4 + with_out]
    qs_ref, dos_ref, qd_ref, dod_ref, q1max_ref, tol_s_ref, tol_dp_ref, qabs_ref, doabs_ref = refs[
        4 + with_out : 13 + with_out
    ]
    qb = q_ref[...].astype(jnp.float32)  # (bq, D)
    dob = do_ref[...].astype(jnp.float32)
    qs_ref[...] = _rows(cs, qb.shape[1], *_split(jnp.sum(qb, axis=0)))
    dos_ref[...] = _rows(cs, dob.shape[1], *_split(jnp.sum(dob, axis=0)))
    qa, doa = jnp.abs(qb), jnp.abs(dob)
    # qd: each query's sum over D in rows 3 and 4 (dk's check shares dv's accumulator), no norm.
    qd_ref[...] = _rows(cs, qb.shape[0], 0.0, 0.0, 0.0, *_split(jnp.sum(qb, axis=1)))
    dod_ref[...] = _rows(cs, dob.shape[0], *_split(jnp.sum(dob, axis=1)), jnp.sum(doa, axis=1) * _UP)
    q1max_ref[...] = jnp.max(jnp.sum(qa, axis=1), keepdims=True)  # (1,)
    tol_s_ref[...] = c_b * jnp.sum(qa * kmax_ref[...][None, :], axis=1)
    tol_dp_ref[...] = c_b * jnp.sum(doa * vmax_ref[...][None, :], axis=1)
    qabs_ref[...] = jnp.sum(qa, axis=0)
    doabs_ref[...] = jnp.sum(doa, axis=0)
    if with_out:
        refs[-1][...] = jnp.sum(dob * out_ref[...].astype(jnp.float32), axis=1)  # δ


def _key_rows_kernel(k_ref, v_ref, qmax_ref, domax_ref, tol_st_ref, tol_dpt_ref, *, c_q: float):
    kb = jnp.abs(k_ref[...].astype(jnp.float32))
    vb = jnp.abs(v_ref[...].astype(jnp.float32))
    tol_st_ref[...] = c_q * jnp.sum(kb * qmax_ref[...][None, :], axis=1)
    tol_dpt_ref[...] = c_q * jnp.sum(vb * domax_ref[...][None, :], axis=1)


@functools.partial(jax.jit, static_argnames=("bq", "bk", "cs", "c_b", "c_q", "interpret", "q_warps"))
def flash_bwd_bounds_kernel(
    q,
    k,
    v,
    do,
    out=None,
    *,
    bq: int,
    bk: int,
    cs: int,
    c_b: float,
    c_q: float,
    interpret: bool = False,
    q_warps: int = 8,
) -> dict:
    """The tiles and rows of ``_flash_bwd.flash_bwd_bounds`` for q, do, out (B, T, H, D) and k, v
    (B, S, KV, D), bf16, T a multiple of bq and S of bk, with ``q1max`` (B, H, T/bq) f32 each query
    block's largest ‖q‖₁ (unscaled) in place of the qm tile, and ``delta`` given ``out``.
    ``q_warps``: the queries kernel's warps per program (``python -m benchmarks.run --suite
    bounds`` times 4, 8 and 16 on a GPU)."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g, nq, nk = h // kvh, t // bq, s // bk
    sq = pl.Squeezed() if hasattr(pl, "Squeezed") else None
    f32, dt = jnp.float32, q.dtype

    def call(*args, out_shape, warps: int = 4, **kw):
        params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1))

        def launch(*operands):  # the results vary over the mesh axes the operands do (ops._vma)
            out = typed_like(out_shape, *operands)
            results = pl.pallas_call(*args, out_shape=out, interpret=interpret, **params, **kw)(*operands)
            return vary_as(results, *operands)

        return launch

    # 1. keys: (batch, KV head, key block).
    key_spec = pl.BlockSpec((sq, bk, sq, d), lambda i, hh, j: (i, j, hh, 0))
    tile_d = pl.BlockSpec((sq, sq, sq, cs, d), lambda i, hh, j: (i, hh, j, 0, 0))
    per_block_d = pl.BlockSpec((sq, sq, sq, d), lambda i, hh, j: (i, hh, j, 0))
    ks, vs, kd, kabs, vabs = call(
        functools.partial(_keys_kernel, cs=cs),
        grid=(b, kvh, nk),
        in_specs=[key_spec, key_spec],
        out_specs=[
            tile_d,
            tile_d,
            pl.BlockSpec((sq, sq, sq, cs, bk), lambda i, hh, j: (i, hh, j, 0, 0)),
            per_block_d,
            per_block_d,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, nk, cs, d), dt),
            jax.ShapeDtypeStruct((b, kvh, nk, cs, d), dt),
            jax.ShapeDtypeStruct((b, kvh, nk, cs, bk), dt),
            jax.ShapeDtypeStruct((b, kvh, nk, d), f32),
            jax.ShapeDtypeStruct((b, kvh, nk, d), f32),
        ],
        name="pimlayers_flash_bwd_bounds_keys",
    )(k, v)
    kmax, vmax = jnp.max(kabs, axis=2), jnp.max(vabs, axis=2)  # (B, KV, D): a few KB

    # 2. queries: (batch, query head, query block); the head's KV group picks kmax's and vmax's row.
    q_spec = pl.BlockSpec((sq, bq, sq, d), lambda i, hh, j: (i, j, hh, 0))
    group_d = pl.BlockSpec((sq, sq, d), lambda i, hh, j: (i, hh // g, 0))
    q_tile_d = pl.BlockSpec((sq, sq, sq, cs, d), lambda i, hh, j: (i, hh, j, 0, 0))
    q_tile_q = pl.BlockSpec((sq, sq, sq, cs, bq), lambda i, hh, j: (i, hh, j, 0, 0))
    q_row = pl.BlockSpec((sq, sq, bq), lambda i, hh, j: (i, hh, j))
    q_block_d = pl.BlockSpec((sq, sq, sq, d), lambda i, hh, j: (i, hh, j, 0))
    with_out = out is not None
    outs = call(
        functools.partial(_queries_kernel, cs=cs, c_b=c_b, with_out=with_out),
        grid=(b, h, nq),
        in_specs=[q_spec, q_spec] + [q_spec] * with_out + [group_d, group_d],
        out_specs=[
            q_tile_d,
            q_tile_d,
            q_tile_q,
            q_tile_q,
            pl.BlockSpec((sq, sq, 1), lambda i, hh, j: (i, hh, j)),
            q_row,
            q_row,
            q_block_d,
            q_block_d,
        ]
        + [q_row] * with_out,
        out_shape=[
            jax.ShapeDtypeStruct((b, h, nq, cs, d), dt),
            jax.ShapeDtypeStruct((b, h, nq, cs, d), dt),
            jax.ShapeDtypeStruct((b, h, nq, cs, bq), dt),
            jax.ShapeDtypeStruct((b, h, nq, cs, bq), dt),
            jax.ShapeDtypeStruct((b, h, nq), f32),
            jax.ShapeDtypeStruct((b, h, t), f32),
            jax.ShapeDtypeStruct((b, h, t), f32),
            jax.ShapeDtypeStruct((b, h, nq, d), f32),
            jax.ShapeDtypeStruct((b, h, nq, d), f32),
        ]
        + [jax.ShapeDtypeStruct((b, h, t), f32)] * with_out,
        name="pimlayers_flash_bwd_bounds_queries",
        # Three (bq, D) f32 blocks and their magnitudes live at once: 8 warps keep them in
        # registers at bq = 64, D = 128 (an a-priori choice; the bounds suite times 4, 8 and 16).
        # In a 4-layer Llama-3-8B step this kernel took 0.13 ms a layer on an H100, about twice
        # one read of q, do and out (profile-sources-s49).
        warps=q_warps,
    )(q, do, *([out] if with_out else []), kmax, vmax)
    qs, dos, qd, dod, q1max, tol_s, tol_dp, qabs, doabs = outs[:9]
    # The key rows' factors: the largest |block| sums over the query blocks and the group's heads.
    grp = lambda x: jnp.max(x.reshape(b, kvh, g * nq, d), axis=2)  # (B, H, T/bq, D) -> (B, KV, D)

    # 3. keys again, for their rows' bounds.
    k_row = pl.BlockSpec((sq, sq, bk), lambda i, hh, j: (i, hh, j))
    tol_st, tol_dpt = call(
        functools.partial(_key_rows_kernel, c_q=c_q),
        grid=(b, kvh, nk),
        in_specs=[key_spec, key_spec] + [pl.BlockSpec((sq, sq, d), lambda i, hh, j: (i, hh, 0))] * 2,
        out_specs=[k_row, k_row],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, s), f32)] * 2,
        name="pimlayers_flash_bwd_bounds_key_rows",
    )(k, v, grp(qabs), grp(doabs))
    res = dict(
        ks=ks, vs=vs, kd=kd, qs=qs, dos=dos, qd=qd, dod=dod, q1max=q1max,
        tol_s=tol_s, tol_dp=tol_dp, tol_st=tol_st, tol_dpt=tol_dpt,
    )  # fmt: skip
    return res | (dict(delta=outs[9]) if with_out else {})
