"""The Equinox adapters: fields and initialisers as in ``equinox.nn``; the math is pimlayers.layers."""

from __future__ import annotations

import math
import typing as tp

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import layers as L
from ..faults import FaultPolicy, FaultReport
from ..ops import pim_pack


def _uniform(key, shape, dtype, lim):
    # equinox.nn.Linear's initialiser: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
    return jax.random.uniform(key, shape, dtype, minval=-lim, maxval=lim)


def _float_dtype(dtype):
    return jnp.float32 if dtype is None else dtype


class Linear(eqx.Module):
    """``equinox.nn.Linear`` with a verified GEMM: weight (out, in), bias (out,).

    ``backend="pim"`` (inference) keeps the weight packed over ``pim_banks`` banks plus a checksum
    bank in ``pim`` and a bank-health mask ``bank_ok`` (int32, 0 = failed); after changing the weight,
    ``layer.repack()`` returns the layer with a fresh packing (encode on write).
    """

    weight: jax.Array
    bias: jax.Array | None
    faults: tp.Any = None  # GemmFaults (or a forward/dx/dw triple) to inject; None: none
    pim: tp.Any = None  # ops.PimWeights for backend "pim"
    bank_ok: jax.Array | None = None
    in_features: int = eqx.field(static=True, default=0)
    out_features: int = eqx.field(static=True, default=0)
    use_bias: bool = eqx.field(static=True, default=True)
    policy: FaultPolicy = eqx.field(static=True, default=None)
    backend: str = eqx.field(static=True, default="xla")

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True, dtype=None, *, key,
                 policy: FaultPolicy | None = None, backend: str = "xla", pim_banks: int = 16):  # fmt: skip
        if backend not in ("xla", "pim"):
            raise ValueError(f"pimlayers.equinox.Linear: backend={backend!r}; expected 'xla' or 'pim'")
        dtype = _float_dtype(dtype)
        wkey, bkey = jax.random.split(key, 2)
        lim = 1.0 if in_features == 0 else 1 / math.sqrt(in_features)
        self.weight = _uniform(wkey, (out_features, in_features), dtype, lim)
        self.bias = _uniform(bkey, (out_features,), dtype, lim) if use_bias else None
        self.faults = None
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.policy = FaultPolicy() if policy is None else policy
        self.backend = backend
        self.pim = pim_pack(self.weight.T, pim_banks) if backend == "pim" else None
        self.bank_ok = jnp.ones((pim_banks,), jnp.int32) if backend == "pim" else None

    def repack(self) -> Linear:
        """This layer with its "pim" packing recomputed from the current weight."""
        banks = self.pim.w.shape[0]
        return eqx.tree_at(lambda m: m.pim, self, pim_pack(self.weight.T, banks))

    def with_report(self, x: jax.Array, *, key=None, tap=None) -> tuple[jax.Array, FaultReport]:
        del key
        if x.ndim != 1:
            raise ValueError(
                f"pimlayers.equinox.Linear: input has shape {tuple(x.shape)}; expected "
                f"({self.in_features},) — Equinox layers take one example: replace `linear(x)` with "
                "`jax.vmap(linear)(x)`"
            )
        return L.linear(
            x, self.weight, self.bias, policy=self.policy, layout="oi", faults=self.faults, tap=tap,
            name="pimlayers.equinox.Linear", backend=self.backend, pim=self.pim, bank_ok=self.bank_ok,
        )  # fmt: skip

    def __call__(self, x: jax.Array, *, key=None) -> jax.Array:
        return self.with_report(x, key=key)[0]


class RMSNorm(eqx.Module):
    """``equinox.nn.RMSNorm`` over a 1-D shape (weight ones, bias zeros), with an insulation gate."""

    weight: jax.Array | None
    bias: jax.Array | None
    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    use_weight: bool = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    policy: FaultPolicy = eqx.field(static=True)

    def __init__(self, shape: int | tuple[int], eps: float = 1e-5, use_weight: bool = True,
                 use_bias: bool = True, dtype=None, *, policy: FaultPolicy | None = None):  # fmt: skip
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(shape) != 1:
            raise ValueError(
                f"pimlayers.equinox.RMSNorm: shape {shape} is not supported; expected one axis (n,)"
            )
        dtype = _float_dtype(dtype)
        self.shape, self.eps, self.use_weight, self.use_bias = shape, eps, use_weight, use_bias
        self.weight = jnp.ones(shape, dtype) if use_weight else None
        self.bias = jnp.zeros(shape, dtype) if use_bias else None
        self.policy = FaultPolicy() if policy is None else policy

    def with_report(self, x: jax.Array, *, key=None) -> tuple[jax.Array, FaultReport]:
        del key
        if x.shape != self.shape:
            raise ValueError(
                f"pimlayers.equinox.RMSNorm: input has shape {tuple(x.shape)}; expected {self.shape} — "
                "replace `rms_norm(x)` with `jax.vmap(rms_norm)(x)`"
            )
        return L.rms_norm(
            x, self.weight, self.bias, eps=self.eps, style="equinox", policy=self.policy,
            name="pimlayers.equinox.RMSNorm",
        )  # fmt: skip

    def __call__(self, x: jax.Array, *, key=None) -> jax.Array:
        return self.with_report(x, key=key)[0]


class LlamaMLP(eqx.Module):
    """Llama's SwiGLU MLP from three bias-free Linears (``gate_proj``, ``up_proj``, ``down_proj``)."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    faults: tp.Any = None  # dict by GEMM name ("gate", "up", "down")
    policy: FaultPolicy = eqx.field(static=True)

    def __init__(
        self, features: int, hidden_features: int, dtype=None, *, key, policy: FaultPolicy | None = None
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate_proj = Linear(features, hidden_features, False, dtype, key=k1, policy=policy)
        self.up_proj = Linear(features, hidden_features, False, dtype, key=k2, policy=policy)
        self.down_proj = Linear(hidden_features, features, False, dtype, key=k3, policy=policy)
        self.faults = None
        self.policy = FaultPolicy() if policy is None else policy

    def with_report(self, x: jax.Array, *, key=None, tap=None) -> tuple[jax.Array, FaultReport]:
        del key
        return L.llama_mlp(
            x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, policy=self.policy,
            layout="oi", faults=self.faults, tap=tap, name="pimlayers.equinox.LlamaMLP",
        )  # fmt: skip

    def __call__(self, x: jax.Array, *, key=None) -> jax.Array:
        return self.with_report(x, key=key)[0]


class Attention(eqx.Module):
    """Llama's grouped-query causal attention with RoPE on one sequence x: (T, E).

    ``with_report(x, positions=None, cache=None)`` returns ``(y, report)``, or ``(y, cache, report)``
    with a KV cache (a :class:`pimlayers.layers.KVCache` of batch 1).
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    faults: tp.Any = None  # dict by GEMM name ("q", "k", "v", "o", "scores", "pv")
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: L.Llama31Scaling | None = eqx.field(static=True)
    policy: FaultPolicy = eqx.field(static=True)
    flash: bool | None = eqx.field(static=True)  # layers.attention_core's choice of a flash kernel

    def __init__(self, features: int, num_heads: int, num_kv_heads: int, head_dim: int | None = None, *,
                 rope_theta: float = 500000.0, rope_scaling: L.Llama31Scaling | None = None, dtype=None, key,
                 policy: FaultPolicy | None = None, flash: bool | None = None):  # fmt: skip
        if num_heads % num_kv_heads:
            raise ValueError(
                f"pimlayers.equinox.Attention: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        hd = features // num_heads if head_dim is None else head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = Linear(features, num_heads * hd, False, dtype, key=kq, policy=policy)
        self.k_proj = Linear(features, num_kv_heads * hd, False, dtype, key=kk, policy=policy)
        self.v_proj = Linear(features, num_kv_heads * hd, False, dtype, key=kv, policy=policy)
        self.o_proj = Linear(num_heads * hd, features, False, dtype, key=ko, policy=policy)
        self.faults = None
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, hd
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.policy = FaultPolicy() if policy is None else policy
        self.flash = flash

    def with_report(
        self, x: jax.Array, positions=None, cache: L.KVCache | None = None, *, key=None, tap=None
    ):
        del key
        if x.ndim != 2:
            raise ValueError(
                f"pimlayers.equinox.Attention: input has shape {tuple(x.shape)}; expected "
                "(tokens, features) — one sequence; use jax.vmap over a batch"
            )
        y, new_cache, report = L.gqa_attention(
            x[None], self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.o_proj.weight,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            inv_freq=L.rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling),
            positions=None if positions is None else positions[None], cache=cache, policy=self.policy,
            layout="oi", faults=self.faults, tap=tap, flash=self.flash, name="pimlayers.equinox.Attention",
        )  # fmt: skip
        return (y[0], report) if cache is None else (y[0], new_cache, report)

    def __call__(self, x: jax.Array, positions=None, cache: L.KVCache | None = None, *, key=None):
        out = self.with_report(x, positions, cache, key=key)
        return out[0] if cache is None else out[:2]
