"""The protected Llama-3 over devices (data + FSDP on 8 CPU devices): no device gathers another's
tokens for the LM head's check, and the split step computes what one device does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama3 import CONFIGS, Llama3
from pimlayers.faults import FaultPolicy
from pimlayers.flax import nnx as pnnx
from train.llama3 import _spec

B, T = 8, 32


@pytest.fixture
def mesh():
    devices = jax.devices("cpu")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((1, len(devices)), ("data", "fsdp"), devices=devices, axis_types=auto)


CHECKED = FaultPolicy(block_n=128)


def _step(mesh, tied: bool, policy: FaultPolicy = CHECKED):
    """The loss and its gradient of a protected tiny Llama-3, parameters split as the training
    script splits them (FSDP: each leaf's largest dimension), the batch over every device."""
    cfg = CONFIGS["llama3_tiny"].replace(tie_embeddings=tied)
    model = Llama3(cfg, policy=policy, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fsdp = mesh.shape["fsdp"]
    params = jax.device_put(params, jax.tree.map(lambda x: NamedSharding(mesh, _spec(x.shape, fsdp)), params))
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)

    def loss(m, toks):
        logits = m(toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))

    def value_and_grad(p, rest, toks, pinned):
        m = nnx.merge(graphdef, p, rest)
        m.activation_sharding = batch if pinned else None
        value, grads = nnx.value_and_grad(loss)(m, toks)
        return value, nnx.state(grads, nnx.Param)

    step = jax.jit(value_and_grad, static_argnums=3)
    return step, (params, rest), jax.device_put(toks, batch), toks, cfg.vocab_size


@pytest.mark.parametrize(
    ("tied", "policy"),
    [(False, CHECKED), (True, CHECKED), (False, FaultPolicy(mode="off", gate=True))],  # gate: rows too
)
def test_the_heads_check_reads_each_devices_own_tokens(mesh, tied, policy):
    step, state, toks, whole, vocab = _step(mesh, tied, policy)
    hlo = step.lower(*state, toks, True).compile().as_text()
    rows = B * T  # the head's rows, flattened
    gathered = [t for t, _ in all_gathers(hlo)]

    def dims(t):
        return tuple(int(d) for d in t[t.index("[") + 1 : -1].split(",") if d)

    # Nothing of the head's product, its checks or its input is gathered: no gathered array has a
    # row per token, nor is it the logits. (The weight is gathered, as FSDP gathers every weight;
    # the embedding's one-hot gradient gathers dy, (B, T, D), as it does without protection.)
    bad = [t for t in gathered if rows in dims(t) or (vocab in dims(t) and B in dims(t))]
    assert bad == [], bad
    # One device's result, to f32 rounding (the split sums in other orders).
    l8, g8 = step(*state, toks, True)
    l1, g1 = step(*jax.device_put((*state, whole), jax.devices("cpu")[0]), False)
    np.testing.assert_allclose(float(l8), float(l1), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)


def test_unpinned_the_protected_head_gathers_the_logits(mesh, monkeypatch):
    """Without the pinned weight (what the model did before) XLA splits the head by the vocabulary
    and gathers every device's logits for the check: the property above could fail."""
    call = pnnx.Linear.__call__
    monkeypatch.setattr(pnnx.Linear, "__call__", lambda self, x, out_sharding=None, **kw: call(self, x))
    step, state, toks, _, vocab = _step(mesh, False)
    gathered = [t for t, _ in all_gathers(step.lower(*state, toks, True).compile().as_text())]
    assert any(f"{B * T},{vocab}]" in t for t in gathered), gathered
