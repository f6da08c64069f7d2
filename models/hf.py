"""Hugging Face checkpoints for `models.llama3.Llama3`: ``config.json`` + ``*.safetensors`` (one file or
a sharded index), read and written without torch.

Safetensors is read here directly (8-byte header length, a JSON header, then raw little-endian
tensors), so every malformed file — truncated, a header past the end, a tensor whose bytes do not
match its shape, an unknown dtype — raises a ValueError naming the file and the tensor, and bf16
tensors need no torch. Hugging Face stores projections as (out, in); pimlayers kernels are (in, out).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import struct
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pimlayers.layers as L
from pimlayers.faults import FaultPolicy

from .llama3 import Llama3, LlamaConfig

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "load_pretrained",
    "read_safetensors",
    "save_pretrained",
    "write_safetensors",
]

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _bad(path, msg: str) -> ValueError:
    return ValueError(f"{path}: {msg}")


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as a read-only numpy array over a memory map."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size < 8:
        raise _bad(path, f"{size} bytes: too short for a safetensors file (truncated?)")
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise _bad(
                path, f"the header claims {n} bytes but the file holds {size - 8} after it (truncated?)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"the header is not valid JSON ({e}); the file is corrupted") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    data_len = size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_len,)) if data_len else None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _bad(path, f"tensor {name!r} has a malformed header entry {meta!r}") from None
        need = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_len:
            raise _bad(
                path,
                f"tensor {name!r} spans bytes {begin}..{end} of a {data_len}-byte data section (truncated?)",
            )
        if end - begin != need:
            raise _bad(
                path, f"tensor {name!r} has {end - begin} bytes; {meta['dtype']}{list(shape)} needs {need}"
            )
        arr = np.zeros(shape, dtype) if need == 0 else mm[begin:end].view(dtype).reshape(shape)
        out[name] = arr
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    path = pathlib.Path(path)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {a.dtype}; not storable")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())


# --- config ---


def config_from_hf(hf: dict) -> LlamaConfig:
    """A `LlamaConfig` from a Hugging Face ``config.json`` dict (transformers 4 and 5 RoPE keys)."""
    if hf.get("model_type") != "llama":
        raise ValueError(f"config.json: model_type={hf.get('model_type')!r}; expected 'llama'")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (expected {want!r})")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    llama31 = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(
                f"config.json: rope scaling {kind!r} is not supported (expected 'llama3' or none)"
            )
        llama31 = L.Llama31Scaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position=int(scaling["original_max_position_embeddings"]),
        )
    try:
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=int(hf["num_attention_heads"]),
            n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            ffn_dim=int(hf["intermediate_size"]),
            head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
            rope_theta=float(theta),
            rope_scaling=llama31,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=int(hf.get("max_position_embeddings", 8192)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        raise ValueError(f"config.json: missing key {e.args[0]!r}") from None


def config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    rope: dict = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {
            "rope_theta": cfg.rope_theta,
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "dtype": dtype,
    }


# --- parameter names ---


def _names(cfg: LlamaConfig) -> Iterator[tuple[str, tuple, bool]]:
    """(Hugging Face tensor name, path in the NNX model, stored transposed?) for every parameter."""
    yield "model.embed_tokens.weight", ("embed_tokens", "embedding"), False
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", ("layers", i, "input_layernorm", "scale"), False
        yield p + "post_attention_layernorm.weight", ("layers", i, "post_attention_layernorm", "scale"), False
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield p + f"self_attn.{proj}.weight", ("layers", i, "self_attn", proj, "kernel"), True
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield p + f"mlp.{proj}.weight", ("layers", i, "mlp", proj, "kernel"), True
    yield "model.norm.weight", ("norm", "scale"), False
    if not cfg.tie_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), True


def _files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index}: names shards that are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    return [single]


def load_pretrained(
    path,
    *,
    dtype=None,
    param_dtype=jnp.float32,
    policy: FaultPolicy | None = None,
    config: LlamaConfig | None = None,
) -> Llama3:
    """A `Llama3` with the weights of a local Hugging Face directory. ``config`` (optional) must equal
    the directory's; every tensor must be present with the shape the config implies, and no other
    tensor may be there (a ValueError lists what differs)."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"{path}: no config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    if config is not None and config != cfg:
        diff = {
            f.name: (getattr(config, f.name), getattr(cfg, f.name))
            for f in dataclasses.fields(LlamaConfig)
            if getattr(config, f.name) != getattr(cfg, f.name)
        }
        raise ValueError(f"{path}: config.json does not match the given config (given, file): {diff}")
    tensors: dict[str, np.ndarray] = {}
    for f in _files(path):
        tensors.update(read_safetensors(f))
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied copy too
    abstract = nnx.eval_shape(
        lambda: Llama3(cfg, dtype=dtype, param_dtype=param_dtype, policy=policy, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    expected = {name for name, _, _ in _names(cfg)}
    unexpected = sorted(set(tensors) - expected - {n for n in tensors if n.endswith("rotary_emb.inv_freq")})
    missing = sorted(expected - set(tensors))
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match the config: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, key, transposed in _names(cfg):
        var = flat[key]
        arr = tensors[name].T if transposed else tensors[name]
        want = var.get_value()
        if tuple(arr.shape) != tuple(want.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(tensors[name].shape)}; the config implies "
                             f"{tuple(want.shape[::-1] if transposed else want.shape)}")  # fmt: skip
        var.set_value(jnp.asarray(np.asarray(arr), want.dtype))
    # The rest of the state is bookkeeping (fault reports and taps), which starts at zero.
    for var in flat.values():
        v = var.get_value()
        if isinstance(v, jax.ShapeDtypeStruct):
            var.set_value(jnp.zeros(v.shape, v.dtype))
        elif not isinstance(v, jax.Array) and jax.tree.leaves(v):
            var.set_value(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), v))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(
    model: Llama3, path, *, max_shard_bytes: int = 5 * 2**30, dtype=None
) -> list[pathlib.Path]:
    """Write ``config.json`` and the weights (sharded with an index above ``max_shard_bytes``) in
    Hugging Face's layout; ``dtype`` converts on the way (default: as stored)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors: dict[str, np.ndarray] = {}
    for name, key, transposed in _names(cfg):
        a = np.asarray(jax.device_get(flat[key].get_value()))
        a = a.T if transposed else a
        tensors[name] = a.astype(np.dtype(dtype)) if dtype is not None else a
    store_dtype = np.dtype(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, str(store_dtype)), indent=2) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    written = []
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0])
        written.append(path / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / fname, shard)
            written.append(path / fname)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written
