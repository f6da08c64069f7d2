"""Training text and tokens: an embedded default corpus, the user's files, a real tokenizer.

The default corpus is the Python standard library's own sources (every machine with Python has them,
no download): the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``, sorted by name, with
every 20th file held out for validation. A user's text files or folders replace it (``--data``).

Tokenizer: a byte-level BPE trained on the training split with Hugging Face ``tokenizers`` (cached by
corpus hash), or a ``tokenizer.json`` given by the user; plain bytes (vocab 256) when ``tokenizers`` is
missing or ``--tokenizer bytes`` asks for it.
"""

from __future__ import annotations

import hashlib
import math
import pathlib
import sysconfig
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

__all__ = ["Corpus", "Tokenizer", "batches", "load_corpus", "make_tokenizer", "unigram_cross_entropy"]

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".yaml", ".yml", ".cfg", ".ini"}


class Corpus(NamedTuple):
    train: str
    valid: str
    source: str  # what it was read from, for the log
    files: int


def _read_files(paths: list[pathlib.Path]) -> list[str]:
    out = []
    for p in paths:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable files are skipped, not fatal
    return out


def load_corpus(
    data: list[str] | None = None, max_bytes: int | None = None, holdout_every: int = 20
) -> Corpus:
    """The training and held-out text. ``data``: files or folders (searched for text files); None: the
    standard library. ``max_bytes`` caps the training text (the held-out share scales with it)."""
    if data:
        paths: list[pathlib.Path] = []
        for d in data:
            p = pathlib.Path(d).expanduser()
            if p.is_dir():
                paths += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            elif p.is_file():
                paths.append(p)
            else:
                raise ValueError(f"--data {d}: no such file or folder")
        source = ", ".join(data)
    else:
        stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(stdlib.glob("*.py"))
        source = f"Python {sysconfig.get_python_version()} standard library ({stdlib})"
    texts = _read_files(paths)
    if not texts:
        raise ValueError(f"no readable text in {source}")
    if len(texts) == 1:  # one file: hold out its tail
        cut = int(len(texts[0]) * (1 - 1 / holdout_every))
        train, valid = texts[0][:cut], texts[0][cut:]
    else:
        train = "\n".join(t for i, t in enumerate(texts) if i % holdout_every != holdout_every - 1)
        valid = "\n".join(t for i, t in enumerate(texts) if i % holdout_every == holdout_every - 1)
    if max_bytes is not None and len(train) > max_bytes:
        valid = valid[: max(max_bytes // holdout_every, 1)]
        train = train[:max_bytes]
    return Corpus(train, valid, source, len(texts))


class Tokenizer:
    """``encode(text) -> np.int32 array`` and ``decode(ids) -> str`` over a BPE or plain bytes."""

    def __init__(self, bpe=None) -> None:
        self._bpe = bpe
        self.kind = "bytes" if bpe is None else "bpe"
        self.vocab_size = 256 if bpe is None else bpe.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        if self._bpe is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        # Long texts are encoded in pieces at line ends: the Rust encoder is fast, but one 5 MB
        # string holds the GIL for the whole call and the progress would be invisible.
        ids = []
        for start in range(0, len(text), 1 << 20):
            ids.extend(self._bpe.encode(text[start : start + (1 << 20)]).ids)
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if self._bpe is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._bpe.decode(ids)


def make_tokenizer(spec: str, corpus: Corpus, vocab_size: int, cache_dir: pathlib.Path) -> Tokenizer:
    """``spec``: "bpe" (train a byte-level BPE on the corpus, cached), "bytes", or a tokenizer.json path."""
    if spec == "bytes":
        return Tokenizer()
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        print("tokenizers is not installed: using plain bytes (vocab 256)")
        return Tokenizer()
    if spec != "bpe":
        p = pathlib.Path(spec)
        if not p.is_file():
            raise ValueError(f"--tokenizer {spec}: expected 'bpe', 'bytes' or a tokenizer.json file")
        return Tokenizer(HFTokenizer.from_file(str(p)))
    digest = hashlib.sha256(corpus.train.encode("utf-8", "replace")).hexdigest()[:16]
    path = cache_dir / f"bpe-{vocab_size}-{digest}.json"
    if path.exists():
        return Tokenizer(HFTokenizer.from_file(str(path)))
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    lines = corpus.train.splitlines(keepends=True)
    bpe.train_from_iterator((lines[i : i + 1000] for i in range(0, len(lines), 1000)), trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    bpe.save(str(path))
    return Tokenizer(bpe)


def unigram_cross_entropy(train_ids: np.ndarray, valid_ids: np.ndarray, vocab: int) -> float:
    """Nats per token a unigram model of the training tokens (add-one smoothed) scores on the held-out
    tokens: what a model that ignores context achieves; a language model must end clearly below."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[valid_ids].mean())


def batches(ids: np.ndarray, batch: int, seq: int, seed: int, start_step: int = 0) -> Iterator[np.ndarray]:
    """Endless (batch, seq + 1) windows at random offsets; step k's batch depends only on (seed, k), so
    a resumed run reads exactly what an uninterrupted one would."""
    if len(ids) < seq + 2:
        raise ValueError(f"the corpus has {len(ids)} tokens; a sequence needs {seq + 2}")
    step = start_step
    while True:
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(ids) - seq - 1, batch)
        yield np.stack([ids[s : s + seq + 1] for s in starts])
        step += 1


def eval_windows(ids: np.ndarray, seq: int, max_windows: int) -> np.ndarray:
    """Non-overlapping (n, seq + 1) windows over the held-out tokens (at most ``max_windows``)."""
    n = min((len(ids) - 1) // seq, max_windows)
    if n < 1:
        raise ValueError(f"the held-out text has {len(ids)} tokens; one window needs {seq + 1}")
    return np.stack([ids[i * seq : i * seq + seq + 1] for i in range(n)])


def fmt_bytes(n: int) -> str:
    units = ["B", "KB", "MB", "GB"]
    k = min(int(math.log(max(n, 1), 1000)), len(units) - 1)
    return f"{n / 1000**k:.1f} {units[k]}"
