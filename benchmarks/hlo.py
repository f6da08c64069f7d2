"""The collectives of a compiled XLA program (its optimized HLO text): which, how large, and whether
they run on every call or only inside a loop or a branch (a recompute, a repair).

Read from ``jax.jit(f).lower(...).compile().as_text()``. Sizes are the bytes of a collective's
result (every device's share of an all-gather included: what each device ends up holding).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["KINDS", "Collective", "collectives"]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4}
_BYTES |= {"f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_NAME = r"%([\w.\-]+)"
_OP = re.compile(r"= (.*?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


class Collective(NamedTuple):
    kind: str  # one of KINDS
    types: tuple[str, ...]  # the result's arrays, e.g. ("f32[1,256,64]",)
    nbytes: int  # the result's bytes on one device
    every_call: bool  # False: only inside a while loop's body or a conditional's branch


def collectives(hlo: str) -> list[Collective]:
    """Every collective of the program (asynchronous ones counted once, at their start)."""
    comps = _computations(hlo)
    nested, callees = set(), {}
    for c, lines in comps.items():
        text = "\n".join(lines)
        branches = re.findall(r"branch_computations=\{([^}]*)\}", text)
        inner = {n for grp in branches for n in re.findall(_NAME, grp)}
        inner |= set(re.findall(r"(?:true_computation|false_computation|body)=" + _NAME, text))
        nested |= inner
        callees[c] = set(re.findall(r"(?:calls|to_apply|condition)=" + _NAME, text)) | inner
    reach, todo = set(), list(nested)
    while todo:
        c = todo.pop()
        if c not in reach:
            reach.add(c)
            todo.extend(callees.get(c, ()))
    out = []
    for c, lines in comps.items():
        for line in lines:
            m = _OP.search(line)
            if m and "-done(" not in line:
                types = tuple(f"{d}[{s}]" for d, s in _ARRAY.findall(m.group(1)))
                if f"{m.group(2)}-start(" in line:  # an async start's tuple holds its operand too
                    types = (max(types, key=_nbytes),)
                out.append(Collective(m.group(2), types, sum(_nbytes(t) for t in types), c not in reach))
    return out


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO text split into its computations (name -> instruction lines)."""
    comps: dict[str, list[str]] = {}
    cur = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    return comps


def _nbytes(t: str) -> int:
    dtype, dims = _ARRAY.fullmatch(t).groups()
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * _BYTES.get(dtype, 4)
