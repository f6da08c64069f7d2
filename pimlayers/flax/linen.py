"""Drop-in Flax Linen layers on pimlayers' shared math (``pimlayers.layers``): no arithmetic here.

Parameters live where ``flax.linen`` puts them (``params/kernel``, ``params/bias``, ``params/scale``).
Each call sows its FaultReport into the ``fault_report`` collection (apply with
``mutable=["fault_report"]``; ``fault_report(state)`` sums them). Injected faults are read from an
optional ``fault_sites`` collection (``{"fault_sites": {<module path>: {"gemm": faults}}}``).
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
from flax import linen as nn

from .. import layers as L
from ..faults import FaultPolicy, FaultReport

__all__ = ["Attention", "Dense", "LlamaMLP", "RMSNorm", "fault_report"]

default_kernel_init = nn.initializers.lecun_normal()  # flax.linen.Dense's defaults
default_bias_init = nn.initializers.zeros_init()


def _sow(module: nn.Module, report: FaultReport) -> None:
    # Summed, not appended: a module called twice in one apply reports both calls.
    module.sow("fault_report", "report", report, init_fn=FaultReport.zeros, reduce_fn=lambda a, b: a + b)


def _kernel(module: nn.Module, name: str, shape: tuple[int, ...]) -> jax.Array:
    # A bias-free projection's weight under params/<name>/kernel, where a stock Dense would keep it.
    def init(key, s, dtype):
        return {"kernel": module.kernel_init(key, s, dtype)}

    return module.param(name, init, shape, module.param_dtype)["kernel"]


def _sites(module: nn.Module):
    return module.get_variable("fault_sites", "gemm") if module.has_variable("fault_sites", "gemm") else None


class Dense(nn.Module):
    """``flax.linen.Dense`` with verified GEMMs."""

    features: int
    use_bias: bool = True
    dtype: tp.Any = None
    param_dtype: tp.Any = jnp.float32
    precision: tp.Any = None
    kernel_init: tp.Callable = default_kernel_init
    bias_init: tp.Callable = default_bias_init
    policy: FaultPolicy = FaultPolicy()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        if self.has_variable("params", "kernel"):  # name the layer, not just the parameter
            L._common.check_features(
                "pimlayers.flax.linen.Dense", inputs, self.get_variable("params", "kernel").shape[0]
            )
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        )
        y, report = L.linear(
            inputs, kernel, bias, policy=self.policy, dtype=self.dtype, precision=self.precision,
            faults=_sites(self), name="pimlayers.flax.linen.Dense",
        )  # fmt: skip
        _sow(self, report)
        return y


class RMSNorm(nn.Module):
    """``flax.linen.RMSNorm`` (last axis) with an insulation gate on its output."""

    epsilon: float = 1e-6
    dtype: tp.Any = None
    param_dtype: tp.Any = jnp.float32
    use_scale: bool = True
    scale_init: tp.Callable = nn.initializers.ones
    policy: FaultPolicy = FaultPolicy()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = (
            self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype) if self.use_scale else None
        )
        y, report = L.rms_norm(
            x, scale, eps=self.epsilon, dtype=self.dtype, style="flax", policy=self.policy,
            name="pimlayers.flax.linen.RMSNorm",
        )  # fmt: skip
        _sow(self, report)
        return y


class LlamaMLP(nn.Module):
    """Llama's SwiGLU MLP with params ``gate_proj``/``up_proj``/``down_proj`` (each ``kernel``)."""

    features: int
    hidden_features: int
    dtype: tp.Any = None
    param_dtype: tp.Any = jnp.float32
    kernel_init: tp.Callable = default_kernel_init
    policy: FaultPolicy = FaultPolicy()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        e, f = self.features, self.hidden_features
        kernel = functools.partial(_kernel, self)
        y, report = L.llama_mlp(
            x, kernel("gate_proj", (e, f)), kernel("up_proj", (e, f)), kernel("down_proj", (f, e)),
            policy=self.policy, dtype=self.dtype, faults=_sites(self), name="pimlayers.flax.linen.LlamaMLP",
        )  # fmt: skip
        _sow(self, report)
        return y


class Attention(nn.Module):
    """Llama's grouped-query causal attention with RoPE (params ``q_proj``... each ``kernel``)."""

    features: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 500000.0
    rope_scaling: L.Llama31Scaling | None = None
    dtype: tp.Any = None
    param_dtype: tp.Any = jnp.float32
    kernel_init: tp.Callable = default_kernel_init
    policy: FaultPolicy = FaultPolicy()
    flash: bool | None = None  # layers.attention_core's choice of a flash kernel

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None = None, cache: L.KVCache | None = None):
        hd = self.features // self.num_heads if self.head_dim is None else self.head_dim
        e, h, kv = self.features, self.num_heads, self.num_kv_heads
        kernel = functools.partial(_kernel, self)

        y, new_cache, report = L.gqa_attention(
            x, kernel("q_proj", (e, h * hd)), kernel("k_proj", (e, kv * hd)), kernel("v_proj", (e, kv * hd)),
            kernel("o_proj", (h * hd, e)), num_heads=h, num_kv_heads=kv, head_dim=hd,
            inv_freq=L.rope_frequencies(hd, self.rope_theta, self.rope_scaling), positions=positions,
            cache=cache, policy=self.policy, dtype=self.dtype, faults=_sites(self), flash=self.flash,
            name="pimlayers.flax.linen.Attention",
        )  # fmt: skip
        _sow(self, report)
        return y if cache is None else (y, new_cache)


def fault_report(state: tp.Mapping) -> FaultReport:
    """Sum every report sown in an ``apply(..., mutable=["fault_report"])`` state (or its collection)."""
    tree = state.get("fault_report", state)
    reports = jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, FaultReport))
    return FaultReport.sum(reports) if reports else FaultReport.zeros()
