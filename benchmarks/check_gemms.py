"""A Llama-3 decoder layer's ABFT check GEMMs as a GPU process forms them, and their floors by arithmetic.

python -m benchmarks.check_gemms                          # Llama-3-8B dims, T = 8192, an H100's rates
python -m benchmarks.check_gemms --bandwidth 4.8          # an H200's HBM
python -m benchmarks.check_gemms --plain-checks --block-n 256    # what fewer columns would leave
python -m benchmarks.check_gemms --config llama3_tiny --tokens 128 --save tiny

Nothing runs on a device: one decoder layer's forward and backward are traced abstractly
(``jax.eval_shape``, any machine) with the process's platform checks answering as on an NVIDIA GPU,
so the protected products form their checks as the GPU step does (one shared check for projections
of one operand, XLA's split-dot GEMMs) rather than the CPU's native passes. Every check GEMM
(``pimlayers.ops._abft.abft_checks`` on a bf16 operand) is recorded: its operand, its columns (c's
and mag's bf16 terms per 128-column block, ``_abft._check_terms``), and whether the one-read checks
kernel takes it (``PIMLAYERS_CHECKS_KERNEL=1``: at most ``PROTECTED_COLUMNS`` padded). A one-device
step is modelled; with several devices a transposed check (xᵀ·Σdy) keeps XLA's dots.

Its floors are arithmetic, not measurements: a check reads its operand x from HBM and multiplies
x's rows by its columns, so it takes at least max(bytes / bandwidth, flops / rate). XLA's form
reads x twice (c = x·[terms of Σw], mag = |x|·[terms of Σ|w|]: two GEMMs), a one-read form once.
``--gemm-tflops`` is the rate a check GEMM's multiplies can reach: 640 TFLOP/s, what the c GEMM of
gate and up's forward check (1,344 columns, compute-bound) ran at on an H100 (2026-12-07,
docs/gpu-tests.md); ``--bandwidth`` an H100 SXM's 3.35 TB/s (datasheet). The step's measured check
GEMMs come from ``python -m benchmarks.profile`` (its ``check GEMMs`` category).

Labels name the layer's weights whose shapes match a check; where two weights share a shape (gate
and up, or o's forward and its x-gradient, told apart by the trace's order: the forward's checks
first) the label names both. The remat of the training step (``--remat-policy gemms``: the
products' outputs saved) is not modelled: these are one forward's and one backward's checks.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from unittest import mock

import jax
import jax.numpy as jnp

from ._harness import command_line, write_result

H100_BANDWIDTH_TBS = 3.35  # H100 SXM HBM3, datasheet
CHECK_GEMM_TFLOPS = 640.0  # a compute-bound check GEMM on an H100 (gate and up's forward c, 2026-12-07)


def _weights(cfg) -> list[tuple[str, int, tuple[int, ...]]]:
    """``(name, k_in, outputs)`` of a decoder layer's protected products: projections of one operand
    (q, k and v; gate and up) share one check, each weight with its own column blocks, and one
    x-gradient GEMM (q, k and v's; gate's and up's are apart in the backward)."""
    hd = cfg.hd
    return [
        ("q/k/v", cfg.dim, (cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd)),
        ("o", cfg.n_heads * hd, (cfg.dim,)),
        ("gate+up", cfg.dim, (cfg.ffn_dim, cfg.ffn_dim)),
        ("gate", cfg.dim, (cfg.ffn_dim,)),
        ("up", cfg.dim, (cfg.ffn_dim,)),
        ("down", cfg.ffn_dim, (cfg.dim,)),
    ]


def _label(
    cfg, block_n: int, forward: bool, transposed: bool, k: int, rows: int, nb: int, batched: bool
) -> str:
    """The weights a check's shape fits, with its role: ``forward`` (x·Σw), ``dx`` (dy·Σwᵀ) or
    ``dw`` (xᵀ·Σdy, the weight gradient's transposed check). ``batched`` (checksums per leading
    index): attention's own GEMMs, where the flash kernels cannot take them."""
    if batched:
        return f"attention {'forward' if forward else 'backward'}"
    blocks = lambda outs: sum(-(-n // block_n) for n in outs)
    ws = _weights(cfg)
    if forward:
        role, fits = "forward", [nm for nm, ki, outs in ws if k == ki and nb == blocks(outs)]
    elif transposed:
        role, fits = "dw", [nm for nm, ki, outs in ws if rows == ki and nb == blocks(outs)]
    else:
        role, fits = "dx", [nm for nm, ki, outs in ws if k == sum(outs) and nb == blocks((ki,))]
    return f"{' or '.join(fits) or '?'} {role}"


@contextlib.contextmanager
def _as_on_a_gpu(log: list[dict]):
    """Every bf16 check GEMM traced inside is appended to ``log``; the platform checks answer as a
    one-device Hopper GPU process's do, whatever devices this process has: no native CPU checks,
    the one-read kernel's device gate open (its eligibility asked as on a GPU), the verified flash
    attention where its shapes fit (its GEMMs checked inside its kernels, no check GEMMs). Nothing
    is lowered: traced abstractly only."""
    from pimlayers.layers import attention
    from pimlayers.ops import _abft, _checks_kernel, _flash, _flash_bwd, _protected_matmul

    original = _abft._with_checks_kernel

    def recording(reference, x, enc, k, transposed, lam, weighted=True):
        c_terms, mag_terms, _ = _abft._check_terms(k, lam)
        nb = enc.abs_sums.shape[-1]
        cols = nb * (c_terms * (2 if weighted else 1) + mag_terms)
        takes = _checks_kernel.checks_kernel_applies(  # one device: transposed checks too
            x,
            enc.sums,
            c_terms,
            mag_terms,
            transposed,
            weighted,
            max_columns=_checks_kernel.PROTECTED_COLUMNS,
        )
        log.append(
            dict(
                x_shape=tuple(int(d) for d in x.shape),
                batched=math.prod(enc.abs_sums.shape[:-2]) > 1,
                transposed=bool(transposed),
                k=int(k),
                blocks=int(nb),
                c_terms=int(c_terms),
                mag_terms=int(mag_terms),
                columns=int(cols),
                padded_columns=int(_checks_kernel._padded(cols)),
                checks_kernel=bool(takes),
            )
        )
        return original(reference, x, enc, k, transposed, lam, weighted)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_abft, "_with_checks_kernel", recording))
        for mod in (_abft, _protected_matmul):
            stack.enter_context(mock.patch.object(mod, "checks_native_everywhere", lambda: False))
        stack.enter_context(mock.patch.object(_checks_kernel, "_gpu_runs_it", lambda: True))
        for mod in (attention, _flash, _flash_bwd):  # the verified flash attention where it applies
            stack.enter_context(mock.patch.object(mod, "hopper", lambda: True))
        stack.enter_context(mock.patch.object(attention, "_per_device", lambda: True))  # one device
        yield


def layer_checks(
    config: str = "llama3_8b", tokens: int = 8192, block_n: int = 128, plain: bool = False
) -> tuple[list[dict], object]:
    """One decoder layer's check GEMMs, forward then backward, each a dict of its shape, columns and
    label: the layers' default policy with ``block_n``-column blocks (the training script's 128);
    ``plain``: ``FaultPolicy(weighted_checks=False, locate=False)``, c1 without the position-weighted
    c2. Any ``block_n`` is traced (the CUDA finish's tile kernel and the pair encode are written for
    128: other widths take slower paths)."""
    from flax import nnx

    from models.llama3 import DecoderBlock, get_config
    from pimlayers import FaultPolicy

    cfg = get_config(config)
    policy = FaultPolicy(block_n=block_n, locate=not plain, weighted_checks=not plain)
    make = lambda: DecoderBlock(
        cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, policy=policy, rngs=nnx.Rngs(0)
    )
    graph, state = nnx.split(nnx.eval_shape(make))
    x = jax.ShapeDtypeStruct((1, tokens, cfg.dim), jnp.bfloat16)

    def loss(st, x):
        y, _ = nnx.merge(graph, st)(x)
        return y.astype(jnp.float32).sum()

    fwd, both = [], []
    with _as_on_a_gpu(fwd):
        jax.eval_shape(loss, state, x)
    with _as_on_a_gpu(both):
        jax.eval_shape(jax.grad(loss, allow_int=True), state, x)
    if both[: len(fwd)] != fwd:
        raise RuntimeError(
            "benchmarks.check_gemms: the backward's trace did not begin with the forward's checks"
        )
    for i, r in enumerate(both):
        rows = r["x_shape"][-1] if r["transposed"] else math.prod(r["x_shape"][:-1])
        r["rows"] = int(rows)
        r["check"] = _label(
            cfg, policy.block_n, i < len(fwd), r["transposed"], r["k"], rows, r["blocks"], r["batched"]
        )
    return both, cfg


def with_floors(rows: list[dict], bandwidth_tbs: float, gemm_tflops: float) -> list[dict]:
    """``rows`` with each check's bytes of x, its multiplies and its floors in µs: XLA's two reads
    of x (``two_read_us``) and one (``one_read_us``), each against the multiplies at ``gemm_tflops``."""
    out = []
    for r in rows:
        read = r["rows"] * r["k"] * 2  # bf16 x, read once
        flops = 2.0 * r["rows"] * r["k"] * r["columns"]
        mult = flops / (gemm_tflops * 1e12) * 1e6
        one = read / (bandwidth_tbs * 1e12) * 1e6
        first = (
            "check",
            "x_shape",
            "transposed",
            "k",
            "rows",
            "blocks",
            "columns",
            "padded_columns",
            "checks_kernel",
        )
        row = {k: r[k] for k in first} | {k: v for k, v in r.items() if k not in first}
        row["x_shape"] = "x".join(map(str, r["x_shape"]))
        out.append(
            row
            | {
                "x_mb": read / 1e6,
                "gflop": flops / 1e9,
                "read_us": one,
                "multiply_us": mult,
                "two_read_us": max(2 * one, mult),
                "one_read_us": max(one, mult),
            }
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3_8b")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a step (batch x sequence)")
    ap.add_argument(
        "--block-n", type=int, default=128, help="FaultPolicy.block_n (the training script's 128)"
    )
    ap.add_argument(
        "--plain-checks",
        action="store_true",
        help="FaultPolicy(weighted_checks=False, locate=False): c1 alone, no position-weighted c2",
    )
    ap.add_argument("--layers", type=int, default=4, help="layers a step, for the totals")
    ap.add_argument("--bandwidth", type=float, default=H100_BANDWIDTH_TBS, help="HBM TB/s")
    ap.add_argument(
        "--gemm-tflops", type=float, default=CHECK_GEMM_TFLOPS, help="a check GEMM's multiply rate"
    )
    ap.add_argument(
        "--save", default="", metavar="TAG", help="write benchmarks/results/<date>-check-gemms-TAG-..."
    )
    ap.add_argument("--note", default="")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.layers < 1 or args.bandwidth <= 0 or args.gemm_tflops <= 0:
        raise ValueError(
            f"benchmarks.check_gemms: --tokens {args.tokens}, --layers {args.layers}, --bandwidth "
            f"{args.bandwidth}, --gemm-tflops {args.gemm_tflops}; expected counts >= 1 and rates > 0"
        )
    rows, _ = layer_checks(args.config, args.tokens, args.block_n, args.plain_checks)
    rows = with_floors(rows, args.bandwidth, args.gemm_tflops)
    print(
        f"{args.config}: one decoder layer at {args.tokens} tokens, {args.block_n}-column blocks"
        f"{', plain checks' if args.plain_checks else ''}, as a GPU traces it; floors at "
        f"{args.bandwidth} TB/s and {args.gemm_tflops} TFLOP/s (arithmetic, not measured)"
    )
    head = ("check", "x", "cols", "padded", "kernel", "GFLOP", "2 reads µs", "1 read µs")
    print(
        f"{head[0]:<22}{head[1]:>14}{head[2]:>6}{head[3]:>8}{head[4]:>8}{head[5]:>8}{head[6]:>12}{head[7]:>11}"
    )
    for r in rows:
        print(
            f"{r['check']:<22}{r['x_shape']:>14}{r['columns']:>6}{r['padded_columns']:>8}"
            f"{'yes' if r['checks_kernel'] else 'no':>8}{r['gflop']:>8.1f}"
            f"{r['two_read_us']:>12.1f}{r['one_read_us']:>11.1f}"
        )
    taken = sum(r["checks_kernel"] for r in rows)
    two, one = sum(r["two_read_us"] for r in rows), sum(r["one_read_us"] for r in rows)
    gf = sum(r["gflop"] for r in rows)
    gap = sum(r["two_read_us"] - r["one_read_us"] for r in rows if r["checks_kernel"])
    print(
        f"a layer: {len(rows)} check GEMMs ({taken} the checks kernel takes), {gf:.0f} GFLOP; floors "
        f"{two / 1e3:.2f} ms (two reads) and {one / 1e3:.2f} ms (one read); {args.layers} layers: "
        f"{args.layers * two / 1e3:.2f} and {args.layers * one / 1e3:.2f} ms\n"
        f"between the two floors at the checks the kernel takes: {gap / 1e3:.2f} ms a layer, "
        f"{args.layers * gap / 1e3:.2f} ms for {args.layers}"
    )
    if args.save:
        n = args.layers
        note = args.note or (
            f"Arithmetic, not measured: floors at {args.bandwidth} TB/s and {args.gemm_tflops} TFLOP/s; "
            f"{n} layers: {n * two / 1e3:.2f} ms two reads, {n * one / 1e3:.2f} one"
        )
        path = write_result(
            "check-gemms",
            rows,
            command_line("benchmarks.check_gemms", argv),
            tag=args.save,
            note=note,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
