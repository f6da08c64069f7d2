"""The gated RMSNorm against the ungated one: forward, and forward and backward alone and rematerialised.

python -m benchmarks.norm_gate                       # 8192 x 4096 bf16 (a Llama-3-8B layer's norm)
python -m benchmarks.norm_gate --rows 256 --features 512 --rounds 1 --save tiny   # a CPU smoke run

A protected norm gates its output (``FaultPolicy.gate``: NaN and ±Inf replaced and counted), and the
gate's gradient passes only where a value was kept. Three variants of ``layers.rms_norm`` (llama
style, as the Llama-3 model has it):

* ``input_mask``: the default, the masks from x, the scale and the row's statistic
  (``layers.norm._columns_ok``): the forward's select fused into the norm, the gradient's mask a
  sibling of the statistics' reduction;
* ``output_mask``: the gate's own mask, from the norm's output (``FaultPolicy(gate_limit=3e38)``:
  the general path, which a finite limit takes; no finite output of these inputs reaches it);
* ``off``: no gate (``FaultPolicy(gate=False)``), the floor.

Each is timed three ways (``pass``, ``remat``): the forward alone, its output written whole as
the GEMM after a norm reads it (``forward``: the norm applied to its own output 50 times in one
jitted loop, the gate counts summed, ``_harness.carried_time``); the value and gradient of a sum
against a fixed cotangent, with respect to x and the scale (``value_and_grad``), plain and under
``jax.checkpoint`` (the backward recomputes the forward, as the model's blocks do: device time of
10 calls in one jitted loop, ``_harness.device_time``; its fold reads one element of an output,
which would let XLA shrink a forward to one row). The variants alternate within each of
``--rounds`` rounds; the rows give each one's median, its ratio to ``off`` and the fusions in its
compiled program (XLA's kernels, about; ``--hlo DIR`` writes the programs,
``<variant>[-forward|-remat].txt``, to read which). Results go to
``benchmarks/results/<date>-norm-gate[-TAG]-<device>.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys

import jax
import jax.numpy as jnp

from pimlayers import FaultPolicy
from pimlayers.layers import rms_norm

from ._harness import carried_time, command_line, device_time, write_result

VARIANTS = {
    "input_mask": FaultPolicy(),
    "output_mask": FaultPolicy(gate_limit=3e38),
    "off": FaultPolicy(gate=False),
}


# (pass, remat) of each timing, and the suffix of its HLO file.
KINDS = (("forward", False, "-forward"), ("value_and_grad", False, ""), ("value_and_grad", True, "-remat"))


def _norm(policy: FaultPolicy):
    def norm(x, scale):
        y, report = rms_norm(x, scale, eps=1e-5, dtype=x.dtype, style="llama", policy=policy)
        return y, report.nonfinite_gated

    return norm


def norm_step(policy: FaultPolicy, cotangent: jax.Array, remat: bool):
    """The jitted value and gradient (x, scale) of sum(rms_norm(x, scale) * cotangent)."""
    norm = _norm(policy)

    def f(x, scale):
        y, gated = norm(x, scale)
        return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32)), gated

    return jax.jit(jax.value_and_grad(jax.checkpoint(f) if remat else f, argnums=(0, 1), has_aux=True))


def norm_forward(policy: FaultPolicy, scale: jax.Array):
    """``(x, gated) -> (rms_norm(x, scale), gated + its gate count)``: the step `carried_time`
    repeats, every byte of the output written."""
    norm = _norm(policy)

    def step(carry):
        y, gated = norm(carry[0], scale)
        return y, carry[1] + gated

    return step


def fusions(compiled_text: str) -> int:
    """The fusion instructions of a compiled program's entry computation."""
    entry = compiled_text[compiled_text.index("\nENTRY ") :]
    return len(re.findall(r"= \S+ fusion\(", entry))


def run(rows: int, features: int, dtype, rounds: int, hlo_dir: pathlib.Path | None = None) -> list[dict]:
    kx, ks, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (rows, features), dtype)
    scale = 1 + 0.1 * jax.random.normal(ks, (features,), jnp.float32)
    cotangent = jax.random.normal(kc, (rows, features), dtype)
    out = []
    for pass_, remat, suffix in KINDS:
        forward = pass_ == "forward"
        if forward:
            steps = {name: norm_forward(p, scale) for name, p in VARIANTS.items()}
            programs = {name: jax.jit(fn).lower((x, jnp.int32(0))) for name, fn in steps.items()}
        else:
            steps = {name: norm_step(p, cotangent, remat) for name, p in VARIANTS.items()}
            programs = {name: fn.lower(x, scale) for name, fn in steps.items()}
        texts = {name: program.compile().as_text() for name, program in programs.items()}
        kernels = {name: fusions(text) for name, text in texts.items()}
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            for name, text in texts.items():
                (hlo_dir / f"{name}{suffix}.txt").write_text(text)
        times = {name: [] for name in steps}
        for _ in range(rounds):
            for name, fn in steps.items():
                if forward:
                    times[name].append(carried_time(fn, (x, jnp.int32(0)), n=50, repeats=3))
                else:
                    times[name].append(device_time(fn, x, scale))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        for name in steps:
            out.append(
                dict(
                    variant=name,
                    **{"pass": pass_},
                    remat=remat,
                    rows=rows,
                    features=features,
                    dtype=jnp.dtype(dtype).name,
                    ms=ms[name],
                    over_off_us=(ms[name] - ms["off"]) * 1e3,
                    vs_off=ms[name] / ms["off"],
                    fusions=kernels[name],
                    rounds_ms=[t * 1e3 for t in times[name]],
                )
            )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--save", default=None, metavar="TAG", help="write benchmarks/results/...-norm-gate-TAG-..."
    )
    ap.add_argument("--note", default="")
    ap.add_argument(
        "--hlo", type=pathlib.Path, default=None, metavar="DIR", help="write each compiled program's HLO here"
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.features < 1 or args.rounds < 1:
        raise ValueError(
            f"benchmarks.norm_gate: --rows {args.rows}, --features {args.features}, --rounds "
            f"{args.rounds}; expected each >= 1"
        )
    rows = run(args.rows, args.features, jnp.dtype(args.dtype), args.rounds, args.hlo)
    print(f"{'variant':12} {'pass':>14} {'remat':>5} {'ms':>9} {'+us':>8} {'vs off':>7} {'fusions':>7}")
    for r in rows:
        print(
            f"{r['variant']:12} {r['pass']:>14} {r['remat']!s:>5} {r['ms']:9.4f} {r['over_off_us']:8.1f} "
            f"{r['vs_off']:7.3f} {r['fusions']:7d}"
        )
    if args.save is not None:
        cmd = command_line("benchmarks.norm_gate", argv)
        path = write_result("norm-gate", rows, cmd, tag=args.save, note=args.note)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
