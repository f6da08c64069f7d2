"""Timing and result bookkeeping shared by the benchmark suites."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@contextlib.contextmanager
def environ(name: str, value: str | None):
    """``name`` set to ``value`` in the process's environment inside (None: left as it is), as it was
    after (the library reads its switches, e.g. ``PIMLAYERS_CHECKS_KERNEL``, when it traces)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _batch(fn: Callable[..., Any], args, iters: int) -> float:
    """Seconds per call of ``iters`` back-to-back calls, closed by block_until_ready."""
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def time_fn(fn: Callable[..., Any], *args, warmup: int = 3, iters: int = 20, repeats: int = 5) -> float:
    """Median seconds per call of a jitted fn, over `repeats` batches of `iters` back-to-back calls.

    Calls are dispatched asynchronously and the batch is closed by block_until_ready, so per-call
    host overhead overlaps device work for kernels longer than a dispatch (tens of microseconds).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return statistics.median(_batch(fn, args, iters) for _ in range(repeats))


def time_pair(
    a: Callable[..., Any],
    args_a,
    b: Callable[..., Any],
    args_b,
    *,
    warmup: int = 3,
    iters: int = 20,
    repeats: int = 7,
    warmup_s: float = 0.25,
) -> tuple[float, float, float]:
    """Two jitted fns timed in alternating batches (a, b, a, b, ...), as :func:`time_fn` times one.

    Returns (median seconds per call of a, of b, median over the rounds of a's time / b's). On a
    shared or throttling machine the drift between two timings taken one after the other can exceed
    the difference measured (seen: +-50% on a 2-core CPU); within a round it falls on both alike.

    The warm-up alternates the two for at least `warmup` calls each and `warmup_s` seconds: on a
    2-core CPU VM (2026-12-04) a 0.1 s pause before a batch (a compile, say) made the protected GEMM's
    next batches 60% slower and the plain one's 24%, recovering over ~100 calls; three calls each
    left that inside the timed rounds, whose median it then moved for a whole case.
    """
    warm_up([(a, args_a), (b, args_b)], warmup, warmup_s)
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(_batch(a, args_a, iters))
        tb.append(_batch(b, args_b, iters))
    return (
        statistics.median(ta),
        statistics.median(tb),
        statistics.median(x / y for x, y in zip(ta, tb, strict=True)),
    )


def warm_up(calls, least: int = 3, seconds: float = 0.25) -> None:
    """Call each (fn, args) in turn, waiting for each, for at least ``least`` rounds and ``seconds``
    (:func:`time_pair` says why by time)."""
    start, done = time.perf_counter(), 0
    while done < least or time.perf_counter() - start < seconds:
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
        done += 1


def fold_firsts(out):
    """XOR of the first element of every non-empty output leaf, as uint32."""
    acc = jax.numpy.uint32(0)
    for leaf in jax.tree.leaves(out):
        if leaf.size:
            v = leaf.reshape(-1)[0]
            acc = acc ^ v.astype(jax.numpy.uint32)
    return acc


def device_time(fn: Callable[..., Any], *args, n: int = 10, fold: Callable | None = None) -> float:
    """Seconds per call of ``fn(*args)`` when ``n`` calls run inside one jitted loop: the device's
    time, without the host's dispatch of each call (which, for a call over a pytree of dozens of
    arrays, can exceed a millisecond kernel and varies with the host).

    Each iteration reads ``args`` through an optimization barrier together with the loop index, and
    XORs ``fold(out)`` (a uint32 scalar; default: the first element of every output leaf) into the
    loop's carry so no call is removed. XLA shrinks an op of its own to what the fold reads: the
    default suits native (FFI) calls and reductions; for other XLA ops use `carried_time`. XLA on
    the GPU (jax 0.11.2) kept native calls in the loop; XLA on the CPU moves loop-invariant native
    calls out of it despite the barrier, and then this warns: the figure is not per call there.
    """
    compiled = looped(fn, n, fold).lower(*args).compile()
    moved = hoisted_native_calls(compiled.as_text())
    if moved:
        warnings.warn(
            f"device_time: XLA moved {sorted(set(moved))} out of the timed loop on "
            f"{jax.default_backend()}; the figure undercounts those calls",
            RuntimeWarning,
            stacklevel=2,
        )
    return time_fn(compiled, *args, iters=3) / n


def hoisted_native_calls(hlo_text: str) -> list[str]:
    """Custom-call targets that sit in the entry computation of a compiled `looped` program, i.e.
    outside its loop (one entry per call)."""
    entry = next((c for c in re.split(r"\n(?=\S)", hlo_text) if c.startswith("ENTRY")), "")
    return re.findall(r'custom_call_target="([^"]+)"', entry)


def looped(fn: Callable[..., Any], n: int = 10, fold: Callable | None = None) -> Callable[..., Any]:
    """The jitted loop `device_time` times: ``n`` calls of ``fn`` on the same arguments, the result
    of each folded into the returned uint32 (see `device_time`)."""
    fold = fold_firsts if fold is None else fold

    def run(*a):
        def body(i, acc):
            _, b = jax.lax.optimization_barrier((i, a))
            return acc ^ fold(fn(*b))

        return jax.lax.fori_loop(0, n, body, jax.numpy.uint32(0))

    return jax.jit(run)


def carried_time(step: Callable[[Any], Any], init, n: int = 10, repeats: int = 5) -> float:
    """Seconds per iteration of ``carry = step(carry)`` run ``n`` times in one jitted loop, the carry
    donated from call to call (no copy of it): every output byte is written, as in a training loop.
    ``init`` is copied once up front and left untouched."""
    f = jax.jit(lambda c: jax.lax.fori_loop(0, n, lambda i, c: step(c), c), donate_argnums=0)
    c = jax.tree.map(lambda x: x.copy(), init)
    for _ in range(2):
        c = jax.block_until_ready(f(c))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = jax.block_until_ready(f(c))
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', 'unknown')}"


def write_result(
    suite: str,
    rows: list[dict[str, Any]],
    command: str,
    *,
    tag: str = "",
    note: str = "",
    measured_on: dict[str, str] | None = None,
) -> pathlib.Path:
    """Write ``rows`` to ``benchmarks/results/<date>-<suite>[-<tag>]-<device>.json`` (replacing a file of
    that name: a second run the same day needs its own ``tag`` to keep the first) with the date,
    device, versions, command, the code's commit where the checkout is a git repository (``-dirty``
    with uncommitted changes to the source: ``code_commit``), the digest of its source files
    (``source_digest``), the folder of the ``pimlayers`` package this process imported where it is
    not this tree's (``foreign_package``: the commit and digest then name code that did not run) and
    an optional ``note`` (shown above the table in docs/benchmarks.md). ``measured_on`` (``device``, ``jax``,
    ``python``) names where rows derived from other results files were measured, in place of this
    process's (a table built here from GPU measurements is still a GPU table).
    """
    if tag and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", tag):
        raise ValueError(
            f"benchmarks: tag={tag!r}; expected letters, digits, '.', '_' or '-' (a file name part)"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    where = {"device": device_name(), "jax": jax.__version__, "python": platform.python_version()}
    if measured_on is not None:
        if set(measured_on) - set(where):
            raise ValueError(
                f"write_result: measured_on keys {sorted(measured_on)}; expected some of {sorted(where)}"
            )
        where.update(measured_on)
    dev = where["device"].replace(":", "-").replace(" ", "_")
    path = RESULTS / f"{now:%Y-%m-%d}-{suite}{'-' + tag if tag else ''}-{dev}.json"
    payload = {"suite": suite, "date": now.isoformat(timespec="seconds"), **where, "command": command}
    commit = code_commit()
    if commit:
        payload["commit"] = commit
    payload["source"] = source_digest()
    package = foreign_package()
    if package:
        payload["package"] = package
    if note:
        payload["note"] = note
    payload["rows"] = rows
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def foreign_package() -> str:
    """The folder of the ``pimlayers`` package this process imported, where that is not this tree's
    (a run with another revision's package first on the path; ``benchmarks.rev_ab``'s and
    ``benchmarks.step_ab --rev``'s children); "" where it is this tree's or none is imported."""
    mod = sys.modules.get("pimlayers")
    origin = getattr(mod, "__file__", None)
    if not origin:
        return ""
    folder = pathlib.Path(origin).resolve().parent
    return "" if folder == (ROOT / "pimlayers").resolve() else str(folder)


def code_commit(root: pathlib.Path = ROOT) -> str:
    """The checkout's commit (``git describe --always``), with ``-dirty`` where a source file
    (``SOURCE_PATHS``, results left out, untracked ones counted) differs from it; "" where the tree is
    not a git checkout of its own (a copy of it, even inside some other repository, names no commit).

    Only the source counts: a benchmark run rewrites docs/benchmarks.md and adds its results file, so
    with ``git describe --dirty`` every later run of the same session called its code dirty."""
    if not (root / ".git").exists():
        return ""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    rev = git("describe", "--always", "--abbrev=7")
    if not rev:
        return ""
    paths = [*SOURCE_PATHS, ":(exclude)benchmarks/results"]
    changed = git("status", "--porcelain", "--untracked-files=all", "--", *paths)
    return rev + ("-dirty" if changed is None or changed else "")


# The code behind a result: the package with its native sources, the model, the training script and
# the benchmarks (not their results), with the build's configuration. Build products (the extension's
# .so copied into the package) and caches have other suffixes.
SOURCE_PATHS = ("pimlayers", "csrc", "models", "train", "benchmarks", "CMakeLists.txt", "pyproject.toml")
_SOURCE_SUFFIXES = frozenset({".py", ".cc", ".cu", ".h", ".txt", ".toml"})


def source_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files ``source_digest`` reads under ``root``, in path order (results left out)."""
    found = []
    for name in SOURCE_PATHS:
        top = root / name
        candidates = [top] if top.is_file() else top.rglob("*") if top.is_dir() else []
        found += [f for f in candidates if f.is_file() and f.suffix in _SOURCE_SUFFIXES]
    rel = sorted((f.relative_to(root) for f in found), key=pathlib.PurePath.as_posix)
    return [root / r for r in rel if "results" not in r.parts]


def source_digest(root: pathlib.Path = ROOT) -> str:
    """sha256 (12 hex digits) of the source files (``SOURCE_PATHS``): each one's path and bytes.

    It names the code a result came from where ``code_commit`` cannot: a copy of the tree without its
    git metadata, or with an older commit's (a GPU machine's copy once recorded "7e08b33-dirty" for
    code of 4ea5c01). ``python -m benchmarks.digest REV ...`` prints a commit's, to match against.
    """
    h = hashlib.sha256()
    for f in source_files(root):
        data = f.read_bytes()
        h.update(f"{f.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]


def without_options(argv, flags=(), values=()) -> list[str]:
    """``argv`` less each flag in ``flags`` and each option in ``values`` with its value (``--opt
    VALUE`` or ``--opt=VALUE``): a child process's command built from its parent's."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in values:
            skip = True
        elif a not in flags and not any(a.startswith(v + "=") for v in values):
            kept.append(a)
    return kept


def command_line(module: str = "benchmarks.run", argv: list[str] | None = None) -> str:
    """The command that ran ``module``, as a results file records it: the library's switches set in
    the environment (every ``PIMLAYERS_*``: ``PIMLAYERS_FLASH_FUSE_V=0``, ``PIMLAYERS_CHECKS_KERNEL=1``,
    ... change what the kernels do, so a command without them would not run the same code) and
    XLA_FLAGS where set, then its arguments ``argv`` where a caller passed them to ``main(argv)``,
    else the process's."""
    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith("PIMLAYERS_"))
    env = "".join(f"{k}={shlex.quote(v)} " for k, v in switches)
    flags = os.environ.get("XLA_FLAGS", "")
    env += f"XLA_FLAGS={shlex.quote(flags.strip())} " if flags.strip() else ""
    return env + f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
