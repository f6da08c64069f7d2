"""What the training step makes devices exchange: the collectives of its compiled program, protection
off and on, over every device of the mesh (data + FSDP, as ``train.llama3`` lays it out).

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.run --suite collectives
python -m benchmarks.run --suite collectives --layers 4          # every GPU of the machine
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.run --suite collectives
    --layers 1 --config llama3_small --seq 64                    # another model (one command)
python -m benchmarks.run --suite collectives --layers 1 --config llama3_8b --seq 8192   # GPUs

Counted from the step's optimized HLO (``benchmarks.hlo``): per kind, the collectives every step
runs, and apart those inside a loop or a branch (a GEMM's recompute, the parameters' repair), which
run only when a fault is found; ``MB`` is what the every-step ones leave on each device (an
all-gather's whole result). The model is the tiny Llama-3 (dim 64, vocabulary 512, bf16) with
``--layers`` blocks, one 32-token sequence per device: the counts show the structure (what a
protected layer adds, what is gathered), not the bytes of an 8B step. ``--config`` takes another
model (with a byte tokenizer: a 256-token vocabulary, so the LM head is small) and ``--seq`` the
tokens per device; XLA's choices of what to gather change with them (with fewer tokens a device
than a weight has rows it gathers tokens, not weights). The 8B model's step ran out of a 24 GB
CPU host's memory on 8 CPU devices at 512 tokens each; its collectives are for several GPUs.
"on" recomputes what a GEMM's check cannot locate in the loop (``recompute_kernel=False``, the
CPU's default), "on, device redo" on the device kernel (the default on the GPUs that run it).
"""

from __future__ import annotations

import pathlib
import tempfile
from collections import Counter

import jax

from train.llama3 import TrainConfig, train

from .hlo import KINDS, collectives


def run(layers: int = 2, devices: int = 0, config: str = "llama3_tiny", seq: int = 32) -> list[dict]:
    n = devices or len(jax.devices())
    if n < 2:
        return []
    variants = (
        ("off", dict(protect=False)),
        ("on", dict(protect=True, recompute_kernel=False)),  # the GEMMs' recompute loop, everywhere
        ("on, device redo", dict(protect=True, recompute_kernel=True)),
    )
    rows = []
    for label, kw in variants:
        with tempfile.TemporaryDirectory() as d:
            hlo = pathlib.Path(d) / "step.hlo"
            cfg = TrainConfig(
                config=config, layers=layers, steps=1, batch=n, seq=seq, devices=n, dtype="bfloat16",
                tokenizer="bpe" if config == "llama3_tiny" else "bytes",
                max_bytes=200_000, eval_every=1000, eval_windows=n, flip_every=0, out_dir=d, quiet=True,
                hlo_path=str(hlo), **kw,
            )  # fmt: skip
            train(cfg)
            found = collectives(hlo.read_text())
        rows.append(dict(config=label, model=config, seq=seq, devices=n, layers=layers, **_summary(found)))
    return rows


def _summary(found) -> dict:
    every = [c for c in found if c.every_call]
    kinds = Counter(c.kind for c in every)
    row = dict(every_step=len(every), MB=round(sum(c.nbytes for c in every) / 1e6, 4))
    row |= {k.replace("-", "_"): kinds.get(k, 0) for k in KINDS}
    nested = [c for c in found if not c.every_call]
    row |= dict(on_a_fault=len(nested), on_a_fault_MB=round(sum(c.nbytes for c in nested) / 1e6, 4))
    return row
