"""The verified flash attention kernels under Nsight Compute: each kernel's time, registers and
instructions executed with its checks and without, the instructions by opcode and the tensor-core
instructions by shape, and what the checks add. Hopper GPU with ``ncu`` on the PATH (or CUDA's
``/usr/local/cuda/bin``) only.

python -m benchmarks.ncu                           # forward and backward, B = 1, T = 8192, 32/8 heads
python -m benchmarks.ncu --which bwd --seq 4096    # the two backward kernels only, a shorter sequence
python -m benchmarks.ncu --save TAG --keep DIR     # also a results file (suite "ncu"), the report kept

The kernels run once each in a child process under ``ncu --clock-control none`` (the clocks as the
benchmarks see them), ``--kernel-name regex:mosaic`` (the Pallas Mosaic-GPU kernels alone) and the
SpeedOfLight, LaunchStats, InstructionStats, WarpStateStats and SourceCounters sections; XLA's GEMM
autotuning is off in the child (with it on, the process died under ncu before the backward's first
kernel on an H200, 2026-12-04). The report's details page gives each kernel's duration, registers
and grid; its SASS page, per instruction, how often it executed and where warps stalled, which this
sums by opcode. The backward's two kernels are told apart by their grids (the dq kernel's runs over
query heads, the dk/dv kernel's over KV heads). Instruction counts are per warp (one per 32 threads).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

SECTIONS = ("SpeedOfLight", "LaunchStats", "InstructionStats", "WarpStateStats", "SourceCounters")
_TO_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
_TO_MS |= {"s": 1e3, "second": 1e3}
LAUNCH = "ncu-launch: "  # the probe's line per call: its label and the kernels it launches


def find_ncu() -> str | None:
    """The ncu executable: on the PATH, else CUDA's default install; None where there is none."""
    found = shutil.which("ncu")
    if found:
        return found
    default = pathlib.Path("/usr/local/cuda/bin/ncu")
    return str(default) if default.exists() else None


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_details(text: str) -> list[dict]:
    """``ncu --page details --csv``: one dict per profiled kernel, in launch order, with ``ms``
    (Duration), ``registers`` (Registers Per Thread), ``grid`` (Grid Size, blocks), ``instructions``
    (Executed Instructions) and ``sm_busy_pct`` (Compute (SM) Throughput) where the report has them."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and not {"ID", "Metric Name", "Metric Value"} <= set(rows[0]):
        raise ValueError(
            f"benchmarks.ncu: details CSV has columns {sorted(rows[0])}; expected ID, Metric Name, ..."
        )
    names = {
        "Duration": "ms",
        "Registers Per Thread": "registers",
        "Grid Size": "grid",
        "Executed Instructions": "instructions",
        "Compute (SM) Throughput": "sm_busy_pct",
    }
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], {"kernel": r.get("Kernel Name", "")})
        key = names.get(r["Metric Name"])
        if key is None or key in k:
            continue
        value = _number(r["Metric Value"])
        if key == "ms":
            unit = r.get("Metric Unit", "ms")
            if unit not in _TO_MS:
                raise ValueError(f"benchmarks.ncu: Duration in {unit!r}; expected one of {sorted(_TO_MS)}")
            value *= _TO_MS[unit]
        k[key] = value
    return [kernels[i] for i in sorted(kernels, key=int)]


def _opcode(source: str) -> str:
    """'@!P1 BRA 0x7f..' -> 'BRA'; 'HGMMA.64x72x16.F32.BF16 R24, ..' -> 'HGMMA'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_sass(text: str) -> list[dict]:
    """``ncu --page source --print-source sass --csv``: one dict per kernel, in launch order, with the
    instructions executed (per warp) and the warp-stall samples by opcode (``by_opcode``: {op:
    [executed, samples]}), the tensor-core instructions by shape (``hgmma``: {'64x72x16': executed})
    and the stall samples by reason (``stalls``)."""
    out = []
    for block in re.split(r'^"Kernel Name",', text, flags=re.M)[1:]:
        lines = block.splitlines()[1:]  # the kernel's name line, then the header and the rows
        reader = csv.DictReader(lines)
        ops: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        hgmma: collections.Counter = collections.Counter()
        stalls: collections.Counter = collections.Counter()
        for r in reader:
            src = r.get("Source") or ""
            executed = int(_number(r.get("Instructions Executed") or "0"))
            samples = int(_number(r.get("Warp Stall Sampling (All Samples)") or "0"))
            op = _opcode(src)
            ops[op][0] += executed
            ops[op][1] += samples
            if op == "HGMMA":
                shape = src.split()[0 if not src.lstrip().startswith("@") else 1].split(".")[1]
                hgmma[shape] += executed
            for col, val in r.items():
                if col and col.startswith("stall_") and "Not Issued" not in col and val:
                    stalls[col[len("stall_") :]] += int(_number(val))
        out.append({"by_opcode": dict(ops), "hgmma": dict(hgmma), "stalls": dict(stalls)})
    return out


def label_kernels(details: list[dict], launches: list[dict]) -> list[str]:
    """A label per profiled kernel from the probe's calls (each: ``label`` and ``kernels``, {name:
    grid}): a call's kernels are matched to the next profiled kernels by grid size, or where two of
    them share a grid (no GQA) named by launch order ("kernel 1", "kernel 2")."""
    labels, at = [], 0
    for call in launches:
        want = dict(call["kernels"])
        got = details[at : at + len(want)]
        if len(got) != len(want):
            raise ValueError(
                f"benchmarks.ncu: {call['label']} launched {len(got)} kernels; expected {len(want)}"
            )
        by_grid = {g: n for n, g in want.items()}
        for j, k in enumerate(got):
            if len(by_grid) < len(want):
                name = f"kernel {j + 1}"
            elif k.get("grid") in by_grid:
                name = by_grid[k.get("grid")]
            else:
                raise ValueError(
                    f"benchmarks.ncu: {call['label']} launched a grid of {k.get('grid')} blocks; "
                    f"expected one of {sorted(by_grid)}"
                )
            labels.append(f"{call['label']}: {name}" if name else call["label"])
        at += len(got)
    return labels


def rows_from(details: list[dict], sass: list[dict], labels: list[str], top: int = 8) -> list[dict]:
    """One row per kernel, then one per (checked, unchecked) pair of the same kernel: the checks'
    addition in ms and instructions, and the opcodes that grew most."""
    rows = []
    for d, s, label in zip(details, sass, labels, strict=True):
        ops = sorted(s["by_opcode"].items(), key=lambda kv: -kv[1][0])
        rows.append(
            {
                "kernel": label,
                "ms": d.get("ms"),
                "registers": d.get("registers"),
                "grid": d.get("grid"),
                "instructions_m": (d.get("instructions") or sum(v[0] for v in s["by_opcode"].values())) / 1e6,
                "hgmma_m": {k: round(v / 1e6, 3) for k, v in sorted(s["hgmma"].items())},
                "top_opcodes_m": {k: round(v[0] / 1e6, 2) for k, v in ops[:top]},
                "top_stalls": dict(collections.Counter(s["stalls"]).most_common(4)),
            }
        )
    by = {r["kernel"]: (r, s) for r, s in zip(rows, sass, strict=True)}
    for name, (r, s) in list(by.items()):
        if ", checks" not in name:
            continue
        other = by.get(name.replace(", checks", ", no checks"))
        if other is None:
            continue
        r0, s0 = other
        grew = {
            op: (s["by_opcode"][op][0] - s0["by_opcode"].get(op, [0, 0])[0]) / 1e6 for op in s["by_opcode"]
        }
        rows.append(
            {
                "kernel": name.replace(", checks", ", what the checks add"),
                "ms": (r["ms"] or 0) - (r0["ms"] or 0),
                "instructions_m": r["instructions_m"] - r0["instructions_m"],
                "top_opcodes_m": {
                    k: round(v, 2) for k, v in sorted(grew.items(), key=lambda kv: -kv[1])[:top]
                },
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    """Two lines per row: kernel, ms, instructions (M) and registers; then its top opcodes (M)."""
    out = []
    for r in rows:
        add = "what the checks add" in r["kernel"]
        regs = f"  {r['registers']:.0f} registers" if r.get("registers") is not None else ""
        ops_m = ", ".join(f"{k} {v:+.1f}" if add else f"{k} {v:.1f}" for k, v in r["top_opcodes_m"].items())
        out.append(
            f"{r['kernel']:<40} {r['ms'] or 0:8.3f} ms {r['instructions_m']:9.1f} M instructions{regs}"
        )
        out.append(f"{'':<40} by opcode (M): {ops_m}")
    return "\n".join(out)


def _probe(args) -> None:
    """Runs under ncu: each kernel once (compile, then one launch), a LAUNCH line per call."""
    import functools

    import jax
    import jax.numpy as jnp

    from pimlayers import ops

    b, t, h, kv, d = 1, args.seq, args.heads, args.kv_heads, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv, d), jnp.bfloat16)
    g = jax.random.normal(keys[3], (b, t, h, d), jnp.bfloat16)
    fcfg, bcfg = ops.FlashConfig(), ops.FlashBwdConfig()
    out, lse, _ = jax.block_until_ready(jax.jit(ops.flash_attention)(q, k, v))  # launch: forward, checks
    calls = [("forward, checks", {"": h * t // (2 * fcfg.block_q) * b})]
    if "fwd" in args.which:
        jax.block_until_ready(jax.jit(functools.partial(ops.flash_attention, checks=False))(q, k, v))
        calls.append(("forward, no checks", {"": h * t // (2 * fcfg.block_q) * b}))
    if "bwd" in args.which:
        grids = {"dq": h * t // (2 * bcfg.block_q) * b, "dk/dv": kv * t // (2 * bcfg.block_kv) * b}
        for checks in (True, False):
            fn = jax.jit(functools.partial(ops.flash_attention_bwd, checks=checks))
            jax.block_until_ready(fn(q, k, v, out, lse, g))
            calls.append((f"backward, {'checks' if checks else 'no checks'}", grids))
    for label, kernels in calls:
        print(LAUNCH + json.dumps({"label": label, "kernels": kernels}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", choices=["fwd", "bwd", "fwd,bwd"], default="fwd,bwd")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument(
        "--save", metavar="TAG", default="", help="also write benchmarks/results/<date>-ncu-TAG-*.json"
    )
    ap.add_argument("--keep", metavar="DIR", default="", help="keep the ncu report and its CSV pages in DIR")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the child under ncu
    args = ap.parse_args(argv)
    if args.probe:
        _probe(args)
        return
    ncu = find_ncu()
    if ncu is None:
        raise SystemExit(
            "benchmarks.ncu: no ncu (Nsight Compute) on the PATH or in /usr/local/cuda/bin; install it"
        )
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        rep = work / "flash"
        child = [
            sys.executable,
            "-m",
            "benchmarks.ncu",
            "--probe",
            "--which",
            args.which,
            "--seq",
            str(args.seq),
        ]
        child += ["--heads", str(args.heads), "--kv-heads", str(args.kv_heads)]
        cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", "regex:mosaic"]
        cmd += [a for s in SECTIONS for a in ("--section", s)] + ["-o", str(rep), "-f", *child]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if run.returncode != 0:
            raise SystemExit(
                f"benchmarks.ncu: ncu exited with {run.returncode}:\n"
                f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            )
        launches = [json.loads(x[len(LAUNCH) :]) for x in run.stdout.splitlines() if x.startswith(LAUNCH)]
        page = lambda *a: (
            subprocess.run(
                [ncu, "-i", f"{rep}.ncu-rep", *a], capture_output=True, text=True, check=True
            ).stdout
        )
        details_csv = page("--page", "details", "--csv")
        sass_csv = page("--page", "source", "--print-source", "sass", "--csv")
        if args.keep:
            (work / "details.csv").write_text(details_csv)
            (work / "sass.csv").write_text(sass_csv)
    details, sass = parse_details(details_csv), parse_sass(sass_csv)
    if len(details) != len(sass):
        raise SystemExit(
            f"benchmarks.ncu: {len(details)} kernels in the details page, {len(sass)} in the SASS page"
        )
    rows = rows_from(details, sass, label_kernels(details, launches))
    print(format_rows(rows))
    if args.save:
        from ._harness import command_line, write_result

        command = command_line("benchmarks.ncu", argv)
        print(f"wrote {write_result('ncu', rows, command, tag=args.save)}")


if __name__ == "__main__":
    main()
