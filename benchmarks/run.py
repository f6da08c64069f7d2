"""Run the benchmark suites, write JSON to benchmarks/results/ and refresh docs/benchmarks.md.

python -m benchmarks.run                 # every suite, on the default JAX device
python -m benchmarks.run --suite ops --size-mb 256
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.run --suite shard   # 8 CPU devices
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.run --suite routing-sim
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.run --suite collectives --layers 2
                                                     # what the training step's devices exchange
python -m benchmarks.run --suite routing-multi          # every GPU: 88% link faults x 50, vs simulator
python -m benchmarks.run --suite llama3 --layers 8 --devices 1   # the 8B-dims training step, on/off
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --fused   # also on with the fused GEMM (Hopper)
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --redo-blocks 32 --no-recompute
                                                     # also branch-free recompute, and none
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --loop --no-recompute
                                                     # also the GEMMs' recompute loop, and none
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --plain-checks
                                                     # also with the plain checksums alone
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --checks-kernel
                                                     # also with the one-read checks kernel
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --no-recompute --remat-policy full
                                                     # blocks recompute their GEMMs' products
python -m benchmarks.run --suite llama3 --layers 4 --steps 6 --also-remat gemms_weights
                                                     # also keeping the bf16 kernels, side by side
python -m benchmarks.run --suite matmul-parts            # where a protected GEMM's time goes
python -m benchmarks.run --suite fused-tiling            # Hopper: the fused GEMM's tilings vs XLA's GEMM
python -m benchmarks.run --suite flash-tiling            # Hopper: the verified attention's tilings vs cuDNN
python -m benchmarks.run --suite encode                  # the weight encodes' rates (pair, rows, transposed)
python -m benchmarks.run --suite update --layers 4       # AdamW's step + encode, fused and not, vs the step
python -m benchmarks.run --suite finish --layers 4       # abft_finish at every product the step checks
python -m benchmarks.run --suite bounds                  # the verified flash attention's XLA-side bounds
python -m benchmarks.run --suite checks                  # the GEMM checks: XLA's against the kernel's grids
python -m benchmarks.run --suite peers     # Hopper: the Pallas/cuDNN/XLA kernels a fused one builds on
python -m benchmarks.run --suite peers --peers attention   # goal 2: verified flash attention vs cuDNN
python -m benchmarks.run --suite matmul --m 256 --dtype float32 --shapes small   # the CPU goal
python -m benchmarks.run --suite matmul --block-n 128 --variants fused,fused_c1   # some policies only
python -m benchmarks.run --suite cpu-kernels --m 256 --dtype float32 --shapes small   # its kernels A/B
python -m benchmarks.run --suite launch                  # what one more kernel costs (gaps, graphs)
python -m benchmarks.run --suite dispatch                # what a jitted (protected) call costs the host
python -m benchmarks.run --suite finish --layers 4 --tag before --note "..."   # keep a second file
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from models.llama3 import REMAT_POLICIES

from . import (
    abft_campaign,
    bounds,
    checks,
    collectives,
    cpu_kernels,
    dispatch,
    finish,
    flash_tiling,
    fused_tiling,
    launch,
    llama3,
    matmul,
    memory,
    ops,
    peers,
    routing,
)
from ._harness import command_line, device_name, write_result
from .report import render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suites = [
        "ops",
        "matmul",
        "matmul-parts",
        "fused-tiling",
        "flash-tiling",
        "cpu-kernels",
        "encode",
        "finish",
        "bounds",
        "checks",
        "abft",
        "memory",
        "update",
        "pim",
        "shard",
        "routing",
        "routing-sim",
        "routing-multi",
        "peers",
        "launch",
        "dispatch",
        "collectives",
    ]
    suites += ["llama3", "all"]
    ap.add_argument("--suite", choices=suites, default="all")
    ap.add_argument("--size-mb", type=int, default=1024, help="array size for the bandwidth-bound ops")
    layers = "llama3, finish: decoder layers at 8B dimensions; collectives: the tiny model's"
    ap.add_argument("--layers", type=int, default=8, help=layers)
    ap.add_argument("--steps", type=int, default=12, help="llama3: training steps per configuration")
    ap.add_argument("--config", default="llama3_tiny", help="collectives: the model (models.llama3.CONFIGS)")
    ap.add_argument("--seq", type=int, default=32, help="collectives: tokens per device")
    ap.add_argument("--devices", type=int, default=1, help="llama3: devices to train on (0: all)")
    ap.add_argument(
        "--fused", action="store_true", help="llama3: also protected with the fused forward GEMM (Hopper)"
    )
    ap.add_argument(
        "--no-cast",
        action="store_true",
        help="llama3: also protected with each layer casting its kernels (no compute copies from the scrub)",
    )
    ap.add_argument(
        "--unfused-update",
        action="store_true",
        help="llama3: also protected with AdamW's step, then the encode (train's --no-fused-update)",
    )
    ap.add_argument(
        "--redo-blocks",
        type=int,
        default=0,
        metavar="N",
        help="llama3: also protected with FaultPolicy(recompute_blocks=N) (branch-free recompute)",
    )
    ap.add_argument(
        "--loop",
        action="store_true",
        help="llama3: also protected with FaultPolicy(recompute_kernel=False) (the GEMMs' and the "
        "attention's recompute loops; the default redoes on device kernels where a GPU runs them)",
    )
    ap.add_argument(
        "--no-recompute",
        action="store_true",
        help="llama3: also protected with FaultPolicy(recompute=False) (skip what a check cannot locate)",
    )
    ap.add_argument(
        "--plain-checks",
        action="store_true",
        help="llama3: also protected with FaultPolicy(weighted_checks=False, locate=False) (the plain "
        "checksums alone: 4 check columns per 128-column block on a GPU instead of 7)",
    )
    ap.add_argument(
        "--checks-kernel",
        action="store_true",
        help="llama3: also protected with the one-read checks kernel (PIMLAYERS_CHECKS_KERNEL=1 while "
        "that step is traced; an NVIDIA GPU runs it, up to 224 check columns)",
    )
    ap.add_argument(
        "--remat-policy",
        choices=sorted(REMAT_POLICIES),
        default="gemms",
        help="llama3: what each rematerialised block keeps (gemms: the linear layers' products too; "
        "gemms_weights: also the kernels cast to bf16; full: recompute them, the training script's default)",
    )
    ap.add_argument(
        "--also-remat",
        default="",
        metavar="POLICY[,POLICY]",
        help="llama3: also run the cuDNN peer and the default protected step under these remat policies",
    )
    ap.add_argument("--m", type=int, default=8192, help="matmul: rows of x (tokens)")
    ap.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="matmul: operand dtype"
    )
    ap.add_argument(
        "--shapes", choices=["llama", "small"], default="llama", help="matmul: Llama-3-8B or small"
    )
    ap.add_argument(
        "--peers", choices=["all", "gemm", "attention"], default="all", help="peers: which kernels to time"
    )
    ap.add_argument(
        "--variants",
        default=",".join(matmul.VARIANTS),
        help=f"matmul: policies to time beside the default, comma-separated, of {', '.join(matmul.VARIANTS)}",
    )
    ap.add_argument(
        "--block-n", choices=["both", "row", "128"], default="both", help="matmul: checksum block widths"
    )
    ap.add_argument(
        "--tag",
        default="",
        help="a name for the results file (<date>-<suite>-<tag>-<device>.json): keeps an earlier run's file",
    )
    ap.add_argument("--note", default="", help="a note stored with the results, shown above their table")
    args = ap.parse_args()
    print(f"device: {device_name()}")
    save = dict(tag=args.tag, note=args.note)
    shapes = matmul.SHAPES if args.shapes == "llama" else matmul.SMALL_SHAPES
    dtype = jnp.dtype(args.dtype)
    block_ns = {"both": (None, 128), "row": (None,), "128": (128,)}[args.block_n]
    variants = tuple(v for v in args.variants.split(",") if v)
    also_remat = tuple(v for v in args.also_remat.split(",") if v)
    for v in also_remat:
        if v not in REMAT_POLICIES:
            ap.error(f"--also-remat {v}: expected one of {sorted(REMAT_POLICIES)}")
    if args.suite in ("ops", "all"):
        rows = ops.run(args.size_mb)
        path = write_result("ops", rows, command_line(), **save)
        for r in rows:
            extra = f"  peer {r['peer_ms']:.3f} ms  ratio {r['ratio']:.2f}x" if "peer" in r else ""
            print(f"{r['op']:<42} {r['ms']:9.3f} ms {r['gbs']:9.1f} GB/s{extra}")
        print(f"wrote {path}")
    for name, run in (
        (
            "matmul",
            lambda: matmul.run(m=args.m, shapes=shapes, dtype=dtype, block_ns=block_ns, variants=variants),
        ),
        ("matmul-parts", lambda: matmul.parts(m=args.m, dtype=dtype)),
        ("fused-tiling", lambda: fused_tiling.run(m=args.m)),
        ("flash-tiling", flash_tiling.run),
        ("cpu-kernels", lambda: cpu_kernels.run(m=args.m, shapes=shapes, dtype=dtype)),
        ("encode", lambda: matmul.encodes(dtype=dtype)),
        ("finish", lambda: finish.run(m=args.m, dtype=dtype, layers=args.layers)),
        ("bounds", bounds.run),
        ("checks", lambda: checks.run(m=args.m)),
        ("abft", abft_campaign.run),
        ("memory", memory.run_store),
        ("update", lambda: memory.run_update(layers=args.layers)),
        ("pim", memory.run_pim),
        ("shard", memory.run_shard),
        ("routing", routing.run_local),
        ("routing-sim", routing.run_sim),
        ("routing-multi", routing.run_multi),
        ("peers", lambda: peers.run(args.peers)),
        ("launch", launch.run),
        ("dispatch", dispatch.run),
        ("collectives", lambda: collectives.run(layers=args.layers, config=args.config, seq=args.seq)),
        (
            "llama3",
            lambda: llama3.run(
                layers=args.layers,
                steps=args.steps,
                devices=args.devices,
                fused=args.fused,
                redo_blocks=args.redo_blocks,
                no_recompute=args.no_recompute,
                remat_policy=args.remat_policy,
                loop=args.loop,
                plain_checks=args.plain_checks,
                also_remat=also_remat,
                no_cast=args.no_cast,
                unfused_update=args.unfused_update,
                checks_kernel=args.checks_kernel,
            ),
        ),
    ):
        # Not in "all": cpu-kernels (a CPU A/B), checks, fused-tiling and flash-tiling (grid sweeps
        # for the kernels' design).
        grids = ("cpu-kernels", "checks", "fused-tiling", "flash-tiling")
        if args.suite == name or (args.suite == "all" and name not in grids):
            rows = run()
            if not rows:
                print(f"{name}: nothing to run on {len(jax.devices())} device(s)")
                continue
            tag = f"llama3-{rows[0]['devices']}dev" if name == "llama3" else name  # a file per device count
            path = write_result(tag, rows, command_line(), **save)
            for r in rows:
                print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
            print(f"wrote {path}")
    render()


if __name__ == "__main__":
    main()
