"""Llama's SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, three verified GEMMs."""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jaxtyping import Array, Float

from ..faults import FaultPolicy, FaultReport
from ._common import policy_or_default
from .linear import linear, linears

__all__ = ["MLP_GEMMS", "llama_mlp"]

MLP_GEMMS = ("gate", "up", "down")


def llama_mlp(
    x: Float[Array, "*b e"],
    w_gate: Float[Array, "e f"],
    w_up: Float[Array, "e f"],
    w_down: Float[Array, "f e"],
    *,
    policy: FaultPolicy | None = None,
    dtype=None,
    precision=None,
    layout: str = "io",
    faults: Mapping[str, object] | None = None,
    tap: jax.Array | None = None,
    name: str = "pimlayers.LlamaMLP",
) -> tuple[Float[Array, "*b e"], FaultReport]:
    """SwiGLU feed-forward without biases, as in Llama; ``(y, report)`` summed over its three GEMMs.

    ``faults`` maps "gate", "up", "down" to GemmFaults (or forward/dx/dw triples) for injection.
    The elementwise product runs in the activations' dtype, as in the reference implementations.
    """
    policy = policy_or_default(policy)
    faults = dict(faults or {})
    unknown = set(faults) - set(MLP_GEMMS)
    if unknown:
        raise ValueError(
            f"{name}: faults for unknown GEMMs {sorted(unknown)}; expected keys among {MLP_GEMMS}"
        )
    kw = dict(policy=policy, dtype=dtype, precision=precision, layout=layout, tap=tap)
    with jax.named_scope(name):
        # gate and up share x: one check GEMM for both (linears).
        (g, u), r12 = linears(
            x,
            (w_gate, w_up),
            faults=(faults.get("gate"), faults.get("up")),
            names=(f"{name}.gate", f"{name}.up"),
            **kw,
        )
        y, r3 = linear(jax.nn.silu(g) * u, w_down, faults=faults.get("down"), name=f"{name}.down", **kw)
    return y, r12 + r3
