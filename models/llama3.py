"""The Llama 3 family built from pimlayers layers (Flax NNX): every GEMM verified per the policy.

Embedding → N decoder blocks (RMSNorm → grouped-query attention with RoPE → residual → RMSNorm →
SwiGLU MLP → residual) → final RMSNorm → LM head (its own kernel, or tied to the embedding). Module
and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``embed_tokens``, ``layers[i].self_attn
.q_proj``, ``input_layernorm``, ...), so checkpoints map one to one (`models.hf`).

Configs: `llama3_8b` (Meta's Llama 3 8B: vocab 128256, dim 4096, 32 layers, 32 heads, 8 KV heads, FFN
14336, RoPE θ 500000, RMSNorm ε 1e-5), `llama3_1_8b` (the same with Llama 3.1's RoPE scaling and 128K
context), and small configs that train on a laptop CPU (`CONFIGS`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

import pimlayers.layers as L
from pimlayers import ops
from pimlayers.faults import FaultPolicy, FaultReport
from pimlayers.flax import nnx as pnnx

__all__ = [
    "CONFIGS",
    "DecoderBlock",
    "Llama3",
    "LlamaConfig",
    "generate",
    "get_config",
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    head_dim: int | None = None  # None: dim // n_heads
    rope_theta: float = 500000.0
    rope_scaling: L.Llama31Scaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 8192
    init_std: float = 0.02  # Hugging Face's initializer_range

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig: {f}={v!r}; expected an int >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} does not split into n_heads={self.n_heads} heads")
        if self.hd % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.hd} must be even (RoPE rotates pairs)")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("LlamaConfig: rope_theta and norm_eps must be positive")

    @property
    def hd(self) -> int:
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameters, the embedding included (and the LM head when untied)."""
        d, hd = self.dim, self.hd
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * d * self.ffn_dim + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): 6 per matmul weight (the
        embedding lookup excluded) plus causal attention's 6 · layers · T · H · D (PaLM's MFU
        accounting, halved for the causal mask)."""
        matmul_params = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        matmul_params -= self.n_layers * 2 * self.dim + self.dim  # norms are not matmuls
        attn = 6 * self.n_layers * seq_len * self.n_heads * self.hd
        return 6.0 * matmul_params + attn


_8B = LlamaConfig()
CONFIGS: dict[str, LlamaConfig] = {
    "llama3_8b": _8B,
    "llama3_1_8b": _8B.replace(rope_scaling=L.Llama31Scaling(), max_seq_len=131072),
    # What `make train` trains on two CPU cores: 3.9M parameters with a 2K-token vocabulary.
    "llama3_small": LlamaConfig(
        vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=704, max_seq_len=512
    ),
    "llama3_tiny": LlamaConfig(
        vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256
    ),
}


def get_config(name: str, **overrides: Any) -> LlamaConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; expected one of {sorted(CONFIGS)}")
    return CONFIGS[name].replace(**overrides)


class DecoderBlock(nnx.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        dtype,
        param_dtype,
        policy: FaultPolicy | None,
        flash: bool | None = None,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.normal(cfg.init_std)
        norm = dict(epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, policy=policy, style="llama")
        self.input_layernorm = pnnx.RMSNorm(cfg.dim, rngs=rngs, **norm)
        self.self_attn = pnnx.Attention(
            cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.hd, rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling, dtype=dtype, param_dtype=param_dtype, kernel_init=init,
            policy=policy, flash=flash, rngs=rngs,
        )  # fmt: skip
        self.post_attention_layernorm = pnnx.RMSNorm(cfg.dim, rngs=rngs, **norm)
        self.mlp = pnnx.LlamaMLP(
            cfg.dim,
            cfg.ffn_dim,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=init,
            policy=policy,
            rngs=rngs,
        )

    def __call__(self, x, positions=None, cache: L.KVCache | None = None):
        h = self.input_layernorm(x)
        if cache is None:
            a, cache = self.self_attn(h, positions), None
        else:
            a, cache = self.self_attn(h, positions, cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


# The primitive of cuDNN's flash attention forward inside ``jax.nn.dot_product_attention`` (its
# custom VJP's forward rule binds it, returning the output and the softmax statistics its backward
# takes). jax names none of its residuals, so a names-only policy reran the forward in the backward
# pass: 8 cuDNN forward kernels per 4-layer step instead of 4 (H200, 2026-12-04 profiles).
_CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"


def _keep_cudnn_attention(prim, *_, **__) -> bool:
    """A remat policy keeping cuDNN's attention forward outputs (protection off, ``flash=True``), as
    ``layers.FLASH_RESIDUALS`` keeps the verified kernel's."""
    return prim.name == _CUDNN_ATTENTION_FWD


# Llama3(remat=...): what a rematerialised block keeps for its backward pass (None: its input alone).
REMAT_POLICIES = {
    "full": None,
    "gemms": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(
            L.LINEAR_OUTPUT, L.FLASH_RESIDUALS, ops.TRANSPOSED_CHECKSUMS
        ),
        _keep_cudnn_attention,
    ),
    "gemms_weights": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(
            L.LINEAR_OUTPUT, L.FLASH_RESIDUALS, ops.TRANSPOSED_CHECKSUMS, L.COMPUTE_WEIGHT
        ),
        _keep_cudnn_attention,
    ),
}


class Llama3(nnx.Module):
    """``Llama3(cfg, rngs=nnx.Rngs(0))(tokens)`` → float32 logits (B, T, vocab).

    ``dtype`` is the compute dtype (e.g. bf16), ``param_dtype`` the storage dtype; ``policy`` reaches
    every layer; ``remat`` rematerialises each block in the backward pass: True (or "full") keeps only
    each block's input (activation memory of one block instead of all), "gemms" also keeps every
    linear layer's product (``layers.LINEAR_OUTPUT``) and the verified flash attention's output and
    logsumexp (``layers.FLASH_RESIDUALS``), cuDNN's flash attention's output and statistics where it
    runs instead (protection off), and the checksums of each weight's transpose that a
    protected GEMM encodes in its forward pass (``ops.TRANSPOSED_CHECKSUMS``), so the backward pass
    recomputes no GEMM (nor a protected GEMM's checks), no flash forward kernel and no encode of a
    weight, only norms, activations, RoPE and the materialised attention where no flash kernel runs;
    "gemms_weights" also keeps each kernel cast to the compute dtype (``layers.COMPUTE_WEIGHT``), so
    the backward pass does not cast the f32 parameters again (a bf16 copy of the block's kernels
    held from its forward pass to its backward pass: at Llama-3-8B dimensions 436 MB a block);
    ``flash`` is every attention's choice of a flash kernel
    (:func:`pimlayers.layers.attention_core`: None = the verified kernel where it applies, True with
    protection off = cuDNN's). With ``cache`` (from `init_cache`), returns ``(logits, cache)``.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        policy: FaultPolicy | None = None,
        remat: bool | str = False,
        flash: bool | None = None,
        rngs: nnx.Rngs,
    ):
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama3: cfg is a {type(cfg).__name__}; expected models.llama3.LlamaConfig")
        if not (isinstance(remat, bool) or (isinstance(remat, str) and remat in REMAT_POLICIES)):
            raise ValueError(f"Llama3: remat={remat!r}; expected a bool or one of {sorted(REMAT_POLICIES)}")
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        # Set by a trainer that shards the batch (e.g. NamedSharding(mesh, P(("data", "fsdp")))): the
        # hidden state is pinned to it after the embedding and after every block, so XLA keeps the
        # activations split by batch and gathers the FSDP-sharded weights, instead of sharding the
        # activations by a weight dimension and replicating the batch (75 GB scores at T = 8192).
        self.activation_sharding = None
        self.policy = FaultPolicy() if policy is None else policy
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.dim, dtype=dtype, param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs,
        )  # fmt: skip
        kw = dict(dtype=dtype, param_dtype=param_dtype, policy=policy, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(cfg, flash=flash, **kw) for _ in range(cfg.n_layers)])
        self.norm = pnnx.RMSNorm(
            cfg.dim, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, policy=policy,
            style="llama", rngs=rngs,
        )  # fmt: skip
        if cfg.tie_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = pnnx.Linear(
                cfg.dim, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                kernel_init=nnx.initializers.normal(cfg.init_std), policy=policy, rngs=rngs,
            )  # fmt: skip
        self.head_report = pnnx.FaultReportVar(FaultReport.zeros())  # the tied head's GEMM

    def init_cache(self, batch: int, max_len: int | None = None, dtype=None) -> list[L.KVCache]:
        cfg = self.cfg
        max_len = cfg.max_seq_len if max_len is None else max_len
        dtype = dtype or self.dtype or self.embed_tokens.embedding[...].dtype
        return [L.KVCache.init(batch, max_len, cfg.n_kv_heads, cfg.hd, dtype) for _ in range(cfg.n_layers)]

    def _pin(self, x):
        s = self.activation_sharding
        return x if s is None else jax.lax.with_sharding_constraint(x, s)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        cache: list[L.KVCache] | None = None,
    ) -> Float[Array, "b t v"] | tuple[Float[Array, "b t v"], list[L.KVCache]]:
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"Llama3: tokens are {tokens.dtype} {tuple(tokens.shape)}; expected int (batch, seq)"
            )
        if cache is not None and len(cache) != self.cfg.n_layers:
            raise ValueError(f"Llama3: cache has {len(cache)} layers; the model has {self.cfg.n_layers}")
        pin = self._pin
        e = self.embed_tokens
        x = pin(embed_lookup(e.embedding[...], tokens, e.dtype or e.embedding[...].dtype))
        new_cache = []
        for i, layer in enumerate(self.layers):
            c = None if cache is None else cache[i]
            if self.remat and cache is None:
                policy = REMAT_POLICIES["full" if self.remat is True else self.remat]
                x, c = nnx.remat(lambda blk, x, p: blk(x, p), policy=policy)(layer, x, positions)
            else:
                x, c = layer(x, positions, c)
            x = pin(x)
            new_cache.append(c)
        x = self.norm(x)
        # The protected head's check (and its gate) reads whole rows of the logits (its blocks span
        # the vocabulary). With the batch split over devices and the head's weight split by FSDP over
        # the vocabulary, XLA would split the head GEMM by the vocabulary and then gather every
        # device's logits to every device for the check (at Llama-3-8B dimensions 2 GB of bf16 per
        # device per step, x and the weight gathered too, the check run on all tokens everywhere).
        # The weight is pinned whole where it is used instead: each device multiplies its own
        # tokens by it, as FSDP does for every other layer, and checks its own rows. Stock (no check,
        # no gate), nothing reads whole rows and XLA's split of the vocabulary moves fewer bytes.
        s = self.activation_sharding
        pinned = isinstance(s, NamedSharding) and (self.policy.enabled or self.policy.gate)
        whole = NamedSharding(s.mesh, PartitionSpec()) if pinned else None
        if self.lm_head is None:
            emb = self.embed_tokens.embedding[...]
            if whole is not None:
                emb = jax.lax.with_sharding_constraint(emb, whole)
            logits, report = L.linear(
                x, emb.astype(x.dtype), policy=self.policy, layout="oi", name="Llama3.lm_head (tied)"
            )
            self.head_report.set_value(report)
        else:
            logits = self.lm_head(x, kernel_sharding=whole)
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)


# Vocabularies up to this size take their embedding gradient as a one-hot GEMM (below).
ONE_HOT_MAX_VOCAB = 2048


def embed_lookup(table: Float[Array, "v d"], tokens: Int[Array, "*n"], dtype) -> Float[Array, "*n d"]:
    """``table[tokens]`` in ``dtype`` (what ``nnx.Embed`` computes), with a gradient accumulated in
    f32 and, for small vocabularies, without XLA's scatter-add.

    The gradient of a gather is a scatter-add of every token's cotangent into its row, and through
    ``nnx.Embed`` it accumulates in the compute dtype: with bf16, 8192 byte tokens (~32 updates per
    row, more for common bytes) came out up to 7% off the exact sum on a CPU. With a byte
    vocabulary the scatter was slow too: on an H200 it took 2.6-13.6 ms per Llama-3-8B-dims
    training step (the time varied from compile to compile). For ``V <= ONE_HOT_MAX_VOCAB`` the
    gradient is ``one_hot(tokens)ᵀ @ dy``: a GEMM of 2·n·V·d flops (17 GFLOP at V = 256, n =
    8192, d = 4096: tens of microseconds) with exact 0/1 operands and f32 accumulation. Larger
    vocabularies (Llama 3's 128256), where the GEMM would cost more than it saves and few updates
    collide, scatter-add in f32: the same bytes as a bf16 scatter followed by the cast to the f32
    parameters' dtype that it replaces.
    """
    return _embed(jnp.dtype(dtype), table, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _embed(dtype, table, tokens):
    return jnp.take(table.astype(dtype), tokens, axis=0)


def _embed_fwd(dtype, table, tokens):
    # The table's shape and dtype travel as an empty array (residuals are arrays).
    return _embed(dtype, table, tokens), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _embed_bwd(dtype, res, dy):
    tokens, like = res
    vocab, d = like.shape[0], dy.shape[-1]
    if vocab <= ONE_HOT_MAX_VOCAB:
        one_hot = jax.nn.one_hot(tokens, vocab, dtype=dy.dtype)  # 0/1: exact in any float dtype
        dtable = jnp.einsum("...v,...d->vd", one_hot, dy, preferred_element_type=jnp.float32)
    else:  # tokens past the table get no gradient, as the one-hot's zero rows give none
        rows, upd = tokens.reshape(-1), dy.reshape(-1, d).astype(jnp.float32)
        dtable = jnp.zeros((vocab, d), jnp.float32).at[rows].add(upd, mode="drop")
    return dtable.astype(like.dtype), None


_embed.defvjp(_embed_fwd, _embed_bwd)


def _sample(logits, key, temperature: float, top_k: int | None):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=16)
def _decoder(graphdef, temperature: float, top_k: int | None):
    """The jitted prefill and decode step of one model structure (cached: a second `generate` call on
    the same model compiles nothing)."""

    @jax.jit
    def prefill(state, tokens, cache, key):
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
        return _sample(logits[:, -1], key, temperature, top_k), cache

    @jax.jit
    def step(state, tok, cache, key):
        logits, cache = nnx.merge(graphdef, state)(tok[:, None], cache=cache)
        return _sample(logits[:, -1], key, temperature, top_k), cache

    return prefill, step


def generate(
    model: Llama3,
    prompt: Int[Array, "b t"],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: jax.Array | None = None,
) -> Int[Array, "b n"]:
    """Continue ``prompt`` by ``max_new_tokens`` tokens with a KV cache: greedy (temperature 0) or
    sampled (``key`` required; ``top_k`` optional). One compile for the prompt, one for all steps."""
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature}; expected >= 0")
    if temperature > 0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs key=jax.random.key(...)")
    prompt = jnp.asarray(prompt, jnp.int32)
    b, t = prompt.shape
    total = t + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"generate: {t} + {max_new_tokens} tokens exceed max_seq_len={model.cfg.max_seq_len}"
        )
    key = jax.random.key(0) if key is None else key
    graphdef, state = nnx.split(model)
    prefill, step = _decoder(graphdef, float(temperature), top_k)

    # Cache lengths in powers of two: prompts and budgets of similar size share one compiled program.
    cache = model.init_cache(b, min(max(64, 1 << (total - 1).bit_length()), model.cfg.max_seq_len))
    keys = jax.random.split(key, max(max_new_tokens, 1))
    out = [prompt]
    if max_new_tokens == 0:
        return prompt
    tok, cache = prefill(state, prompt, cache, keys[0])
    out.append(tok[:, None])
    for i in range(1, max_new_tokens):
        tok, cache = step(state, tok, cache, keys[i])
        out.append(tok[:, None])
    return jnp.concatenate(out, axis=1)
