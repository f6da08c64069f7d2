"""protect() for Flax NNX: swap stock layers for pimlayers ones that hold the same Param variables."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .faults import FaultPolicy
from .flax import nnx as pnnx


def _placeholder(key, shape, dtype):
    del key, shape
    return jnp.zeros((), dtype)  # replaced by the stock layer's own variable right away


def _linear(m: nnx.Linear, policy: FaultPolicy) -> pnnx.Linear:
    new = pnnx.Linear(
        m.in_features, m.out_features, use_bias=m.use_bias, dtype=m.dtype, param_dtype=m.param_dtype,
        precision=m.precision, kernel_init=_placeholder, bias_init=_placeholder, policy=policy,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    new.kernel, new.bias = m.kernel, m.bias
    return new


def _linear_general(m: nnx.LinearGeneral, policy: FaultPolicy) -> pnnx.LinearGeneral | None:
    if m.batch_axis or tuple(m.axis) != tuple(range(-len(m.in_features), 0)):
        return None
    new = pnnx.LinearGeneral(
        m.in_features, m.out_features, axis=m.axis, use_bias=m.use_bias, dtype=m.dtype,
        param_dtype=m.param_dtype, precision=m.precision, kernel_init=lambda k, s, d: jnp.zeros(s, d),
        bias_init=lambda k, s, d: jnp.zeros(s, d), policy=policy, rngs=nnx.Rngs(0),
    )  # fmt: skip
    new.kernel, new.bias = m.kernel, m.bias
    return new


def _rms_norm(m: nnx.RMSNorm, policy: FaultPolicy) -> pnnx.RMSNorm | None:
    if m.reduction_axes not in (-1, (-1,)) or m.feature_axes not in (-1, (-1,)) or m.axis_name is not None:
        return None
    new = pnnx.RMSNorm(
        m.num_features, epsilon=m.epsilon, dtype=m.dtype, param_dtype=m.param_dtype, use_scale=m.use_scale,
        scale_init=_placeholder, policy=policy, rngs=nnx.Rngs(0),
    )  # fmt: skip
    new.scale = m.scale
    return new


_CONVERTERS = {nnx.Linear: _linear, nnx.LinearGeneral: _linear_general, nnx.RMSNorm: _rms_norm}


def _is_attr(obj, part) -> bool:
    return isinstance(part, str) and not isinstance(obj, dict) and hasattr(obj, part)


def _set(root, path, value) -> None:
    parent = root
    for part in path[:-1]:
        parent = getattr(parent, part) if _is_attr(parent, part) else parent[part]
    if _is_attr(parent, path[-1]):
        setattr(parent, path[-1], value)
    else:
        parent[path[-1]] = value


def protect_nnx(model: nnx.Module, policy: FaultPolicy, verbose: bool):
    converted, left = [], []
    for path, node in list(nnx.iter_graph(model)):
        kind = type(node)
        if kind is nnx.MultiHeadAttention:
            node.attention_fn = nnx.data(pnnx.ProtectedAttentionFn(policy))
            converted.append((path, "MultiHeadAttention.attention_fn"))
            continue
        if kind not in _CONVERTERS:
            if (
                isinstance(node, nnx.Module)
                and kind.__module__.startswith("flax.")
                and "Attention" in kind.__name__
            ):
                left.append((path, kind.__name__))
            continue
        new = _CONVERTERS[kind](node, policy)
        if new is None:
            left.append((path, kind.__name__))
            continue
        if not path:
            model = new
        else:
            _set(model, path, new)
        converted.append((path, kind.__name__))
    if verbose:
        for path, name in converted:
            print(f"protect: {'/'.join(map(str, path)) or '<root>'}: {name} -> pimlayers")
        for path, name in left:
            print(f"protect: {'/'.join(map(str, path)) or '<root>'}: {name} left as is (unsupported options)")
    return model
