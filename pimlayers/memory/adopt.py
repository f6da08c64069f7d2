"""Adopting buffers made outside JAX (numpy on CPU, CuPy on GPU) without copying them.

``jax.dlpack.from_dlpack`` wraps a foreign buffer when it can and silently copies when it cannot (on
CPU, XLA needs 64-byte alignment; numpy only promises 16). `adopt` checks every leaf's device pointer
before and after, so a copy is an error (or, with ``require_zero_copy=False``, a reported fact), never
a silent doubling of parameter memory.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["adopt", "aligned_empty", "buffer_pointer"]

CPU_ALIGNMENT = 64


def aligned_empty(shape, dtype, alignment: int = CPU_ALIGNMENT) -> np.ndarray:
    """An uninitialised numpy array whose data starts on an ``alignment``-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + alignment, np.uint8)
    off = (-raw.ctypes.data) % alignment
    return raw[off : off + n].view(dtype).reshape(shape)


def buffer_pointer(x) -> int:
    """The data address of a numpy array, a CuPy array or a single-device jax.Array."""
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data)
    if hasattr(x, "unsafe_buffer_pointer"):
        return int(x.unsafe_buffer_pointer())
    if hasattr(x, "__cuda_array_interface__"):
        return int(x.__cuda_array_interface__["data"][0])
    raise TypeError(f"pimlayers.memory.buffer_pointer: cannot read the address of a {type(x).__name__}")


def adopt(tree, *, require_zero_copy: bool = True):
    """Every leaf (numpy or CuPy array, or anything with ``__dlpack__``) as a jax.Array over the same
    memory. Returns ``(jax_tree, copied)``: the paths of leaves JAX had to copy (empty when all were
    adopted). With ``require_zero_copy`` (default) a copy raises ValueError naming the leaf instead.
    The caller must keep the source arrays alive as long as the jax arrays are used."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out, copied = [], []
    for kp, x in flat:
        path = jax.tree_util.keystr(kp) or "<root>"
        if not hasattr(x, "__dlpack__"):
            raise TypeError(
                f"pimlayers.memory.adopt: leaf {path} is a {type(x).__name__}; expected a DLPack array"
            )
        before = buffer_pointer(x) if getattr(x, "size", 1) else None
        j = jax.dlpack.from_dlpack(x)
        if before is not None and j.unsafe_buffer_pointer() != before:
            if require_zero_copy:
                hint = (
                    f" (CPU buffers need {CPU_ALIGNMENT}-byte alignment: use aligned_empty)"
                    if isinstance(x, np.ndarray)
                    else ""
                )
                raise ValueError(f"pimlayers.memory.adopt: leaf {path} would be copied{hint}")
            copied.append(path)
        out.append(j)
    return jax.tree_util.tree_unflatten(treedef, out), copied
