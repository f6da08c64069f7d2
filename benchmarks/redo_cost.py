"""What the attention's device redo costs when nothing failed, kernel by kernel (Hopper GPUs).

python -m benchmarks.redo_cost --tag s68

One call each of the protected forward with its device redo (``ops.flash_attention_with_redo``),
the forward alone (``ops.flash_attention``), the backward with its redo
(``ops.flash_attention_bwd_with_redo``) and alone (``ops.flash_attention_bwd``), on random normal
bf16 inputs at ``--shape`` (goal 2's by default), each traced ``--reps`` times by
``profile.kernel_us`` (µs by kernel name; the Mosaic kernels of one call share a name, so the
forward with its redo shows the two summed). A clean redo's cost is the with-redo call's total less
the call alone. To set two versions of the package side by side, run it with each first on
``PYTHONPATH`` (``python -S`` with the environment's site-packages appended, where the package is an
editable install, as ``benchmarks.rev_ab`` does).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pimlayers import ops
from pimlayers.ops._flash import hopper

from ._harness import command_line, write_result
from .profile import kernel_us


def run(shape: tuple[int, int, int, int, int] = (1, 8192, 32, 8, 128), reps: int = 2) -> list[dict]:
    """Rows (call, rep, kernel, us) and per call and rep a row with kernel "(all)", the total."""
    if not hopper():
        raise SystemExit("benchmarks.redo_cost: the flash kernels and their redo run on a Hopper GPU only")
    b, t, h, kv, d = shape
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kv, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, t, h, d), jnp.bfloat16)
    fwd_redo = jax.jit(lambda q, k, v: ops.flash_attention_with_redo(q, k, v)[:2])
    out, lse = fwd_redo(q, k, v)
    bwd_args = (q, k, v, out, lse, do)
    calls = [
        ("fwd + redo", fwd_redo, (q, k, v)),
        ("fwd", jax.jit(lambda q, k, v: ops.flash_attention(q, k, v)[:2]), (q, k, v)),
        ("bwd + redo", jax.jit(lambda *a: ops.flash_attention_bwd_with_redo(*a)[:3]), bwd_args),
        ("bwd", jax.jit(lambda *a: ops.flash_attention_bwd(*a)[:3]), bwd_args),
    ]
    rows = []
    for name, fn, args in calls:
        for rep in range(reps):
            us = kernel_us(fn, *args)
            rows.append(dict(call=name, rep=rep, kernel="(all)", us=sum(us.values())))
            rows += [dict(call=name, rep=rep, kernel=kn, us=t) for kn, t in us.most_common()]
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,8192,32,8,128", help="B,T,H,KV,D")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 5 or args.reps < 1:
        raise ValueError(
            f"benchmarks.redo_cost: --shape {args.shape!r}, --reps {args.reps}; expected B,T,H,KV,D, >= 1"
        )
    rows = run(shape, args.reps)
    for r in rows:
        print(f"{r['call']:>10} rep {r['rep']}  {r['us']:9.1f} us  {r['kernel'][:100]}")
    print(
        "wrote",
        write_result(
            "redo-cost", rows, command_line("benchmarks.redo_cost", argv), tag=args.tag, note=args.note
        ),
    )


if __name__ == "__main__":
    main()
