"""Llama 3 from pimlayers layers: logits equal Hugging Face transformers' LlamaForCausalLM (PyTorch, CPU)
on small random models transformers created and saved; save/load round trip; generation; errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import grad_jaxpr

from models import hf
from models.llama3 import CONFIGS, Llama3, LlamaConfig, generate, get_config
from pimlayers.faults import GemmFaults
from pimlayers.flax import nnx as pnnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_model(tmp_path, *, tied=False, scaling=True, shard="60KB", seed=0):
    kw = dict(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
        tie_word_embeddings=tied,
    )  # fmt: skip
    if scaling:
        kw["rope_scaling"] = dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    path = tmp_path / f"hf-{tied}-{scaling}"
    model.save_pretrained(path, max_shard_size=shard)
    return model, path


def _logits_torch(model, toks):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks))).logits.numpy()


def _logits_ours(model, toks):
    # Jitted: eager, each of the model's ops compiles on its own (~170 compiles per call on the CPU).
    with jax.default_matmul_precision("highest"):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(toks, jnp.int32)))


@pytest.mark.parametrize("tied, scaling", [(False, True), (True, False)])
def test_logits_equal_transformers(tmp_path, tied, scaling):
    ref, path = _hf_model(tmp_path, tied=tied, scaling=scaling)
    if not tied:
        assert (path / "model.safetensors.index.json").exists()  # the sharded layout is exercised
    ours = hf.load_pretrained(path)
    assert ours.cfg.tie_embeddings == tied and (ours.cfg.rope_scaling is not None) == scaling
    toks = np.random.default_rng(1).integers(0, 300, (2, 40))  # past original_max_position: scaling matters
    diff = np.abs(_logits_ours(ours, toks) - _logits_torch(ref, toks)).max()
    assert diff <= 1e-4, diff


def test_save_load_round_trip_through_transformers(tmp_path):
    ref, path = _hf_model(tmp_path)
    ours = hf.load_pretrained(path)
    out = tmp_path / "ours"
    files = hf.save_pretrained(ours, out, max_shard_bytes=40_000)
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    toks = np.random.default_rng(2).integers(0, 300, (1, 12))
    np.testing.assert_array_equal(_logits_torch(back, toks), _logits_torch(ref, toks))
    again = hf.load_pretrained(out)
    np.testing.assert_array_equal(_logits_ours(again, toks), _logits_ours(ours, toks))


def test_greedy_generation_equals_transformers_and_sampling_is_seeded(tmp_path):
    ref, path = _hf_model(tmp_path, scaling=False)
    ours = hf.load_pretrained(path)
    prompt = np.random.default_rng(3).integers(0, 300, (2, 5))
    with jax.default_matmul_precision("highest"):
        got = np.asarray(generate(ours, prompt, 8))
    with torch.no_grad():
        want = ref.generate(
            torch.tensor(prompt), attention_mask=torch.ones(2, 5, dtype=torch.long), max_new_tokens=8,
            do_sample=False, pad_token_id=0,
        ).numpy()  # fmt: skip
    np.testing.assert_array_equal(got, want)
    a = generate(ours, prompt, 6, temperature=0.8, top_k=5, key=jax.random.key(7))
    b = generate(ours, prompt, 6, temperature=0.8, top_k=5, key=jax.random.key(7))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 11) and int(a.min()) >= 0 and int(a.max()) < 300
    np.testing.assert_array_equal(a[:, :5], prompt)
    with pytest.raises(ValueError, match="needs key"):
        generate(ours, prompt, 2, temperature=1.0)
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        generate(ours, prompt, 500)


def test_bad_checkpoints_give_clear_errors(tmp_path):
    _, path = _hf_model(tmp_path, shard="10GB")
    st = path / "model.safetensors"
    data = st.read_bytes()
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        hf.load_pretrained(tmp_path / "trunc")
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(ValueError, match="too short"):
        hf.load_pretrained(tmp_path / "trunc")
    bad = bytearray(data)
    bad[8:40] = b"\xff" * 32
    (tmp_path / "trunc" / "model.safetensors").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="corrupted"):
        hf.load_pretrained(tmp_path / "trunc")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="does not match the given config"):
        hf.load_pretrained(path, config=hf.config_from_hf(cfg).replace(n_layers=3))
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "model.safetensors").write_bytes(data)
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        hf.load_pretrained(tmp_path / "wrong")
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(
        ValueError, match=r"mlp\.gate_proj\.weight has shape \(160, 64\); the config implies \(128, 64\)"
    ):
        hf.load_pretrained(tmp_path / "wrong")
    with pytest.raises(ValueError, match="model_type"):
        hf.config_from_hf({**cfg, "model_type": "mistral"})
    with pytest.raises(ValueError, match=r"no config\.json"):
        hf.load_pretrained(tmp_path)


def test_configs():
    c = CONFIGS["llama3_8b"]
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim) == (
        128256,
        4096,
        32,
        32,
        8,
        14336,
    )
    assert (c.rope_theta, c.norm_eps, c.hd) == (500000.0, 1e-5, 128)
    assert c.num_params() == 8_030_261_248  # Meta's Llama 3 8B
    assert CONFIGS["llama3_1_8b"].rope_scaling.factor == 8.0
    assert get_config("llama3_tiny", n_layers=3).n_layers == 3
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        LlamaConfig(n_heads=6, n_kv_heads=4, dim=48)
    with pytest.raises(ValueError, match="unknown config"):
        get_config("llama2")
    with pytest.raises(ValueError, match="tokens are"):
        Llama3(CONFIGS["llama3_tiny"], rngs=nnx.Rngs(0))(jnp.zeros((2, 3)))


def test_faults_in_the_model_are_corrected_and_counted():
    cfg = CONFIGS["llama3_tiny"]
    model = Llama3(cfg, rngs=nnx.Rngs(0))
    toks = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    fwd = nnx.jit(lambda m, t: m(t))
    clean = fwd(model, toks)
    rep = pnnx.fault_report(model)
    # Per block: q, k, v, o, scores, p·v (one GEMM per batch and KV head each) and 3 MLP GEMMs; + head.
    assert int(rep.gemm_checked) > 0 and int(rep.gemm_detected) == 0
    mlp = model.layers[1].mlp
    pnnx.inject(mlp, {"up": GemmFaults.random(jax.random.key(1), (32, cfg.ffn_dim), sites=3, bit=28)})
    faulty = fwd(model, toks)
    rep = pnnx.fault_report(model)
    assert int(rep.gemm_detected) >= 1 and int(rep.gemm_uncorrectable) == 0
    np.testing.assert_allclose(faulty, clean, atol=1e-5)


@pytest.mark.slow
def test_remat_and_bf16_train_step():
    cfg = get_config("llama3_tiny", n_layers=1)
    toks = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)

    def loss_of(model):
        logits = model(toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1))

    plain = Llama3(cfg, rngs=nnx.Rngs(0))
    step = nnx.jit(nnx.value_and_grad(loss_of))
    l1, g1 = step(plain)
    for how in (True, "gemms"):  # recompute everything; keep the GEMMs' products (see below)
        l2, g2 = step(Llama3(cfg, remat=how, rngs=nnx.Rngs(0)))
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        for a, b in zip(
            jax.tree.leaves(nnx.state(g1, nnx.Param)), jax.tree.leaves(nnx.state(g2, nnx.Param)), strict=True
        ):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert abs(float(l1) - np.log(cfg.vocab_size)) < 0.5  # an untrained model is near uniform
    half = Llama3(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    lb = nnx.jit(loss_of)(half)
    assert lb.dtype == jnp.float32 and abs(float(lb) - float(l1)) < 0.1


def test_without_recompute_the_training_gradient_has_no_loop_or_branch():
    # FaultPolicy(recompute=False) corrects what the checks locate and leaves the rest to the
    # optimizer's skip: no GEMM or attention call keeps a loop whose predicate a GPU's host must read.
    from helpers import host_control_flow

    from pimlayers.faults import FaultPolicy

    cfg = get_config("llama3_tiny", n_layers=1)
    toks = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    flow = lambda policy: host_control_flow(
        grad_jaxpr(Llama3(cfg, policy=policy, remat=True, rngs=nnx.Rngs(0)), toks)
    )
    assert flow(FaultPolicy())["while"] > 0  # the default recomputes in loops of 0 or 1 trips
    assert flow(FaultPolicy(recompute=False)) == {"cond": 0, "while": 0}


def test_remat_saving_gemm_outputs_recomputes_no_gemm():
    from helpers import jaxpr_eqns

    from pimlayers.faults import FaultPolicy

    cfg = get_config("llama3_tiny", n_layers=1)
    toks = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)

    def saved(policy) -> int:  # dot products the backward no longer reruns with remat="gemms"
        def dots(remat):
            jaxpr = grad_jaxpr(Llama3(cfg, policy=policy, remat=remat, rngs=nnx.Rngs(0)), toks).jaxpr
            return sum(bwd and e.primitive.name == "dot_general" for e, bwd in jaxpr_eqns(jaxpr))

        return dots(True) - dots("gemms")

    # Of each block's GEMMs the backward needs the products of q, k, v, gate and up (attention and
    # the activation's derivative): full remat recomputes them, "gemms" kept them; protected, the
    # GEMMs' checks are not rerun either.
    plain = saved(FaultPolicy.off())
    assert plain >= 5 * cfg.n_layers and saved(FaultPolicy()) > plain
    with pytest.raises(ValueError, match="remat='dots'"):
        Llama3(cfg, remat="dots", rngs=nnx.Rngs(0))


def test_remat_keeps_the_merged_qkv_product_whole():
    # Where q, k and v are one protected product (32-column blocks dividing 64, 32 and 32; 64 tokens
    # against K = 64 make x's gradient one GEMM), "gemms" keeps that product whole, one (1, 64, 128)
    # array a block, not its slices as copies, and the backward still reruns no dot of them.
    from helpers import jaxpr_eqns

    from pimlayers.faults import FaultPolicy
    from pimlayers.layers import LINEAR_OUTPUT

    cfg = get_config("llama3_tiny", n_layers=1)
    toks = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 33)), jnp.int32)
    policy = FaultPolicy(block_n=32)
    jaxpr = grad_jaxpr(Llama3(cfg, policy=policy, remat="gemms", rngs=nnx.Rngs(0)), toks).jaxpr
    kept = [
        e.outvars[0].aval.shape
        for e, _ in jaxpr_eqns(jaxpr)
        if e.primitive.name == "name" and e.params.get("name") == LINEAR_OUTPUT
    ]
    # (x's products as protected_matmuls forms them, (1, tokens, N): q/k/v merged, gate, up)
    assert sorted(s for s in kept if s[0] == 1) == [(1, 64, 128), (1, 64, 160), (1, 64, 160)]
    dots = lambda remat: sum(
        bwd and e.primitive.name == "dot_general"
        for e, bwd in jaxpr_eqns(
            grad_jaxpr(Llama3(cfg, policy=policy, remat=remat, rngs=nnx.Rngs(0)), toks).jaxpr
        )
    )
    assert dots(True) - dots("gemms") >= 4  # the merged q/k/v product, gate, up, and their checks


def test_gemms_policy_keeps_cudnn_attention_forward_outputs():
    # jax names none of cuDNN attention's residuals: "gemms" keeps them by their primitive (the GPU
    # test, tests/test_gpu_remat.py, counts the forward kernels in the gradient), and nothing else.
    from jax.extend.core import Primitive

    from models.llama3 import REMAT_POLICIES

    keep = REMAT_POLICIES["gemms"]
    assert keep(Primitive("dot_product_attention_fwd_wrapper")) is True
    for other in ("dot_product_attention_bwd_wrapper", "dot_general", "exp", "custom_vjp_call"):
        assert keep(Primitive(other)) is False


def test_remat_saving_gemms_and_flash_residuals_recomputes_nothing_the_flash_step_multiplies():
    # The protected step's attention on the GPU is the verified flash kernel (here its XLA
    # references through the same custom VJP): "gemms" also keeps its output and logsumexp
    # (layers.FLASH_RESIDUALS), so the rematerialised gradient runs exactly the dot products and
    # exponentials of the gradient without rematerialisation (the forward kernel is not rerun), and
    # gives the same loss and gradients.
    from helpers import jaxpr_eqns

    from pimlayers.faults import FaultPolicy

    cfg = get_config("llama3_tiny", n_layers=1, dim=128, n_heads=2, n_kv_heads=1, ffn_dim=256)
    toks = jnp.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 129)), jnp.int32)

    def model(remat):  # head dim 64, T = 128: shapes the flash kernels take
        kw = dict(dtype=jnp.bfloat16, policy=FaultPolicy(recompute=False), flash=True)
        return Llama3(cfg, remat=remat, rngs=nnx.Rngs(0), **kw)

    def ops(remat) -> dict[str, int]:
        eqns = [e.primitive.name for e, _ in jaxpr_eqns(grad_jaxpr(model(remat), toks).jaxpr)]
        return {name: eqns.count(name) for name in ("dot_general", "exp")}

    assert ops("gemms") == ops(False)  # without the names: 5 more dots and 1 more exp per block

    def loss_of(m):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(m(toks[:, :-1])), toks[:, 1:, None], axis=-1))

    step = nnx.jit(nnx.value_and_grad(loss_of))
    (l0, g0), (l1, g1) = step(model(False)), step(model("gemms"))
    assert float(l0) == float(l1)
    # bf16 compute: a rematerialised gradient is not bit-identical (XLA fuses the recomputed parts
    # differently); both full remat and "gemms" stayed within ~1% of each leaf's largest entry.
    # Stale or wrong saved residuals would be off by the gradient's own size.
    g0, g1 = nnx.state(g0, nnx.Param), nnx.state(g1, nnx.Param)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 2.0**-5 * np.max(np.abs(a))


@pytest.mark.parametrize("vocab", [256, 4096])
def test_embedding_gradient_is_a_one_hot_gemm_for_small_vocabularies(vocab):
    # Up to ONE_HOT_MAX_VOCAB rows the gradient is one_hot(tokens)ᵀ @ dy accumulated in f32
    # (no scatter-add); above it, a scatter-add in f32. Both equal the exact sum per row to f32
    # rounding, where nnx.Embed's gradient (a scatter-add in the compute dtype) is ~1e-2 off in bf16.
    from helpers import jaxpr_eqns

    from models.llama3 import ONE_HOT_MAX_VOCAB, embed_lookup

    rng = np.random.default_rng(9)
    table = jnp.asarray(rng.normal(size=(vocab, 64)), jnp.float32)
    # A skewed draw (most tokens in a few rows) and one token past the table (gets no gradient).
    toks = jnp.asarray(np.append(rng.zipf(1.5, 255) % vocab, vocab).reshape(2, 128), jnp.int32)
    dy = jnp.asarray(rng.normal(size=(2, 128, 64)), jnp.bfloat16)

    def grad(dtype, t=table):
        y, vjp = jax.vjp(lambda t: embed_lookup(t, toks, dtype), t)
        return y, vjp(dy.astype(dtype))[0]

    want = np.zeros((vocab, 64))
    np.add.at(want, np.asarray(toks).ravel()[:-1], np.asarray(dy, np.float64).reshape(-1, 64)[:-1])
    for dtype in (jnp.float32, jnp.bfloat16):
        y, g = grad(dtype)
        assert y.dtype == dtype and g.dtype == jnp.float32
        gathered = jnp.take(table.astype(dtype), toks, axis=0)  # NaN for the token past the table
        assert np.array_equal(np.asarray(y, np.float32), np.asarray(gathered, np.float32), equal_nan=True)
        np.testing.assert_allclose(np.asarray(g), want, atol=1e-5 * np.abs(want).max())
    jaxpr = jax.make_jaxpr(lambda t: grad(jnp.bfloat16, t)[1])(table).jaxpr
    prims = [e.primitive.name for e, _ in jaxpr_eqns(jaxpr)]
    assert ("scatter-add" in prims) == (vocab > ONE_HOT_MAX_VOCAB)


def test_gemms_weights_policy_casts_each_kernel_once():
    # "gemms" keeps the products but casts each f32 kernel to bf16 again in the backward pass (dx
    # needs it); "gemms_weights" keeps the cast kernels (layers.COMPUTE_WEIGHT): one cast per kernel
    # in the whole gradient, the same loss and gradients.
    from helpers import jaxpr_eqns

    from pimlayers.faults import FaultPolicy

    cfg = get_config("llama3_tiny", n_layers=2)
    toks = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)

    def model(remat, policy):
        return Llama3(cfg, dtype=jnp.bfloat16, policy=policy, remat=remat, rngs=nnx.Rngs(0))

    def kernel_casts(remat, policy) -> int:  # f32 -> bf16 casts of a block's 2-D kernels
        m = model(remat, policy)
        shapes = {
            tuple(p.shape)
            for path, p in nnx.iter_graph(m)
            if isinstance(p, nnx.Param) and p[...].ndim == 2 and "layers" in map(str, path)
        }
        jaxpr = grad_jaxpr(m, toks).jaxpr
        return sum(
            e.primitive.name == "convert_element_type"
            and e.params["new_dtype"] == jnp.bfloat16
            and e.invars[0].aval.dtype == jnp.float32
            and tuple(e.invars[0].aval.shape) in shapes
            for e, _ in jaxpr_eqns(jaxpr)
        )

    kernels = 7 * cfg.n_layers  # q, k, v, o, gate, up, down
    for policy in (FaultPolicy.off(), FaultPolicy()):
        assert kernel_casts("gemms", policy) == 2 * kernels  # forward, and again in the backward
        assert kernel_casts("gemms_weights", policy) == kernels

    def loss_of(m):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(m(toks[:, :-1])), toks[:, 1:, None], axis=-1))

    step = nnx.jit(nnx.value_and_grad(loss_of))
    (l0, g0), (l1, g1) = step(model("gemms", FaultPolicy())), step(model("gemms_weights", FaultPolicy()))
    assert float(l0) == float(l1)
    for a, b in zip(
        jax.tree.leaves(nnx.state(g0, nnx.Param)), jax.tree.leaves(nnx.state(g1, nnx.Param)), strict=True
    ):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 2.0**-5 * np.max(np.abs(a))  # bf16: the remat test's slack


def test_a_model_on_its_compute_copies_casts_no_kernel():
    """``flax.nnx.compute_dtypes``: every linear kernel (q, k, v, o, gate, up, down, the LM head) in
    the compute dtype, the embedding and norm scales in their own. A model merged with those copies
    (what the training step multiplies by, from the scrub) casts no kernel in its loss or gradient,
    under either remat policy, where its layers cast each once or twice."""
    from helpers import jaxpr_eqns

    from pimlayers.faults import FaultPolicy
    from pimlayers.flax import nnx as pnnx

    cfg = get_config("llama3_tiny", n_layers=2)
    toks = jnp.asarray(np.random.default_rng(10).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    m = Llama3(cfg, dtype=jnp.bfloat16, policy=FaultPolicy(), remat="gemms", rngs=nnx.Rngs(0))
    dtypes = pnnx.compute_dtypes(m)
    named = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_leaves_with_path(dtypes)}
    bf16 = {k for k, d in named.items() if d == jnp.bfloat16}
    assert len(bf16) == 7 * cfg.n_layers + 1 and all("kernel" in k for k in bf16)
    assert all(named[k] == jnp.float32 for k in named if "embedding" in k or "scale" in k)

    def casts(model) -> int:  # f32 -> bf16 casts of 2-D arrays in the loss and gradient
        return sum(
            e.primitive.name == "convert_element_type"
            and e.params["new_dtype"] == jnp.bfloat16
            and e.invars[0].aval.dtype == jnp.float32
            and e.invars[0].aval.ndim == 2
            and tuple(e.invars[0].aval.shape) != (cfg.vocab_size, cfg.dim)  # the embedding's lookup
            for e, _ in jaxpr_eqns(grad_jaxpr(model, toks).jaxpr)
        )

    kernels = 7 * cfg.n_layers
    for remat, cast in (("gemms", 2 * kernels + 1), ("gemms_weights", kernels + 1)):
        m = Llama3(cfg, dtype=jnp.bfloat16, policy=FaultPolicy(), remat=remat, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        copies = jax.tree.map(lambda p, d: p.astype(d), params, pnnx.compute_dtypes(m))
        assert casts(m) == cast  # the blocks' kernels (again in the backward under "gemms"), the head's
        assert casts(nnx.merge(graphdef, copies, rest)) == 0
