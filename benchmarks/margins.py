"""How close the training step's clean GEMMs come to the ABFT detection bound (``lam``'s headroom).

python -m benchmarks.margins --layers 2                 # one GPU, Llama-3-8B dims, T = 8192
python -m benchmarks.margins --config llama3_tiny --seq 64 --layers 1   # a CPU smoke run

Runs the protected training script for a few steps with no faults injected, under
``pimlayers.ops.check_margins``: every protected GEMM (forward, the backward's dx and dw, and any
recompute) records its largest residual-to-bound ratio. Any ratio >= 1 is a false detection (the
step counts it as a detected, maybe uncorrectable, fault). Prints the worst GEMMs and, per GEMM kind
(role and shape), the worst ratio, and writes ``benchmarks/results/<date>-margins-<device>.json``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile

import jax

from pimlayers.ops import check_margins
from train.llama3 import TrainConfig, train

from ._harness import device_name, write_result


def run(config: str, layers: int, seq: int, steps: int, dtype: str, batch: int) -> tuple[list[dict], dict]:
    n = len(jax.devices())
    with tempfile.TemporaryDirectory() as tmp, check_margins() as log:
        s = train(
            TrainConfig(
                config=config, layers=layers, tokenizer="bytes", steps=steps, batch=batch or n, seq=seq,
                dtype=dtype, remat=True, devices=n, eval_every=10**9, eval_windows=n, warmup=1, lr=3e-4,
                protect=True, flip_every=0, gemm_fault_rate=0.0, nan_rate=0.0, out_dir=tmp, quiet=True,
            )
        )  # fmt: skip
        jax.effects_barrier()
    return summarize(log), {"gemm": s["gemm"], "table": log.table(15)}


def summarize(log) -> list[dict]:
    """One row per kind of GEMM (role, shape, dtype), worst first."""
    kinds: dict[tuple, list] = collections.defaultdict(list)
    for m in log:
        kinds[(m.role, m.shape, m.dtype)].append(m)
    rows = []
    for (role, shape, dt), ms in sorted(kinds.items(), key=lambda kv: -max(m.ratio for m in kv[1])):
        worst = max(ms, key=lambda m: m.ratio)
        rows.append(
            {
                "role": role,
                "shape": "x".join(map(str, shape)),
                "dtype": dt,
                "block_n": worst.block_n,
                "calls": len(ms),
                "worst_ratio": worst.ratio,
                "calls_over": sum(m.over > 0 for m in ms),
                "blocks_over": sum(m.over for m in ms),
                "sum_over_mag_at_worst": worst.sum_over_mag,
                "nonfinite_checks": sum(m.nonfinite_checks for m in ms),
                "nonfinite_y": sum(m.nonfinite_y for m in ms),
            }
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3_8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (0: one per device)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    print(f"device: {device_name()}")
    rows, extra = run(args.config, args.layers, args.seq, args.steps, args.dtype, args.batch)
    print(extra["table"])
    print("\nper GEMM kind (role, G x R x K x N):")
    for r in rows:
        print(
            f"  {r['role']:<5}{r['shape']:>26}  worst {r['worst_ratio']:.3g}  over in {r['calls_over']}/"
            f"{r['calls']} calls ({r['blocks_over']} blocks)  |s1|/mag {r['sum_over_mag_at_worst']:.3g}"
            f"  non-finite checks {r['nonfinite_checks']}, y {r['nonfinite_y']}"
        )
    print(f"\nthe step's GEMM counters: {extra['gemm']}")
    path = write_result("margins", rows, "python -m benchmarks.margins " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
