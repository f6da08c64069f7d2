"""Where a training step's device time goes: a few steps of the training script under the JAX
profiler, the device's kernels summed by name and by the JAX scope that launched them.

python -m benchmarks.profile --layers 2 --protect          # one GPU, Llama-3-8B dims, T = 8192
python -m benchmarks.profile --layers 2 --protect --fused  # the same with FaultPolicy(fused=True)
python -m benchmarks.profile --layers 2 --flash on         # unprotected, cuDNN's flash attention
python -m benchmarks.profile --layers 4 --protect --no-recompute --remat-policy gemms   # train's options
python -m benchmarks.profile --config llama3_tiny --seq 64 --layers 1 --protect   # a CPU smoke run
python -m benchmarks.profile --layers 4 --protect --no-recompute --remat-policy gemms --hlo-dump  # + ops
python -m benchmarks.profile --layers 4 --protect --no-recompute --remat-policy gemms --hlo-dump \
    --save 4layers --note "..."    # also results files: the kernels and (with --hlo-dump) the ops
python -m benchmarks.profile --compare benchmarks/results/<on>.json benchmarks/results/<off>.json \
    --save TAG                     # two saved op tables side by side: what protection adds, per op
python -m benchmarks.profile --compare <profile-protect fused>.json <profile-protect default>.json
                                   # two kernel tables (two configurations on one card), per kernel
python -m benchmarks.profile --layers 4 --remat-policy gemms --no-command-buffers --top 200 \
    --pair --save TAG              # both steps on this card, then --compare of the two: TAG{on,off}, TAG

Two runs of the script are traced, one of 1 step and one of 1 + ``--steps``; each kernel's time in
the first is subtracted from the second and divided by ``--steps``: what a step costs, with the
run's one-off work (parameter initialisation, the first encode, the final repair and evaluation)
cancelled. A first, untraced run compiles the step into JAX's compilation cache (a folder under
``--out``), and the two traced runs load it from there (``--no-compile-cache``: each compiles it, as
before 2026-12-07). Each run is a process of its own (``--run``, from the sixty-second session): in
one process a GPU never read the step back, since jaxlib's Mosaic GPU lowering names each module it
serialises (the flash kernels') with a process-wide counter that is part of the cache's key (H100,
2026-12-07; a new process counts from zero: ``tests/test_benchmarks.py``'s GPU cache tests). Prints
two tables (top kernels; top scopes, e.g.
``pimlayers.protected_matmul``) in ms per step with each entry's share, then the time per step the
device sat idle between its first and last kernel, with the largest gaps named by the kernels on
either side (where the device waits for the host: a branch's predicate, a launch; gaps of 50 ms or
more are host phases, apart), then the host's events per step (the runtime's spans, the CUDA calls:
where the host's time goes when the device waits on it), and writes them as JSON next to the traces
(``--out``). ``--hlo-dump`` has XLA dump the optimised programs and names, for each kernel, the op
it came from (a fusion's kernel is named after its HLO instruction, whose metadata holds the JAX
scope: inside XLA's command buffers the trace's own scopes name only the buffer), with a table of
all kernels grouped by op (ms and kernels launched per step). cuBLAS's kernels have no instruction
of their name: the table puts them under the op whose instruction launched them where the trace
names it, which XLA's command buffers hide (``--no-command-buffers`` runs without them, so every
GEMM, the check GEMMs that run on cuBLAS too, is attributed; the step then runs as it does not by
default). Each op's row keeps its cuBLAS kernels' share (``cublas_ms_per_step``), which the
categories count as GEMMs whatever the op is called (an unprotected step's weight gradients run
under ``.../transpose``). ``--compare`` runs nothing: it sets two such tables (``profile-sources``
files of the protected and the unprotected step) side by side per op (``profile-compare``) and per
category (``profile-categories``: attention, GEMMs, check GEMMs, the checks' verify, encodes and XLA
ops, the parameter memory's kernels, the rest; ``CATEGORIES``), what protection adds in each; given
two kernel tables instead (``profile-protect`` / ``profile-off`` files, which a run saves with or
without ``--hlo-dump``), it sets them side by side per kernel (``profile-compare-kernels``).
``--save TAG`` also writes the kernel table (``profile-protect`` or ``profile-off``) and the op
table (``profile-sources``) to ``benchmarks/results/`` for docs/benchmarks.md, their note ending
with each run's wall time (from 2026-12-07's sixty-third session: what the compile cache saves).
``--pair`` profiles both steps on one card in one command, each as above (three processes each,
under ``--out``'s ``on`` and ``off``): the protected step as the other options give it and the
unprotected one with cuDNN's attention (``--flash on``; the protected step's own options left out),
both with ``--hlo-dump``; then it compares their op tables as ``--compare`` does (with ``--save
TAG``: the steps' tables as TAGon and TAGoff, the comparison and its categories as TAG). On a CPU there is no
device timeline, so the host's XLA op events are summed instead (the runtime, compiler and Python
frames left out): good enough to see the ops, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import gzip
import itertools
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing
import warnings

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

try:  # private: a jax without it leaves the check to the dump's absence after the runs
    from jax._src.xla_bridge import backends_are_initialized
except ImportError:
    backends_are_initialized = lambda: False

from models.llama3 import REMAT_POLICIES

from ._harness import command_line, without_options, write_result


@functools.lru_cache(maxsize=4)  # _sums and _idle read the same (large) trace
def _events(trace_dir: pathlib.Path) -> tuple[list[dict], dict[int, str]]:
    files = sorted(trace_dir.glob("**/*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: did the profiler run?")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return events, procs


def _device_pids(procs: dict[int, str]) -> set[int]:
    """The trace's device timelines (process names like "/device:GPU:0"); empty on a CPU trace."""
    return {pid for pid, name in procs.items() if "/device:" in name}


def _scope(e: dict) -> str:
    """The JAX scope of a kernel event: the named scopes of its HLO op's metadata, where recorded."""
    args = e.get("args", {})
    for key in ("tf_op", "long_name", "hlo_op"):
        v = args.get(key)
        # On a GPU trace every kernel's tf_op reads "XlaModule:" (no scope): fall through to the next key.
        if isinstance(v, str) and v and not v.startswith("XlaModule"):
            parts = [
                p for p in v.split("/") if p and not p.startswith(("jit(", "pjit(", "jvp(", "transpose("))
            ]
            return "/".join(parts[:2]) if parts else v
    return "(no scope recorded)"


def _sums(
    trace_dir: pathlib.Path,
) -> tuple[str, collections.Counter, collections.Counter, int, collections.Counter]:
    """(timeline, µs by kernel name, µs by scope, number of events, events by kernel name) of the
    trace's device kernels, or with no device timeline, of the host's XLA ops."""
    device, kernels = _kernels(trace_dir)
    by_name: collections.Counter = collections.Counter()
    by_scope: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    n = 0
    for e in kernels:
        dur = float(e.get("dur", 0.0))
        by_name[e["name"]] += dur
        by_scope[_scope(e)] += dur
        count[e["name"]] += 1
        n += 1
    return ("device" if device else "host"), by_name, by_scope, n, count


def _kernels(trace_dir: pathlib.Path) -> tuple[bool, list[dict]]:
    """(whether the trace has a device timeline, its kernel events): the device's, or with no
    device timeline the host's XLA ops (host work, on a CPU everything but XLA's ops, left out)."""
    events, procs = _events(trace_dir)
    device = _device_pids(procs)
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and ((e["pid"] in device) if device else ("hlo_op" in e.get("args", {})))
    ]
    return bool(device), kernels


_INSTRUCTION = re.compile(r"^[\w.\-]+$")


def _instruction(e: dict) -> str:
    """The HLO instruction that launched a device event, as the trace records it (a fusion, a custom
    call: ``custom-call.18``), or "" where none is. Kernels inside one of XLA's command buffers
    carry the buffer's name (``command_buffer_967``), which no instruction of the HLO text has."""
    args = e.get("args", {})
    for key in ("hlo_op", "long_name", "tf_op"):
        v = args.get(key)
        if isinstance(v, str) and _INSTRUCTION.match(v):
            return v
    return ""


def _by_instruction(trace_dir: pathlib.Path) -> tuple[collections.Counter, collections.Counter]:
    """µs and events by (kernel name, :func:`_instruction`) of the trace's device kernels (on a CPU
    trace, of the host's XLA ops): where a library kernel (cuBLAS's) has no instruction of its name,
    the instruction that launched it says which product it computed."""
    us: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in _kernels(trace_dir)[1]:
        key = (e["name"], _instruction(e))
        us[key] += float(e.get("dur", 0.0))
        count[key] += 1
    return us, count


def kernel_events(
    fn: typing.Callable[..., typing.Any], *args, warmup: int = 2, copies: bool = False
) -> tuple[collections.Counter, collections.Counter]:
    """µs and launches by kernel name of the device kernels one call of ``fn(*args)`` launched (each
    name summed over its launches), from a JAX profiler trace: device time alone, free of the host's
    dispatch and of a loop's own overhead (on an H200 a jitted loop's wall clock per trip exceeded
    the finish kernel's own time at 67 MB by ~25 µs). Copies and memsets are left out unless
    ``copies`` (XLA copying a buffer it could not update in place shows as one). ``fn`` must
    accept being called ``warmup + 1`` times with ``args`` (no donation of them). Both empty without
    a device timeline (a CPU)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(fn(*args))
        timeline, by_name, _, _, count = _sums(pathlib.Path(d))
    if timeline != "device":
        return collections.Counter(), collections.Counter()
    keep = lambda c: collections.Counter(
        {k: v for k, v in c.items() if copies or not k.startswith(("Memcpy", "Memset"))}
    )
    return keep(by_name), keep(count)


def device_ms(fn: typing.Callable[..., typing.Any], args, calls: int = 3) -> float:
    """The device kernels' time of one call of a warmed-up ``fn`` (ms): the median over ``calls``
    profiled calls (:func:`kernel_events`); NaN without a device timeline, or (with a warning) where
    the profiler fails: a wall-clock figure beside it stands without it."""
    try:
        totals = [sum(kernel_events(fn, *args, warmup=0)[0].values()) for _ in range(calls)]
    except RuntimeError as e:
        warnings.warn(f"no device time ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
        return float("nan")
    return statistics.median(totals) / 1e3 if all(totals) else float("nan")


def kernel_us(fn: typing.Callable[..., typing.Any], *args, warmup: int = 2) -> collections.Counter:
    """µs by kernel name of one call of ``fn(*args)`` (:func:`kernel_events`)."""
    return kernel_events(fn, *args, warmup=warmup)[0]


def kernel_seconds(fn: typing.Callable[..., typing.Any], *args) -> float:
    """Seconds of device kernels in one call of ``fn(*args)`` (:func:`kernel_events`); NaN without a
    device timeline."""
    us = sum(kernel_us(fn, *args).values())
    return us / 1e6 if us else float("nan")


# A device gap this long is a host phase (the profiler starting, an evaluation, the host's own work
# between steps under the tracer), not the device waiting on a launch or a branch's predicate: those
# are 0.01-1 ms. Kept apart so a phase that differs between the two traced runs cannot swamp idle_ms.
PHASE_US = 50_000.0


class Idle(typing.NamedTuple):
    """A device timeline's idle time between its first and last event: gaps shorter than
    ``PHASE_US`` (µs, µs and count by (event before, event after)) and host phases (the longer ones,
    the same)."""

    us: float
    gaps: collections.Counter
    count: collections.Counter
    phase_us: float
    phases: collections.Counter
    phase_count: collections.Counter

    def __sub__(self, other: Idle) -> Idle:
        return Idle(
            self.us - other.us,
            _minus(self.gaps, other.gaps),
            _minus(self.count, other.count),
            self.phase_us - other.phase_us,
            _minus(self.phases, other.phases),
            _minus(self.phase_count, other.phase_count),
        )


def _idle(trace_dir: pathlib.Path) -> Idle:
    """The device timeline's idle time: per device, the span less the union of its events'
    intervals (kernels on several streams may overlap); each gap is keyed by (the event that ended
    last before it, the one after it). All zeros without a device timeline."""
    events, procs = _events(trace_dir)
    device = _device_pids(procs)
    spans: dict[int, list] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] in device:
            t0 = float(e["ts"])
            spans[e["pid"]].append((t0, t0 + float(e.get("dur", 0.0)), e["name"]))
    waits = [0.0, collections.Counter(), collections.Counter()]  # µs, µs by gap, count by gap
    phases = [0.0, collections.Counter(), collections.Counter()]
    for iv in spans.values():
        iv.sort()
        _, end, last = iv[0]
        for t0, t1, name in iv[1:]:
            if t0 > end:
                acc = phases if t0 - end >= PHASE_US else waits
                acc[0] += t0 - end
                acc[1][last, name] += t0 - end
                acc[2][last, name] += 1
            if t1 > end:
                end, last = t1, name
    return Idle(*waits, *phases)


class StepIdle(typing.NamedTuple):
    """The device's idle time inside executions of one program (``_step_idle``): per execution,
    medians of its device span (first kernel's start to last kernel's end), of the union of its
    kernels' intervals and of the difference, the idle time; ``gaps``/``count``: µs and number per
    execution by (event before, event after), means over the executions."""

    runs: int
    span_us: float
    busy_us: float
    idle_us: float
    gaps: collections.Counter
    count: collections.Counter
    # Between consecutive executions (medians over the pairs; NaN with fewer than two): the device's
    # time from one execution's last kernel to the next one's first, and how much of it other
    # programs' kernels and copies covered (the training loop's own work, say); the rest is idle.
    between_us: float = float("nan")
    between_busy_us: float = float("nan")


def _sweep(
    intervals: list[tuple[float, float, str]],
    gaps: collections.Counter | None = None,
    count: collections.Counter | None = None,
) -> tuple[float, float, float]:
    """(first start, last end, union length) of (start, end, name) intervals, which may overlap;
    each gap between them added to ``gaps``/``count`` under (the event that ended last before it,
    the one after it), where given."""
    iv = sorted(intervals)
    first, end, last = iv[0]
    covered = end - first
    for t0, t1, name in iv[1:]:
        if t0 > end and gaps is not None and count is not None:
            gaps[last, name] += t0 - end
            count[last, name] += 1
        if t1 > end:
            covered += t1 - max(t0, end)
            end, last = t1, name
    return first, end, covered


def _step_idle(
    trace_dir: pathlib.Path, module: str | None = "jit_step_fn", skip_first: bool = True
) -> StepIdle | None:
    """Idle time inside the executions of ``module`` on a GPU trace, each measured on its own.

    Unlike ``_idle`` (the whole timeline, differenced between two traced runs) this needs no second
    run and no host phase can enter it: a device event belongs to an execution when the host call
    that launched it (the same ``correlation_id``, a kernel or graph launch) lies inside that
    execution's ``GpuExecutable::ExecuteThunks`` span; the execution's idle time is its device span
    less the union of its events. What the device waits for inside a program is what this counts:
    the host's launches falling behind, a branch's predicate read on the host. ``skip_first``
    leaves out the first execution (autotuning, first-touch). ``module`` None: the module executed
    most often in the trace. None without a device timeline or without an execution of ``module``."""
    events, procs = _events(trace_dir)
    device = _device_pids(procs)
    if not device:
        return None
    host = (e for e in events if e.get("ph") == "X" and e["pid"] not in device)
    execs = [e for e in host if e["name"].endswith("GpuExecutable::ExecuteThunks")]
    if module is None and execs:
        module = collections.Counter(e.get("args", {}).get("module_name") for e in execs).most_common(1)[0][0]
    runs = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in execs
        if e.get("args", {}).get("module_name") == module
    )
    if not runs:
        return None
    starts = [r[0] for r in runs]
    owner: dict[str, int] = {}  # correlation id -> execution
    for e in events:
        cid = e.get("args", {}).get("correlation_id")
        if e.get("ph") == "X" and e["pid"] not in device and cid is not None:
            t = float(e["ts"])
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= runs[i][1]:
                owner[str(cid)] = i
    per_run: dict[int, list] = collections.defaultdict(list)
    others = []  # device events of no execution of the module
    for e in events:
        if e.get("ph") == "X" and e["pid"] in device:
            i = owner.get(str(e.get("args", {}).get("correlation_id")))
            t0 = float(e["ts"])
            iv = (t0, t0 + float(e.get("dur", 0.0)), e["name"])
            if i is not None:
                per_run[i].append(iv)
            else:
                others.append(iv)
    keep = sorted(per_run)[1:] if skip_first and len(per_run) > 1 else sorted(per_run)
    if not keep:
        return None
    spans, busy, idle = [], [], []
    gaps, count = collections.Counter(), collections.Counter()
    for i in keep:
        first, end, covered = _sweep(per_run[i], gaps, count)
        spans.append(end - first)
        busy.append(covered)
        idle.append(end - first - covered)
    between, between_busy = [], []
    for i, j in itertools.pairwise(keep):
        if j != i + 1:
            continue
        lo, hi = max(t1 for _, t1, _ in per_run[i]), min(t0 for t0, _, _ in per_run[j])
        cut = [(max(t0, lo), min(t1, hi), n) for t0, t1, n in others if t1 > lo and t0 < hi]
        between.append(max(hi - lo, 0.0))
        between_busy.append(_sweep(cut)[2] if cut else 0.0)
    n = len(keep)
    med = lambda v: float(np.median(v)) if v else float("nan")
    return StepIdle(
        n,
        float(np.median(spans)),
        float(np.median(busy)),
        float(np.median(idle)),
        collections.Counter({k: v / n for k, v in gaps.items()}),
        collections.Counter({k: v / n for k, v in count.items()}),
        med(between),
        med(between_busy),
    )


def call_idle(fn: typing.Callable[..., typing.Any], *args, calls: int = 6) -> StepIdle | None:
    """The device's idle time inside ``calls`` back-to-back calls of the jitted ``fn(*args)`` (the
    first left out) and between them (:func:`_step_idle`, on the module executed most often): where
    a program's wall clock exceeds its kernels' time, which kernels the device waited between. None
    without a device timeline (a CPU)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            outs = [fn(*args) for _ in range(calls)]
            jax.block_until_ready(outs)
        return _step_idle(pathlib.Path(d), module=None)


def _host(trace_dir: pathlib.Path) -> tuple[collections.Counter, collections.Counter]:
    """(µs, count) by name of the host's events on a trace with a device timeline: the runtime's
    spans and the CUDA API calls the profiler records (launches, graph launches and updates,
    copies, synchronisations). Spans nest, so a name's time includes what ran inside it. Empty
    counters without a device timeline (there the host's events are what ``_sums`` reads)."""
    events, procs = _events(trace_dir)
    device = _device_pids(procs)
    us, count = collections.Counter(), collections.Counter()
    if device:
        for e in events:
            if e.get("ph") == "X" and e["pid"] not in device:
                us[e["name"]] += float(e.get("dur", 0.0))
                count[e["name"]] += 1
    return us, count


def _minus(a: collections.Counter, b: collections.Counter) -> collections.Counter:
    """a - b for every key of either, zero and negative differences kept (Counter's - drops them)."""
    return collections.Counter({k: a[k] - b.get(k, 0) for k in a.keys() | b.keys()})


_INST = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b(fusion|custom-call)\(")
_TRANSFORMS = re.compile(r"^(?:jvp|transpose|vmap|remat|checkpoint|custom_vjp_call|shard_map)\((.*)\)$")
_FRAMES = ("while", "body", "cond", "branch_0_fun", "branch_1_fun", "rematted_computation", "checkpoint")


def _op_path(op_name: str) -> str:
    """An HLO op's ``op_name`` metadata as the named scopes (layers, pimlayers ops) and the primitive:
    jax's transformations unwrapped (``transpose(jvp(pimlayers.protected_matmul))`` ->
    ``pimlayers.protected_matmul``), ``jit(...)`` and loop frames dropped, e.g.
    ``pimlayers.flax.nnx.LlamaMLP.up/pimlayers.protected_matmul/pimlayers.abft_finish/ffi_call``."""
    parts = []
    for p in op_name.split(";")[0].split("/"):  # a fusion of several ops lists each: the first
        while (m := _TRANSFORMS.match(p)) is not None:
            p = m.group(1)
        if p and not p.startswith(("jit(", "pjit(")) and p not in _FRAMES:
            parts.append(p)
    return "/".join(parts) or op_name


def hlo_sources(texts: typing.Iterable[str]) -> dict[str, str]:
    """Kernel name -> the op path (``_op_path``) of the fusion or custom call it ran, from optimised
    HLO text (XLA's ``*after_optimizations.txt`` dumps, or ``compiled.as_text()``). XLA names a
    fusion's GPU kernel after its instruction with "." turned into "_" (``loop_add_fusion.4`` ->
    ``loop_add_fusion_4``); CPU traces use the instruction name itself: both are keys. A pimlayers
    custom call's path ends in its target. Library kernels (cuBLAS, cuDNN, Mosaic) keep names no
    instruction has, and stay unattributed. Where programs share an instruction name, the last text
    given wins."""
    src: dict[str, str] = {}
    for text in texts:
        for line in text.splitlines():
            m = _INST.match(line)
            meta = m and re.search(r'op_name="([^"]*)"', line)
            if not meta:
                continue
            path = _op_path(meta.group(1))
            target = re.search(r'custom_call_target="(pimlayers_\w+)"', line)
            if target:
                path = f"{path.rsplit('/', 1)[0]}/{target.group(1)}"
            src[m.group(1)] = src[m.group(1).replace(".", "_")] = path
    return src


def _source(kernel: str, instruction: str, sources: dict[str, str]) -> str:
    """The op path behind a kernel: its own name's (a fusion's kernel is named after it), else for a
    cuBLAS kernel the instruction's that launched it (outside XLA's command buffers), else "". Other
    library kernels keep their family's row (``_family``): the Mosaic GPU kernels' instruction is a
    ``pallas_call``'s, whose path names no attention op (the first GPU run that attributed them so
    put the verified flash kernels under ``entry/mpmd_map``, profile-sources-s57nocb)."""
    if kernel in sources:
        return sources[kernel]
    return sources.get(instruction, "") if _family(kernel) == "(cuBLAS kernels)" else ""


def _group(path: str) -> str:
    """The part of an op path a table groups by: from the innermost pimlayers op on (its primitive or
    custom call), or else the last two parts, so every layer's instance of an op adds up to one row.
    The front ends' layer scopes (``pimlayers.flax...``) are not ops."""
    parts = path.split("/")
    ops = [
        i
        for i, p in enumerate(parts)
        if p.startswith("pimlayers.") and not p.startswith(("pimlayers.flax", "pimlayers.equinox"))
    ]
    return "/".join(parts[ops[-1] :]) if ops else "/".join(parts[-2:])


TOTAL = "(all device kernels)"  # the totals' row of the kernel and op tables
MOSAIC = "(Mosaic GPU kernels: the verified flash attention)"
# With FaultPolicy(fused=True) the fused GEMM is a Mosaic GPU kernel too, and the trace names every
# Mosaic kernel alike (inside XLA's command buffers no HLO op either): one row for both.
MOSAIC_FUSED = "(Mosaic GPU kernels: the verified flash attention and the fused GEMM)"


def _family(kernel: str, fused: bool = False) -> str:
    """A library kernel's row in the sources table (no HLO instruction carries its name): cuBLAS's
    and cuDNN's kernels each one row, this library's CUDA kernels one row per kernel function
    (``void pimlayers::(anonymous namespace)::AbftTileKernel<...>(...)`` -> ``(pimlayers
    AbftTileKernel)``: verify, encode and memory kernels are different costs); the Mosaic GPU
    kernels one row, ``fused``: of a step run with the fused GEMM."""
    name = kernel.removeprefix("void ")
    for prefix, family in (
        ("nvjet", "cuBLAS"),
        ("cutlass", "cuBLAS"),
        ("sm90_xmma", "cuBLAS"),
        ("cudnn", "cuDNN"),
    ):
        if name.startswith(prefix):
            return f"({family} kernels)"
    if "mosaic" in name:
        return MOSAIC_FUSED if fused else MOSAIC
    native = re.match(r"pimlayers::(?:\(anonymous namespace\)::)?(\w+)", name)
    if native:
        return f"(pimlayers {native.group(1)})"
    return f"({name.split('(')[0].split('<')[0][:60]})"


# Where a step's device time goes, coarser than ops: each op of a sources table (its ``_group`` or
# ``_family`` name) falls in the first category one of whose patterns it contains. Protection's
# cost per category is the protected step's time less the unprotected one's (``compare_categories``).
# cuBLAS's kernels carry no HLO op of their name: attributed to the instruction that launched them
# (outside command buffers), their time is a row's ``cublas_ms_per_step`` and counts as a GEMM of
# the op's kind (``category(op, library=True)``); inside command buffers they stay one
# "(cuBLAS kernels)" row among the GEMMs, the check GEMMs that XLA hands to cuBLAS with them.
OTHER = "other: norms, activations, optimizer, copies"
CATEGORIES = (
    ("Mosaic GPU kernels: attention and the fused GEMM", (MOSAIC_FUSED,)),
    (
        "attention",
        ("Mosaic GPU", "cuDNN", "cudnn", "pimlayers_flash", "Attention.core", "dot_product_attention"),
    ),
    ("check GEMMs", ("abft_checks/dot_general", "pimlayers_abft_checks", "checks_kernel")),
    (
        "checks: verify, correct, gate, redo",
        (
            "AbftTileKernel",
            "AbftRowKernel",
            "AbftWarpKernel",
            "FinishKernel",
            "GateKernel",
            "pimlayers_abft_check",
            "pimlayers_abft_finish",
            "pimlayers_gate",
            "redo_detected",
        ),
    ),
    ("checks: weight encodes", ("AbftEncode", "pimlayers_abft_encode")),
    # AdamW's step fused with the guard's checksums (``ops.adamw_guard_many``) is the optimizer,
    # beside the unprotected step's XLA update (unscoped ops, in OTHER); the guard's share of it
    # (~0.3 ms of ~8 in a 4-layer step) is not split out.
    (OTHER, ("AdamGuardKernel", "pimlayers_adamw_guard")),
    (
        "parameter memory: scrub, guard, repair",
        (
            "ManyKernel",
            "GuardKernel",
            "ChecksumKernel",
            "ParityKernel",
            "ReconstructKernel",
            "pimlayers_bank",
            "pimlayers_parity",
            "pimlayers_reconstruct",
            "pimlayers.memory",
        ),
    ),
    # Tables written before the library's CUDA kernels got a row each lump them in one.
    ("library CUDA kernels (an older table: not split)", ("(void pimlayers::)",)),
    ("checks: XLA ops (split terms, counts, flags)", ("pimlayers.abft_", "pimlayers.protected_matmul")),
    ("GEMMs", ("cuBLAS", "dot_general", "gemm_fusion")),
)


def category(op: str, library: bool = False) -> str:
    """The :data:`CATEGORIES` entry an op of a sources table belongs to (``OTHER`` if none). A
    protected product's own GEMM may be an XLA fusion under ``pimlayers.protected_matmul`` (its
    ``dot_general``): that is a GEMM, not a check, so the GEMMs' patterns are tried for a
    ``dot_general`` before the checks' XLA ops; AD's cotangent sums under it (``add_any``) are not
    checks either (``OTHER``, as the unprotected step's). ``library``: the op's cuBLAS kernels (a
    sources row's ``cublas_ms_per_step``), a GEMM whatever the op's last name: check GEMMs or
    attention's if the op is theirs, else GEMMs (an unprotected step's weight gradients run under
    ops named ``.../transpose``, profile-sources-s58off)."""
    if library:
        named = dict(CATEGORIES)
        return next((c for c in ("check GEMMs", "attention") if any(p in op for p in named[c])), "GEMMs")
    for name, patterns in CATEGORIES:
        # Under a protected product's name but not check work: its own GEMM (a ``dot_general``
        # fusion) and AD's sums of its operands' cotangents (``add_any``: q, k and v's merged
        # cotangent, written by the RoPE backward's fusion, 0.55 ms in profile-sources-s58on, which
        # the unprotected step does under attention's ops).
        if name.startswith("checks: XLA") and op.endswith(("/dot_general", "/add_any")):
            continue
        if any(p in op for p in patterns):
            return name
    return OTHER


def categories(rows: list[dict]) -> dict[str, dict]:
    """A sources table's ops added up by :func:`category`: ``{category: {ms_per_step, count_per_step}}``
    (the totals' row left out). A row's cuBLAS share (``cublas_ms_per_step``, tables since
    profile-sources-s58) goes by ``category(op, library=True)``, the rest by the op's name."""
    out: dict[str, dict] = {}

    def add(name: str, ms: float, n) -> None:
        c = out.setdefault(name, {"ms_per_step": 0.0, "count_per_step": 0.0})
        c["ms_per_step"] += ms
        c["count_per_step"] += 0.0 if n is None or n != n else n

    for r in rows:
        if r["op"].startswith(TOTAL):
            continue
        lib, lib_n = r.get("cublas_ms_per_step", 0.0), r.get("cublas_count_per_step", 0.0)
        n = r.get("count_per_step", 0.0)
        if lib:
            add(category(r["op"], library=True), lib, lib_n)
        if not lib or r.get("ms_per_step", 0.0) - lib > 1e-12:
            add(
                category(r["op"]), r.get("ms_per_step", 0.0) - lib, None if n is None or n != n else n - lib_n
            )
    return out


def compare_categories(protect: list[dict], off: list[dict]) -> list[dict]:
    """Two sources tables (protection on and off) by category: ms per step in each and what
    protection adds, the largest addition first, then a row for the ops the tables leave out (each
    table's total less its rows: older files kept only the top ops)."""
    on, base = categories(protect), categories(off)
    rows = []
    for c in on.keys() | base.keys():
        a = on.get(c, {}).get("ms_per_step", 0.0)
        b = base.get(c, {}).get("ms_per_step", 0.0)
        rows.append(dict(category=c, protect_ms=a, off_ms=b, added_ms=a - b))
    rows.sort(key=lambda r: -r["added_ms"])

    def unlisted(table, by):
        total = next((r["ms_per_step"] for r in table if r["op"].startswith(TOTAL)), None)
        return 0.0 if total is None else total - sum(v["ms_per_step"] for v in by.values())

    a, b = unlisted(protect, on), unlisted(off, base)
    if abs(a) > 1e-9 or abs(b) > 1e-9:
        rows.append(dict(category="(ops not in the tables)", protect_ms=a, off_ms=b, added_ms=a - b))
    return rows


def summarize(
    trace_dir: pathlib.Path,
    top: int = 25,
    base_dir: pathlib.Path | None = None,
    steps: int = 1,
    sources: dict[str, str] | None = None,
    fused: bool = False,
) -> dict:
    """Sum the trace's device kernels (or, with no device timeline, the host's XLA ops), less those
    of ``base_dir`` (a trace of the same run with ``steps`` fewer steps) when given, divided by
    ``steps``: ms per step. A name whose difference is not positive is left out of the tables (its
    time is the same in both runs, to noise), not out of the total. On a device timeline also its idle
    time (``idle_ms``) and the ``gaps`` that make it, largest first (ms and count per step). With
    ``sources`` (``hlo_sources``), each kernel row names the op it came from and a ``sources`` table
    adds up every kernel by op (``_group``; a kernel no op names by its family, ``_family``, of a
    step run with the fused GEMM where ``fused``), all of them, where ``kernels`` keeps the top."""
    timeline, names, scopes, n, counts = _sums(trace_dir)
    if base_dir is not None:
        _, names0, scopes0, n0, counts0 = _sums(base_dir)
        names, scopes, n = _minus(names, names0), _minus(scopes, scopes0), n - n0
        counts = _minus(counts, counts0)
    total = sum(names.values()) / steps

    def table(c: collections.Counter, limit: int | None = top) -> list[dict]:
        rows = [(k, v / steps) for k, v in c.most_common() if v > 0][:limit]
        return [dict(name=k, ms=v / 1e3, share=v / total if total > 0 else 0.0) for k, v in rows]

    # Events per step: kernel launches (and copies) on a device timeline. Each costs a launch gap
    # even inside a command buffer, so a step of many small kernels idles between them.
    out = dict(timeline=timeline, steps=steps, total_ms=total / 1e3, events=n / steps)
    out.update(kernels=table(names), scopes=table(scopes))
    for r in out["kernels"]:  # launches per step: XLA runs identical fusions as one kernel name
        r["count"] = counts[r["name"]] / steps
    if sources is not None:
        for r in out["kernels"]:
            r["source"] = sources.get(r["name"], "")
        pairs, pair_counts = _by_instruction(trace_dir)
        if base_dir is not None:
            pairs0, pair_counts0 = _by_instruction(base_dir)
            pairs, pair_counts = _minus(pairs, pairs0), _minus(pair_counts, pair_counts0)
        by_op: collections.Counter = collections.Counter()
        launches: collections.Counter = collections.Counter()
        library: collections.Counter = collections.Counter()  # of by_op: cuBLAS kernels' time
        library_n: collections.Counter = collections.Counter()  # and launches
        for (name, inst), us in pairs.items():
            path = _source(name, inst, sources)
            op = _group(path) if path else _family(name, fused)
            by_op[op] += us
            launches[op] += pair_counts[(name, inst)]
            if path and name not in sources:  # a library (cuBLAS) kernel under its instruction's op
                library[op] += us
                library_n[op] += pair_counts[(name, inst)]
        out["sources"] = table(by_op, None)  # every op: the categories add them all up
        for r in out["sources"]:  # kernels launched per step for the op (each a launch gap)
            r["count"] = launches[r["name"]] / steps
            r["cublas_ms"] = max(library[r["name"]], 0.0) / steps / 1e3
            r["cublas_count"] = max(library_n[r["name"]], 0) / steps
    if timeline == "device":
        idle, (host, calls) = _idle(trace_dir), _host(trace_dir)
        if base_dir is not None:
            idle = idle - _idle(base_dir)
            host0, calls0 = _host(base_dir)
            host, calls = _minus(host, host0), _minus(calls, calls0)
        out["idle_ms"], out["phase_ms"] = idle.us / steps / 1e3, idle.phase_us / steps / 1e3

        def per_step(us: collections.Counter, count: collections.Counter, **key) -> list[dict]:
            return [
                dict(**{k: f(name) for k, f in key.items()}, ms=v / steps / 1e3, count=count[name] / steps)
                for name, v in us.most_common()
                if v > 0
            ][:top]

        gap = dict(before=lambda k: k[0], after=lambda k: k[1])
        out["gaps"] = per_step(idle.gaps, idle.count, **gap)
        out["phases"] = per_step(idle.phases, idle.phase_count, **gap)
        # A host event that the longer run does not repeat more often is one-off work whose time
        # varied between the runs (compiling: each train() call jits its step afresh), not a step's.
        per_call = collections.Counter({k: v for k, v in host.items() if base_dir is None or calls[k] > 0})
        out["host"] = per_step(per_call, calls, name=lambda k: k)
        # Negative: the runs' one-off gaps (compiles between kernels, the profiler's start) differed by
        # more than the added steps' idle time; the difference then measures nothing.
        out["idle_measured"] = idle.us >= 0 and idle.phase_us >= 0
        inside = _step_idle(trace_dir)
        if inside is not None:
            out["step_idle"] = dict(
                runs=inside.runs,
                span_ms=inside.span_us / 1e3,
                busy_ms=inside.busy_us / 1e3,
                idle_ms=inside.idle_us / 1e3,
                gap_count=sum(inside.count.values()),
                between_ms=inside.between_us / 1e3,
                between_busy_ms=inside.between_busy_us / 1e3,
                gaps=[
                    dict(before=k[0], after=k[1], ms=v / 1e3, count=inside.count[k])
                    for k, v in inside.gaps.most_common(top)
                ],
            )
    return out


def result_tables(summary: dict, protect: bool) -> dict[str, list[dict]]:
    """The summary's tables as results rows, by suite: the top kernels (with the op each came from,
    where the HLO was dumped) and, with ``--hlo-dump``, all kernels grouped by op, each led by the
    total of all device kernels per step; where the idle inside the step's program was measured, its
    largest gaps (``profile-gaps``: ms and count per execution, the kernels before and after)."""
    total = {"ms_per_step": summary["total_ms"], "share": 1.0}
    kernels = [{"kernel": TOTAL, **total, "count_per_step": summary["events"]}]
    if "step_idle" in summary:  # inside the step's program, measured per execution (_step_idle)
        si = summary["step_idle"]
        name = f"(device idle inside the step program: median of {si['runs']} executions)"
        share = si["idle_ms"] / si["span_ms"]
        kernels.append(
            dict(kernel=name, ms_per_step=si["idle_ms"], share=share, count_per_step=si["gap_count"])
        )
        if math.isfinite(si["between_ms"]):  # NaN with fewer than two executions kept
            between = "(device time between two executions of the step program: median)"
            kernels.append(dict(kernel=between, ms_per_step=si["between_ms"]))
            busy = "(of it, with another program's kernel or copy running)"
            kernels.append(dict(kernel=busy, ms_per_step=si["between_busy_ms"]))
    for r in summary["kernels"]:
        row = {
            "kernel": r["name"][:90],
            "ms_per_step": r["ms"],
            "share": r["share"],
            "count_per_step": r["count"],
        }
        if "sources" in summary:
            row["hlo_op"] = r.get("source", "")[-90:]
        kernels.append(row)
    tables = {"profile-protect" if protect else "profile-off": kernels}
    if "sources" in summary:
        tables["profile-sources"] = [{"op": TOTAL, **total}] + [
            {"op": r["name"], "ms_per_step": r["ms"], "share": r["share"], "count_per_step": r["count"]}
            | (
                {"cublas_ms_per_step": r["cublas_ms"], "cublas_count_per_step": r["cublas_count"]}
                if r.get("cublas_ms")
                else {}
            )
            for r in summary["sources"]
        ]
    gaps = summary.get("step_idle", {}).get("gaps")
    if gaps:  # where the step program's idle lies: its largest gaps, named by the kernels around them
        tables["profile-gaps"] = [
            {"before": g["before"][:60], "after": g["after"][:60], "ms_per_execution": g["ms"],
             "count_per_execution": g["count"]}
            for g in gaps
        ]  # fmt: skip
    return tables


def compare(protect: list[dict], off: list[dict]) -> list[dict]:
    """Two ``profile-sources`` tables of one step, protection on and off, side by side per op: ms and
    kernels per step in each and what protection adds, the largest addition first, led by the
    totals' row. An op only one of the steps runs has zeros for the other."""
    on = {r["op"]: r for r in protect}
    base = {r["op"]: r for r in off}
    rows = []
    for op in on.keys() | base.keys():
        a, b = on.get(op, {}), base.get(op, {})
        ms_on, ms_off = a.get("ms_per_step", 0.0), b.get("ms_per_step", 0.0)
        n_on, n_off = a.get("count_per_step", float("nan")), b.get("count_per_step", float("nan"))
        if op not in on:
            n_on = 0.0
        if op not in base:
            n_off = 0.0
        rows.append(
            dict(op=op, protect_ms=ms_on, off_ms=ms_off, added_ms=ms_on - ms_off, protect_n=n_on, off_n=n_off)
        )
    rows.sort(key=lambda r: (r["op"] != TOTAL, -r["added_ms"]))
    return rows


def compare_kernels(first: list[dict], second: list[dict]) -> list[dict]:
    """Two kernel tables (``profile-protect`` / ``profile-off`` files: two configurations' steps on
    one card, e.g. the fused path's against the default's) side by side per kernel name: ms per step
    in each and the difference (first - second), the totals' row first, then the largest changes
    either way. A kernel only one step runs has 0 for the other."""
    a = {r["kernel"]: r["ms_per_step"] for r in first}
    b = {r["kernel"]: r["ms_per_step"] for r in second}
    rows = [
        dict(kernel=k, first_ms=a.get(k, 0.0), second_ms=b.get(k, 0.0), diff_ms=a.get(k, 0.0) - b.get(k, 0.0))
        for k in a.keys() | b.keys()
    ]
    rows.sort(key=lambda r: (r["kernel"] != TOTAL, -abs(r["diff_ms"])))
    return rows


KERNEL_TABLES = ("profile-protect", "profile-off")


def measured_on(tables: list[dict], paths: list[str]) -> dict[str, str]:
    """Where two saved tables were measured: their common device and jax version (and the first
    one's Python). Two ``profile-sources`` tables, or two kernel tables (``KERNEL_TABLES``); tables of
    another suite, a mix of the two kinds, or of two devices or jax versions are not one comparison."""
    kinds = [t.get("suite") for t in tables]
    for kind, p in zip(kinds, paths, strict=True):
        if kind != "profile-sources" and kind not in KERNEL_TABLES:
            raise ValueError(
                f"benchmarks.profile --compare: {p} holds suite {kind!r}; expected 'profile-sources', "
                "'profile-protect' or 'profile-off'"
            )
    if (kinds[0] == "profile-sources") != (kinds[1] == "profile-sources"):
        raise ValueError(
            f"benchmarks.profile --compare: {kinds[0]!r} against {kinds[1]!r}; expected two op tables "
            "(profile-sources) or two kernel tables (profile-protect, profile-off)"
        )
    for key in ("device", "jax"):
        a, b = (t.get(key) for t in tables)
        if a != b:
            raise ValueError(
                f"benchmarks.profile --compare: the tables' {key} differ ({a} vs {b}); "
                "expected two tables of one device and one jax version"
            )
    return {k: str(tables[0][k]) for k in ("device", "jax", "python") if k in tables[0]}


# The three runs, each a process: the warm one compiles the step into the cache; "base" (1 step) and
# "trace" (1 + --steps) are traced, and their difference is the profile.
RUNS = ("warm", "base", "trace")


def saved_note(note: str, run_seconds: dict[str, float]) -> str:
    """A saved table's note: the caller's, then each run's wall time (what the compile cache saves
    shows in the results file, not only in the printout)."""
    runs = ", ".join(f"{name} {sec:.1f} s" for name, sec in run_seconds.items())
    return "; ".join(x for x in (note, f"the profile's runs (wall time): {runs}" if runs else "") if x)


def run_command(argv: list[str], out: pathlib.Path, name: str) -> list[str]:
    """The command of one run: this script with the caller's arguments, its folder and ``--run``."""
    argv = without_options(argv, values=("--out", "--run"))  # the caller's own (a folder it named), replaced
    return [sys.executable, "-m", "benchmarks.profile", *argv, "--out", str(out), "--run", name]


# Options of the protected step alone (flags, and options with a value), left out of --pair's
# unprotected one, with those --pair sets itself for each.
_PROTECTED_FLAGS = ("--protect", "--fused", "--no-recompute", "--no-cast-on-scrub", "--no-fused-update")
_PAIR_FLAGS = ("--pair", "--hlo-dump")
_PAIR_VALUES = ("--out", "--run", "--save", "--flash")


def pair_commands(argv: list[str], out: pathlib.Path, tag: str | None) -> dict[str, list[str]]:
    """``--pair``'s two profiles: ``{"on": command, "off": command}``, this script with the caller's
    arguments, each with ``--hlo-dump``, a folder of its own under ``out`` and (with a ``tag``) its
    results saved as ``tag`` + on / off. "on" is the protected step as the caller gave it (its
    ``--flash`` kept); "off" the unprotected step with cuDNN's attention, the protected step's own
    options (``--protect``, ``--fused``, ``--redo-blocks`` ...) left out."""

    common = without_options(argv, _PAIR_FLAGS, (*_PAIR_VALUES, "--redo-blocks"))
    on = without_options(argv, _PAIR_FLAGS, ("--out", "--run", "--save"))
    on = on if "--protect" in on else [*on, "--protect"]
    off = [*without_options(common, _PROTECTED_FLAGS, ()), "--flash", "on"]
    cmds = {}
    for name, args in (("on", on), ("off", off)):
        save = ["--save", f"{tag}{name}"] if tag is not None else []
        cmds[name] = [
            sys.executable,
            "-m",
            "benchmarks.profile",
            *args,
            "--hlo-dump",
            "--out",
            str(out / name),
            *save,
        ]
    return cmds


def _pair(argv: list[str], out: pathlib.Path, args, command: str) -> None:
    """``--pair``: both profiles (``pair_commands``), each a process of its own, then their op tables
    side by side per op and per category (``compare``, ``compare_categories``), printed and, with
    ``--save TAG``, saved as TAG."""
    sources = {}
    for name, cmd in pair_commands(argv, out, args.save).items():
        done = subprocess.run(cmd, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"benchmarks.profile --pair: the {name} profile failed (exit {done.returncode})"
            )
        summary = json.loads((out / name / "summary.json").read_text())
        sources[name] = result_tables(summary, name == "on")["profile-sources"]
    rows = compare(sources["on"], sources["off"])
    cats = compare_categories(sources["on"], sources["off"])
    if args.save is not None:
        note = args.note or f"the profiles {args.save}on against {args.save}off of this command"
        for suite, table in (("profile-compare", rows), ("profile-categories", cats)):
            print(f"wrote {write_result(suite, table, command, tag=args.save, note=note)}")
    print(f"{'added ms':>9} {'on ms':>8} {'off ms':>8}  category (per step)")
    for r in cats:
        print(f"{r['added_ms']:9.2f} {r['protect_ms']:8.2f} {r['off_ms']:8.2f}  {r['category']}")


def one_run(args, out: pathlib.Path, name: str) -> None:
    """One of the profile's runs (``RUNS``) in this process: the training script for one step
    ("warm", "base") or 1 + ``--steps`` ("trace"), the last two under JAX's profiler."""
    n = len(jax.devices())
    cfg = dict(
        config=args.config, layers=args.layers, tokenizer="bytes", batch=n, seq=args.seq, dtype=args.dtype,
        remat=True, remat_policy=args.remat_policy, recompute=not args.no_recompute,
        recompute_blocks=args.redo_blocks, devices=n, eval_every=10**9, eval_windows=n, warmup=1,
        protect=args.protect, fused=args.fused, flash=args.flash, flip_every=0, gemm_fault_rate=0.0,
        nan_rate=0.0, quiet=True, cast_on_scrub=not args.no_cast_on_scrub,
        fused_update=not args.no_fused_update,
    )  # fmt: skip
    # Here, not at the module's top: benchmarks.rev_ab imports this module's trace readers beside
    # an older revision's pimlayers, which the working tree's training script may not import with.
    from train.llama3 import TrainConfig, train

    share_compiles(None if args.no_compile_cache else out / "jax-cache", fresh=False)
    if name == "warm":  # autotuning, the step's compilation into the cache, the ops' own programs
        train(TrainConfig(steps=1, out_dir=str(out / "warm"), **cfg))
        return
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # Python frames would flood the trace buffer (events get dropped)
    steps = 1 if name == "base" else 1 + args.steps
    with jax.profiler.trace(str(out / name), create_perfetto_trace=True, profiler_options=opts):
        train(TrainConfig(steps=steps, out_dir=str(out / f"run-{name}"), **cfg))


def share_compiles(folder: pathlib.Path | None, min_seconds: float = 1.0, fresh: bool = True) -> None:
    """JAX's persistent compilation cache in ``folder`` for this process's later compilations of at
    least ``min_seconds``: a program compiled again, as each ``train()`` call jits its step afresh,
    is then read back instead (its executable, so the same kernels and autotuning choices). The
    profile's three runs compiled the step three times; on a 2-core CPU the small config's profile
    (``--config llama3_small --layers 2 --seq 256 --steps 2 --protect --hlo-dump``) took 50 s with
    the cache against 60 without (2026-12-07, one run each). A cache entry JAX cannot read is
    compiled again, with a warning. ``folder`` is emptied first: a program compiled by an earlier
    run there, perhaps under other settings that the cache's key does not see (the native handlers'
    traits, which decide what XLA's command buffers take), is never loaded, and the warm run
    compiles, so that ``--hlo-dump`` has its programs (``fresh=False``: kept, for the runs after the
    first, each a process of its own). ``folder`` None: no persistent cache at all, not even one the
    environment names (``--no-compile-cache``)."""
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_seconds))
    # JAX settles on its cache (or none) at the process's first compilation: start it again, so the
    # folder is used whatever compiled before (an import's constants, the native module's probes).
    compilation_cache.reset_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3_8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="steps the longer traced run adds")
    ap.add_argument("--protect", action="store_true")
    ap.add_argument("--fused", action="store_true", help="FaultPolicy(fused=True): the fused forward GEMM")
    ap.add_argument("--no-recompute", action="store_true", help="train's --no-recompute")
    ap.add_argument("--redo-blocks", type=int, default=None, metavar="N", help="train's --recompute-blocks")
    ap.add_argument(
        "--remat-policy", default="full", choices=sorted(REMAT_POLICIES), help="train's --remat-policy"
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--no-cast-on-scrub",
        action="store_true",
        help="train's --no-cast-on-scrub: each layer casts its kernels (no compute copies from the scrub)",
    )
    ap.add_argument(
        "--no-fused-update",
        action="store_true",
        help="train's --no-fused-update: AdamW's step, then the parameters' encode",
    )
    ap.add_argument(
        "--flash",
        default="auto",
        choices=["auto", "on", "off"],
        help="attention's flash kernel (train's --flash)",
    )
    ap.add_argument(
        "--out", default="", help="folder for the trace and summary.json (default: a temporary one)"
    )
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--hlo-dump",
        action="store_true",
        help="have XLA dump the optimised HLO (under --out/hlo) and name the op behind each kernel",
    )
    ap.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="run XLA without command buffers (--xla_gpu_enable_command_buffer=): every kernel's "
        "event then names its own instruction, so with --hlo-dump the sources table attributes "
        "cuBLAS's kernels to the products they computed (inside a command buffer they name the "
        "buffer); the step's timing is then not the default's",
    )
    ap.add_argument(
        "--save",
        default=None,
        metavar="TAG",
        help="also write the tables to benchmarks/results/<date>-profile-...-<TAG>-<device>.json",
    )
    ap.add_argument("--note", default="", help="with --save: a note stored with the tables")
    ap.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile the step in each of the three runs (warm, base, traced) instead of the base "
        "and traced runs loading the warm run's executable from JAX's compilation cache",
    )
    ap.add_argument(
        "--run",
        choices=RUNS,
        default=None,
        help="one of the three runs only, in this process (the profile starts each so, under --out)",
    )
    ap.add_argument(
        "--pair",
        action="store_true",
        help="profile the protected step and the unprotected one (cuDNN's attention), each with "
        "--hlo-dump, then compare their op tables (with --save TAG: TAGon, TAGoff and TAG)",
    )
    ap.add_argument(
        "--compare",
        nargs=2,
        metavar=("PROTECT", "OFF"),
        help="no run: two saved profile-sources files side by side per op, or two kernel tables "
        "(profile-protect / profile-off files) per kernel (with --save: a results file)",
    )
    args = ap.parse_args()
    # The command as given, before the flags below join XLA_FLAGS (the runs' own, not the caller's).
    command = command_line("benchmarks.profile")
    if args.pair and (args.compare or args.run):
        raise ValueError("benchmarks.profile --pair: not with --compare or --run (it makes both profiles)")
    if args.compare:
        tables = [json.loads(pathlib.Path(f).read_text()) for f in args.compare]
        note = args.note or f"{args.compare[0]} against {args.compare[1]}"
        where = measured_on(tables, args.compare)

        def save(suite: str, rows: list[dict]) -> None:  # with --save: a results file
            if args.save is not None:
                print(
                    f"wrote {write_result(suite, rows, command, tag=args.save, note=note, measured_on=where)}"
                )

        if tables[0].get("suite") in KERNEL_TABLES:
            rows = compare_kernels(tables[0]["rows"], tables[1]["rows"])
            save("profile-compare-kernels", rows)
            print(f"{'diff ms':>9} {'first ms':>9} {'second ms':>9}  kernel (per step)")
            for r in rows[: args.top]:
                print(f"{r['diff_ms']:9.2f} {r['first_ms']:9.2f} {r['second_ms']:9.2f}  {r['kernel'][:90]}")
            return
        rows = compare(tables[0]["rows"], tables[1]["rows"])
        save("profile-compare", rows)
        cats = compare_categories(tables[0]["rows"], tables[1]["rows"])
        save("profile-categories", cats)
        print(f"{'added ms':>9} {'on ms':>8} {'off ms':>8}  category (per step)")
        for r in cats:
            print(f"{r['added_ms']:9.2f} {r['protect_ms']:8.2f} {r['off_ms']:8.2f}  {r['category']}")
        print()
        print(f"{'added ms':>9} {'on ms':>8} {'off ms':>8} {'on n':>7} {'off n':>7}  op (per step)")
        # The largest additions, then (past --top) the ops protection removes, the largest first:
        # the unprotected step's own kernels (cuDNN's attention) it replaces.
        shown = rows[: args.top]
        removed = sorted((r for r in rows[args.top :] if r["added_ms"] < 0), key=lambda r: r["added_ms"])
        for r in shown + removed[: max(args.top // 3, 1)]:
            print(
                f"{r['added_ms']:9.2f} {r['protect_ms']:8.2f} {r['off_ms']:8.2f} "
                f"{r['protect_n']:7.0f} {r['off_n']:7.0f}  {r['op'][:90]}"
            )
        return
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="pimlayers-profile-"))
    if args.pair:
        return _pair(sys.argv[1:], out, args, command)
    dump = out / "hlo"
    flags = ([f"--xla_dump_to={dump}"] if args.hlo_dump else []) + (
        ["--xla_gpu_enable_command_buffer="] if args.no_command_buffers else []
    )
    if flags:  # read when the backends start, which the first jax.devices() below does
        if backends_are_initialized():
            raise RuntimeError(
                f"benchmarks.profile {' '.join(flags)}: the XLA backends started before the flags were set"
            )
        have = os.environ.get("XLA_FLAGS", "")  # a run inherits its starter's, flags included
        os.environ["XLA_FLAGS"] = " ".join([have, *(f for f in flags if f not in have.split())]).strip()
    if args.run is not None:
        one_run(args, out, args.run)
        return
    # Each run in a process of its own (RUNS); this one starts no backend until they are done.
    share_compiles(None if args.no_compile_cache else out / "jax-cache")
    run_seconds = {}  # each run's wall time: the warm one compiles, the others should load
    for name in RUNS:
        t0 = time.perf_counter()
        done = subprocess.run(run_command(sys.argv[1:], out, name), check=False)
        if done.returncode != 0:
            raise RuntimeError(f"benchmarks.profile: the {name} run failed (exit {done.returncode})")
        run_seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name} run: {run_seconds[name]:.1f} s", flush=True)
    sources = None
    if args.hlo_dump:
        # Instruction names repeat across programs (every module has its fusion.1): the largest
        # program, the training step, is read last and wins.
        texts = sorted((f.read_text() for f in dump.glob("*after_optimizations.txt")), key=len)
        if not texts:
            raise RuntimeError(f"benchmarks.profile --hlo-dump: XLA wrote no optimised HLO under {dump}")
        sources = hlo_sources(texts)
    s = summarize(
        out / "trace", args.top, base_dir=out / "base", steps=args.steps, sources=sources, fused=args.fused
    )
    s.update(command=command, run_seconds=run_seconds)
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    if args.save is not None:
        note = saved_note(args.note, run_seconds)
        for suite, rows in result_tables(s, args.protect).items():
            print(f"wrote {write_result(suite, rows, command, tag=args.save, note=note)}")
    print(
        f"{s['timeline']} time per step: {s['total_ms']:.1f} ms in {s['events']:.0f} events "
        f"(runs of 1 and {1 + args.steps} steps; {out})"
    )
    for title in ("kernels", "scopes", "sources"):
        if title == "sources" and "sources" not in s:
            continue
        what = ", every kernel by the op it came from" if title == "sources" else ""
        print(f"\n{title} (ms per step{what}):")
        for r in s[title][: args.top]:
            src = f"  <- {r['source'][-70:]}" if r.get("source") else ""
            unit = "launches" if title == "kernels" else "kernels"
            n = f"  {r['count']:6.0f} {unit}" if "count" in r else ""
            print(f"  {r['ms']:10.2f} ms  {100 * r['share']:5.1f}%{n}  {r['name'][:100]}{src}")
    if "sources" in s:
        print("\nby category (ms per step):")
        by = categories(result_tables(s, args.protect)["profile-sources"])  # as a saved table
        for name, v in sorted(by.items(), key=lambda kv: -kv[1]["ms_per_step"]):
            print(f"  {v['ms_per_step']:10.2f} ms  {v['count_per_step']:6.0f} kernels  {name}")
    if "idle_ms" in s and not s["idle_measured"]:
        print(
            f"\ndevice idle: not measured (the two runs' one-off gaps differ by more than the steps' idle: "
            f"{s['idle_ms']:.1f} ms idle and {s['phase_ms']:.1f} ms of host phases per step differenced)"
        )
    if "idle_ms" in s and s["idle_measured"]:
        print(f"\ndevice idle between kernels: {s['idle_ms']:.1f} ms per step; largest gaps (ms, count):")
        for r in s["gaps"]:
            print(f"  {r['ms']:10.2f} ms  {r['count']:6.1f}  {r['before'][:50]}  ->  {r['after'][:50]}")
        phase = f"device gaps of {PHASE_US / 1e3:.0f} ms or more"
        print(f"\nhost phases ({phase}): {s['phase_ms']:.1f} ms per step")
        for r in s["phases"][:5]:
            print(f"  {r['ms']:10.2f} ms  {r['count']:6.1f}  {r['before'][:50]}  ->  {r['after'][:50]}")
    if "step_idle" in s:
        si = s["step_idle"]
        print(
            f"\ndevice idle inside the step program (median of {si['runs']} executions): "
            f"{si['idle_ms']:.2f} ms of a {si['span_ms']:.2f} ms span ({si['busy_ms']:.2f} ms with a kernel "
            "running); largest gaps (ms, count per execution):"
        )
        for r in si["gaps"]:
            print(f"  {r['ms']:10.3f} ms  {r['count']:6.1f}  {r['before'][:50]}  ->  {r['after'][:50]}")
        if math.isfinite(si["between_ms"]):
            print(
                f"between two executions (median): {si['between_ms']:.2f} ms of device time, "
                f"{si['between_busy_ms']:.2f} ms of it with another program's kernel or copy running"
            )
    if "host" in s:
        print("\nhost events (ms per step, inclusive of what they enclose; count per step):")
        for r in s["host"]:
            print(f"  {r['ms']:10.2f} ms  {r['count']:8.1f}  {r['name'][:100]}")


if __name__ == "__main__":
    main()
