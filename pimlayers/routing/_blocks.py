"""Attention of a local query block against one key/value block: the partial results an online
softmax merges, and the matching backward (FlashAttention-2's recurrences, Dao 2023).

Layout: queries grouped by KV head, q5 (B, KV, G, T, D) with G = H / KV query heads per KV head, so
each (batch, KV head) pair is one GEMM whose rows are its G x T queries — the layout
:func:`pimlayers.layers.attention_core` uses. Both GEMMs go through :func:`pimlayers.ops.protected_bmm`
(checksums of k and v encoded on the fly) unless the policy is stock. Scores, the running max and the
running sum stay float32; p and ds are cast to the operand dtype for their GEMMs as flash kernels do.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ..faults import FaultPolicy, FaultReport
from ..layers._common import stock
from ..ops import protected_bmm

NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "minus infinity": exp(NEG - m) is 0, never NaN


def _mm(a, b, policy: FaultPolicy):
    """a @ b with f32 accumulation and output; verified unless the policy is stock."""
    if stock(policy):
        prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jnp.matmul(a, b, preferred_element_type=jnp.float32, precision=prec), FaultReport.zeros()
    return protected_bmm(a, b, policy=policy, out_dtype=jnp.float32)


def _visible(qpos: Int[Array, " t"], kpos: Int[Array, " s"], g: int):
    """(1, 1, G*T, S) causal visibility for rows ordered (g, t)."""
    rows = jnp.tile(qpos, g)
    return (kpos[None, :] <= rows[:, None])[None, None]


def block_forward(
    q5: Float[Array, "b kv g t d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    qpos: Int[Array, " t"],
    kpos: Int[Array, " s"],
    *,
    masked: bool,
    scale: float,
    policy: FaultPolicy,
):
    """Unnormalised output o (f32), row max m and row sum l of one block; rows with no visible key
    give o = 0, m = NEG, l = 0, which the merge treats as "nothing here"."""
    b, kvh, g, t, d = q5.shape
    qg = q5.reshape(b, kvh, g * t, d)
    logits, r1 = _mm(qg, k.transpose(0, 2, 3, 1), policy)
    logits = logits * jnp.float32(scale)
    if masked:
        vis = _visible(qpos, kpos, g)
        logits = jnp.where(vis, logits, NEG)
    m = jnp.max(logits, axis=-1)
    p = jnp.exp(logits - m[..., None])
    if masked:
        p = jnp.where(vis, p, 0.0)
    rowsum = jnp.sum(p, axis=-1)
    o, r2 = _mm(p.astype(v.dtype), v.transpose(0, 2, 1, 3), policy)
    return o.reshape(b, kvh, g, t, d), m.reshape(b, kvh, g, t), rowsum.reshape(b, kvh, g, t), r1 + r2


def block_backward(
    q5: Float[Array, "b kv g t d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    do5: Float[Array, "b kv g t d"],
    lse: Float[Array, "b kv g t"],
    dsum: Float[Array, "b kv g t"],
    qpos: Int[Array, " t"],
    kpos: Int[Array, " s"],
    *,
    masked: bool,
    scale: float,
    policy: FaultPolicy,
):
    """dq5 (f32, this block's share), dk and dv (f32, (B, S, KV, D)) for p = exp(scale q kᵀ - lse)."""
    b, kvh, g, t, d = q5.shape
    dt = q5.dtype
    qg = q5.reshape(b, kvh, g * t, d)
    dog = do5.reshape(b, kvh, g * t, d).astype(dt)
    kt = k.transpose(0, 2, 3, 1)  # (B, KV, D, S)
    vv = v.transpose(0, 2, 1, 3)  # (B, KV, S, D)
    logits, r1 = _mm(qg, kt, policy)
    p = jnp.exp(logits * jnp.float32(scale) - lse.reshape(b, kvh, g * t)[..., None])
    if masked:
        p = jnp.where(_visible(qpos, kpos, g), p, 0.0)
    dv, r2 = _mm(jnp.swapaxes(p, -1, -2).astype(dt), dog, policy)  # (B, KV, S, D): sums the G heads
    dp, r3 = _mm(dog, jnp.swapaxes(vv, -1, -2), policy)
    ds = p * (dp - dsum.reshape(b, kvh, g * t)[..., None]) * jnp.float32(scale)
    dq, r4 = _mm(ds.astype(dt), k.transpose(0, 2, 1, 3), policy)
    dk, r5 = _mm(jnp.swapaxes(ds, -1, -2).astype(dt), qg, policy)
    return (
        dq.reshape(b, kvh, g, t, d),
        dk.transpose(0, 2, 1, 3),
        dv.transpose(0, 2, 1, 3),
        r1 + r2 + r3 + r4 + r5,
    )


def merge(acc, part):
    """Online-softmax merge of two partial results (o, m, l); exact in any order up to rounding."""
    o1, m1, l1 = acc
    o2, m2, l2 = part
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * a1[..., None] + o2 * a2[..., None], m, l1 * a1 + l2 * a2


def empty(q5):
    """The merge's identity for rows shaped like q5."""
    return (
        jnp.zeros(q5.shape, jnp.float32),
        jnp.full(q5.shape[:-1], NEG, jnp.float32),
        jnp.zeros(q5.shape[:-1], jnp.float32),
    )
