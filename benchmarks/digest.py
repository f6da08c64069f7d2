"""The source digest that results record (``source``), for the working tree or for commits.

    python -m benchmarks.digest              # the working tree's
    python -m benchmarks.digest HEAD 4ea5c01 # each commit's, from `git archive`

A result whose ``source`` equals a commit's digest ran that commit's code, whatever its ``commit``
field says (a copy of the tree may carry no git metadata, or an older commit's).
"""

from __future__ import annotations

import argparse
import io
import pathlib
import subprocess
import tarfile
import tempfile

from ._harness import ROOT, source_digest


def commit_digest(rev: str, root: pathlib.Path = ROOT) -> str:
    """``source_digest`` of the tree of commit ``rev`` of the git repository at ``root``."""
    out = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", rev], capture_output=True, check=False
    )
    if out.returncode != 0:
        raise ValueError(f"benchmarks.digest: git archive {rev!r} failed: {out.stderr.decode().strip()}")
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        tar.extractall(tmp, filter="data")
        return source_digest(pathlib.Path(tmp))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.digest", description=__doc__.splitlines()[0])
    ap.add_argument("revs", nargs="*", help="commits (default: the working tree)")
    args = ap.parse_args()
    if not args.revs:
        print(f"{source_digest()}  (working tree)")
    for rev in args.revs:
        print(f"{commit_digest(rev)}  {rev}")


if __name__ == "__main__":
    main()
