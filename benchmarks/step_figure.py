"""Where the protected training step's extra time goes, drawn from the newest ``profile-categories``
results file (``python -m benchmarks.profile --compare ON OFF --save TAG``): the protected and the
unprotected step's kernel time per category side by side, and what protection adds in each.

``newest`` picks the file (the newest by date and name, of a GPU: on a CPU the profile sums host
events, not device time); ``figure`` draws it; ``caption`` is the text docs/benchmarks.md shows
with it (the file, device, date and command it came from).
"""

from __future__ import annotations

import pathlib

SUITE = "profile-categories"


def newest(results: list[dict]) -> dict | None:
    """The newest ``profile-categories`` file measured on a GPU (``results``: loaded files, each
    with its ``file`` name), or None."""
    found = [r for r in results if r.get("suite") == SUITE and str(r.get("device", "")).startswith("gpu:")]
    return max(found, key=lambda r: (r["date"], r["file"])) if found else None


def _rows(data: dict) -> list[dict]:
    """The file's category rows, the largest addition first (the ops no table listed, if any, last)."""
    rows = [r for r in data["rows"] if not r["category"].startswith("(")]
    rest = [r for r in data["rows"] if r["category"].startswith("(")]
    return sorted(rows, key=lambda r: -r["added_ms"]) + rest


def figure(data: dict, path: pathlib.Path) -> None:
    """Draw ``data`` (a ``profile-categories`` file) to ``path`` (PNG). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(data)
    names = [r["category"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2), sharey=True)
    at = range(len(rows))
    h = 0.38
    left.barh([i - h / 2 for i in at], [r["protect_ms"] for r in rows], h, color="C3", label="protected")
    left.barh([i + h / 2 for i in at], [r["off_ms"] for r in rows], h, color="C0", label="unprotected")
    left.set_yticks(list(at), names, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("kernel time per step (ms)", fontsize=8)
    left.legend(fontsize=8, loc="lower right")
    left.set_title("each step's kernels by category", fontsize=9)
    added = [r["added_ms"] for r in rows]
    right.barh(list(at), added, color=["C3" if a >= 0 else "C2" for a in added])
    for i, a in enumerate(added):
        right.text(
            a,
            i,
            f" {a:+.2f} " if a < 0 else f" {a:+.2f}",
            va="center",
            ha="left" if a >= 0 else "right",
            fontsize=7,
        )
    # Room for the labels past the longest bars on either side.
    lo, hi = min([*added, 0.0]), max([*added, 0.0])
    span = hi - lo or 1.0
    right.set_xlim(lo - 0.15 * span, hi + 0.12 * span)
    right.axvline(0, color="grey", lw=0.8)
    right.set_xlabel("protected less unprotected (ms per step)", fontsize=8)
    total = sum(added)
    right.set_title(f"what protection adds: {total:+.1f} ms per step in all", fontsize=9)
    for ax in (left, right):
        ax.tick_params(labelsize=7)
    device = str(data.get("device", "")).removeprefix("gpu:")
    fig.suptitle(
        f"The protected training step against the unprotected one, {device}, {data['date'][:10]} "
        f"({data['file']})",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def caption(data: dict, image: str) -> str:
    """The section docs/benchmarks.md shows with the drawing (``image``: its path from docs/)."""
    return (
        "\nWhere the protected step's extra kernel time goes, by category (`benchmarks.profile."
        "CATEGORIES`), from the newest GPU `profile-categories` file: "
        f"`benchmarks/results/{data['file']}` ({data['device']}, {data['date'][:10]}, jax {data['jax']}; "
        f"`{data['command']}`). Its table is below with the others.\n\n"
        f"![The protected step's kernel time by category]({image})\n"
    )
