"""protect() for Equinox: a new pytree whose stock layers are pimlayers ones over the same arrays."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax

from . import equinox as peqx
from .faults import FaultPolicy


def _build(cls, **fields):
    # How Equinox itself rebuilds modules when unflattening: no __init__, every field set directly.
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(obj, f.name, fields[f.name])
    return obj


def _convert(node, policy: FaultPolicy, log: list):
    if type(node) is eqx.nn.Linear and "scalar" not in (node.in_features, node.out_features):
        log.append(("Linear", True))
        return _build(
            peqx.Linear, weight=node.weight, bias=node.bias, faults=None, pim=None, bank_ok=None,
            in_features=node.in_features, out_features=node.out_features, use_bias=node.use_bias,
            policy=policy, backend="xla",
        )  # fmt: skip
    if type(node) is eqx.nn.RMSNorm and len(node.shape) == 1:
        log.append(("RMSNorm", True))
        return _build(
            peqx.RMSNorm, weight=node.weight, bias=node.bias, shape=node.shape, eps=node.eps,
            use_weight=node.use_weight, use_bias=node.use_bias, policy=policy,
        )  # fmt: skip
    log.append((type(node).__name__, False))
    return node


def protect_eqx(model: eqx.Module, policy: FaultPolicy, verbose: bool):
    log: list = []
    out = jax.tree.map(
        lambda n: _convert(n, policy, log) if isinstance(n, (eqx.nn.Linear, eqx.nn.RMSNorm)) else n,
        model,
        is_leaf=lambda n: isinstance(n, (eqx.nn.Linear, eqx.nn.RMSNorm)),
    )
    if verbose:
        for name, done in log:
            print(f"protect: {name} {'-> pimlayers' if done else 'left as is (unsupported options)'}")
    return out
