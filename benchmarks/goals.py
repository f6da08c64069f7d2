"""The performance goals' standing, read from the newest results file that measures each (goal 5:
the newest three).

One row per goal and case: the peer measured in the same run, our figure, the ratio the goal is
stated in, the target, whether the figure meets it, and the file it came from. Goals (on one H200,
ratios side by side in one run; the CPU goal on the CI machine):

1. protected GEMM, forward and forward+backward at the four Llama-3-8B shapes (M = 8192, bf16,
   128-column blocks, the default policy): plain / protected >= 1.00;
2. protected causal GQA attention (the layer's protected core on the verified flash kernels, with
   the default recompute loop and, where the file has it, without) against cuDNN's flash attention,
   forward and forward+backward: >= 0.93;
3. the parameter scrub's bandwidth against the datasheet's 4.8 TB/s: >= 0.90 (by its kernels' time
   where the file has it, and by the timed loop);
4. the 4-layer Llama-3-8B-dimension training step, protected against unprotected with cuDNN's
   attention: >= 0.95 in tokens/s and MFU >= 0.50;
5. CPU: protected Dense <= 1.3x plain at small sizes, i.e. plain / protected >= 1 / 1.3 (the worst
   row of the newest three CPU files: one run's worst row moved by up to 0.3 between runs, so one
   file alone could say "met" by luck).
"""

from __future__ import annotations

import math

__all__ = ["rows", "table"]

COLUMNS = ("goal", "case", "peer", "ours", "ratio", "target", "met", "file")


def _latest(results: list[dict], suite: str, gpu: bool, want) -> dict | None:
    """The newest file (by its timestamp) of ``suite`` on a GPU (or the CPU) with a row ``want`` takes."""
    found = [
        r
        for r in results
        if r["suite"] == suite
        and r["device"].startswith("gpu" if gpu else "cpu")
        and any(want(row) for row in r["rows"])
    ]
    return max(found, key=lambda r: r["date"]) if found else None


def _newest(results: list[dict], suite: str, gpu: bool, want, n: int) -> list[dict]:
    """Up to ``n`` files as ``_latest`` finds one, newest first."""
    found = [
        r
        for r in results
        if r["suite"] == suite
        and r["device"].startswith("gpu" if gpu else "cpu")
        and any(want(row) for row in r["rows"])
    ]
    return sorted(found, key=lambda r: r["date"], reverse=True)[:n]


def _num(v) -> bool:
    return isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))


def rows(results: list[dict]) -> list[dict]:
    """``results``: every results file as loaded, each with its ``file`` name added."""
    out: list[dict] = []

    def add(goal, res, case, peer, ours, ratio, least: float, target: str = "", also: bool = True):
        target = target or f">= {least:.2f}"
        met = ratio >= least and also
        out.append(dict(goal=goal, case=case, peer=peer, ours=ours, ratio=ratio, target=target, met=met,
                        file=res["file"]))  # fmt: skip

    gemm = lambda r: r.get("m") == 8192 and r.get("block_n") == 128 and _num(r.get("ratio"))
    res = _latest(results, "matmul", True, gemm)
    for r in filter(gemm, res["rows"] if res else []):
        add(
            1,
            res,
            r["op"],
            f"XLA GEMM {r['plain_ms']:.3g} ms",
            f"{r['protected_ms']:.3g} ms",
            r["ratio"],
            1.0,
        )

    core = "pimlayers attention_core, protected (flash"
    attn = lambda r: str(r.get("op", "")).startswith(core) and _num(r.get("vs_cudnn"))
    res = _latest(results, "peers", True, attn)
    cudnn = {r["mode"]: r for r in res["rows"] if r.get("op") == "cuDNN flash attention"} if res else {}
    for r in filter(attn, res["rows"] if res else []):
        if r["mode"] in cudnn:
            case = f"{r['mode']}, {r['shape']}" + (", no recompute" if "no recompute" in r["op"] else "")
            add(
                2,
                res,
                case,
                f"cuDNN {cudnn[r['mode']]['ms']:.3g} ms",
                f"{r['ms']:.3g} ms",
                r["vs_cudnn"],
                0.93,
            )

    scrub = lambda r: str(r.get("op", "")).startswith("scrub (") or r.get("op") == "scrub, float32 parameters"
    res = _latest(results, "memory", True, lambda r: scrub(r) and _num(r.get("vs_datasheet")))
    for r in filter(scrub, res["rows"] if res else []):
        for key, how, gbs in (
            ("dev_vs_datasheet", "kernels' time", "dev_gbs"),
            ("vs_datasheet", "timed loop", "gbs"),
        ):
            if _num(r.get(key)):
                case = f"{r['op']}, {r['gbytes']:.3g} GB, {how}"
                add(3, res, case, "4.8 TB/s (datasheet)", f"{r[gbs]:.0f} GB/s", r[key], 0.90)

    step = lambda r: r.get("protect") is True and _num(r.get("on_over_cudnn"))
    res = _latest(results, "llama3-1dev", True, step)
    peer = next((r for r in res["rows"] if r.get("attention") == "cuDNN"), None) if res else None
    for r in filter(step, res["rows"] if res else []):
        case = f"recompute: {r.get('recompute')}" + (", fused forward GEMM" if r.get("fused") else "")
        add(4, res, case, f"cuDNN step {peer['step_ms']:.4g} ms" if peer else "",
            f"{r['step_ms']:.4g} ms, MFU {r['mfu']:.3f}", r["on_over_cudnn"], 0.95, ">= 0.95, MFU >= 0.50",
            also=r["mfu"] >= 0.50)  # fmt: skip

    dense = lambda r: _num(r.get("ratio")) and str(r.get("op", "")).startswith("fwd")
    files = _newest(results, "matmul", False, dense, 3)
    if files:
        found = [(f, row) for f in files for row in filter(dense, f["rows"])]
        res, w = min(found, key=lambda fr: fr[1]["ratio"])
        case = (f"worst of {len(found)} rows in the newest {len(files)} file(s): {w['op']}, block_n "
                f"{w['block_n']}, M = {w['m']}")  # fmt: skip
        add(5, res, case, f"plain {w['plain_ms']:.3g} ms", f"{w['protected_ms']:.3g} ms", w["ratio"], 1 / 1.3,
            ">= 0.77 (1 / 1.3)")  # fmt: skip
    return out


def table(results: list[dict]) -> str:
    """The goals' rows as a markdown section (empty where no file measures any goal)."""
    rs = rows(results)
    if not rs:
        return ""
    lines = [
        "\n## Performance goals: where they stand\n\n",
        "Read by `benchmarks/goals.py` from the newest results file that measures each goal (goal 5: "
        "the worst row of the newest three; the module's docstring states them); `ratio` is in the "
        "goal's own terms (higher is better).\n\n",
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
