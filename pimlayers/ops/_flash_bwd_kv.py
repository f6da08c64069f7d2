"""The flash backward's key-row kernel: dk and dv and their checks (the second of
:mod:`._flash_bwd`'s two kernels), and with ``fused`` dq too, in one pass over the key blocks.

:mod:`._flash_bwd`'s two kernels run seven GEMMs per (query block, key block) pair: the dq kernel
recomputes s = q·kᵀ and dp = do·vᵀ that the dk/dv kernel forms again as sᵀ and dpᵀ. This kernel is
the dk/dv kernel with dq added, as FlashAttention-3's backward does it: per step (one query block of
``block_q`` rows against the CTA's 2·``block_kv`` keys) each compute warpgroup writes its ds tile
(keys x queries, bf16) to shared memory; once both have, warpgroup w forms dq_blk[:, half w] =
dsᵀ·k[:, half w] (the query block's rows against all 128 keys, half of D each, K = 128 from two
wgmmas) and adds it to an f32 dq accumulator in global memory with a TMA reduce-add. Five GEMMs per
pair instead of seven; dq's f32 partial sums cross the L2 once per step (32 KB per CTA step at
D = 128), and an XLA epilogue rounds the accumulator to bf16.

Checks: sᵀ, dpᵀ, dv and dk as the dk/dv kernel checks them. dq's check is the dq kernel's, with its
sums accumulated the same way as dq itself: warpgroup 0 adds each query row's dsᵀ·kd (kd: each key
row summed over D, as hi and lo rows of the ``kd`` tile) and warpgroup 1 its |ds|ᵀ·‖k‖₁ (the tile's
third row) to two f32 rows in global memory; the epilogue compares rowsum(dq) with the first and
bounds the difference by ``c_dq`` times the second, exactly the dq kernel's bound. A fault in a
step's dq wgmma changes that step's contribution to rowsum(dq) and not to dsᵀ·kd, so it fails the
same comparison; dq's injected faults (``FlashBwdFaults.dq``) flip the accumulated f32 value before
the check, as the dq kernel flipped its accumulator after the last step.

Measured on an H200 (2026-12-04, ``python -m benchmarks.run --suite peers --peers attention``;
B = 1, T = 8192, 32/8 heads, causal): 8.17 ms with the checks against the two kernels' 4.51, and
3.72 against 3.34 without them, so it is opt-in (``FlashBwdConfig(fused=True)``). Measured: ptxas
spills registers in it (``MOSAIC_GPU_DUMP_PTXAS=1``: 1324 bytes of spill stores with the checks,
440 without; the two kernels' larger one spills 260 and 76), where the dq accumulator (32 registers
per thread) and the dq check's accumulator are live beside dk's and dv's. Taking dk's ds from the
shared tile instead of registers made it slower (4.03 ms without checks; a probe, not kept). Not
measured, likely: the two barriers per step hold both warpgroups in step, where the two kernels'
warpgroups drift apart and one's softmax overlaps the other's GEMMs. FlashAttention-3 schedules the
two warpgroups' GEMMs and softmax in explicit ping-pong and overlaps each step's softmax with the
next GEMMs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ._flash import CS, _flip, _load, _ratio, _stream, _tile_sum
from ._flash_bwd import _K_GEMMS, _QM_ROW, _hilo, _launch, _own_inputs, _scoped, _zeros
from ._vma import typed_like, vary_alike, vary_as

__all__ = ["dkv_call"]


def dkv_call(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    rows,
    tiles,
    flips,
    *,
    causal: bool,
    c: float,
    scale: float,
    checks: bool,
    c_sum,
    cfg,
    fused: bool = False,
    c_dq=0.0,
    redo: tuple | None = None,
):
    """(dq, dk, dv, key-row ratios, dq ratio): dk, dv and the key-row checks, and with ``fused`` dq
    and its check (else None for both). lse2, δ (B, H, T) f32; rows with checks: tol_st, tol_dpt
    (B, KV, S) f32; tiles: qs, dos, qd, dod, qm (fused: then kd); flips: {gemm: (bit, col)} for
    scores_t, dp_t, dv, dk (fused: and dq, flipped on the accumulated dq before its check); c_sum:
    the dv and dk checks' factor (times Σ p·‖do‖₁ and Σ_i Σ |ds|·max ‖q‖₁, measured); c_dq: the dq
    check's (times Σ |ds|·‖k‖₁, measured). ``redo`` (two kernels only): (flags (B, KV,
    S / (2 block_kv)) int32, then refs of dk, dv and the four ratio rows): only flagged CTAs
    run, writing over the refs; returns None."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g, dtype = h // kvh, q.dtype
    bq, bk = cfg.block_q, cfg.block_kv
    nq = t // bq
    stages = cfg.stages
    qn = bq + CS if checks else bq
    n_rows = len(rows)
    names = [n for n in _K_GEMMS if n in flips]
    dh = d // 2  # fused: each warpgroup's half of dq's columns
    n_in = n_rows + 2 * len(names)
    wl, cl = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
    n_t = (6 if fused else 5) if checks else 0
    diag = (2 * bk) // bq  # query blocks that overlap a CTA's keys (causal): the masked ones

    def kernel(refs, scoped):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
        row_refs = refs[6 : 6 + n_rows]
        tile_refs = refs[6 + n_rows : 6 + n_rows + n_t]
        flip_refs = refs[6 + n_rows + n_t : 6 + n_rows + n_t + 2 * len(names)]
        outs_at = 6 + n_rows + n_t + 2 * len(names)
        if fused:  # the accumulators dq and the dq check's rows, updated in place
            dq_ref, cq_ref, mq_ref = refs[outs_at : outs_at + 3]
            outs_at += 3
        dk_ref, dv_ref, *r_refs = refs[outs_at:]
        smem, bars, consumed = scoped
        k2, v2, q_smem, do_smem, qd_smem, dod_smem, qm_smem, lse_smem, dl_smem, rows_f, rows_i = smem[:11]
        q_bar, do_bar, in_bar, row_bar = bars[:4]
        if fused:
            ds_smem, abs_smem, dq_stage, kd_smem, crow = smem[11:]
            ds_bars = bars[4]
        q_done, do_done = consumed
        batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_base = lax.axis_index("kv_seq") * (2 * bk)
        i0 = lax.div(cta_base, jnp.array(bq, jnp.int32)) if causal else 0
        count = nq - i0  # query blocks per head
        steps = g * count

        def block_of(n):  # step -> (query head, query block)
            return kv_head * g + lax.div(n, count), i0 + lax.rem(n, count)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            ks, vs = k2.at[wg], v2.at[wg]
            base = cta_base + wg * bk
            sl = (batch, pl.ds(base, bk), kv_head)
            own = [(k_ref.at[sl], ks), (v_ref.at[sl], vs)]
            if fused and checks:  # both halves' kd tiles: the dq check's wgmma reads all the CTA's keys
                cb = lax.axis_index("kv_seq") * 2
                own += [(tile_refs[5].at[batch, kv_head, cb + j], kd_smem.at[wg, j]) for j in range(2)]
            rv, fl = _own_inputs(
                pl, plgpu, wg, own, in_bar,
                (batch, kv_head, pl.ds(base, bk)), row_refs, flip_refs, names, (rows_f, rows_i, row_bar),
            )  # fmt: skip
            zeros, row0 = _zeros(plgpu, bk)
            if fused:  # ds_bars[1] starts released: the first step's ds needs no earlier dq GEMM done
                plgpu.barrier_arrive(ds_bars.at[1])

            rows_b = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
            cols_b = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])

            def dq_step(w: int, head, i):
                """Warpgroup w's half of the query block's dq (and, with checks, its half of the
                dq check's sums), added to the global accumulators. Static w: the half is a slice."""

                def mm(acc, chk=None):
                    for j in range(2):  # K = the CTA's 2 bk keys, one wgmma per warpgroup's ds tile
                        plgpu.wgmma(acc, ds_smem.at[j].transpose((1, 0)), k2.at[j, :, pl.ds(w * dh, dh)])
                    if checks:
                        src = ds_smem if w == 0 else abs_smem
                        for j in range(2):
                            plgpu.wgmma(chk, src.at[j].transpose((1, 0)), kd_smem.at[w, j].transpose((1, 0)))
                    return acc[...], (chk[...] if checks else None)

                accs = [plgpu.ACC((bq, dh), jnp.float32)] + [plgpu.ACC((bq, CS), jnp.float32)] * checks
                acc, chk = pl.run_scoped(mm, *accs)
                plgpu.barrier_arrive(ds_bars.at[1])  # both GEMMs done: ds may be overwritten
                # The previous step's reduce-adds must have read their staging first.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                dq_stage.at[w][...] = acc
                if checks:
                    crow.at[w][...] = _hilo(plgpu, chk) if w == 0 else _hilo(plgpu, chk, (2,))
                plgpu.commit_smem()
                rs = pl.ds(i * bq, bq)
                plgpu.copy_smem_to_gmem(
                    dq_stage.at[w], dq_ref.at[batch, rs, head, pl.ds(w * dh, dh)], reduction_op="add"
                )
                if checks:
                    dst = cq_ref if w == 0 else mq_ref
                    plgpu.copy_smem_to_gmem(crow.at[w], dst.at[batch, head, rs], reduction_op="add")

            def step(n, carry, masked: bool):
                dk_acc, dv_acc, cc, r_st, r_dpt = carry
                slot = lax.rem(n, jnp.array(stages, n.dtype))
                head, i = block_of(n)
                plgpu.barrier_wait(q_bar.at[slot])
                plgpu.barrier_wait(do_bar.at[slot])

                def gemms(s_ref, p_ref):
                    plgpu.wgmma(s_ref, ks, q_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(p_ref, vs, do_smem.at[slot].transpose((1, 0)))
                    return s_ref[...], p_ref[...]

                st_all, dpt_all = pl.run_scoped(
                    gemms, plgpu.ACC((bk, qn), jnp.float32), plgpu.ACC((bk, qn), jnp.float32)
                )
                st, dpt = st_all[:, :bq], dpt_all[:, :bq]
                q_ids = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=wl) + i * bq
                for name in ("scores_t", "dp_t"):
                    if name in fl:
                        bit, col = fl[name]
                        hit = (q_ids == rows_b(col, (bk, bq))) & (rows_b(bit, (bk, bq)) >= 0)
                        if name == "scores_t":
                            st = _flip(st, rows_b(bit, (bk, bq)), hit)
                        else:
                            dpt = _flip(dpt, rows_b(bit, (bk, bq)), hit)
                if checks:  # as the dq kernel's: the largest |difference|, divided once after the loop
                    r_st = jnp.maximum(r_st, jnp.abs(st.sum(axis=1) - _tile_sum(st_all[:, bq:])))
                    r_dpt = jnp.maximum(r_dpt, jnp.abs(dpt.sum(axis=1) - _tile_sum(dpt_all[:, bq:])))
                lse = _load(plgpu, lse_smem.at[slot], cl)
                dl = _load(plgpu, dl_smem.at[slot], cl)
                p = jnp.exp2(st * c - cols_b(lse, (bk, bq)))
                if masked:
                    k_ids = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 0, layout=wl) + base
                    p = jnp.where(q_ids >= k_ids, p, 0.0)
                p16 = p.astype(dtype)
                ds = p * (dpt - cols_b(dl, (bk, bq)))
                ds16 = ds.astype(dtype)
                if fused:
                    # This step's ds for dq, once both warpgroups' dq GEMMs of the last step read
                    # theirs. (dk's GEMMs take ds from registers: from this tile they ran 0.4 ms
                    # slower in a probe.)
                    plgpu.barrier_wait(ds_bars.at[1])
                    ds_smem.at[wg][...] = ds16
                    if checks:
                        abs_smem.at[wg][...] = jnp.abs(ds16)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ds_bars.at[0])

                def mms(refs):
                    dk_ref_, dv_ref_, c_ref = refs
                    plgpu.wgmma(dv_ref_, p16, do_smem.at[slot, pl.ds(0, bq)])
                    if checks:
                        # [dod hi, dod lo, ‖do‖₁] per query: p·dod for the check, p·‖do‖₁ (p >= 0)
                        # for its bound, in columns 0-2; ds·qd for dk's check in columns 3 and 4.
                        plgpu.wgmma(c_ref, p16, dod_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dk_ref_, ds16, q_smem.at[slot, pl.ds(0, bq)])
                    if checks:
                        plgpu.wgmma(c_ref, ds16, qd_smem.at[slot].transpose((1, 0)))
                        # dk's magnitude, Σ |ds16| times the block's largest ‖q‖₁, in column 5: on
                        # the tensor cores, where the f32 sum of |ds| per step cost a FADD per
                        # element beside the softmax.
                        plgpu.wgmma(c_ref, jnp.abs(ds16), qm_smem.at[slot].transpose((1, 0)))

                init = lambda x: plgpu.ACC.init(x) if x is not None else None
                dk_acc, dv_acc, cc = pl.run_state(mms)((init(dk_acc), init(dv_acc), init(cc)))
                plgpu.barrier_arrive(q_done.at[slot])
                plgpu.barrier_arrive(do_done.at[slot])
                if fused:
                    plgpu.barrier_wait(ds_bars.at[0])
                    for w in range(2):
                        pl.when(wg == w)(functools.partial(dq_step, w, head, i))
                return dk_acc, dv_acc, cc, r_st, r_dpt

            c8 = zeros((bk, CS)) if checks else None
            carry = (zeros((bk, d)), zeros((bk, d)), c8, row0(), row0())

            def head(hh, carry):
                n0 = hh * count
                if causal:
                    carry = lax.fori_loop(n0, n0 + diag, functools.partial(step, masked=True), carry)
                    return lax.fori_loop(n0 + diag, n0 + count, functools.partial(step, masked=False), carry)
                return lax.fori_loop(n0, n0 + count, functools.partial(step, masked=False), carry)

            dk_acc, dv_acc, cc, r_st, r_dpt = lax.fori_loop(0, g, head, carry)
            for name in ("dv", "dk"):
                if name in fl:
                    bit, col = fl[name]
                    d_ids = plgpu.broadcasted_iota(jnp.int32, (bk, d), 1, layout=wl)
                    hit = (d_ids == rows_b(col, (bk, d))) & (rows_b(bit, (bk, d)) >= 0)
                    if name == "dv":
                        dv_acc = _flip(dv_acc, rows_b(bit, (bk, d)), hit)
                    else:
                        dk_acc = _flip(dk_acc, rows_b(bit, (bk, d)), hit)
            outs = []
            if checks:
                r_dv = _ratio(dv_acc.sum(axis=1) - _hilo(plgpu, cc), c_sum * _hilo(plgpu, cc, (2,)))
                mag_k = _hilo(plgpu, cc, (_QM_ROW,))
                r_dk = _ratio(dk_acc.sum(axis=1) - _hilo(plgpu, cc, (3, 4)), c_sum * mag_k)
                outs = [_ratio(r_st, rv[0]), _ratio(r_dpt, rv[1]), r_dv, r_dk]
            if fused:  # the other warpgroup's last dq GEMM reads this one's k rows: wait before staging
                plgpu.barrier_wait(ds_bars.at[1])
            ks[...] = (dk_acc * scale).astype(dtype)
            vs[...] = dv_acc.astype(dtype)
            for i, r in enumerate(outs):
                rows_f.at[wg, i][...] = r
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ks, dk_ref.at[sl])
            plgpu.copy_smem_to_gmem(vs, dv_ref.at[sl])
            for i in range(len(outs)):
                plgpu.copy_smem_to_gmem(rows_f.at[wg, i], r_refs[i].at[batch, kv_head, pl.ds(base, bk)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def loader(x_ref, x_smem, row_ref, row_smem, bar, sums, tiles):
                """Step n's query block of x (q or do) into ``slot``, its per-row f32 input, and with
                the checks its block-sum tile (``sums``) below the block, then ``tiles``: (tile
                input, its smem) pairs; every copy on ``bar``."""

                def load(n, slot):
                    head, i = block_of(n)
                    rs = pl.ds(i * bq, bq)
                    copy = lambda src, dst: plgpu.copy_gmem_to_smem(src, dst, bar.at[slot])
                    copy(x_ref.at[batch, rs, head], x_smem.at[slot, pl.ds(0, bq)])
                    copy(row_ref.at[batch, head, rs], row_smem.at[slot])
                    if checks:
                        copy(sums.at[batch, head, i], x_smem.at[slot, pl.ds(bq, CS)])
                        for src, dst in tiles:
                            copy(src.at[batch, head, i], dst.at[slot])

                return load

            t = tile_refs if checks else [None] * 5
            load_q = loader(q_ref, q_smem, lse_ref, lse_smem, q_bar, t[0], [(t[2], qd_smem), (t[4], qm_smem)])
            load_do = loader(do_ref, do_smem, delta_ref, dl_smem, do_bar, t[1], [(t[3], dod_smem)])
            _stream(pl, plgpu, steps, stages, [(q_done, load_q), (do_done, load_do)])

    def entry(*refs):
        tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((2, bk, d), dtype, transforms=tf),  # k in, dk staged on its way back
            plgpu.SMEM((2, bk, d), dtype, transforms=tf),  # v in, dv staged
            plgpu.SMEM((stages, qn, d), dtype, transforms=tf),
            plgpu.SMEM((stages, qn, d), dtype, transforms=tf),
            plgpu.SMEM((stages, CS, bq), dtype, transforms=tf) if checks else None,
            plgpu.SMEM((stages, CS, bq), dtype, transforms=tf) if checks else None,
            plgpu.SMEM((stages, CS, bq), dtype, transforms=tf) if checks else None,  # qm
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((2, max(n_rows, 4), bk), jnp.float32),
            plgpu.SMEM((2, max(2 * len(names), 1), bk), jnp.int32),
        )
        if fused:
            tf32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
            smem += (
                plgpu.SMEM((2, bk, bq), dtype, transforms=tf),  # each warpgroup's ds (keys x queries)
                plgpu.SMEM((2, bk, bq), dtype, transforms=tf) if checks else None,  # and its |ds|
                plgpu.SMEM((2, bq, dh), jnp.float32, transforms=tf32),  # dq halves on their way out
                plgpu.SMEM((2, 2, CS, bk), dtype, transforms=tf) if checks else None,  # kd per wg, per half
                plgpu.SMEM((2, bq), jnp.float32) if checks else None,  # the dq check's rows
            )
        bars = (  # one arrival per copy: q, lse (+ qs, qd, qm); do, δ (+ dos, dod); k, v (+ kd x 2)
            plgpu.Barrier(num_arrivals=5 if checks else 2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=4 if checks else 2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=4 if fused and checks else 2, num_barriers=2),
            plgpu.Barrier(num_barriers=max(2 * n_in, 1)),
        )
        if fused:  # ds_bars: [0] both warpgroups wrote this step's ds, [1] both dq GEMMs read it
            bars += (plgpu.Barrier(num_arrivals=2, num_barriers=2),)
        _scoped(pl, plgpu, kernel, refs, smem, bars, stages, len(args) if redo else None, "kv_seq")

    kv_shape = jax.ShapeDtypeStruct(k.shape, dtype)
    row = jax.ShapeDtypeStruct((b, kvh, s), jnp.float32)
    flat_flips = [a for n in names for a in flips[n]]
    n_out = 4 if checks else 0  # ratio rows: scores_t, dp_t, dv, dk
    args = (q, k, v, do, lse2, delta, *rows, *tiles, *flat_flips)
    out_type = typed_like([kv_shape, kv_shape] + [row] * n_out, *args)  # inside shard_map: ops._vma
    if redo is not None:
        if fused:
            raise NotImplementedError("pimlayers: the fused backward kernel has no device redo")
        _launch(plgpu, entry, out_type, (kvh, s // (2 * bk), b), "kv_seq", redo)(*args)
        return None
    if not fused:
        launch = _launch(plgpu, entry, out_type, (kvh, s // (2 * bk), b), "kv_seq")
        dk, dv, *rk = vary_as(launch(*args), *args)  # inside shard_map: ops._vma
        return None, dk, dv, rk, None
    # dq and the dq check's two rows are accumulated by reduce-adds: zeroed buffers the kernel
    # updates in place (mutable refs are aliased in and out of a Pallas kernel).
    zeros = (jnp.zeros((b, t, h, d), jnp.float32),) + (jnp.zeros((b, h, t), jnp.float32),) * 2
    _, zeros = vary_alike(args, zeros)  # inside shard_map they vary as the operands do (ops._vma)
    dq_acc, cq, mq = (jax.new_ref(z) for z in zeros)
    mesh = plgpu.Mesh(
        grid=(kvh, s // (2 * bk), b), grid_names=("heads", "kv_seq", "batch"), num_threads=3, thread_name="wg"
    )
    params = plgpu.CompilerParams(approx_math=True)
    launch = pl.kernel(entry, out_type=out_type, mesh=mesh, compiler_params=params)
    dk, dv, *rk = vary_as(launch(*args, dq_acc, cq, mq), *args)
    dq_f = vary_as(dq_acc[...], *args)
    r_dq = None
    if "dq" in flips:  # (B, H, T) sites on the (B, T, H, D) accumulator
        bit, col = (x.transpose(0, 2, 1) for x in flips["dq"])
        hit = (jnp.arange(d, dtype=jnp.int32)[None, None, None, :] == col[..., None]) & (bit >= 0)[..., None]
        dq_f = _flip(dq_f, bit[..., None], hit)
    if checks:
        r_dq = _ratio(jnp.sum(dq_f, axis=-1).transpose(0, 2, 1) - cq[...], c_dq * mq[...])
    return (dq_f * scale).astype(dtype), dk, dv, rk, r_dq
