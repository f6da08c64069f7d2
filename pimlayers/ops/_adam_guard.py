"""adamw_guard_many: AdamW's update of many float32 leaves and the guard of what it writes, in one pass.

Encode on write reads every parameter the optimizer has just written (``bank_guard_many`` after
``optax.apply_updates``: 3.5 GB of float32 for 4 Llama-3-8B layers, ~1.3 ms of an H100's step,
on top of the update's own ~7.9 ms). On CUDA this op is that update with the guard fused into its
write: one kernel per call reads p, g, m, v, writes p', m', v' in place and forms p''s bank checksums,
parity and parity checksums from the values in its registers (``csrc/guard.cu::AdamGuardKernel``).

Per element, in float32, in the order of optax's ``clip_by_global_norm -> adamw -> apply_updates``
under ``pimlayers.optim.fault_aware``::

    g~ = g                          if trigger else (g / norm) * max_norm
    m' = (1 - b1) g~ + b1 m         v' = (1 - b2) g~^2 + b2 v
    u  = step * ((m' / bc1) / (sqrt(v' / bc2 + eps_root) + eps) + wd p)
    skipped: u = 0, m' = m, v' = v  p' = p + u

with the step's scalars in an :class:`AdamHyper` (made by ``pimlayers.optim.adamw_guarded`` from
optax's state). Elsewhere (the CPU, other geometries or dtypes) the reference runs: this expression
in XLA, then ``bank_guard_many`` of the result; on a CPU it is optax's update to the last bit or an
ulp (``tests/test_adam_guard.py``). The kernel rounds every operation on its own (no FMA) and
takes the three divisions by a scalar as products by its reciprocal, as XLA's GPU programs do (with
the divisions kept, a measuring build not in the repo ran 0.3-0.6 ms slower over 4 Llama-3-8B
layers on an H100: docs/gpu-tests.md, fifty-second session); NumPy's float32
arithmetic in that order is its exact twin (``_update_numpy``, ``tests/test_gpu_adam_guard.py``).
XLA's program on a GPU rounds otherwise (it contracts multiply-adds): the two agree within a few
float32 epsilons of the magnitudes each result sums (``_scales``, ``_misfit``), and each one's
guard is exactly that of the parameters it returns. A CPU handler with the kernel's arithmetic answers
``impl="native"`` (so CI runs the kernel's definition and the handlers' checks; the CPU's default
stays the reference, whose arithmetic is optax's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checksum import num_banks
from ._dispatch import dispatch
from ._guard import GuardWithParitySums as Guard3
from ._guard_many import _check, bank_guard_many
from ._parity import num_groups

__all__ = ["AdamHyper", "adamw_guard_many", "adamw_guard_many_reference"]

_MAX_BANK_BYTES = 4096  # the fused kernel's geometry: one 4 KiB chunk per bank,
_MAX_GROUP = 8  # up to 8 banks per parity group (BankGeometry's default is 4096 / 8)


class AdamHyper(NamedTuple):
    """The step's scalars (float32; the native kernel reads them in this order)."""

    trigger: jax.Array  # 1: the gradient's global norm is under max_norm (g used as it is)
    norm: jax.Array  # the gradient's global norm (1 without clipping)
    max_norm: jax.Array
    b1: jax.Array
    one_minus_b1: jax.Array
    b2: jax.Array
    one_minus_b2: jax.Array
    bc1: jax.Array  # 1 - b1^t: the first moment's bias correction at step t
    bc2: jax.Array  # 1 - b2^t
    eps: jax.Array
    eps_root: jax.Array
    wd: jax.Array  # weight decay (decoupled, on every leaf of the call: PimStore splits a mask in two)
    step: jax.Array  # -learning_rate(count): the signed step size
    skip: jax.Array  # 1: the step is skipped (updates zero, moments kept)

    def pack(self) -> jax.Array:
        """float32 (14,): the kernel's operand."""
        return jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in self])


def _update_reference(p, g, m, v, h: AdamHyper):
    """One leaf's update in optax's order of operations (see the module docstring)."""
    g = g.astype(jnp.float32)
    gg = jnp.where(h.trigger != 0, g, (g / h.norm) * h.max_norm)
    m1 = h.one_minus_b1 * gg + h.b1 * m
    v1 = h.one_minus_b2 * (gg * gg) + h.b2 * v
    u = (m1 / h.bc1) / (jnp.sqrt(v1 / h.bc2 + h.eps_root) + h.eps)
    u = h.step * (u + h.wd * p)
    skip = h.skip != 0
    return p + jnp.where(skip, jnp.zeros_like(u), u), jnp.where(skip, m, m1), jnp.where(skip, v, v1)


def _update_numpy(p, g, m, v, h: AdamHyper):
    """The CUDA kernel's arithmetic in NumPy float32, bit for bit (its tests' exact twin; host
    memory, for small leaves): every operation correctly rounded on its own, the divisions by a
    scalar as products by its reciprocal."""
    f = {k: np.float32(np.asarray(x)) for k, x in h._asdict().items()}
    p, g, m, v = (np.asarray(x).astype(np.float32) for x in (p, g, m, v))
    one = np.float32(1)
    gg = g if f["trigger"] != 0 else g * (f["max_norm"] / f["norm"])
    m1 = f["one_minus_b1"] * gg + f["b1"] * m
    v1 = f["one_minus_b2"] * (gg * gg) + f["b2"] * v
    u = (m1 * (one / f["bc1"])) / (np.sqrt(v1 * (one / f["bc2"]) + f["eps_root"]) + f["eps"])
    u = f["step"] * (u + f["wd"] * p)
    if f["skip"] != 0:
        return p + np.float32(0), m, v
    return p + u, m1, v1


def _scales(p, g, m, v, h: AdamHyper):
    """Per element, the magnitude of the terms each result sums (|p| + |u|, |(1-b1) g~| + |b1 m|,
    |(1-b2) g~^2| + |b2 v|): two computations of the update that round differently (the kernel's
    operations one by one, XLA's contracted and with a division by a scalar taken as a product by
    its reciprocal) differ by a few float32 epsilons of these, however much the sum cancels."""
    g = g.astype(jnp.float32)
    gg = jnp.abs(jnp.where(h.trigger != 0, g, (g / h.norm) * h.max_norm))
    m1 = h.one_minus_b1 * gg + h.b1 * jnp.abs(m)
    v1 = h.one_minus_b2 * (gg * gg) + h.b2 * v
    u = jnp.abs(h.step) * ((m1 / h.bc1) / (jnp.sqrt(v1 / h.bc2 + h.eps_root) + h.eps) + h.wd * jnp.abs(p))
    return jnp.abs(p) + u, m1, v1


_AGREE_EPS = 16 * float(np.finfo(np.float32).eps)  # two roundings of the update agree within this


def _misfit(got, want, p, g, m, v, h: AdamHyper) -> jax.Array:
    """float32 (3,): for p', m' and v', how far two computations of the update disagree beyond
    ``_AGREE_EPS`` times the magnitudes each value sums (:func:`_scales`), as the largest ratio of a
    difference to that tolerance where it is exceeded: all zeros where they agree."""
    out = []
    for a, b, s in zip(got, want, _scales(p, g, m, v, h), strict=True):
        err = jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))
        tol = _AGREE_EPS * s
        over = jnp.where(err <= tol, 0.0, err / jnp.maximum(tol, np.finfo(np.float32).tiny))
        out.append(jnp.max(over, initial=0.0))
    return jnp.stack(out)


def adamw_guard_many_reference(
    params, grads, mu, nu, hyper: AdamHyper, bank_bytes: int = 4096, group: int = 8
):
    """Pure-JAX twin: the update in XLA, then ``bank_guard_many`` of the new parameters."""
    h = AdamHyper(*(jnp.asarray(x, jnp.float32) for x in hyper))
    new = [_update_reference(p, g, m, v, h) for p, g, m, v in zip(params, grads, mu, nu, strict=True)]
    ps = tuple(n[0] for n in new)
    guards = bank_guard_many(list(ps), bank_bytes=bank_bytes, group=group)
    return ps, tuple(n[1] for n in new), tuple(n[2] for n in new), guards


def _native(params, grads, mu, nu, packed, bank_bytes: int, group: int):
    n = len(params)
    out, operands, aliases = [], [], {}
    for i, (p, g, m, v) in enumerate(zip(params, grads, mu, nu, strict=True)):
        nb, ng = num_banks(p, bank_bytes), num_groups(p, bank_bytes, group)
        out += [
            jax.ShapeDtypeStruct(p.shape, jnp.float32),
            jax.ShapeDtypeStruct(p.shape, jnp.float32),
            jax.ShapeDtypeStruct(p.shape, jnp.float32),
            jax.ShapeDtypeStruct((nb, 2), jnp.uint32),
            jax.ShapeDtypeStruct((ng, bank_bytes), jnp.uint8),
            jax.ShapeDtypeStruct((ng, 2), jnp.uint32),
        ]
        operands += [p, g, m, v]
        aliases.update({4 * i: 6 * i, 4 * i + 2: 6 * i + 1, 4 * i + 3: 6 * i + 2})  # in place
    call = jax.ffi.ffi_call(
        "pimlayers_adamw_guard_many", out, vmap_method="sequential", input_output_aliases=aliases
    )
    res = call(*operands, packed, bank_bytes=np.int64(bank_bytes), group=np.int64(group))
    pick = lambda k: tuple(res[6 * i + k] for i in range(n))
    guards = tuple(tuple(res[6 * i + 3 : 6 * i + 6]) for i in range(n))
    return pick(0), pick(1), pick(2), guards


def _check_leaves(params, grads, mu, nu) -> None:
    op = "pimlayers.adamw_guard_many"
    for name, t in (("grads", grads), ("mu", mu), ("nu", nu)):
        if not isinstance(t, Sequence) or isinstance(t, str) or len(t) != len(params):
            got = f"{len(t)} arrays" if isinstance(t, Sequence) else type(t).__name__
            raise TypeError(
                f"{op}: {name} is {got}; expected a list of {len(params)} arrays, one per parameter"
            )
    for i, (p, g, m, v) in enumerate(zip(params, grads, mu, nu, strict=True)):
        for name, x in (("params", p), ("grads", g), ("mu", m), ("nu", v)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{op}: {name}[{i}] is a {type(x).__name__}; expected an array")
            if tuple(x.shape) != tuple(p.shape):
                raise ValueError(
                    f"{op}: {name}[{i}] has shape {tuple(x.shape)}; expected params[{i}]'s {tuple(p.shape)}"
                )
        for name, x in (("params", p), ("mu", m), ("nu", v)):
            if x.dtype != jnp.float32:
                raise TypeError(f"{op}: {name}[{i}] is {x.dtype}; expected float32")
        if g.dtype not in (jnp.float32, jnp.bfloat16):
            raise TypeError(f"{op}: grads[{i}] is {g.dtype}; expected float32 or bfloat16")


def adamw_guard_many(
    params: Sequence,
    grads: Sequence,
    mu: Sequence,
    nu: Sequence,
    hyper: AdamHyper,
    *,
    bank_bytes: int = 4096,
    group: int = 8,
    impl: str = "auto",
) -> tuple[tuple, tuple, tuple, tuple[Guard3, ...]]:
    """AdamW's update of every leaf, and ``bank_guard(p', parity_sums=True)`` of each new leaf.

    ``params``, ``mu``, ``nu``: float32 arrays; ``grads``: float32 or bfloat16 of the same shapes
    (a bfloat16 gradient is widened exactly, in the kernel's read); ``hyper``: the step's scalars.
    Returns ``(params', mu', nu', guards)``, each a tuple with one entry per leaf, the guards as
    ``bank_guard_many``'s. Native on CUDA (the leaves updated in place where XLA can donate them)
    for banks of up to 4096 bytes in groups of up to 8; elsewhere the reference (``impl="native"``
    on a CPU: its handler, with the CUDA kernel's arithmetic).
    """
    params, bank_bytes, group = _check("adamw_guard_many", params, bank_bytes, group, impl)
    _check_leaves(params, grads, mu, nu)
    if not isinstance(hyper, AdamHyper):
        raise TypeError(
            f"pimlayers.adamw_guard_many: hyper is a {type(hyper).__name__}; expected an AdamHyper"
        )
    if not params:
        return (), (), (), ()
    grads, mu, nu = list(grads), list(mu), list(nu)
    fits = bank_bytes <= _MAX_BANK_BYTES and group <= _MAX_GROUP
    if impl == "auto" and not fits:
        impl = "reference"
    if impl == "native" and not fits:
        raise ValueError(
            f"pimlayers.adamw_guard_many: bank_bytes={bank_bytes}, group={group}; the native kernel "
            f"takes banks of at most {_MAX_BANK_BYTES} bytes in groups of at most {_MAX_GROUP}"
        )
    n = len(params)

    def native(*a):
        return _native(a[:n], a[n : 2 * n], a[2 * n : 3 * n], a[3 * n : 4 * n], a[4 * n], bank_bytes, group)

    def reference(*a):  # the scalars unpacked from the kernel's operand: the values it reads
        h = AdamHyper(*(a[4 * n][k] for k in range(len(AdamHyper._fields))))
        return adamw_guard_many_reference(
            a[:n], a[n : 2 * n], a[2 * n : 3 * n], a[3 * n : 4 * n], h, bank_bytes, group
        )

    return dispatch(
        "adamw_guard_many",
        impl,
        native,
        reference,
        *params,
        *grads,
        *mu,
        *nu,
        hyper.pack(),
        native_on=("cuda",),
    )
