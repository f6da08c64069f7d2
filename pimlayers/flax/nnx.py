"""Drop-in Flax NNX layers on pimlayers' shared math (``pimlayers.layers``): no arithmetic here.

Each layer takes ``flax.nnx``'s constructor arguments, parameter names, shapes and initialisers,
plus ``policy``. Fault bookkeeping lives in three variable types, so NNX's filters find it:
  FaultReportVar  the last call's FaultReport (forward);   ``fault_report(model)`` sums a model's
  FaultTap        zeros whose gradient is the backward pass's report: differentiate with
                  ``nnx.DiffState(0, (nnx.Param, FaultTap))`` and call ``backward_report(grads)``
  FaultSites      injected faults (tests, demos): ``inject(layer, faults)``; data, so no recompile
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import initializers

from .. import layers as L
from ..faults import FaultPolicy, FaultReport
from ..ops import pim_pack, report_from_tap, zero_tap

__all__ = [
    "Attention",
    "BankHealth",
    "FaultReportVar",
    "FaultSites",
    "FaultTap",
    "Linear",
    "LinearGeneral",
    "LlamaMLP",
    "PimPacked",
    "ProtectedAttentionFn",
    "RMSNorm",
    "backward_report",
    "compute_dtypes",
    "fault_report",
    "inject",
]

default_kernel_init = initializers.lecun_normal()  # flax.nnx.Linear's defaults
default_bias_init = initializers.zeros_init()


def _no_out_sharding(out_sharding) -> None:
    if out_sharding is not None:
        raise ValueError(
            "pimlayers.flax.nnx: out_sharding is not supported by protected layers; shard the parameters "
            "and inputs with NamedSharding and let jit propagate it"
        )


class FaultReportVar(nnx.Variable):
    """The FaultReport of the layer's last call (forward pass)."""


class FaultTap(nnx.Variable):
    """A zero vector threaded into every protected GEMM; its gradient is the backward report."""


class FaultSites(nnx.Variable):
    """Injected GEMM faults (GemmFaults, or a dict of them by GEMM name); None when not injecting."""


class _Protected(nnx.Module):
    """Fault bookkeeping shared by every layer (no arithmetic)."""

    def _init_faults(self, policy: FaultPolicy | None) -> None:
        self.policy = FaultPolicy() if policy is None else policy
        self.fault_report = FaultReportVar(FaultReport.zeros())
        self.fault_tap = FaultTap(zero_tap())
        self.fault_sites = FaultSites(None)

    def _record(self, report: FaultReport) -> None:
        self.fault_report.set_value(report)


class PimPacked(nnx.Variable):
    """The kernel packed for the "pim" backend (bank-major + checksum bank); not a trainable Param."""


class BankHealth(nnx.Variable):
    """int32 per PIM bank: 1 healthy, 0 failed (data: changing it never recompiles)."""


class Linear(_Protected):
    """``flax.nnx.Linear`` with verified GEMMs: kernel (in, out), bias (out,).

    ``backend="pim"`` (an inference backend) also keeps the kernel packed over ``pim_banks`` banks
    plus a checksum bank (`PimPacked`, refreshed by `repack()` after the kernel changes) and a
    `BankHealth` mask; a failed bank's slice of the output is rebuilt from the checksum bank.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        policy: FaultPolicy | None = None,
        backend: str = "xla",
        pim_banks: int = 16,
        rngs: nnx.Rngs,
    ):
        if backend not in ("xla", "pim"):
            raise ValueError(f"pimlayers.flax.nnx.Linear: backend={backend!r}; expected 'xla' or 'pim'")
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = (
            nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else nnx.data(None)
        )
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.backend, self.pim_banks = backend, pim_banks
        if backend == "pim":
            self.pim = PimPacked(pim_pack(self.kernel[...], pim_banks))
            self.bank_ok = BankHealth(jnp.ones((pim_banks,), jnp.int32))
        self._init_faults(policy)

    def repack(self) -> None:
        """Re-pack the kernel for the "pim" backend (encode on write: after every kernel update)."""
        self.pim.set_value(pim_pack(self.kernel[...], self.pim_banks))

    def __call__(self, inputs: jax.Array, out_sharding=None, *, kernel_sharding=None) -> jax.Array:
        """``kernel_sharding`` (a ``jax.sharding.Sharding``, or None to leave it to XLA): the kernel
        pinned to it where it is multiplied (``with_sharding_constraint``; its gradient flows back
        as usual). Replicated, each device multiplies its own rows by the whole kernel, as FSDP
        gathers a weight, and the check reads whole rows of its own tokens: a kernel split over
        its outputs would otherwise have XLA split the product's columns and gather every row to
        every device for the check."""
        _no_out_sharding(out_sharding)
        kernel = self.kernel[...]
        if kernel_sharding is not None:
            kernel = jax.lax.with_sharding_constraint(kernel, kernel_sharding)
        bias = None if self.bias is None else self.bias[...]
        pim = self.pim.get_value() if self.backend == "pim" else None
        bank_ok = self.bank_ok[...] if self.backend == "pim" else None
        y, report = L.linear(
            inputs, kernel, bias, policy=self.policy, dtype=self.dtype, precision=self.precision,
            faults=self.fault_sites.get_value(), tap=self.fault_tap[...], name="pimlayers.flax.nnx.Linear",
            backend=self.backend, pim=pim, bank_ok=bank_ok,
        )  # fmt: skip
        self._record(report)
        return y


class LinearGeneral(_Protected):
    """``flax.nnx.LinearGeneral`` over trailing axes (how MultiHeadAttention uses it), verified:
    contracted axes are flattened into one GEMM, kernel (*in, *out)."""

    def __init__(
        self,
        in_features,
        out_features,
        *,
        axis=-1,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        policy: FaultPolicy | None = None,
        rngs: nnx.Rngs,
    ):
        self.in_features = tuple(np.atleast_1d(in_features).tolist())
        self.out_features = tuple(np.atleast_1d(out_features).tolist())
        axes = tuple(np.atleast_1d(axis).tolist())
        if axes != tuple(range(-len(self.in_features), 0)):
            raise ValueError(
                f"pimlayers.flax.nnx.LinearGeneral: axis={axis} is not supported; only the trailing "
                f"{len(self.in_features)} axes (axis={tuple(range(-len(self.in_features), 0))})"
            )
        n_in, n_out = int(np.prod(self.in_features)), int(np.prod(self.out_features))
        kernel = kernel_init(rngs.params(), (n_in, n_out), param_dtype)  # flax initialises it flat too
        self.kernel = nnx.Param(jnp.reshape(kernel, self.in_features + self.out_features))
        self.bias = (
            nnx.Param(jnp.reshape(bias_init(rngs.params(), (n_out,), param_dtype), self.out_features))
            if use_bias
            else nnx.data(None)
        )
        self.axis, self.use_bias, self.dtype, self.param_dtype = axes, use_bias, dtype, param_dtype
        self.precision = precision
        self._init_faults(policy)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        _no_out_sharding(out_sharding)
        k_in = len(self.in_features)
        if tuple(inputs.shape[-k_in:]) != self.in_features:
            raise ValueError(
                f"pimlayers.flax.nnx.LinearGeneral: input has shape {tuple(inputs.shape)}; expected "
                f"(..., {', '.join(map(str, self.in_features))})"
            )
        lead = inputs.shape[:-k_in]
        kernel = self.kernel[...].reshape(int(np.prod(self.in_features)), -1)
        bias = None if self.bias is None else self.bias[...].reshape(-1)
        y, report = L.linear(
            inputs.reshape(*lead, -1), kernel, bias, policy=self.policy, dtype=self.dtype,
            precision=self.precision, faults=self.fault_sites.get_value(), tap=self.fault_tap[...],
            name="pimlayers.flax.nnx.LinearGeneral",
        )  # fmt: skip
        self._record(report)
        return y.reshape(*lead, *self.out_features)


class RMSNorm(_Protected):
    """``flax.nnx.RMSNorm`` (last axis; scale (features,)) with an insulation gate on its output.

    ``style="llama"`` multiplies in Hugging Face's order (normalise in f32, cast, then scale), for
    checkpoint-exact Llama models; the default is flax.nnx.RMSNorm's."""

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype=None,
        param_dtype=jnp.float32,
        use_scale: bool = True,
        scale_init=initializers.ones,
        policy: FaultPolicy | None = None,
        style: str = "flax",
        rngs: nnx.Rngs,
    ):
        if style not in ("flax", "llama"):
            raise ValueError(f"pimlayers.flax.nnx.RMSNorm: style={style!r}; expected 'flax' or 'llama'")
        self.style = style
        self.scale = (
            nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
            if use_scale
            else nnx.data(None)
        )
        self.num_features, self.epsilon, self.dtype, self.param_dtype = (
            num_features,
            epsilon,
            dtype,
            param_dtype,
        )
        self.use_scale = use_scale
        self._init_faults(policy)

    def __call__(self, x: jax.Array) -> jax.Array:
        L._common.check_features("pimlayers.flax.nnx.RMSNorm", x, self.num_features)
        scale = None if self.scale is None else self.scale[...]
        y, report = L.rms_norm(
            x, scale, eps=self.epsilon, dtype=self.dtype, style=self.style, policy=self.policy,
            name="pimlayers.flax.nnx.RMSNorm",
        )  # fmt: skip
        self._record(report)
        return y


class LlamaMLP(_Protected):
    """Llama's SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(
        self,
        features: int,
        hidden_features: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        policy: FaultPolicy | None = None,
        rngs: nnx.Rngs,
    ):
        kw = dict(
            use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, policy=policy
        )
        self.gate_proj = Linear(features, hidden_features, rngs=rngs, **kw)
        self.up_proj = Linear(features, hidden_features, rngs=rngs, **kw)
        self.down_proj = Linear(hidden_features, features, rngs=rngs, **kw)
        self.dtype = dtype
        self._init_faults(policy)

    def __call__(self, x: jax.Array) -> jax.Array:
        y, report = L.llama_mlp(
            x, self.gate_proj.kernel[...], self.up_proj.kernel[...], self.down_proj.kernel[...],
            policy=self.policy, dtype=self.dtype, faults=self.fault_sites.get_value(),
            tap=self.fault_tap[...], name="pimlayers.flax.nnx.LlamaMLP",
        )  # fmt: skip
        self._record(report)
        return y


class Attention(_Protected):
    """Llama's grouped-query causal attention with RoPE and an optional KV cache.

    Projections ``q_proj`` (E, H·D), ``k_proj``/``v_proj`` (E, KV·D), ``o_proj`` (H·D, E), no biases
    (Hugging Face names). ``__call__(x, positions=None, cache=None)`` returns y, or ``(y, cache)``
    when a :class:`pimlayers.layers.KVCache` is passed.
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None = None,
        *,
        rope_theta: float = 500000.0,
        rope_scaling: L.Llama31Scaling | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        policy: FaultPolicy | None = None,
        flash: bool | None = None,
        rngs: nnx.Rngs,
    ):
        head_dim = features // num_heads if head_dim is None else head_dim
        if num_heads % num_kv_heads:
            raise ValueError(
                f"pimlayers.flax.nnx.Attention: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        kw = dict(
            use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, policy=policy
        )
        self.q_proj = Linear(features, num_heads * head_dim, rngs=rngs, **kw)
        self.k_proj = Linear(features, num_kv_heads * head_dim, rngs=rngs, **kw)
        self.v_proj = Linear(features, num_kv_heads * head_dim, rngs=rngs, **kw)
        self.o_proj = Linear(num_heads * head_dim, features, rngs=rngs, **kw)
        self.features, self.num_heads, self.num_kv_heads, self.head_dim = (
            features,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.rope_theta, self.rope_scaling, self.dtype = rope_theta, rope_scaling, dtype
        self.flash = flash  # layers.attention_core's choice of a flash kernel
        self._init_faults(policy)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, cache: L.KVCache | None = None):
        y, new_cache, report = L.gqa_attention(
            x, self.q_proj.kernel[...], self.k_proj.kernel[...],
            self.v_proj.kernel[...], self.o_proj.kernel[...],
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            inv_freq=L.rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling),
            positions=positions, cache=cache, policy=self.policy, dtype=self.dtype,
            faults=self.fault_sites.get_value(), tap=self.fault_tap[...], flash=self.flash,
            name="pimlayers.flax.nnx.Attention",
        )  # fmt: skip
        self._record(report)
        return y if cache is None else (y, new_cache)


class ProtectedAttentionFn(_Protected):
    """A verified ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` (what ``protect`` installs)."""

    def __init__(self, policy: FaultPolicy | None = None):
        self._init_faults(policy)

    def __call__(self, query, key, value, bias=None, mask=None, *, dropout_rate=0.0, deterministic=True,
                 is_causal=False, dtype=None, **_ignored):  # fmt: skip
        if bias is not None or (dropout_rate > 0 and not deterministic):
            raise ValueError(
                "pimlayers ProtectedAttentionFn: attention bias and dropout are not supported; use "
                "mask= for masking and dropout_rate=0 (or deterministic=True)"
            )
        lead = query.shape[:-3]
        q, k, v = (a.reshape(-1, *a.shape[-3:]) for a in (query, key, value))
        if mask is not None:
            mask = jnp.broadcast_to(mask, (*lead, q.shape[2], q.shape[1], k.shape[1])).reshape(
                -1, q.shape[2], q.shape[1], k.shape[1]
            )
        out, report = L.attention_core(
            q, k, v, q_positions=jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2]),
            causal=is_causal, mask=mask, policy=self.policy, faults=self.fault_sites.get_value(),
            tap=self.fault_tap[...], name="pimlayers.flax.nnx.attention_fn",
        )  # fmt: skip
        self._record(report)
        return out.reshape(*lead, *out.shape[1:])


def fault_report(model: nnx.Module) -> FaultReport:
    """The sum of every layer's last forward report in ``model``."""
    reports = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, FaultReportVar)]
    return FaultReport.sum(reports) if reports else FaultReport.zeros()


def backward_report(grads: tp.Any) -> FaultReport:
    """The backward pass's report, from gradients taken with respect to the FaultTap variables."""
    taps = [v for _, v in nnx.to_flat_state(nnx.state(grads, FaultTap))]
    return FaultReport.sum([report_from_tap(t.get_value()) for t in taps]) if taps else FaultReport.zeros()


def inject(layer: nnx.Module, faults) -> None:
    """Set (or with None, clear) a layer's injected faults: GemmFaults for Linear/LinearGeneral, a
    dict by GEMM name ("gate"/"up"/"down"; "q"/"k"/"v"/"o"/"scores"/"pv") for the composites."""
    if not isinstance(getattr(layer, "fault_sites", None), FaultSites):
        raise TypeError(f"pimlayers.flax.nnx.inject: {type(layer).__name__} is not a pimlayers NNX layer")
    layer.fault_sites.set_value(faults)


def compute_dtypes(model: nnx.Module):
    """The dtype ``model``'s forward pass reads each parameter in, in the structure of
    ``nnx.state(model, nnx.Param)``: a `Linear` or `LinearGeneral` kernel in its layer's ``dtype``
    where one is set (``layers.linear`` promotes it so; a "pim" backend's packed copy excepted),
    every other parameter in its own dtype.

    For ``PimStore.repair(params, state, cast=compute_dtypes(model))``: the scrub's read of the
    weights then also writes their compute copies, which the step multiplies by in place of
    casting each kernel in the forward pass and again where its backward pass rematerialises it.
    """
    kernels = {
        (*path, "kernel"): jnp.dtype(m.dtype)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Linear | LinearGeneral)
        and m.dtype is not None
        and getattr(m, "backend", "xla") == "xla"
    }

    def dtype(path, x):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        return kernels.get(keys, jnp.dtype(x.dtype))

    return jax.tree_util.tree_map_with_path(dtype, nnx.state(model, nnx.Param))
