"""Test helpers: shapes that are not multiples of any tile, trace counters, random inputs, the
all-gathers of a compiled program, a model's loss-and-gradient jaxpr, AdamW's operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.hlo import collectives
from pimlayers.memory import BankGeometry

RAGGED_SHAPES = [(), (1,), (7,), (129,), (4097,), (0,), (3, 0), (2, 7), (3, 129), (2, 3, 5), (2, 1, 3, 7)]


def random_array(rng: np.random.Generator, shape, dtype) -> jnp.ndarray:
    dt = np.dtype(jnp.dtype(dtype))
    if dt == np.bool_:
        return jnp.asarray(rng.random(shape) < 0.5)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return jnp.asarray(rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 3).astype(dtype)


class TraceCounter:
    """Counts how often a function body is traced (a Python side effect runs once per trace)."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fn(*args, **kwargs)


# 16 banks, 256-byte stripes, groups of 4: small enough that every test leaf spans several groups and
# rows of the address map.
SMALL_GEOMETRY = BankGeometry(
    stacks=2,
    pseudo_channels=2,
    bank_groups=2,
    banks_per_group=2,
    stripe_bytes=256,
    group=4,
    bank_bytes=1 << 20,
)


def jaxpr_eqns(jaxpr, in_backward: bool = False, skip: tuple[str, ...] = ()):
    """Every equation of a jaxpr, nested ones included, each with whether it sits in a
    rematerialised block's backward pass (a ``remat`` equation with ``differentiated`` set).
    ``skip``: primitives whose nested jaxprs are not entered (e.g. ``pallas_call``'s kernel body)."""
    for eqn in jaxpr.eqns:
        yield eqn, in_backward
        if eqn.primitive.name in skip:
            continue
        inner_bwd = in_backward or bool(eqn.params.get("differentiated"))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr itself
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner, inner_bwd, skip)


def host_control_flow(closed_jaxpr) -> dict[str, int]:
    """``cond`` and ``while`` equations anywhere in a jaxpr, nested ones included: on a GPU the
    runtime reads each one's predicate on the host (XLA's default command buffers leave them out),
    so the host waits there and cannot queue further work meanwhile. ``lax.platform_dependent``'s
    conds (``branches_platforms`` set) are left out: lowering picks one branch, none runs as a cond;
    so are a Pallas kernel's own (its body runs on the device, inside one kernel)."""
    counts = {"cond": 0, "while": 0}
    for eqn, _ in jaxpr_eqns(closed_jaxpr.jaxpr, skip=("pallas_call",)):
        if eqn.primitive.name in counts and not eqn.params.get("branches_platforms"):
            counts[eqn.primitive.name] += 1
    return counts


def all_gathers(hlo: str) -> list[tuple[str, bool]]:
    """Every all-gather of a compiled program: (its result type, whether it runs only inside a loop
    or a conditional's branch: ``benchmarks.hlo``)."""
    return [(c.types[0], not c.every_call) for c in collectives(hlo) if c.kind == "all-gather"]


def flash_faults(rows, b: int, h: int, t: int):
    """``ops.FlashFaults`` with the given (site, batch, head, row, bit, key-or-column) flips, site
    "scores" (bit of S at that key) or "out" (bit of the output accumulator at that column)."""
    from pimlayers import ops

    sb, sk, ob, oc = (np.array(a) for a in ops.FlashFaults.none(b, h, t))
    for which, bi, hi, ti, bit, col in rows:
        if which == "scores":
            sb[bi, hi, ti], sk[bi, hi, ti] = bit, col
        else:
            ob[bi, hi, ti], oc[bi, hi, ti] = bit, col
    return ops.FlashFaults(*(jnp.asarray(a) for a in (sb, sk, ob, oc)))


def grad_jaxpr(model, toks):
    """The jaxpr of ``model``'s loss and gradient, built as the training step builds it (merged
    inside the trace, nnx's own grad)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(m):
        logits = m(toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1))

    def step(p, r):
        return nnx.value_and_grad(loss)(nnx.merge(graphdef, p, r))

    return jax.make_jaxpr(step)(params, rest)


# adamw_guard_many's leaves: whole parity groups, ragged ones (a partial last group, a partial last
# bank, a last vector of 1 to 3 values) and a tiny one.
ADAM_SHAPES = [(64, 1024), (1000,), (7, 301), (3,), (4097,)]


def adam_leaves(dev, seed: int, gdtype):
    """(params, grads, mu, nu) lists over ADAM_SHAPES on ``dev``; grads in ``gdtype``."""
    rng = np.random.default_rng(seed)

    def mk(shape, scale):
        return jax.device_put(jnp.asarray(scale * rng.standard_normal(shape), jnp.float32), dev)

    p = [mk(s, 1.0) for s in ADAM_SHAPES]
    g = [mk(s, 0.3).astype(gdtype) for s in ADAM_SHAPES]
    m = [mk(s, 0.01) for s in ADAM_SHAPES]
    v = [jnp.abs(mk(s, 1e-4)) for s in ADAM_SHAPES]
    return p, g, m, v


def adam_hyper(trigger: float = 0.0, skip: float = 0.0):
    """A step's scalars: clipped (norm 7.5 to 1) unless ``trigger``, step 3, decay 0.1."""
    from pimlayers import ops

    vals = dict(trigger=trigger, norm=7.5, max_norm=1.0, b1=0.9, one_minus_b1=0.1, b2=0.999,
                one_minus_b2=1 - 0.999, bc1=1 - 0.9**3, bc2=1 - 0.999**3, eps=1e-8, eps_root=0.0,
                wd=0.1, step=-3e-4, skip=skip)  # fmt: skip
    return ops.AdamHyper(**{k: jnp.float32(x) for k, x in vals.items()})
