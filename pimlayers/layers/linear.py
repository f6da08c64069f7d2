"""Dense / Linear: ``y = x @ kernel + bias``, each GEMM verified per the policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float

from ..faults import FaultPolicy, FaultReport
from ..ops import PimWeights, gate, pim_linear, protected_matmul, protected_matmuls
from ._common import check_features, policy_or_default, promote, stock

__all__ = ["COMPUTE_WEIGHT", "LINEAR_OUTPUT", "linear", "linears"]

# The name every linear layer's product carries (before its bias, protected or not): a
# rematerialisation policy that saves it (``jax.checkpoint_policies.save_only_these_names``) keeps
# the backward pass from recomputing any GEMM, and with it a protected GEMM's checks; what follows a
# GEMM (norms, activations, RoPE, attention) is recomputed from the saved products.
LINEAR_OUTPUT = "pimlayers.linear_output"

# The name a kernel carries once cast to the compute dtype (an f32 parameter promoted to bf16 for the
# GEMM). A rematerialised block recomputes that cast in its backward pass (dx needs the bf16 kernel)
# unless its policy saves it: in the 4-layer Llama-3-8B-dimension step the casts ran twice a step,
# ~1.6 ms of an H100's ~3.2 ms of weight casts (2026-12-06, profile-sources-s49). Saving it costs
# one bf16 copy of the block's kernels held from its forward pass to its backward pass.
COMPUTE_WEIGHT = "pimlayers.compute_weight"


def _named_if_cast(cast, stored):
    """``cast`` named ``COMPUTE_WEIGHT`` where promotion changed the kernel's dtype (a parameter kept
    as it is needs no copy: the block holds it anyway)."""
    return checkpoint_name(cast, COMPUTE_WEIGHT) if cast.dtype != stored.dtype else cast


def linear(
    x: Float[Array, "*b i"],
    kernel: Float[Array, "i o"],
    bias: Float[Array, " o"] | None = None,
    *,
    policy: FaultPolicy | None = None,
    dtype=None,
    precision=None,
    layout: str = "io",
    faults=None,
    tap: jax.Array | None = None,
    name: str = "pimlayers.Linear",
    backend: str = "xla",
    pim: PimWeights | None = None,
    bank_ok: jax.Array | None = None,
) -> tuple[Float[Array, "*b o"], FaultReport]:
    """A dense layer as Flax (``layout="io"``: kernel (in, out)) or Equinox (``"oi"``: weight (out, in),
    ``weight @ x`` on one example) computes it; ``(y, report)``.

    Mode "off" without gates reproduces the stock layer's arithmetic exactly. Otherwise the product
    is a :func:`pimlayers.ops.protected_matmul` (f32 accumulation, checked before rounding to
    ``dtype``) and the bias is added after rounding, as the stock layers add it. ``faults`` and
    ``tap`` reach the protected GEMM (injection for tests and demos; the backward pass's report).

    ``backend="pim"`` runs the product as the banked GEMV of :func:`pimlayers.ops.pim_linear` on
    ``pim`` (the kernel packed by ``ops.pim_pack``; the front ends keep it next to the kernel), with
    ``bank_ok`` (int32 per bank, 0 = failed) as data; an inference backend (no gradient to ``pim``).
    """
    if backend not in ("xla", "pim"):
        raise ValueError(f"{name}: backend={backend!r}; expected 'xla' or 'pim'")
    if layout not in ("io", "oi"):
        raise ValueError(
            f"{name}: layout must be 'io' (Flax kernel) or 'oi' (Equinox weight); got {layout!r}"
        )
    policy = policy_or_default(policy)
    n_in = kernel.shape[0] if layout == "io" else kernel.shape[1]
    check_features(name, x, n_in)
    with jax.named_scope(name):
        if layout == "io":  # Flax promotes inputs, kernel and bias to one dtype first.
            stored = kernel
            x, kernel, bias = promote(x, kernel, bias, dtype=dtype)
            kernel = _named_if_cast(kernel, stored)
        if backend == "pim":
            if pim is None:
                raise ValueError(f"{name}: backend='pim' needs the packed kernel (pim=ops.pim_pack(...))")
            # The packed copy keeps the kernel's storage dtype; the output takes the layer's.
            y, report = pim_linear(x.astype(pim.w.dtype), pim, bank_ok)
            y = y.astype(x.dtype)
            if bias is not None:
                y = y + _row(bias.astype(y.dtype), y.ndim)
            return y, report
        if stock(policy):
            if layout == "io":
                y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
            else:
                y = kernel @ x if x.ndim == 1 else x @ kernel.T
            y = checkpoint_name(y, LINEAR_OUTPUT)
            if bias is not None:
                y = y + _row(bias, y.ndim)
            return y, FaultReport.zeros()
        w = kernel if layout == "io" else kernel.T
        if not policy.enabled:  # mode "off" with gates: plain product, gated below
            y = jnp.matmul(x, w, precision=precision, preferred_element_type=jnp.float32).astype(w.dtype)
            report = FaultReport.zeros()
        else:
            y, report = protected_matmul(x, w, policy=policy, faults=faults, tap=tap, precision=precision)
        y = checkpoint_name(y, LINEAR_OUTPUT)
        if bias is not None:
            y = y + _row(bias.astype(y.dtype), y.ndim)
        if policy.gate and not policy.enabled:
            y, counts = gate(y, fill=policy.gate_fill, limit=policy.gate_limit)
            report = report + FaultReport(nonfinite_gated=jnp.sum(counts, dtype=jnp.int32))
        return y, report


def linears(
    x: Float[Array, "*b i"],
    kernels,
    *,
    policy: FaultPolicy | None = None,
    dtype=None,
    precision=None,
    layout: str = "io",
    faults=None,
    tap: jax.Array | None = None,
    names,
) -> tuple[tuple[Float[Array, "*b o"], ...], FaultReport]:
    """Several bias-free :func:`linear` layers of one input: ``(ys, report)``, each y computed as
    ``linear(x, kernel, ...)`` computes it, the report their sum.

    Where the layers run protected GEMMs (checks on, the XLA backend) they run as one
    :func:`pimlayers.ops.protected_matmuls`, whose checks read x once for every kernel; otherwise
    (mode "off", stock or gated) each is its own ``linear``. ``faults``: None or one entry per
    kernel; ``names``: one per kernel (the layers' named scopes).
    """
    policy = policy_or_default(policy)
    kernels, names = tuple(kernels), tuple(names)
    faults = (None,) * len(kernels) if faults is None else tuple(faults)
    if not (len(kernels) == len(names) == len(faults)) or not kernels:
        raise ValueError(
            f"pimlayers.linears: {len(kernels)} kernels, {len(names)} names and {len(faults)} fault entries; "
            f"expected one name and one fault entry (or None) per kernel"
        )
    mixed = len({jnp.dtype(k.dtype) for k in kernels}) > 1  # each linear promotes its own pair
    if layout not in ("io", "oi") or not policy.enabled or len(kernels) == 1 or mixed:
        kw = dict(policy=policy, dtype=dtype, precision=precision, layout=layout, tap=tap)
        outs = [linear(x, k, faults=f, name=n, **kw) for k, f, n in zip(kernels, faults, names, strict=True)]
        report = outs[0][1]
        for _, r in outs[1:]:
            report = report + r
        return tuple(y for y, _ in outs), report
    for kernel, name in zip(kernels, names, strict=True):
        check_features(name, x, kernel.shape[0] if layout == "io" else kernel.shape[1])
    with jax.named_scope(" + ".join(names)):
        if layout == "io":  # Flax promotes inputs and kernel to one dtype first, as linear does.
            x, *ws = promote(x, *kernels, dtype=dtype)
            ws = [_named_if_cast(w, k) for w, k in zip(ws, kernels, strict=True)]
        else:
            ws = [k.T for k in kernels]
        # Named inside: where the products are one GEMM, that product whole (its slices kept as
        # copies would cost a pass over them each).
        ys, report = protected_matmuls(
            x, ws, policy=policy, faults=faults, tap=tap, precision=precision, checkpoint=LINEAR_OUTPUT
        )
    return ys, report


def _row(bias, ndim: int):
    # Explicit broadcasting, as flax.nnx.Linear writes it (works under rank promotion "raise").
    return jnp.reshape(bias, (1,) * (ndim - 1) + (-1,))
