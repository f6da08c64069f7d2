"""Kernels of the working tree against other revisions' in alternating processes, side by side.

python -m benchmarks.rev_ab --rev 6ed0dce --case flash --rounds 2

A change to a kernel is timed against the code before it: each variant's ``pimlayers`` package (the
working tree's, and each ``--rev``'s, exported with ``git archive``; a ``--rev`` that names a folder
holding a ``pimlayers`` package, such as another checkout, gives that package) is copied into a folder
of its own with the built extension modules this process imports (so ``--rev`` must not predate a change to
the native handlers' interfaces), and timed in processes of its own, alternating between the
variants for ``--rounds`` rounds so that a drift of the machine falls on all of them. The timing
code is this tree's (``benchmarks``, ``models``, ``train``); only the package differs. A child
imports it with Python's site processing off (``-S``) and the environment's site-packages folders
appended: an editable install's import hook would otherwise map ``pimlayers`` to this tree whatever
the path says. Each child reports where its ``pimlayers`` came from, and the parent refuses a run
that imported the wrong one.

Cases (``--case``), each at ``--shape``:

* ``flash`` (Hopper GPUs): the verified flash attention's forward and backward, and both with the
  checks off, and with the bounds kernels where the variant has them (opt-in before 2026-12-05, the
  default since, when "XLA bounds" rows time XLA's bounds); shape B,T,H,KV,D
  (default 1,8192,32,8,128), bf16.
* ``matmul``: the protected GEMM's forward (the default FaultPolicy) and the plain one; shape M,K,N
  (default 8192,4096,14336), bf16 (``--dtype``).
* ``projections``: the forward and backward (``jax.vjp``, fixed cotangents) of the projections of
  one input as a Llama-3 layer has them, protected (``ops.protected_matmuls``, the default
  FaultPolicy) and plain: attention's q, k and v (D -> D, KV, KV) and the MLP's gate and up
  (D -> F, F); shape M,D,KV,F (default 8192,4096,1024,14336), bf16 (``--dtype``).

Before timing, each variant's ops are checked on their clean inputs (``_sane``: the protected GEMM
against the plain one; the verified flash kernels within their own bounds and close to their
unchecked outputs). Time per call: the device kernels' own time in one call from a profiler trace
(``profile.kernel_us``), the median over ``--reps`` such calls; where the trace has no device
timeline (a CPU) the wall time of jitted calls (``_harness.time_fn``). Rows: per variant, round
and op the time (and, with kernel times, ``top``: the kernels of at least 2% of it, µs each); per
variant and op the median over the rounds with ``vs_base`` = the working tree's median / the
variant's (> 1: the variant is faster).
Results go to ``benchmarks/results/<date>-rev-ab[-TAG]-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import site
import statistics
import subprocess
import sys
import tarfile
import tempfile

from ._harness import ROOT, command_line, write_result

__all__ = ["main", "measure", "summarize"]

CASES = ("flash", "matmul", "projections")
_DEFAULT_SHAPES = {
    "flash": (1, 8192, 32, 8, 128),
    "matmul": (8192, 4096, 14336),
    "projections": (8192, 4096, 1024, 14336),
}
_SHAPE_NAMES = {"flash": "B,T,H,KV,D", "matmul": "M,K,N", "projections": "M,D,KV,F"}
_MARK = "REV_AB "


def _parse_shape(case: str, text: str | None) -> tuple[int, ...]:
    want = len(_DEFAULT_SHAPES[case])
    if text is None:
        return _DEFAULT_SHAPES[case]
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != want or min(shape) <= 0:
        raise ValueError(
            f"benchmarks.rev_ab: --shape {text!r} for case {case!r}; expected {_SHAPE_NAMES[case]} (positive)"
        )
    return shape


def _ops(case: str, shape: tuple[int, ...], dtype: str) -> dict:
    """``{name: (jitted fn, args)}`` for one case, from the ``pimlayers`` this process imported."""
    import functools

    import jax
    import jax.numpy as jnp

    import pimlayers
    from pimlayers import ops

    dt = jnp.dtype(dtype)
    if case == "matmul":
        m, k, n = shape
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dt)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(dt)
        policy = pimlayers.FaultPolicy()
        enc = ops.abft_encode(w, policy.block_n)
        prot = jax.jit(lambda x, w, e: ops.protected_matmul(x, w, e, policy=policy)[0])
        return {"plain": (jax.jit(jnp.matmul), (x, w)), "protected": (prot, (x, w, enc))}
    if case == "projections":
        return _projections(shape, dt)
    b, t, h, kv, d = shape
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (b, t, kv, d), jnp.float32).astype(dt)
    v = jax.random.normal(ks[2], (b, t, kv, d), jnp.float32).astype(dt)
    g = jax.random.normal(ks[3], (b, t, h, d), jnp.float32).astype(dt)
    out, lse, _ = ops.flash_attention(q, k, v)
    bwd = (q, k, v, out, lse, g)
    table = {
        "fwd verified": (jax.jit(ops.flash_attention), (q, k, v)),
        "fwd off": (jax.jit(functools.partial(ops.flash_attention, checks=False)), (q, k, v)),
        "bwd verified": (jax.jit(ops.flash_attention_bwd), bwd),
        "bwd off": (jax.jit(functools.partial(ops.flash_attention_bwd, checks=False)), bwd),
    }
    # The bounds kernels, where this variant has them (older revisions do not; opt-in before
    # 2026-12-05), and XLA's bounds where the kernels are the default.
    if "bounds_kernel" in getattr(ops.FlashConfig, "__dataclass_fields__", {}):
        cfg = ops.FlashConfig(bounds_kernel=True)
        table["fwd verified, bounds kernel"] = (
            jax.jit(functools.partial(ops.flash_attention, config=cfg)),
            (q, k, v),
        )
    if "bounds_kernel" in getattr(ops.FlashBwdConfig, "__dataclass_fields__", {}):
        cfg = ops.FlashBwdConfig(bounds_kernel=True)
        table["bwd verified, bounds kernel"] = (
            jax.jit(functools.partial(ops.flash_attention_bwd, config=cfg)),
            bwd,
        )
    if getattr(ops.FlashBwdConfig(), "bounds_kernel", False) is None:  # the kernels the default
        fcfg, bcfg = ops.FlashConfig(bounds_kernel=False), ops.FlashBwdConfig(bounds_kernel=False)
        table["fwd verified, XLA bounds"] = (
            jax.jit(functools.partial(ops.flash_attention, config=fcfg)),
            (q, k, v),
        )
        table["bwd verified, XLA bounds"] = (
            jax.jit(functools.partial(ops.flash_attention_bwd, config=bcfg)),
            bwd,
        )
    return table


def _projections(shape: tuple[int, ...], dt) -> dict:
    """The ``projections`` case: ``{"<group> plain" | "<group> protected": (fn, args)}``, each fn
    the forward and backward of one input's projections, returning the products and the gradients
    of x and of each weight."""
    import functools

    import jax
    import jax.numpy as jnp

    import pimlayers
    from pimlayers import ops

    m, d, kv, f = shape
    policy = pimlayers.FaultPolicy()
    table = {}
    for group, widths in (("qkv", (d, kv, kv)), ("gate/up", (f, f))):
        keys = jax.random.split(jax.random.key(len(widths)), 1 + 2 * len(widths))
        x = jax.random.normal(keys[0], (m, d), jnp.float32).astype(dt)
        ws = tuple(
            (jax.random.normal(kk, (d, n), jnp.float32) / d**0.5).astype(dt)
            for kk, n in zip(keys[1 : 1 + len(widths)], widths, strict=True)
        )
        cts = tuple(
            jax.random.normal(kk, (m, n), jnp.float32).astype(dt)
            for kk, n in zip(keys[1 + len(widths) :], widths, strict=True)
        )

        def both(fwd, x, ws, cts):
            ys, vjp = jax.vjp(fwd, x, ws)
            return ys, *vjp(cts)

        plain = lambda x, ws: tuple(x @ w for w in ws)
        prot = lambda x, ws: ops.protected_matmuls(x, ws, policy=policy)[0]
        table[f"{group} plain"] = (jax.jit(functools.partial(both, plain)), (x, ws, cts))
        table[f"{group} protected"] = (jax.jit(functools.partial(both, prot)), (x, ws, cts))
    return table


def _sane(case: str, table: dict) -> None:
    """Before timing, what each variant's kernels must show on clean inputs: the protected GEMM the
    plain product (bf16 rounding apart) with nothing detected; the verified flash kernels every
    row within its checks' bounds (their ratios <= 1), and the checked outputs close to the unchecked."""
    import jax
    import jax.numpy as jnp

    def diff(a, b):
        return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

    if case == "projections":  # products and gradients within bf16's rounding of the plain ones
        for group in ("qkv", "gate/up"):
            (plain, pa), (prot, qa) = table[f"{group} plain"], table[f"{group} protected"]
            for a, b in zip(jax.tree.leaves(prot(*qa)), jax.tree.leaves(plain(*pa)), strict=True):
                err, size = diff(a, b), float(jnp.max(jnp.abs(b.astype(jnp.float32))))
                if not err <= 2e-2 * max(size, 1.0):
                    raise AssertionError(f"rev_ab: protected {group} differs from the plain one by {err}")
        return
    if case == "matmul":
        (plain, pa), (prot, qa) = table["plain"], table["protected"]
        err = diff(plain(*pa), prot(*qa))
        if not err <= 0.05:
            raise AssertionError(f"rev_ab: the protected GEMM differs from the plain one by {err}")
        return
    for mode in ("fwd", "bwd"):
        (on, a1), (off, a2) = table[f"{mode} verified"], table[f"{mode} off"]
        got, want = on(*a1), off(*a2)
        ratios = [r for r in got[-1] if r is not None]
        worst = max(float(jnp.max(r)) for r in ratios)
        if not worst <= 1.0:
            raise AssertionError(f"rev_ab: the verified flash {mode} flags a clean input (ratio {worst})")
        for a, b in zip(got[:-1], want[:-1], strict=True):  # (the GPU tests' tolerance, 3e-2)
            err = diff(a, b)
            if not err <= 3e-2 * max(1.0, float(jnp.max(jnp.abs(b.astype(jnp.float32))))):
                raise AssertionError(
                    f"rev_ab: the flash {mode} outputs with checks on and off differ by {err}"
                )


def measure(case: str, shape: tuple[int, ...], dtype: str = "bfloat16", reps: int = 3) -> dict:
    """In a child: ``{"pimlayers": its file, "native": the platforms its native handlers loaded for,
    "timer": "kernels" | "wall", "ops": {name: {"us", "top"}}}``."""
    import jax

    import pimlayers

    from ._harness import time_fn
    from .profile import kernel_us

    res = {}
    timer = "kernels"
    table = _ops(case, shape, dtype)
    _sane(case, table)
    for name, (fn, args) in table.items():
        jax.block_until_ready(fn(*args))  # compiled before anything is timed
        runs = [kernel_us(fn, *args) for _ in range(reps)] if timer == "kernels" else []
        if timer == "kernels" and not any(runs):
            timer = "wall"  # no device timeline (a CPU): this op and the rest by the wall clock
        if timer == "wall":
            res[name] = {"us": 1e6 * time_fn(fn, *args), "top": ""}
            continue
        total = statistics.median(sum(r.values()) for r in runs)
        names = {kk for r in runs for kk, us in r.items() if us >= 0.02 * total}
        top = {kk: statistics.median(r.get(kk, 0.0) for r in runs) for kk in names}
        # The largest kernels as one readable cell: "name us; ..." (names cut to 60 characters)
        cell = "; ".join(f"{kk[:60]} {us:.1f}" for kk, us in sorted(top.items(), key=lambda t: -t[1]))
        res[name] = {"us": total, "top": cell}
    from pimlayers._native import has_native

    native = [p for p in ("cpu", "cuda") if has_native(p)]
    return {"pimlayers": pimlayers.__file__, "native": native, "timer": timer, "ops": res}


def summarize(runs: list[tuple[str, int, dict]]) -> list[dict]:
    """Rows from (variant, round, child result): one per (variant, round, op), then one per (variant,
    op) with the median over its rounds and ``vs_base`` = the first variant's median / its own."""
    rows, pooled = [], {}
    for variant, rnd, res in runs:
        for op, r in res["ops"].items():
            rows.append(dict(variant=variant, round=rnd, op=op, us=r["us"], timer=res["timer"], top=r["top"]))
            pooled.setdefault((variant, op), []).append(r["us"])
    base_variant = runs[0][0] if runs else None
    for (variant, op), us in pooled.items():
        med = statistics.median(us)
        base = pooled.get((base_variant, op))
        vs = statistics.median(base) / med if base and med > 0 else None
        rows.append(dict(variant=variant, round="all", op=op, us=med, rounds=len(us), vs_base=vs))
    return rows


def _extension_files() -> list[pathlib.Path]:
    """The built extension modules this environment imports for ``pimlayers`` (asked of a child:
    importing the package here would start jax in the parent)."""
    code = (
        "import importlib.util as u, pimlayers, pathlib\n"
        "for m in ('_pimlayers_cpu', '_pimlayers_cuda'):\n"
        "    s = u.find_spec('pimlayers.' + m)\n"
        "    print(s.origin if s and s.origin else '')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT)
    return [pathlib.Path(p) for p in out.stdout.split() if p and pathlib.Path(p).is_file()]


def _export(rev: str | None, dest: pathlib.Path, extensions: list[pathlib.Path]) -> None:
    """``dest/pimlayers``: the working tree's package (rev None), the package in folder ``rev`` or
    revision ``rev``'s, with the extension modules copied in (over any the source had)."""
    dest.mkdir(parents=True)
    source = ROOT if rev is None else pathlib.Path(rev)
    if rev is None or (source / "pimlayers" / "__init__.py").is_file():
        ignore = shutil.ignore_patterns("__pycache__", "*.so")
        shutil.copytree(source / "pimlayers", dest / "pimlayers", ignore=ignore)
    elif source.is_dir():
        raise ValueError(f"benchmarks.rev_ab: --rev {rev!r} is a folder without a pimlayers package")
    else:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "pimlayers"],
            capture_output=True,
            check=False,
        )
        if out.returncode != 0:
            msg = out.stderr.decode(errors="replace").strip()
            raise ValueError(f"benchmarks.rev_ab: --rev {rev!r}: git archive failed: {msg}")
        tar = dest / "pkg.tar"
        tar.write_bytes(out.stdout)
        with tarfile.open(tar) as tf:
            tf.extractall(dest, filter="data")
        tar.unlink()
    for ext in extensions:
        shutil.copy2(ext, dest / "pimlayers" / ext.name)


# A child's first lines: its config from argv, its own exported package first on the path, this
# tree's benchmarks (and models, train) after it, the site folders appended (it runs with site
# processing off: an editable install's import hook would map pimlayers to this tree whatever the
# path). benchmarks.step_ab --rev's children start the same way.
CHILD_PATHS = """
import json, sys
cfg = json.loads(sys.argv[1])
sys.path[:0] = [cfg["tree"], cfg["root"]]
sys.path += cfg["site"]
"""


def check_imported(who: str, name: str, imported: str, tree: pathlib.Path) -> None:
    """Refuse a child (``name``'s run) that imported ``pimlayers`` from elsewhere than ``tree``."""
    if not imported or not pathlib.Path(imported).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(
            f"benchmarks.{who}: the {name} run imported pimlayers from {imported!r}, expected {tree}"
        )


_CHILD = (
    CHILD_PATHS
    + f"""
from benchmarks.rev_ab import measure
res = measure(cfg["case"], tuple(cfg["shape"]), cfg["dtype"], cfg["reps"])
print({_MARK!r} + json.dumps(res), flush=True)
"""
)


def _site_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dirs if os.path.isdir(d)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rev",
        action="append",
        default=[],
        help="a git revision (or a folder holding a pimlayers package) to time against the working tree",
    )
    ap.add_argument("--case", choices=CASES, default="flash")
    ap.add_argument("--shape", default=None, help="flash: B,T,H,KV,D; matmul: M,K,N; projections: M,D,KV,F")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="profiled calls per op and process")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    ap.add_argument("--tag", default="")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    if not args.rev:
        raise ValueError("benchmarks.rev_ab: give a revision to compare with, --rev REV")
    if args.rounds < 1 or args.reps < 1:
        raise ValueError(f"benchmarks.rev_ab: --rounds {args.rounds}, --reps {args.reps}; expected >= 1")
    shape = _parse_shape(args.case, args.shape)
    extensions = _extension_files()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("working tree", None), *((rev, rev) for rev in args.rev)]
        trees = {}
        for i, (name, rev) in enumerate(variants):
            trees[name] = pathlib.Path(tmp) / f"v{i}"
            _export(rev, trees[name], extensions)
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        for r in range(args.rounds):
            for name, _ in variants:
                cfg = dict(
                    tree=str(trees[name]), root=str(ROOT), site=_site_dirs(), case=args.case, shape=shape,
                    dtype=args.dtype, reps=args.reps,
                )  # fmt: skip
                out = subprocess.run(
                    [sys.executable, "-S", "-c", _CHILD, json.dumps(cfg)],
                    env=env, capture_output=True, text=True, check=False, timeout=args.timeout, cwd=tmp,
                )  # fmt: skip
                line = next((x for x in out.stdout.splitlines() if x.startswith(_MARK)), None)
                if out.returncode != 0 or line is None:
                    raise RuntimeError(f"benchmarks.rev_ab: the {name} run failed:\n{out.stderr[-3000:]}")
                res = json.loads(line[len(_MARK) :])
                check_imported("rev_ab", name, res["pimlayers"], trees[name])
                if runs and res["native"] != runs[0][2]["native"]:
                    raise RuntimeError(
                        f"benchmarks.rev_ab: the {name} run loaded native handlers for {res['native']}, "
                        f"the first run for {runs[0][2]['native']} (the extension modules copied in "
                        "do not load with that revision's package?)"
                    )
                runs.append((name, r, res))
                times = "  ".join(f"{op} {v['us']:.1f}" for op, v in res["ops"].items())
                native = ", ".join(res["native"]) or "none"
                print(f"round {r} {name} ({res['timer']}, us; native: {native}): {times}", flush=True)
    rows = summarize(runs)
    for row in rows:
        if row["round"] == "all":
            vs = "" if row["vs_base"] is None else f"  vs_base={row['vs_base']:.4f}"
            print(f"{row['variant']}: {row['op']} {row['us']:.1f} us{vs}")
    print(
        "wrote", write_result("rev-ab", rows, command_line("benchmarks.rev_ab"), tag=args.tag, note=args.note)
    )


if __name__ == "__main__":
    main()
