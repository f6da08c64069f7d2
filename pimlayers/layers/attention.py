"""Grouped-query causal attention (Llama 3): projections, RoPE, a KV cache, and a verified core.

The core's two products — scores = q·kᵀ and out = p·v — are checked like any GEMM
(:func:`pimlayers.ops.protected_bmm`, checksum columns of k and v encoded on the fly), one GEMM per
(batch, KV head) with that head's query group stacked into its rows. The softmax runs in float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ..faults import FaultPolicy, FaultReport
from ..ops import protected_bmm
from ._common import check_features, policy_or_default, stock
from .linear import linear
from .rope import apply_rope

__all__ = ["ATTENTION_GEMMS", "KVCache", "attention_core", "gqa_attention"]

ATTENTION_GEMMS = ("q", "k", "v", "o", "scores", "pv")


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
    name: str = "pimlayers.attention",
) -> tuple[Float[Array, "b t h d"], FaultReport]:
    """softmax(q·kᵀ·scale + mask)·v with H query heads sharing KV heads in groups of H/KV.

    Key s is visible to query t when ``s <= q_positions[t]`` (causal) and ``s < kv_length`` (a
    partly filled cache) and ``mask`` (broadcastable to (B, H, T, S); True = visible) allows it.
    Default positions: queries are the last T of the S keys.
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
    name: str = "pimlayers.Attention",
) -> tuple[Float[Array, "b t e"], KVCache | None, FaultReport]:
    """Llama's attention block without biases: ``(y, cache, report)``.

    With a cache, the T new tokens take positions ``cache.index ...`` (or ``positions``), their
    keys and values are written at that offset, and attention runs over the whole (fixed-size)
    cache with the unfilled tail masked: one compiled program serves every decoding step.
    ``inv_freq`` None skips RoPE. Weights are in Flax layout (in, out) unless ``layout="oi"``.
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
        q, rq = linear(x, wq, faults=faults.get("q"), name=f"{name}.q", **kw)
        k, rk = linear(x, wk, faults=faults.get("k"), name=f"{name}.k", **kw)
        v, rv = linear(x, wv, faults=faults.get("v"), name=f"{name}.v", **kw)
        q = q.reshape(b, t, num_heads, head_dim)
        k = k.reshape(b, t, num_kv_heads, head_dim)
        v = v.reshape(b, t, num_kv_heads, head_dim)
        start = jnp.zeros((), jnp.int32) if cache is None else cache.index
        if positions is None:
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
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
            q_positions=positions,
            kv_length=kv_length,
            causal=causal,
            policy=policy,
            faults=faults,
            tap=tap,
            name=f"{name}.core",
        )
        y, ro = linear(
            o.reshape(b, t, num_heads * head_dim), wo, faults=faults.get("o"), name=f"{name}.o", **kw
        )
    return y, cache, rq + rk + rv + rc + ro
