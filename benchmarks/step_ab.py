"""The training step with and without an environment setting (or with another revision's code),
side by side in one run.

python -m benchmarks.step_ab --env PIMLAYERS_ABFT_ROW_KERNEL=1 --layers 4 --steps 10 --rounds 2
python -m benchmarks.step_ab --rev 9475388 --layers 4 --steps 8 --rounds 3 --flip-every 0
python -m benchmarks.step_ab --step fused=1 --layers 4 --steps 8 --rounds 4 --flip-every 0

The native handlers read their switches (``PIMLAYERS_ABFT_ROW_KERNEL``: the finish's row kernel for
128-column blocks) once per process, so each variant trains in its own process; the two alternate
for ``--rounds`` rounds, so a drift of the machine over the run falls on both. Each process trains
the llama3 suite's default protected step (``benchmarks.llama3.step_config``; ``--no-recompute``:
with ``FaultPolicy(recompute=False)``, as the tool ran before 2026-12-06's fifty-fifth session;
``--unprotected``: the stock step with cuDNN's attention instead) and reports every step's time
but the first (which compiles: the training script leaves it out); ``--flip-every`` sets how often
parameter flips are injected (5, as the suite; in 6-step runs of the 4-layer step on an H100,
2026-12-06, each process's one repair step took ~230 ms against ~110, so short runs want 0). The
rows give each process's median step (and its steps, what it injected and detected, and the host's
time in each step's call, ``calls_ms``: near the step time, the host waited inside the call) and, per
variant, the median of all its steps, with ``vs_base`` = the base variant's median / this one's
(> 1: faster), its ratio in each round, a 95% bootstrap interval that counts the spread between
processes and a t interval over the rounds (``summarize``): whether the run resolves the difference
(both intervals must exclude 1; one round resolves nothing; ``--resummarize FILE ...`` reads saved
files again under this rule). On an H200 (2026-12-03) the
medians of processes running the same code differed by up to 9 ms in a 120 ms step (each process
autotuning its own GEMMs, as the tool then had them do): resolving a change of a few ms takes
several rounds. The
processes now share XLA's autotuning results (``--xla_gpu_per_fusion_autotune_cache_dir``, a
temporary folder; ``--own-autotuning`` for the old behaviour), so the GEMMs and fusions that XLA
autotunes get the same choices in every process; whether that narrows the spread is not yet
measured. A variant's later rounds load the program its first round compiled (JAX's compilation
cache, a folder per variant; ``--no-compile-cache``: each process compiles), so they start sooner;
the compiling step is left out of the timing either way. Results go to
``benchmarks/results/<date>-step-ab[-TAG]-<device>.json``.

``--rev REV`` (instead of ``--env``; repeatable) times code instead of a setting: the working tree's
``pimlayers`` package against each revision's (a git revision, or a folder holding a package),
exported and imported as ``benchmarks.rev_ab`` does it (each with this environment's built
extension modules, so a revision must not predate a change to the native handlers' interfaces;
each child reports the package it imported and the parent refuses one that imported another), with
this tree's training script and timing code. For a change to the step too small for the step's
kernel time to resolve between sessions: on an H100 (2026-12-06) the same code profiled in two
processes gave 108.07 and 107.97 ms of kernels, its cuBLAS kernels 56.14 and 54.49 ms
(profile-protect-s56, -s56rep), as XLA chose other GEMM algorithms; here every process reuses the
first one's autotuning.

``--step NAME=VALUE`` (instead of ``--env`` or ``--rev``; repeatable) times a configuration of the
step: the default protected step against the same with fields of ``benchmarks.llama3.Step`` set
(``fused=1``: ``FaultPolicy(fused=True)``, the fused forward GEMM where a Hopper GPU runs it;
``weighted_checks=0``; ...), each variant in processes of its own as above, so a configuration
whose lead is smaller than the spread between one run's configurations (the llama3 suite runs its
configurations one after the other in one process) is resolved or shown unresolved.

``--attention fwd`` (or ``fwd+bwd``) times the protected attention core instead of a training step:
``layers.attention_core`` with the default FaultPolicy (its recompute included: since the later runs
of 2026-12-05 the device redo, before a loop) at one Llama-3-8B layer's attention (B = 1, T =
``--seq``, 32 query / 8 KV heads, D = 128, ``--dtype``), ``--steps`` calls per process after one
that compiles. Written for settings that act on the loop, such as XLA's command buffers with
device-side loops (``--env "XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"``): on an
H100 (2026-12-05, step-ab-s44cb) the loop's forward took 1.271 ms a call with them against 1.218
without, so they did not take its host round trip away; the device redo did (peers-s44bwd).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from ._harness import ROOT, command_line, without_options, write_result

__all__ = ["main", "summarize", "variant_envs"]

_PKG = "STEP_AB_PIMLAYERS "


def _rev_child() -> str:
    """A --rev variant's child: ``benchmarks.rev_ab``'s path set-up, then it reports the package it
    imported and runs this module's child."""
    from .rev_ab import CHILD_PATHS

    return (
        CHILD_PATHS
        + f"""
import pimlayers
print({_PKG!r} + pimlayers.__file__, flush=True)
from benchmarks.step_ab import main
main(cfg["argv"])
"""
    )


def _attention_child(args) -> None:
    """Seconds per call of the protected attention core (forward, or forward and backward)."""
    import time

    import jax
    import jax.numpy as jnp

    from pimlayers import layers
    from pimlayers.faults import FaultPolicy

    b, t, h, kv, d = 1, args.seq, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 3)
    mk = lambda key, n: jax.random.normal(key, (b, t, n, d), jnp.float32).astype(args.dtype)
    q, k, v = mk(ks[0], h), mk(ks[1], kv), mk(ks[2], kv)
    fwd = lambda q, k, v: layers.attention_core(q, k, v, policy=FaultPolicy())[0]
    if args.attention == "fwd":
        fn = jax.jit(fwd)
    else:
        loss = lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32))
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    seconds = []
    for _ in range(args.steps):  # the first compiles, and is left out as a training step's is
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        seconds.append(time.perf_counter() - t0)
    print("STEP_AB " + json.dumps({"step_seconds": seconds[1:]}))


def _child(args) -> None:
    if args.attention:
        return _attention_child(args)
    from train.llama3 import train

    from ._harness import environ
    from .llama3 import Step, step_config

    flash = "on" if args.unprotected else "auto"
    step = Step(protect=not args.unprotected, flash=flash, recompute=not args.no_recompute)
    step = step._replace(**step_fields(args.step))
    # As the llama3 suite runs a Step: its checks_kernel is the environment's switch while it traces.
    kernel = "1" if step.checks_kernel else None
    with tempfile.TemporaryDirectory() as tmp, environ("PIMLAYERS_CHECKS_KERNEL", kernel):
        shape = (args.layers, args.steps, 1, args.seq, args.config, args.dtype)
        cfg = step_config(*shape, args.flip_every, "gemms", tmp, step)
        s = train(cfg)
    # What each process injected and what its checks did with it: a setting that changed the
    # results (not only the time) shows here.
    faults = {k: s[k] for k in ("injected", "gemm", "memory")}
    # The host's time in each step's call (the training script's call_seconds): near the step
    # time, the host waited inside the call (a branch or loop on a GPU reads its predicate there).
    res = {"step_seconds": [float(t) for t in s["step_seconds"]], "faults": faults}
    res["call_seconds"] = [float(t) for t in s["call_seconds"]]
    print("STEP_AB " + json.dumps(res))


def summarize(runs: list[tuple[str, int, list[float]]], resamples: int = 2000) -> list[dict]:
    """Rows from (variant, round, step seconds) of each process: one per process (its steps in
    ``steps_ms``), then one per variant pooling its steps; the first variant is the base of
    ``vs_base``. ``iqr_ms`` is the interquartile range: the step that repairs injected parameter
    flips takes about a second and would set any range that counted it.

    Each other variant's pooled row also says whether the run resolves its difference from the
    base: ``round_ratios``, the base's median / the variant's in each round (the two processes of a
    round ran one after the other), ``faster_rounds``, how many of those exceed 1, and
    ``ci95_vs_base``, a 95% interval of ``vs_base`` by a two-level bootstrap (``resamples`` draws,
    seeded: rounds drawn with replacement, the same rounds for both variants, then each drawn
    process's steps with replacement), so the spread between processes (each autotunes and places
    its own programs) counts, not only between steps; and ``ci95_rounds``, a t interval (n - 1
    degrees of freedom) of the rounds' geometric-mean ratio. ``resolved``: both intervals exclude 1,
    on the same side. The bootstrap alone is too narrow with few rounds: with two it spans just the
    two rounds' ratios, so two rounds on the same side "resolve" any difference, where two processes
    of the same code can differ by more than the difference (5.886 and 5.577 ms a call, the base of
    step-ab-s65fvbwd, H100, 2026-12-07); the rounds' t interval, with one degree of freedom there,
    asks for rounds that agree closely."""

    def row(variant, rnd, t):
        q25, q50, q75 = np.percentile(1e3 * np.asarray(t), [25, 50, 75])
        return dict(variant=variant, round=rnd, steps=len(t), step_ms=float(q50), iqr_ms=float(q75 - q25))

    rows = [row(v, r, t) | dict(steps_ms=[round(1e3 * x, 3) for x in t]) for v, r, t in runs]
    pooled: dict[str, list[float]] = {}
    by_round: dict[str, dict] = {}
    for v, r, t in runs:
        pooled.setdefault(v, []).extend(t)
        by_round.setdefault(v, {})[r] = np.asarray(t, float)
    base = base_name = None
    for v, t in pooled.items():
        rows.append(row(v, "all", t))
        if base is None:
            base, base_name = rows[-1]["step_ms"], v
        rows[-1]["vs_base"] = base / rows[-1]["step_ms"]
        if v != base_name:
            rows[-1].update(_paired(by_round[base_name], by_round[v], resamples))
    return rows


def _paired(base: dict, variant: dict, resamples: int) -> dict:
    """``summarize``'s per-round ratios and bootstrap interval of one variant against the base, over
    the rounds both ran."""
    rounds = sorted(set(base) & set(variant), key=str)
    ratios = [float(np.median(base[r]) / np.median(variant[r])) for r in rounds]
    rng = np.random.default_rng(0)

    def steps(runs: dict, pick) -> np.ndarray:  # each drawn round's process, its steps redrawn
        return np.concatenate([rng.choice(runs[rounds[i]], runs[rounds[i]].size) for i in pick])

    draws = []
    for _ in range(resamples if rounds else 0):
        pick = rng.integers(0, len(rounds), len(rounds))
        draws.append(np.median(steps(base, pick)) / np.median(steps(variant, pick)))
    lo, hi = (float(x) for x in np.percentile(draws, [2.5, 97.5])) if draws else (float("nan"),) * 2
    t_lo, t_hi = _rounds_interval(ratios)
    return dict(
        round_ratios=ratios,
        faster_rounds=sum(x > 1 for x in ratios),
        ci95_vs_base=[lo, hi],
        ci95_rounds=[t_lo, t_hi],
        resolved=bool(draws) and ((lo > 1 and t_lo > 1) or (hi < 1 and t_hi < 1)),
    )


def interval_line(row: dict) -> str:
    """A variant's pooled row (``summarize``) in words: its rounds, both intervals, the verdict."""
    (lo, hi), (t_lo, t_hi) = row["ci95_vs_base"], row["ci95_rounds"]
    ratios = ", ".join(f"{x:.4f}" for x in row["round_ratios"])
    why = []
    if not (lo > 1 or hi < 1):
        why.append("the bootstrap's interval holds 1")
    if math.isnan(t_lo):
        why.append("one round gives no rounds' interval")
    elif not (t_lo > 1 or t_hi < 1):
        why.append("the rounds' interval holds 1")
    verdict = (
        "resolved" if row["resolved"] else f"not resolved ({'; '.join(why) or 'the intervals disagree'})"
    )
    return (
        f"vs_base per round [{ratios}], faster in {row['faster_rounds']} of {len(row['round_ratios'])}; "
        f"95% intervals: bootstrap {lo:.4f}-{hi:.4f}, rounds' t {t_lo:.4f}-{t_hi:.4f}: {verdict}"
    )


def resummarize(files: list[str]) -> list[dict]:
    """Step-ab results files' per-process rows (their ``steps_ms``) through ``summarize`` again: a file
    written before a change of its verdict's rule (``ci95_rounds``: 2026-12-07) read under the
    present one. Prints each variant's line beside what the file said; returns the pooled rows."""
    pooled = []
    for f in files:
        data = json.loads(pathlib.Path(f).read_text())
        if data.get("suite") != "step-ab":
            raise ValueError(f"benchmarks.step_ab --resummarize: {f} is a {data.get('suite')!r} file")
        old = {r["variant"]: r for r in data["rows"] if r["round"] == "all"}
        procs = [r for r in data["rows"] if r["round"] != "all"]
        if not all("steps_ms" in r for r in procs):
            raise ValueError(f"benchmarks.step_ab --resummarize: {f} keeps no steps per process (steps_ms)")
        print(pathlib.Path(f).name)
        for row in summarize([(r["variant"], r["round"], [1e-3 * x for x in r["steps_ms"]]) for r in procs]):
            if "ci95_vs_base" in row:
                said = old[row["variant"]].get("resolved")
                print(f"  {row['variant']}: {interval_line(row)} (the file said resolved={said})")
                pooled.append(row | dict(file=pathlib.Path(f).name, file_resolved=said))
    return pooled


def _rounds_interval(ratios: list[float]) -> tuple[float, float]:
    """A 95% t interval of the rounds' geometric-mean ratio (the rounds as independent samples of the
    ratio between two processes); NaN with fewer than two rounds (NaN compares false: unresolved)."""
    from scipy import stats

    logs = np.log(np.asarray(ratios, float))
    if logs.size < 2:
        return float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, logs.size - 1)) * float(logs.std(ddof=1)) / np.sqrt(logs.size)
    return float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def variant_envs(environ: dict, setting: dict, cache: str, own_autotuning: bool) -> tuple[dict, dict]:
    """The base's and the variant's environments: ``environ`` without the names ``setting`` sets,
    and with them. Unless ``own_autotuning``, both get XLA's per-fusion autotuning cache in ``cache``
    added to their XLA_FLAGS (the variant's own, where the setting names XLA_FLAGS)."""
    base = {k: v for k, v in environ.items() if k not in setting}
    variant = {**base, **setting}
    for env in (base, variant):
        flags = env.get("XLA_FLAGS", "")
        if not own_autotuning and "autotune_cache_dir" not in flags:
            # Every process after the first reuses the first's GEMM and fusion autotuning, so the
            # variants differ only in the setting (different choices per process are one suspect
            # for the spread between processes running the same code; not confirmed).
            env["XLA_FLAGS"] = f"{flags} --xla_gpu_per_fusion_autotune_cache_dir={cache}".strip()
    return base, variant


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="the variant's setting")
    ap.add_argument(
        "--rev",
        action="append",
        default=[],
        help="a git revision (or a folder holding a pimlayers package) whose package is a variant "
        "against the working tree's (instead of --env)",
    )
    ap.add_argument(
        "--step",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a field of benchmarks.llama3.Step the variant sets (e.g. fused=1; instead of --env or --rev)",
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="steps per process (the first is left out)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--config", default="llama3_8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--unprotected", action="store_true", help="the stock step (cuDNN attention)")
    ap.add_argument("--no-recompute", action="store_true", help="the protected step without recompute")
    ap.add_argument(
        "--flip-every",
        type=int,
        default=5,
        help="parameter flips every N steps (0: none; a step that repairs them takes twice a step or more)",
    )
    ap.add_argument(
        "--attention",
        choices=("fwd", "fwd+bwd"),
        help="time the protected attention core (one layer's) instead of a training step",
    )
    ap.add_argument(
        "--own-autotuning",
        action="store_true",
        help="each process autotunes its own GEMMs (by default all reuse the first process's results)",
    )
    ap.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="every process compiles its program (by default a variant's later rounds load its "
        "first round's executable from JAX's compilation cache, one folder per variant)",
    )
    ap.add_argument("--tag", default="")
    ap.add_argument("--note", default="")
    ap.add_argument(
        "--resummarize",
        nargs="+",
        metavar="FILE",
        help="no run: each step-ab results file's processes summarized again under the present rule",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if args.resummarize:
        return resummarize(args.resummarize)
    setting = {}
    for kv in args.env:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            raise ValueError(f"benchmarks.step_ab: --env {kv!r}; expected NAME=VALUE")
        setting[name] = value
    fields = step_fields(args.step)  # refused here, before any process starts
    if sum(map(bool, (setting, args.rev, fields))) != 1:
        raise ValueError(
            "benchmarks.step_ab: give the variant's setting with --env NAME=VALUE, revisions to time "
            "against the working tree with --rev REV, or the step's fields with --step NAME=VALUE "
            "(one of the three)"
        )
    if fields and (args.unprotected or args.attention):
        raise ValueError(
            "benchmarks.step_ab: --step sets the protected step's fields; not with "
            "--unprotected or --attention"
        )
    if args.flip_every < 0:
        raise ValueError(f"benchmarks.step_ab: --flip-every {args.flip_every}; expected >= 0 (0: no flips)")
    argv = sys.argv[1:] if argv is None else list(argv)
    child_argv = ["--child", *_without_revs(a for a in argv if a != "--child")]
    child = [sys.executable, "-m", "benchmarks.step_ab", *child_argv]
    base_child = [
        sys.executable,
        "-m",
        "benchmarks.step_ab",
        *without_options(child_argv, values=("--step",)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "autotune")
        os.mkdir(cache)
        base_env, variant_env = variant_envs(dict(os.environ), setting, cache, args.own_autotuning)
        if args.rev:
            variants = _rev_variants(args.rev, pathlib.Path(tmp), base_env, child_argv)
        elif fields:  # one environment: the variant's child alone is given the fields
            variants = [("base", base_child, base_env, None), (" ".join(args.step), child, base_env, None)]
        else:
            variants = [("base", child, base_env, None), (" ".join(args.env), child, variant_env, None)]
        variants = own_compile_caches(variants, None if args.no_compile_cache else pathlib.Path(tmp))
        runs, faults, calls = [], [], []
        for r in range(args.rounds):
            for name, cmd, env, tree in variants:
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                line = next((x for x in out.stdout.splitlines() if x.startswith("STEP_AB ")), None)
                if out.returncode != 0 or line is None:
                    raise RuntimeError(f"benchmarks.step_ab: the {name} run failed:\n{out.stderr[-3000:]}")
                if tree is not None:
                    _check_package(name, out.stdout, tree)
                res = json.loads(line[len("STEP_AB ") :])
                steps = res["step_seconds"]  # the compiling one left out
                runs.append((name, r, steps))
                faults.append(res.get("faults"))  # None from the attention child
                calls.append(res.get("call_seconds"))  # None from the attention child
                med = 1e3 * np.median(steps)
                print(f"round {r} {name}: median step {med:.2f} ms over {len(steps)} steps", flush=True)
                if res.get("faults"):
                    print(f"  faults: {json.dumps(res['faults'])}", flush=True)
    rows = summarize(runs)
    for row, f, c in zip(rows, faults, calls, strict=False):  # the per-process rows come first
        if f:
            row["faults"] = f
        if c:
            row["calls_ms"] = [round(1e3 * x, 3) for x in c]
    for row in rows:
        print(
            "  ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row.items()
                if k not in ("steps_ms", "calls_ms", "faults", "round_ratios", "ci95_vs_base", "ci95_rounds")
            )
        )
        if "ci95_vs_base" in row:
            print("  " + interval_line(row))
    print(
        "wrote",
        write_result("step-ab", rows, command_line("benchmarks.step_ab"), tag=args.tag, note=args.note),
    )


def own_compile_caches(variants: list[tuple], folder: pathlib.Path | None) -> list[tuple]:
    """``variants`` (``(name, command, env, package)``) each with a JAX compilation cache of its own
    under ``folder``, in place of any the environment names: a variant's later rounds then load the
    program its first round compiled instead of compiling it again (the compile is the step left
    out of the timing). One new folder per variant, never shared: a setting may change what XLA
    compiles without changing the program's text, which is all the cache's key sees (e.g. the
    native handlers' traits, which decide what XLA's command buffers take). ``folder`` None: no
    cache at all, every process compiles. A GPU's rounds read the step back too: jaxlib's Mosaic GPU
    lowering names the flash kernels' modules with a process-wide counter, which is in the cache's
    key, but each round is a new process lowering the same program in the same order (H100,
    2026-12-07: ``tests/test_benchmarks.py``'s GPU cache tests)."""
    out = []
    for i, (name, cmd, env, tree) in enumerate(variants):
        env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        if folder is None:
            env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        else:
            env["JAX_COMPILATION_CACHE_DIR"] = str(folder / f"jax-cache-{i}")
        out.append((name, cmd, env, tree))
    return out


def _without_revs(argv) -> list[str]:
    """``argv`` less its ``--rev`` options (a child runs one package, given by its path)."""
    return without_options(argv, values=("--rev",))


def step_fields(pairs) -> dict:
    """``--step NAME=VALUE`` options as ``benchmarks.llama3.Step`` fields, each value read by its
    field's annotation (bool: 1/0/true/false; int: an integer; ``| None``: also none; str as
    given). ``protect`` is not one of them: both variants are the protected step. (The parent
    imports the training script's modules only for these: it starts no backend either way.)"""
    if not pairs:
        return {}
    import typing

    from .llama3 import Step

    hints = typing.get_type_hints(Step).items()
    kinds = {n: getattr(a, "__name__", str(a)) for n, a in hints if n != "protect"}
    out = {}
    for kv in pairs:
        name, sep, value = kv.partition("=")
        if not sep or name not in kinds:
            raise ValueError(
                f"benchmarks.step_ab: --step {kv!r}; expected NAME=VALUE with NAME one of {', '.join(kinds)}"
            )
        kind, low = kinds[name], value.strip().lower()
        if "None" in kind and low == "none":
            out[name] = None
        elif "bool" in kind:
            if low not in ("1", "0", "true", "false"):
                raise ValueError(f"benchmarks.step_ab: --step {kv!r}; {name} is {kind} (1, 0, true, false)")
            out[name] = low in ("1", "true")
        elif "int" in kind:
            if not low.lstrip("-").isdigit():
                raise ValueError(f"benchmarks.step_ab: --step {kv!r}; {name} is {kind}")
            out[name] = int(low)
        else:
            out[name] = value
    return out


def _rev_variants(revs, tmp: pathlib.Path, env: dict, child_argv: list[str]) -> list[tuple]:
    """``(name, command, env, package folder)`` per variant: the working tree's package and each
    revision's (exported as ``benchmarks.rev_ab`` exports them, with this environment's built
    extension modules), each child importing its own."""
    from .rev_ab import _export, _extension_files, _site_dirs

    extensions = _extension_files()
    variants = []
    for i, (name, rev) in enumerate([("working tree", None), *((r, r) for r in revs)]):
        tree = tmp / f"v{i}"
        _export(rev, tree, extensions)
        cfg = dict(tree=str(tree), root=str(ROOT), site=_site_dirs(), argv=child_argv)
        variants.append((name, [sys.executable, "-S", "-c", _rev_child(), json.dumps(cfg)], env, tree))
    return variants


def _check_package(name: str, stdout: str, tree: pathlib.Path) -> None:
    """Refuse a --rev child that imported another package than its own."""
    from .rev_ab import check_imported

    line = next((x for x in stdout.splitlines() if x.startswith(_PKG)), "")
    check_imported("step_ab", name, line[len(_PKG) :], tree)


if __name__ == "__main__":
    main()
