"""The performance goals' standing, read from the newest results file that measures each (the GPU
goals: the newest of each GPU model; goal 5: the newest three), and their history over every file
that measures them.

One row per goal, device and case: the peer measured in the same run, our figure, the ratio the
goal is stated in, the target, whether the figure meets it, and the file it came from. Goals (on
one H200, ratios side by side in one run; the CPU goal on the CI machine):

1. protected GEMM, forward and forward+backward at the four Llama-3-8B shapes (M = 8192, bf16,
   128-column blocks, the default policy and, where the file has them, the other recompute
   policies): plain / protected >= 1.00;
2. protected causal GQA attention (the layer's protected core on the verified flash kernels, with
   the default recompute (a loop until 2026-12-05, then the device redo) and, where the file has
   them, with the loop and without recompute) against cuDNN's flash attention,
   forward and forward+backward: >= 0.93;
3. the parameter scrub's bandwidth against the datasheet's 4.8 TB/s: >= 0.90 (by its kernels' time
   where the file has it, and by the timed loop);
4. the 4-layer Llama-3-8B-dimension training step, protected against unprotected with cuDNN's
   attention: >= 0.95 in tokens/s and MFU >= 0.50;
5. CPU: protected Dense <= 1.3x plain at small sizes, i.e. plain / protected >= 1 / 1.3 (the worst
   row of the newest three CPU files: one run's worst row moved by up to 0.3 between runs, so one
   file alone could say "met" by luck).

``figure`` draws the history: per goal and results file, the best and the worst case's ratio.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable

__all__ = ["figure", "history", "rows", "table"]

COLUMNS = ("goal", "device", "case", "peer", "ours", "ratio", "target", "met", "file")
GOAL_GPU = "gpu:NVIDIA H200"  # the device the GPU goals are stated on
CPU_FILES = 3  # goal 5 is judged by the worst row of this many newest CPU files


def _num(v) -> bool:
    return isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))


def _row(goal, res, case, peer, ours, ratio, least: float, target: str = "", also: bool = True) -> dict:
    met = ratio >= least and also
    target = target or f">= {least:.2f}"
    device = _short(res["device"])
    return dict(
        goal=goal, device=device, case=case, peer=peer, ours=ours, ratio=ratio, target=target, met=met,
        file=res["file"],
    )  # fmt: skip


def _short(device: str) -> str:
    """ "gpu:NVIDIA H100 80GB HBM3" -> "H100 80GB HBM3"; "cpu:cpu" -> "cpu"."""
    return device.split(":", 1)[-1].removeprefix("NVIDIA ")


# Goal 1's other policies, where a file has them: (column prefix, case suffix). From the s40 files
# (2026-12-05) on, the default redoes on the device kernel on a GPU and ``loop`` is the recompute
# loop; before, the default was the loop and ``kernel`` / ``fused_redo_kernel`` the opt-in redo.
# ``fused`` is the fused GEMM under the file's default policy; ``checks_kernel`` (from the s42 file
# on) the one-read checks kernel under it.
_GEMM_VARIANTS = (
    ("loop", "recompute loop"),
    ("kernel", "device redo"),
    ("fused_redo_kernel", "fused GEMM, device redo"),
    ("fused", "fused GEMM"),
    ("checks_kernel", "one-read checks kernel"),
    ("c1_only", "plain checks"),
    ("fused_c1", "fused GEMM, plain checks in its kernel"),
)


def _gemm(res: dict) -> list[dict]:
    want = lambda r: r.get("m") == 8192 and r.get("block_n") == 128 and _num(r.get("ratio"))
    out = []
    for r in filter(want, res["rows"]):
        peer, ours = f"XLA GEMM {r['plain_ms']:.3g} ms", f"{r['protected_ms']:.3g} ms"
        # Rows name the default's recompute (`recompute`) since 2026-12-06 (the first file of that
        # day, run with `--variants` and so without loop columns, ran the device redo too); before,
        # a file without loop columns predates the device redo as the default: its default was the
        # loop, named so that the op alone always means today's default.
        redo = "loop_ms" in r or str(res.get("date", "")) >= "2026-12-06"
        loop = r.get("recompute", "device kernel" if redo else "loop") == "loop"
        case = f"{r['op']}, recompute loop" if loop else r["op"]
        out.append(_row(1, res, case, peer, ours, r["ratio"], 1.0))
        for col, what in _GEMM_VARIANTS:
            if col == "fused" and loop:
                what += ", recompute loop"  # the default of its day
            if _num(r.get(f"{col}_ratio")):
                ours = f"{r[f'{col}_ms']:.3g} ms"
                out.append(_row(1, res, f"{r['op']}, {what}", peer, ours, r[f"{col}_ratio"], 1.0))
    return out


def _attention(res: dict) -> list[dict]:
    core = "pimlayers attention_core, protected (flash"
    want = lambda r: str(r.get("op", "")).startswith(core) and _num(r.get("vs_cudnn"))
    cudnn = {r["mode"]: r for r in res["rows"] if r.get("op") == "cuDNN flash attention"}
    out = []
    for r in filter(want, res["rows"]):
        if r["mode"] in cudnn:
            # The default (since 2026-12-05 the device redo), the recompute loop, or no recompute.
            kind = next((k for k in ("no recompute", "recompute loop") if k in r["op"]), "")
            case = f"{r['mode']}, {r['shape']}" + (f", {kind}" if kind else "")
            peer = f"cuDNN {cudnn[r['mode']]['ms']:.3g} ms"
            out.append(_row(2, res, case, peer, f"{r['ms']:.3g} ms", r["vs_cudnn"], 0.93))
    return out


def _scrub(res: dict) -> list[dict]:
    want = lambda r: str(r.get("op", "")).startswith("scrub (") or r.get("op") == "scrub, float32 parameters"
    out = []
    for r in filter(want, res["rows"]):
        timings = (("dev_vs_datasheet", "kernels' time", "dev_gbs"), ("vs_datasheet", "timed loop", "gbs"))
        for key, how, gbs in timings:
            if _num(r.get(key)):
                case = f"{r['op']}, {r['gbytes']:.3g} GB, {how}"
                out.append(_row(3, res, case, "4.8 TB/s (datasheet)", f"{r[gbs]:.0f} GB/s", r[key], 0.90))
    return out


def _step(res: dict) -> list[dict]:
    want = lambda r: r.get("protect") is True and _num(r.get("on_over_cudnn"))
    cudnn = [r for r in res["rows"] if r.get("attention") == "cuDNN"]
    main = res["rows"][0].get("remat")  # the run's own policy; --also-remat rows name theirs
    out = []
    for r in filter(want, res["rows"]):
        peer = next((c for c in cudnn if c.get("remat") == r.get("remat")), cudnn[0] if cudnn else None)
        case = f"recompute: {r.get('recompute')}" + (", fused forward GEMM" if r.get("fused") else "")
        case += ", plain checks" if r.get("checks") == "c1 only" else ""
        case += ", kernels cast by each layer" if r.get("weights") == "cast by each layer" else ""
        case += ", update then encode" if r.get("update") == "then encode" else ""
        if r.get("checks_kernel_ran"):  # asked for, or on for the whole process
            case += ", one-read checks kernel"
        elif r.get("checks_kernel"):
            case += ", one-read checks kernel (asked; not run here)"
        case += f", remat {r.get('remat')}" if r.get("remat") != main else ""
        theirs = f"cuDNN step {peer['step_ms']:.4g} ms" if peer else ""
        ours = f"{r['step_ms']:.4g} ms, MFU {r['mfu']:.3f}"
        row = _row(
            4, res, case, theirs, ours, r["on_over_cudnn"], 0.95, ">= 0.95, MFU >= 0.50", r["mfu"] >= 0.50
        )
        out.append(dict(row, mfu=r["mfu"]))
    return out


def _dense(res: dict) -> list[dict]:
    want = lambda r: _num(r.get("ratio")) and str(r.get("op", "")).startswith("fwd")
    out = []
    for r in filter(want, res["rows"]):
        case = f"{r['op']}, block_n {r['block_n']}, M = {r['m']}"
        peer, ours = f"plain {r['plain_ms']:.3g} ms", f"{r['protected_ms']:.3g} ms"
        out.append(_row(5, res, case, peer, ours, r["ratio"], 1 / 1.3, ">= 0.77 (1 / 1.3)"))
    return out


# goal: (suite, on a GPU, the file's rows in the goal's terms, what the goal asks, its target)
GOALS: dict[int, tuple[str, bool, Callable[[dict], list[dict]], str, float]] = {
    1: ("matmul", True, _gemm, "protected GEMM: plain / protected", 1.0),
    2: ("peers", True, _attention, "protected attention: vs cuDNN", 0.93),
    3: ("memory", True, _scrub, "scrub: bandwidth / 4.8 TB/s", 0.90),
    4: ("llama3-1dev", True, _step, "training step: protected / cuDNN step", 0.95),
    5: ("matmul", False, _dense, "CPU Dense: plain / protected", 1 / 1.3),
}


def _files(results: list[dict], goal: int) -> list[dict]:
    """The files that measure ``goal``, each with its rows in the goal's terms, newest first."""
    suite, gpu, of, *_ = GOALS[goal]
    found = [
        dict(res, goal_rows=of(res))
        for res in results
        if res["suite"] == suite and res["device"].startswith("gpu" if gpu else "cpu")
    ]
    return sorted((f for f in found if f["goal_rows"]), key=lambda f: f["date"], reverse=True)


def rows(results: list[dict]) -> list[dict]:
    """``results``: every results file as loaded, each with its ``file`` name added. GPU goals: the
    newest file of each GPU model, the goals' own (an H200) first; a ratio is against the peer
    measured in the same run on the same GPU, so each model's rows stand on their own."""
    out: list[dict] = []
    for goal in (1, 2, 3, 4):
        newest: dict[str, dict] = {}
        for f in _files(results, goal):  # newest first
            newest.setdefault(f["device"], f)
        for dev in sorted(newest, key=lambda d: (d != GOAL_GPU, d)):
            out += [{k: v for k, v in r.items() if k in COLUMNS} for r in newest[dev]["goal_rows"]]
    found = [r for f in _files(results, 5)[:CPU_FILES] for r in f["goal_rows"]]
    if found:
        worst = min(found, key=lambda r: r["ratio"])
        n = len({r["file"] for r in found})
        out.append(dict(worst, case=f"worst of {len(found)} rows in the newest {n} file(s): {worst['case']}"))
    return out


def history(results: list[dict]) -> list[dict]:
    """Per goal and file that measures it, oldest first: the date, the best and the worst case's ratio
    and the number of cases (goal 4 also the best case's MFU)."""
    out = []
    for goal in GOALS:
        for f in reversed(_files(results, goal)):
            rs = f["goal_rows"]
            best = max(rs, key=lambda r: r["ratio"])
            worst = min(r["ratio"] for r in rs)
            point = dict(
                goal=goal, date=f["date"], file=f["file"], best=best["ratio"], worst=worst, cases=len(rs),
                device=_short(f["device"]),
            )  # fmt: skip
            out.append(dict(point, best_case=best["case"], mfu=best.get("mfu")))
    return out


def figure(results: list[dict], path: pathlib.Path) -> None:
    """Draw ``history`` to ``path`` (PNG): one panel per goal, its target dashed. Needs matplotlib."""
    import matplotlib

    points = history(results)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, goal in zip(axes.flat, GOALS, strict=False):
        _, gpu, _, title, target = GOALS[goal]
        ps = [p for p in points if p["goal"] == goal]
        ax.set_title(f"goal {goal}: {title} >= {target:.2f}", fontsize=9)
        ax.axhline(target, color="grey", ls="--", lw=1, label="the goal's target")
        if ps:
            # Files in the order they were written, evenly spaced (some days hold a dozen runs), each
            # day's first file labelled with its date.
            at = range(len(ps))
            ax.vlines(at, [p["worst"] for p in ps], [p["best"] for p in ps], color="C0", alpha=0.35, lw=2)
            ax.plot(at, [p["best"] for p in ps], "o-", ms=4, lw=1, color="C0", label="best case")
            ax.plot(at, [p["worst"] for p in ps], "v", ms=4, color="C0", alpha=0.6, label="worst case")
            other = [i for i, p in enumerate(ps) if gpu and p["device"] != _short(GOAL_GPU)]
            if other:  # files from another GPU model than the goals' (ratios against that GPU's peer)
                ax.plot(other, [ps[i]["best"] for i in other], "D", ms=6, mfc="none", color="C3",
                        label="another GPU model")  # fmt: skip
            if goal == 4:
                ax.plot(at, [p["mfu"] for p in ps], "s-", ms=3, lw=1, color="C1", label="best case's MFU")
                ax.axhline(0.50, color="C1", ls=":", lw=1, label="MFU target 0.50")
            days = [i for i, p in enumerate(ps) if i == 0 or p["date"][:10] != ps[i - 1]["date"][:10]]
            ax.set_xticks(days, [ps[i]["date"][5:10] for i in days], rotation=60)
            ax.set_xlabel("results files, oldest first (month-day)", fontsize=8)
        ax.set_ylabel("ratio (higher is better)", fontsize=8)
        ax.tick_params(labelsize=7)
        where = "one H200 (diamond: another GPU model)" if gpu else "CI's CPU"
        ax.text(0.01, 0.98, where, transform=ax.transAxes, va="top", fontsize=7)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    for ax in list(axes.flat)[len(GOALS) :]:
        ax.axis("off")
    axes.flat[-1].legend(handles.values(), handles.keys(), loc="center", fontsize=9)
    title = "Performance goals per results file (benchmarks/results/), drawn by python -m benchmarks.report"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def table(results: list[dict]) -> str:
    """The goals' rows as a markdown section (empty where no file measures any goal)."""
    rs = rows(results)
    if not rs:
        return ""
    lines = [
        "\n## Performance goals: where they stand\n\n",
        "Read by `benchmarks/goals.py` from the newest results file that measures each goal, for the "
        "GPU goals the newest of each GPU model (the goals are stated on an H200; each ratio is "
        "against the peer measured in the same run on the same GPU) (goal 5: the worst row of the "
        "newest three; the module's docstring states them); `ratio` is in the goal's own terms "
        "(higher is better).\n\n",
        f"| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}\n",
    ]
    for r in rs:
        cells = [
            f"{r[c]:.3f}" if c == "ratio" else ("yes" if r[c] else "no") if c == "met" else str(r[c])
            for c in COLUMNS
        ]
        cells[-1] = f"`{cells[-1]}`"
        lines.append(f"| {' | '.join(cells)} |\n")
    return "".join(lines)
