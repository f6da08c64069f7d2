"""`FaultReport`: the counters every protected call returns (principle 3, "never silent")."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["FaultReport"]


# What each counter counts; `summary()` prints it as the description column.
_DOCS: dict[str, str] = {
    "gemm_checked": "GEMMs verified by ABFT checksums",
    "gemm_detected": "GEMMs whose checksums disagreed",
    "gemm_corrected": "GEMM errors located and corrected in place",
    "gemm_recomputed": "GEMMs with a recompute (of flagged column blocks, or whole)",
    "gemm_uncorrectable": "GEMM errors neither corrected nor recomputed",
    "nonfinite_gated": "values replaced by insulation gates",
    "banks_checked": "memory stripes (checksum blocks) scrubbed",
    "banks_faulty": "stripes or parity blocks whose checksum disagreed",
    "banks_repaired": "of those, rebuilt from parity or refreshed",
    "banks_uncorrectable": "of those, beyond what parity can rebuild",
    "link_retries": "transfer attempts repeated (over the best route left)",
    "link_failures": "transfers lost on every route",
}


# The counters, in order: a report's one array holds them on its last axis.
_FIELDS: tuple[str, ...] = tuple(_DOCS)
_I32 = np.iinfo(np.int32)


class FaultReport:
    """Fault counters, int32; a JAX pytree of one leaf, ``counts``, the counters on its last axis.

    Every protected op returns one; callers add them up the model (`+`, `FaultReport.sum`) and across
    devices (`psum` inside `shard_map`). Build one from counters by name (``FaultReport(
    gemm_checked=7, gemm_detected=d)``: Python ints, bools and integer arrays, omitted ones zero);
    read them by name (``report.gemm_detected``, an int32 array: a scalar for a single call, with
    leading axes under `vmap`; read on the host, as numpy, from a concrete report). Counters given
    with different shapes are broadcast to one.

    One array rather than one per counter: a jitted call returning a report hands the host one
    buffer instead of twelve, and each costs it microseconds. A protected f32 GEMM of 8 x 128 -> 128,
    all dispatch, took 30-33 µs per call, 61-73 with its counters returned as twelve arrays, the
    plain GEMM 16 (``python -m benchmarks.run --suite dispatch``, a 2-core CPU, 2026-12-04); at
    256 x 256 -> 1024 the dispatch overlaps the ~0.6 ms GEMM and the protected/plain ratio did not
    change measurably.

    Counters are int32 and wrap at 2**31 like any int32 add on the device (no saturation, to keep the
    add a single instruction). A report counts the events of one step, far below that limit; keep
    long-run totals on the host (`to_dict()` gives Python ints). `any_uncorrectable()` tests for
    non-zero rather than positive, so even a wrapped count still reads as a fault.
    """

    __slots__ = ("counts",)
    FIELDS: tuple[str, ...] = _FIELDS

    def __init__(self, **counters: Any) -> None:
        unknown = sorted(set(counters) - set(_FIELDS))
        if unknown:
            expected = ", ".join(_FIELDS)
            raise TypeError(f"FaultReport got unknown counters {unknown}; expected some of: {expected}")
        values = [counters.get(name, 0) for name in _FIELDS]
        if all(isinstance(v, (bool, int, np.integer, np.bool_)) for v in values):
            # Python ints as one host array; out of int32 range an OverflowError, not a wrap.
            for name, v in zip(_FIELDS, values, strict=True):
                if not _I32.min <= int(v) <= _I32.max:
                    raise OverflowError(f"FaultReport.{name} = {int(v)} is out of int32 range")
            counts = jnp.asarray(np.array([int(v) for v in values], np.int32))
        else:
            parts = jnp.broadcast_arrays(*(_as_counter(n, v) for n, v in zip(_FIELDS, values, strict=True)))
            counts = jnp.stack(parts, axis=-1)
        object.__setattr__(self, "counts", counts)

    @classmethod
    def from_counts(cls, counts: Any) -> FaultReport:
        """A report around ``counts`` as given: an int32 array (..., 12), or any pytree leaf JAX puts
        in its place (a tracer, a PartitionSpec, a ShapeDtypeStruct, None), kept unchecked."""
        report = object.__new__(cls)
        object.__setattr__(report, "counts", counts)
        return report

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        # copy and pickle rebuild through from_counts (the default would assign the slot).
        return (FaultReport.from_counts, (self.counts,))

    def __repr__(self) -> str:
        if self._is_concrete():  # a tracer prints as one (indexing it would add ops to the trace)
            return "FaultReport(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in _FIELDS) + ")"
        return f"FaultReport(counts={self.counts!r})"

    # --- construction and arithmetic (all traceable) ---

    @classmethod
    def zeros(cls) -> FaultReport:
        """A report with every counter zero."""
        return cls()

    def __add__(self, other: object) -> FaultReport:
        if not isinstance(other, FaultReport):
            return NotImplemented
        return jax.tree.map(jnp.add, self, other)

    def __radd__(self, other: object) -> FaultReport:
        # Lets the builtin `sum(reports)` work: it starts from the int 0.
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented

    @classmethod
    def sum(cls, reports: Iterable[FaultReport]) -> FaultReport:
        """Fieldwise sum of `reports`; zeros for an empty iterable."""
        return functools.reduce(lambda a, b: a + b, reports, cls.zeros())

    def psum(self, axis_name: Hashable | tuple[Hashable, ...]) -> FaultReport:
        """Sum every counter over the named mesh axis (inside `shard_map`/`pmap`).

        The result is the same on every device, so a decision taken from it (skip a step) agrees
        across replicas.
        """
        return jax.tree.map(lambda x: lax.psum(x, axis_name), self)

    def total_faults(self) -> jax.Array:
        """Fault events seen: gemm_detected + nonfinite_gated + banks_faulty + link_failures.

        Counts each fault once, where it was found, whether or not it was then fixed: corrected,
        recomputed and repaired counts are subsets of detected/faulty and are not added again.
        `link_retries` counts recovery actions rather than faults, so it is left out; a transfer lost
        on every route counts as a link failure. Elementwise over any batch axes.
        """
        return self.gemm_detected + self.nonfinite_gated + self.banks_faulty + self.link_failures

    def uncorrectable(self) -> jax.Array:
        """Faults nothing could fix: gemm_uncorrectable + banks_uncorrectable + link_failures (int32)."""
        return self.gemm_uncorrectable + self.banks_uncorrectable + self.link_failures

    def any_uncorrectable(self) -> jax.Array:
        """Bool array: whether any uncorrectable fault was counted (elementwise over batch axes).

        Tests each counter for non-zero instead of `uncorrectable() > 0`, which a wrapped or
        overflowing int32 sum could turn negative.
        """
        return (self.gemm_uncorrectable != 0) | (self.banks_uncorrectable != 0) | (self.link_failures != 0)

    # --- host side ---

    def to_dict(self) -> dict[str, int]:
        """Counters as Python ints, summed over any batch axes (in int64, so no wrap on the host)."""
        # Host-device sync point: `device_get` waits for the step that made this report to finish.
        self._require_concrete("to_dict")
        counts = np.asarray(jax.device_get(self.counts), np.int64).reshape(-1, len(_FIELDS))
        return {name: int(v) for name, v in zip(_FIELDS, counts.sum(axis=0), strict=True)}

    def summary(self) -> str:
        """A text table of every counter with its description; batched reports are summed first."""
        counts = self.to_dict()  # Host-device sync point (see `to_dict`).
        rows = [(name, counts[name], _DOCS[name]) for name in _FIELDS]
        total = counts["gemm_detected"] + counts["nonfinite_gated"] + counts["banks_faulty"]
        total += counts["link_failures"]
        lost = counts["gemm_uncorrectable"] + counts["banks_uncorrectable"] + counts["link_failures"]
        rows += [("total_faults", total, "faults seen (see total_faults)"), ("uncorrectable", lost, "")]
        name_w = max(len(r[0]) for r in rows)
        count_w = max(5, *(len(str(r[1])) for r in rows))
        lines = [f"{'field':<{name_w}}  {'count':>{count_w}}  description"]
        lines.append("-" * len(lines[0]))
        for i, (name, count, doc) in enumerate(rows):
            if i == len(rows) - 2:
                lines.append("-" * len(lines[0]))  # Derived totals below the rule.
            lines.append(f"{name:<{name_w}}  {count:>{count_w}}  {doc}".rstrip())
        return "FaultReport\n" + "\n".join(lines)

    def __str__(self) -> str:
        # Under tracing (or for a report holding non-array leaves, e.g. specs) there are no values
        # to print; fall back to the dataclass repr instead of raising.
        if self._is_concrete():
            return self.summary()
        return repr(self)

    def _is_concrete(self) -> bool:
        return _is_array(self.counts) and not isinstance(self.counts, jax.core.Tracer)

    def _require_concrete(self, what: str) -> None:
        if not self._is_concrete():
            raise TypeError(
                f"FaultReport.{what}() needs concrete values but this report holds tracers or non-array "
                "leaves. Return the report from the jitted function and call it on the result, or use "
                "`jax.debug.print` inside the trace."
            )


def _as_counter(name: str, value: Any) -> Any:
    """Convert a constructor argument to an int32 array; reject non-integer values."""
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        # Python ints out of int32 range raise OverflowError here rather than wrapping.
        return jnp.asarray(value, dtype=jnp.int32)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)):
        return jnp.asarray(value, dtype=jnp.int32)  # No-op for an int32 array or tracer.
    raise TypeError(
        f"FaultReport.{name} must be an int or an integer/bool array (stored as int32), got "
        f"{type(value).__name__}{'' if dtype is None else f' of dtype {dtype}'}. Counters are counts; "
        "convert with `jnp.sum(mask)` or `.astype(jnp.int32)`."
    )


def _is_array(v: Any) -> bool:
    return isinstance(v, (np.ndarray, np.generic, jax.Array))


def _field(i: int):
    """The property of counter i: ``counts[..., i]``, read on the host (a numpy int32 array) when the
    report is concrete: indexing a device array eagerly would trace a gather the first time, which
    ``jax.no_tracing`` (the no-recompile tests) forbids, and a counter read outside jit is for the
    host anyway. Under tracing, a traced slice. For a leaf JAX put in the array's place, the leaf
    itself (a spec applies to every counter) or, for a ShapeDtypeStruct, the counter's shape."""

    def get(self: FaultReport) -> Any:
        c = self.counts
        if isinstance(c, jax.core.Tracer):
            return c[..., i]
        if _is_array(c):
            return np.asarray(c)[..., i]
        if isinstance(c, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(c.shape[:-1], c.dtype)
        return c

    return property(get, doc=_DOCS[_FIELDS[i]])


for _i, _name in enumerate(_FIELDS):
    setattr(FaultReport, _name, _field(_i))

_KEYS = (jax.tree_util.GetAttrKey("counts"),)


def _flatten_with_keys(report: FaultReport) -> tuple[list[tuple[Any, Any]], None]:
    return [(_KEYS[0], report.counts)], None


def _flatten(report: FaultReport) -> tuple[tuple[Any, ...], None]:
    return (report.counts,), None


def _unflatten(_aux: None, leaves: Iterable[Any]) -> FaultReport:
    # JAX rebuilds pytrees with arbitrary leaves (tracers, None, PartitionSpecs, vmap axis ints,
    # ShapeDtypeStructs) that must be kept as they are: no conversion, no checks but the count.
    leaves = tuple(leaves)
    if len(leaves) != 1:
        raise ValueError(f"FaultReport: {len(leaves)} leaves; expected 1 (counts)")
    return FaultReport.from_counts(leaves[0])


jax.tree_util.register_pytree_with_keys(FaultReport, _flatten_with_keys, _unflatten, _flatten)
