"""Grouped-query causal attention (Llama 3): projections, RoPE, a KV cache, and a verified core.

The core's two products — scores = q·kᵀ and out = p·v — are checked like any GEMM
(:func:`pimlayers.ops.protected_bmm`, checksum columns of k and v encoded on the fly), one GEMM per
(batch, KV head) with that head's query group stacked into its rows. The softmax runs in float32.

On a Hopper GPU, with protection on and the shapes the kernel takes (bf16, queries at the keys'
positions, no mask or partly filled cache; causal self-attention of any length, padded with zero
rows to a multiple of 128 that the causal mask hides), the forward pass instead runs
:func:`pimlayers.ops.flash_attention`: flash attention with both GEMMs' checksums verified inside the
kernel, the scores never materialised; a detected fault reruns the kernel on the blocks of query
rows that failed (by default a device kernel that needs no branch, ``FaultPolicy.recompute_kernel``;
else a loop of 0 or 1 trips over the whole kernel). Its backward pass starts
from the forward's output and logsumexp: the scores are recomputed by one checked GEMM and the
probabilities read off the logsumexp: on a Hopper GPU by the flash backward kernels
(:func:`pimlayers.ops.flash_attention_bwd`, all seven of their GEMMs checked inside them, a
detected fault reruns them, by default on the device over the failing blocks alone), elsewhere
materialised, its GEMMs checked as the materialised path's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int

from ..faults import FaultPolicy, FaultReport, GemmFaults
from ..ops import (
    FlashBwdChecks,
    FlashChecks,
    FlashFaults,
    flash_attention,
    flash_attention_bwd,
    flash_attention_bwd_reference,
    flash_attention_bwd_with_redo,
    flash_attention_bwd_with_redo_reference,
    flash_attention_reference,
    flash_attention_with_redo,
    flash_attention_with_redo_reference,
    flash_bwd_supported,
    flash_supported,
    gate,
    protected_bmm,
    protected_bmm_grads,
    zero_tap,
)
from ..ops._dispatch import compute_device
from ..ops._flash_bwd import bwd_gemms
from ..ops._fused_gemm import hopper
from ..ops._protected_matmul import _to_tap
from ..ops._rows import row_parallel
from ..ops._vma import varies, vary_alike, zero_cotangent
from ._common import check_features, policy_or_default, stock
from .linear import linear, linears
from .rope import apply_rope

__all__ = ["ATTENTION_GEMMS", "FLASH_RESIDUALS", "KVCache", "attention_core", "gqa_attention"]

ATTENTION_GEMMS = ("q", "k", "v", "o", "scores", "pv")

# The name the verified flash forward's output and logsumexp carry, the residuals its backward
# reads beside q, k and v: a rematerialisation policy that saves them
# (``jax.checkpoint_policies.save_only_these_names``) keeps the backward pass from running the
# forward kernel again (q, k and v come back from the saved linear products through RoPE). Per
# layer at T = 8192 with 32 heads: 64 MB of bf16 output and 1 MB of f32 logsumexp.
FLASH_RESIDUALS = "pimlayers.flash_residuals"


class KVCache(NamedTuple):
    """Keys and values of the positions decoded so far; fixed shapes, so decoding never recompiles."""

    k: Float[Array, "b s kv d"]
    v: Float[Array, "b s kv d"]
    index: Int[Array, ""]  # how many positions are filled (the next token's position)

    @staticmethod
    def init(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
        z = jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype)
        return KVCache(z, z, jnp.zeros((), jnp.int32))


def _large_negative(dtype):
    # What jax.nn.dot_product_attention writes into masked logits: finite, so exp() gives exact 0
    # and a masked row never produces inf - inf.
    return jnp.asarray(-0.7 * float(jnp.finfo(dtype).max), dtype)


def attention_core(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    *,
    q_positions: Int[Array, "b t"] | None = None,
    kv_length: Int[Array, ""] | None = None,
    causal: bool = True,
    mask: Bool[Array, "b h t s"] | None = None,
    scale: float | None = None,
    policy: FaultPolicy | None = None,
    faults: Mapping[str, object] | None = None,
    tap: jax.Array | None = None,
    flash: bool | None = None,
    name: str = "pimlayers.attention",
) -> tuple[Float[Array, "b t h d"], FaultReport]:
    """softmax(q·kᵀ·scale + mask)·v with H query heads sharing KV heads in groups of H/KV.

    Key s is visible to query t when ``s <= q_positions[t]`` (causal) and ``s < kv_length`` (a
    partly filled cache) and ``mask`` (broadcastable to (B, H, T, S); True = visible) allows it.
    Default positions: queries are the last T of the S keys.

    ``flash``: None takes the verified flash kernels where they apply (module docstring) and the
    arrays are one device's (a single device, or inside a ``shard_map`` over every mesh axis); False
    never; True requires them (ValueError naming what stands in the way) and, off a Hopper GPU, runs
    the kernels' XLA references through the same checks, recompute and report (for tests). Over
    several devices True runs the kernels on each device's batch rows (``custom_partitioning``: XLA
    cannot partition a Pallas kernel and would gather the operands to every device); tested on
    CPU devices with the references, not yet on several GPUs, hence not the default there. With
    protection off, True runs ``jax.nn.dot_product_attention`` instead (cuDNN's flash attention on
    a GPU, unchecked): a fast unprotected peer; None keeps the stock layer's materialised arithmetic.
    """
    policy = policy_or_default(policy)
    faults = dict(faults or {})
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    if k.shape != (b, s, kvh, d) or v.shape != k.shape:
        raise ValueError(
            f"{name}: q {q.shape}, k {k.shape}, v {v.shape}; expected q (B, T, H, D), k and v (B, S, KV, D)"
        )
    if h % kvh:
        raise ValueError(f"{name}: {h} query heads cannot share {kvh} KV heads; H must be a multiple of KV")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; expected one dtype")
    g = h // kvh
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if flash and not policy.enabled:
        # Protection off: the stock flash attention (cuDNN's kernel on a GPU, XLA's elsewhere).
        why_not = _layout_obstacle(q, k, q_positions, kv_length, mask, causal)
        if why_not:
            raise ValueError(f"{name}: flash=True, but {why_not}")
        with jax.named_scope(name):
            return _unverified_flash(q, k, v, scale, causal, policy)
    why_not = _flash_obstacle(q, k, policy, q_positions, kv_length, mask, causal, faults)
    if flash and why_not:
        raise ValueError(f"{name}: flash=True, but {why_not}")
    if flash or (flash is None and not why_not and hopper() and _per_device()):
        with jax.named_scope(name):
            return _flash_core(q, k, v, faults, tap, scale, causal, policy, not hopper())
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32), (b, t))
    with jax.named_scope(name):
        # Rows of one (batch, KV head) GEMM: its g query heads x T positions.
        qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
        kt = k.transpose(0, 2, 3, 1)  # (B, KV, D, S)
        vv = v.transpose(0, 2, 1, 3)  # (B, KV, S, D)
        if stock(policy):
            logits = jnp.matmul(qg, kt, preferred_element_type=jnp.float32)
            r1 = FaultReport.zeros()
        else:
            logits, r1 = protected_bmm(
                qg, kt, policy=policy, faults=faults.get("scores"), tap=tap, out_dtype=jnp.float32
            )
        logits = logits * jnp.float32(scale)
        key_pos = jnp.arange(s, dtype=jnp.int32)
        qpos = jnp.broadcast_to(q_positions[:, None, None, :], (b, 1, g, t)).reshape(b, 1, g * t, 1)
        visible = jnp.ones((b, 1, g * t, s), bool)
        if causal:
            visible = visible & (key_pos[None, None, None, :] <= qpos)
        if kv_length is not None:
            visible = visible & (key_pos < kv_length)[None, None, None, :]
        if mask is not None:
            grouped = jnp.broadcast_to(mask != 0, (b, h, t, s)).reshape(b, kvh, g * t, s)
            visible = jnp.broadcast_to(visible, grouped.shape) & grouped
        logits = jnp.where(visible, logits, _large_negative(jnp.float32))
        p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        if stock(policy):
            o = jnp.matmul(p, vv, preferred_element_type=jnp.float32).astype(v.dtype)
            r2 = FaultReport.zeros()
        else:
            o, r2 = protected_bmm(p, vv, policy=policy, faults=faults.get("pv"), tap=tap)
        out = o.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out, r1 + r2


def _per_device() -> bool:
    """Whether arrays here are one device's: a single device, or inside shard_map over every axis."""
    if jax.device_count() == 1:
        return True
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(mesh.manual_axes) == set(mesh.axis_names)


def _per_batch(fn, *args):
    """``fn(*args)``, a tuple of arrays, every operand and result with the batch on axis 0 and its
    rows independent. One device's arrays: the plain call. Arrays over several devices: XLA cannot
    partition a Pallas kernel (it would gather every operand to every device), so each device runs
    ``fn`` on its own batch rows (``row_parallel``'s custom_partitioning); a vmapped call's axes are
    folded into the batch."""
    if _per_device():
        return fn(*args)
    n_out = [o.ndim - 1 for o in jax.eval_shape(fn, *args)]

    def folded(*xs):
        lead = xs[0].shape[: xs[0].ndim - args[0].ndim + 1]  # vmapped axes, then the batch
        flat = (x.reshape(-1, *x.shape[len(lead) :]) for x in xs)
        return tuple(o.reshape(*lead, *o.shape[1:]) for o in fn(*flat))

    return row_parallel(folded, [a.ndim - 1 for a in args], n_out)(*args)


def _layout_obstacle(q, k, q_positions, kv_length, mask, causal: bool) -> str:
    """Why a flash kernel cannot take this call's positions and masks ("" when it can)."""
    if q_positions is not None or kv_length is not None or mask is not None:
        return (
            "q_positions, kv_length and mask must be None (queries at the keys' positions, no cache or mask)"
        )
    if causal and q.shape[1] != k.shape[1]:
        return f"causal attention needs T == S here; got T = {q.shape[1]}, S = {k.shape[1]}"
    return ""


def _unverified_flash(q, k, v, scale: float, causal: bool, policy: FaultPolicy):
    """Protection off, flash requested: ``jax.nn.dot_product_attention`` (cuDNN's flash attention on
    a GPU for bf16/f16, XLA's elsewhere), nothing checked; gated if the policy gates."""
    gpu = getattr(compute_device(), "platform", None) == "gpu"
    impl = "cudnn" if gpu and q.dtype in (jnp.bfloat16, jnp.float16) else None
    # jax's own XLA implementation promotes bf16 with f32 internally: allowed here even when a
    # caller runs with strict dtype promotion.
    with jax.numpy_dtype_promotion("standard"):
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation=impl)
    report = FaultReport.zeros()
    if policy.gate:
        out, counts = gate(out, fill=policy.gate_fill, limit=policy.gate_limit)
        report = FaultReport(nonfinite_gated=jnp.sum(counts, dtype=jnp.int32))
    return out, report


_ROWS = 128  # the kernels' sequence multiple: two 64-row query warpgroups, 128-key blocks


def _flash_length(t: int, s: int, causal: bool, faults) -> int:
    """The sequence length the kernels run at: T, or for causal self-attention whose T is not a
    multiple of 128 (and no injected faults: their sites name the unpadded rows) the next multiple.
    The zero rows appended to q, k and v change nothing: every appended key comes after every real
    query, so the causal mask hides it, and the appended queries' rows are dropped (their cotangent
    is zero, so they add nothing to dk and dv either)."""
    if causal and t == s and t % _ROWS and not faults:
        return -(-t // _ROWS) * _ROWS
    return t


def _flash_obstacle(q, k, policy: FaultPolicy, q_positions, kv_length, mask, causal: bool, faults) -> str:
    """Why the verified flash path does not apply ("" when it does)."""
    if not policy.enabled:
        return f"protection is off (mode {policy.mode!r}): the flash kernel's checks are its protection"
    why = _layout_obstacle(q, k, q_positions, kv_length, mask, causal)
    if why:
        return why
    if q.dtype != jnp.bfloat16:
        return f"q has dtype {q.dtype}; the kernel's checksums are bf16"
    b, t, h, d = q.shape
    tp = _flash_length(t, k.shape[1], causal, faults)
    if not flash_supported((b, tp, h, d), (b, k.shape[1] + tp - t, *k.shape[2:]), q.dtype, causal):
        return (
            f"q {q.shape}, k {k.shape} (causal={causal}) are outside the kernel's shapes "
            "(D 64 or 128, T a multiple of 128 and S of 128; causal: T == S, any T without injected faults)"
        )
    return ""


def _split_faults(f) -> tuple[GemmFaults | None, tuple | None]:
    """A GEMM's faults as (forward, backward-only): a tuple's first entry is the forward's."""
    if f is None or isinstance(f, GemmFaults):
        return f, None
    return f[0], (None, *f[1:])


def _flash_faults(scores: GemmFaults | None, pv: GemmFaults | None, b: int, h: int, t: int, kvh: int):
    """The materialised path's fault sites (rows of the (B·KV·g·T, ·) GEMM outputs) as the kernel's
    per-row flips; one site per row and GEMM (a later active site in the same row wins)."""
    if scores is None and pv is None:
        return None
    g = h // kvh
    ff = FlashFaults.none(b, h, t)

    def scatter(bits, cols, f: GemmFaults):
        r = f.rows
        bi, hi, ti = r // (kvh * g * t), (r // (g * t)) % kvh * g + (r // t) % g, r % t
        bi = jnp.where(f.active, bi, b)  # inactive sites fall outside and are dropped
        return (
            bits.at[bi, hi, ti].set(f.bits, mode="drop"),
            cols.at[bi, hi, ti].set(f.cols, mode="drop"),
        )

    sb, sk, ob, oc = ff
    if scores is not None:
        sb, sk = scatter(sb, sk, scores)
    if pv is not None:
        ob, oc = scatter(ob, oc, pv)
    return FlashFaults(sb, sk, ob, oc)


def _run_checked(run, inputs: tuple, faults, groups, n: int, policy: FaultPolicy, gate_first: bool = False):
    """``run(*inputs, faults)`` -> (outputs, checks), its GEMMs checked inside the kernels; ``groups``
    turns the checks into one flag per checked GEMM (True: a row failed). When any failed and the
    policy corrects, the kernels rerun, fault-free (injected faults model transient errors): a loop
    of 0 or 1 trips. ``gate_first`` gates the rerun's first output's non-finite values. Counts are
    per (batch, KV head) GEMM, as ``protected_bmm`` counts the materialised path's."""
    outs, ch = run(*inputs, faults)
    detected = jnp.sum(groups(ch), dtype=jnp.int32)
    if not (policy.corrects and policy.recompute):
        return outs, FaultReport(gemm_checked=n, gemm_detected=detected, gemm_uncorrectable=detected)

    def redo(carry):
        # The barrier keeps XLA from reusing the first call's results: a real rerun.
        outs2, ch2 = run(*lax.optimization_barrier(inputs), None)
        # The counters and the stop flag from the carry's (zeros_like), not constants: inside
        # shard_map they then vary over the mesh axes as the carry does, which the loop requires.
        gated = jnp.zeros_like(carry[2])
        if gate_first and policy.gate:
            first, counts = gate(outs2[0], fill=policy.gate_fill, limit=policy.gate_limit)
            outs2, gated = (first, *outs2[1:]), jnp.sum(counts, dtype=jnp.int32)
        return outs2, jnp.sum(groups(ch2), dtype=jnp.int32), gated, jnp.int32(n), jnp.zeros_like(carry[-1])

    init = (outs, detected, jnp.zeros_like(detected), jnp.int32(0), detected > 0)
    outs, still, gated, recomputed, _ = lax.while_loop(lambda c: c[-1], redo, init)
    report = FaultReport(
        gemm_checked=n,
        gemm_detected=detected,
        gemm_corrected=detected - still,
        gemm_recomputed=recomputed,
        gemm_uncorrectable=still,
        nonfinite_gated=gated,
    )
    return outs, report


def _failing(rows: list, b: int, kvh: int):
    """Per-row ratios (each (B, H, T) or (B, KV, S)) -> (len(rows), B, KV): which GEMM of each
    (batch, KV head) group had a failing row. NaN counts as failing.

    Rows of one shape are reduced together, stacked (the stack fuses into the reduction): one small
    reduction per shape instead of one per GEMM (the attention's "any" reductions were 112 kernels a
    4-layer Llama-3-8B step, 0.20 ms on an H100, profile-sources-s49; this is most of them)."""
    out: list = [None] * len(rows)
    for shape in dict.fromkeys(tuple(r.shape) for r in rows):
        at = [i for i, r in enumerate(rows) if tuple(r.shape) == shape]
        both = jnp.stack([rows[i] for i in at]).reshape(len(at), b, kvh, -1)
        got = jnp.any(~(both <= 1.0), axis=-1)
        for j, i in enumerate(at):
            out[i] = got[j]
    return jnp.stack(out)


def _flash_forward(q, k, v, ff, scale: float, causal: bool, policy: FaultPolicy, reference: bool):
    """The kernel, its checks turned into a FaultReport, and a rerun when any row failed."""
    kernel = flash_attention_reference if reference else flash_attention
    b, kvh = q.shape[0], k.shape[2]

    def run(q, k, v, ff):
        def call(q, k, v, *sites):
            out, lse, ch = kernel(
                q, k, v, FlashFaults(*sites) if sites else None, causal=causal, scale=scale, lam=policy.lam
            )
            return out, lse, *ch

        out, lse, *ch = _per_batch(call, q, k, v, *(ff or ()))
        return (out, lse), FlashChecks(*ch)

    groups = lambda ch: _failing([ch.scores, ch.out], b, kvh)
    if policy.corrects and policy.recompute and _flash_redo_wanted(policy, reference, q):
        return _flash_forward_redo(q, k, v, ff, groups, scale, causal, policy, reference)
    (out, lse), report = _run_checked(run, (q, k, v), ff, groups, 2 * b * kvh, policy, gate_first=True)
    return out, lse, report


def _flash_redo_wanted(policy: FaultPolicy, reference: bool, q) -> bool:
    """Whether the detected rows are redone by the device kernels (``recompute_kernel``: True, or
    None where the Hopper kernels run) rather than by the loop; with ``reference`` (XLA standing in
    for the kernels) the redo's XLA twin, for tests. Inside ``shard_map`` (q varies over a mesh
    axis) the kernels' redo gives way to the loop: it updates the first pass's results through
    refs, and jax 0.11.2 refuses a Mosaic GPU kernel refs that vary over mesh axes ("mpmd_map does
    not support Refs with varying manual axis types")."""
    if not reference and varies(q):
        return False
    return policy.recompute_kernel if policy.recompute_kernel is not None else not reference


def _flash_forward_redo(
    q, k, v, ff, groups, scale: float, causal: bool, policy: FaultPolicy, reference: bool
):
    """The kernel, then the same kernel again over the CTAs whose rows failed a check
    (:func:`pimlayers.ops.flash_attention_with_redo`): no branch, so no host round trip on a GPU
    (the loop costs one per call: on an H100 the core's forward ran at 0.858x of cuDNN's speed with
    the loop, 0.914x with this, 0.928x recomputing nothing, 2026-12-05, peers-s44bwd). A redone row
    is checked again; one that fails again is uncorrectable. The rerun's output values are gated as
    the loop gates them. ``gemm_recomputed`` counts the (batch, KV head) GEMMs with a redone block
    (the loop's counts every GEMM)."""
    b, kvh = q.shape[0], k.shape[2]
    op = flash_attention_with_redo_reference if reference else flash_attention_with_redo
    limit = math.inf if policy.gate_limit is None else policy.gate_limit
    kw = dict(
        causal=causal, scale=scale, lam=policy.lam, gate=(policy.gate_fill, limit) if policy.gate else None
    )

    def call(q, k, v, *sites):
        out, lse, first, final, gated = op(q, k, v, FlashFaults(*sites) if sites else None, **kw)
        return out, lse, *first, *final, gated

    out, lse, s1, o1, s2, o2, gated = _per_batch(call, q, k, v, *(ff or ()))
    first, final = FlashChecks(s1, o1), FlashChecks(s2, o2)
    failed = groups(first)  # (2, B, KV): a group with a failing row is one whose CTAs were redone
    detected = jnp.sum(failed, dtype=jnp.int32)
    still = jnp.sum(groups(final), dtype=jnp.int32)
    redone = jnp.sum(jnp.any(failed, axis=0), dtype=jnp.int32)
    report = FaultReport(
        gemm_checked=2 * b * kvh,
        gemm_detected=detected,
        gemm_corrected=detected - still,
        gemm_recomputed=2 * redone,
        gemm_uncorrectable=still,
        nonfinite_gated=jnp.sum(gated, dtype=jnp.int32),
    )
    return out, lse, report


def _flash_backward(
    q, k, v, out, lse, dout, scale: float, causal: bool, policy: FaultPolicy, faults=None, reference=False
):
    """The verified backward kernels (seven GEMMs per (batch, KV head), checked inside them), their
    checks turned into a FaultReport, and a rerun of both kernels when any row failed. ``faults``
    (FlashBwdFaults) and ``reference`` (XLA standing in for the kernels): for tests."""
    b, kvh = q.shape[0], k.shape[2]
    kernel = flash_attention_bwd_reference if reference else flash_attention_bwd
    gemms = bwd_gemms(q.shape[-1])  # the two kernels' seven GEMMs, or the fused kernel's five

    def run(q, k, v, out, lse, dout, faults):
        leaves, tree = jax.tree.flatten(faults)

        def call(q, k, v, out, lse, dout, *sites):
            f = jax.tree.unflatten(tree, sites)
            dq, dk, dv, ch = kernel(q, k, v, out, lse, dout, f, causal=causal, scale=scale, lam=policy.lam)
            return dq, dk, dv, *(getattr(ch, n) for n in gemms)

        dq, dk, dv, *ch = _per_batch(call, q, k, v, out, lse, dout, *leaves)
        return (dq, dk, dv), dict(zip(gemms, ch, strict=True))

    groups = lambda ch: _failing(list(ch.values()), b, kvh)
    if policy.corrects and policy.recompute and _flash_redo_wanted(policy, reference, q) and len(gemms) == 7:
        return _flash_backward_redo(q, k, v, out, lse, dout, scale, causal, policy, faults, reference)
    return _run_checked(run, (q, k, v, out, lse, dout), faults, groups, len(gemms) * b * kvh, policy)


def _flash_backward_redo(
    q, k, v, out, lse, dout, scale, causal, policy: FaultPolicy, faults, reference: bool
):
    """The two backward kernels, then both again on the device over the CTAs whose rows failed a check
    (:func:`pimlayers.ops.flash_attention_bwd_with_redo`): no branch, so no host round trip. A redone
    row is checked again; one that fails again is uncorrectable. ``gemm_recomputed`` counts the
    (batch, KV head) GEMMs with a redone block: the dq kernel's three, the dk/dv kernel's four."""
    b, kvh = q.shape[0], k.shape[2]
    kernel = flash_attention_bwd_with_redo_reference if reference else flash_attention_bwd_with_redo
    leaves, tree = jax.tree.flatten(faults)

    def call(q, k, v, out, lse, dout, *sites):
        f = jax.tree.unflatten(tree, sites)
        dq, dk, dv, first, final = kernel(
            q, k, v, out, lse, dout, f, causal=causal, scale=scale, lam=policy.lam
        )  # fmt: skip
        return dq, dk, dv, *first, *final

    dq, dk, dv, *ch = _per_batch(call, q, k, v, out, lse, dout, *leaves)
    first, final = FlashBwdChecks(*ch[:7]), FlashBwdChecks(*ch[7:])
    # (7, B, KV), the dq kernel's three GEMMs first: a group with a failing row in a kernel's GEMMs
    # is one whose CTAs that kernel redid.
    failed = _failing(list(first), b, kvh)
    detected = jnp.sum(failed, dtype=jnp.int32)
    still = jnp.sum(_failing(list(final), b, kvh), dtype=jnp.int32)
    redone = lambda f: jnp.sum(jnp.any(f, axis=0), dtype=jnp.int32)
    report = FaultReport(
        gemm_checked=7 * b * kvh,
        gemm_detected=detected,
        gemm_corrected=detected - still,
        gemm_recomputed=3 * redone(failed[:3]) + 4 * redone(failed[3:]),
        gemm_uncorrectable=still,
    )
    return (dq, dk, dv), report


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash_vjp(q, k, v, ff, bwd_faults, tap, scale, causal, policy, reference):
    del bwd_faults, tap
    out, _, report = _flash_forward(q, k, v, ff, scale, causal, policy, reference)
    return out, report


def _flash_vjp_fwd(q, k, v, ff, bwd_faults, tap, scale, causal, policy, reference):
    out, lse, report = _flash_forward(q, k, v, ff, scale, causal, policy, reference)
    out, lse = checkpoint_name(out, FLASH_RESIDUALS), checkpoint_name(lse, FLASH_RESIDUALS)
    return (out, report), (q, k, v, out, lse, ff, bwd_faults)


def _flash_vjp_bwd(scale, causal, policy, reference, res, cts):
    """Attention's backward from the forward's output and logsumexp, every GEMM verified.

    On a Hopper GPU: the flash backward kernels (:func:`pimlayers.ops.flash_attention_bwd`), unless
    backward faults are injected through ``GemmFaults`` (those name the materialised GEMMs' sites).
    Otherwise materialised: the scores are recomputed (one checked GEMM) and the probabilities read
    off the saved logsumexp, p = exp(s·scale - lse), so neither the softmax's reductions nor p·v run
    again (the materialised path's backward recomputes its whole forward); then, as the
    materialised path's own backward: dp = do·vᵀ and dv = pᵀ·do (checked), δ = rowsum(do ∘ out)
    (FlashAttention's identity for rowsum(p ∘ dp)), ds = p ∘ (dp - δ)·scale, dq = ds·k and
    dk = dsᵀ·q (checked). Either way the report of the GEMMs travels as the tap's gradient.
    """
    q, k, v, out, lse, ff, bwd_faults = res
    dout, _ = cts
    zero = lambda tree: jax.tree.map(zero_cotangent, tree)
    if not reference and not bwd_faults and flash_bwd_supported(q.shape, k.shape, q.dtype, causal):
        (dq, dk, dv), report = _flash_backward(q, k, v, out, lse, dout.astype(q.dtype), scale, causal, policy)
        return dq, dk, dv, zero(ff), zero(bwd_faults), _to_tap(report)
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh

    def grouped(x):  # (B, T, H, D) -> (B, KV, g·T, D): one GEMM per (batch, KV head)
        return x.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)

    qg, og, dog = grouped(q), grouped(out), grouped(dout.astype(q.dtype))
    kt = k.transpose(0, 2, 3, 1)  # (B, KV, D, S)
    vv = v.transpose(0, 2, 1, 3)  # (B, KV, S, D)
    sc, r_s = protected_bmm(qg, kt, policy=policy, out_dtype=jnp.float32)
    logits = sc * jnp.float32(scale) - lse.reshape(b, kvh, g * t)[..., None]
    if causal:  # the flash path's queries sit at the keys' positions (T == S)
        qpos = jnp.tile(jnp.arange(t, dtype=jnp.int32), g)[None, None, :, None]
        logits = jnp.where(jnp.arange(s, dtype=jnp.int32)[None, None, None, :] <= qpos, logits, -jnp.inf)
    p = jnp.exp(logits)
    bf = bwd_faults or {}
    dp, dv, r_pv = protected_bmm_grads(p.astype(v.dtype), vv, dog, policy=policy, faults=bf.get("pv"))
    delta = jnp.sum(dog.astype(jnp.float32) * og.astype(jnp.float32), axis=-1, keepdims=True)
    ds = p * (dp.astype(jnp.float32) - delta) * jnp.float32(scale)
    dqg, dkt, r_sc = protected_bmm_grads(qg, kt, ds, policy=policy, faults=bf.get("scores"))
    dq = dqg.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    dk = dkt.transpose(0, 3, 1, 2)  # (B, KV, D, S) -> (B, S, KV, D)
    dv = dv.transpose(0, 2, 1, 3)  # (B, KV, S, D) -> (B, S, KV, D)
    return dq, dk, dv, zero(ff), zero(bwd_faults), _to_tap(r_s + r_pv + r_sc)


_flash_vjp.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def _flash_core(q, k, v, faults, tap, scale: float, causal: bool, policy: FaultPolicy, reference: bool):
    b, t, h, _ = q.shape
    kvh = k.shape[2]
    tp = _flash_length(t, k.shape[1], causal, faults)
    if tp != t:  # causal, ragged, no faults: zero rows appended, their outputs dropped
        pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        out, report = _flash_core(pad(q), pad(k), pad(v), faults, tap, scale, causal, policy, reference)
        return out[:, :t], report
    f_scores, b_scores = _split_faults(faults.get("scores"))
    f_pv, b_pv = _split_faults(faults.get("pv"))
    ff = _flash_faults(f_scores, f_pv, b, h, t, kvh)
    bwd = {name: f for name, f in (("scores", b_scores), ("pv", b_pv)) if f is not None}
    tap = zero_tap() if tap is None else tap
    q, k, v, tap = vary_alike(q, k, v, tap)  # inside shard_map: ops._vma says why
    return _flash_vjp(q, k, v, ff, bwd, tap, scale, causal, policy, reference)


def gqa_attention(
    x: Float[Array, "b t e"],
    wq: Float[Array, "e hd"],
    wk: Float[Array, "e kvd"],
    wv: Float[Array, "e kvd"],
    wo: Float[Array, "hd e"],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inv_freq: np.ndarray | None,
    positions: Int[Array, "b t"] | None = None,
    cache: KVCache | None = None,
    causal: bool = True,
    policy: FaultPolicy | None = None,
    dtype=None,
    precision=None,
    layout: str = "io",
    faults: Mapping[str, object] | None = None,
    tap: jax.Array | None = None,
    flash: bool | None = None,
    name: str = "pimlayers.Attention",
) -> tuple[Float[Array, "b t e"], KVCache | None, FaultReport]:
    """Llama's attention block without biases: ``(y, cache, report)``.

    With a cache, the T new tokens take positions ``cache.index ...`` (or ``positions``), their
    keys and values are written at that offset, and attention runs over the whole (fixed-size)
    cache with the unfilled tail masked: one compiled program serves every decoding step.
    ``inv_freq`` None skips RoPE. Weights are in Flax layout (in, out) unless ``layout="oi"``.
    ``flash``: as for :func:`attention_core` (the core takes the verified flash kernel only without
    a cache or given positions).
    """
    policy = policy_or_default(policy)
    faults = dict(faults or {})
    unknown = set(faults) - set(ATTENTION_GEMMS)
    if unknown:
        raise ValueError(
            f"{name}: faults for unknown GEMMs {sorted(unknown)}; expected keys among {ATTENTION_GEMMS}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    e = wq.shape[0] if layout == "io" else wq.shape[1]
    check_features(name, x, e)
    if x.ndim != 3:
        raise ValueError(f"{name}: input has shape {tuple(x.shape)}; expected (batch, tokens, {e})")
    b, t, _ = x.shape
    kw = dict(policy=policy, dtype=dtype, precision=precision, layout=layout, tap=tap)
    with jax.named_scope(name):
        # q, k and v share x: one check GEMM for the three (linears).
        (q, k, v), rqkv = linears(
            x,
            (wq, wk, wv),
            faults=tuple(faults.get(g) for g in "qkv"),
            names=tuple(f"{name}.{g}" for g in "qkv"),
            **kw,
        )
        q = q.reshape(b, t, num_heads, head_dim)
        k = k.reshape(b, t, num_kv_heads, head_dim)
        v = v.reshape(b, t, num_kv_heads, head_dim)
        start = jnp.zeros((), jnp.int32) if cache is None else cache.index
        # Without a cache or given positions the queries sit at the keys' positions, which is the
        # core's default: it may then take the flash kernel.
        default_positions = positions is None and cache is None
        if positions is None:
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        q_positions = None if default_positions else positions
        if inv_freq is not None:
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        kv_length = None
        if cache is not None:
            if cache.k.shape[0] != b or cache.k.shape[2:] != (num_kv_heads, head_dim):
                raise ValueError(
                    f"{name}: cache holds {tuple(cache.k.shape)}; expected "
                    f"(batch={b}, max_len, {num_kv_heads}, {head_dim})"
                )
            k_all = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, start, 0, 0))
            v_all = lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, start, 0, 0))
            cache = KVCache(k_all, v_all, start + t)
            k, v, kv_length = k_all.astype(q.dtype), v_all.astype(q.dtype), start + t
        o, rc = attention_core(
            q,
            k,
            v,
            q_positions=q_positions,
            kv_length=kv_length,
            causal=causal,
            policy=policy,
            faults=faults,
            tap=tap,
            flash=flash,
            name=f"{name}.core",
        )
        y, ro = linear(
            o.reshape(b, t, num_heads * head_dim), wo, faults=faults.get("o"), name=f"{name}.o", **kw
        )
    return y, cache, rqkv + rc + ro
