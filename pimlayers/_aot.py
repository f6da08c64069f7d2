"""Ahead-of-time compilation ("pre-warming") from abstract shapes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["compile_ahead"]


def compile_ahead(
    fn: Callable[..., Any],
    *abstract_args: Any,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    **abstract_kwargs: Any,
) -> jax.stages.Compiled:
    """Compile ``fn`` for the given ``jax.ShapeDtypeStruct`` pytrees without allocating inputs.

    Nothing is placed on a device: lowering reads only shapes, dtypes and shardings. The returned
    ``Compiled`` runs on real arrays of those shapes (and raises a TypeError for others), so the
    first training step pays no compile time. Pass ``in_shardings`` or ShapeDtypeStructs with a
    ``sharding=`` to compile for a mesh.
    """
    for leaf in jax.tree.leaves((abstract_args, abstract_kwargs)):
        if isinstance(leaf, jax.Array):
            raise TypeError(
                "pimlayers.compile_ahead: got a concrete jax.Array; pass jax.ShapeDtypeStruct(x.shape, "
                "x.dtype) (or jax.eval_shape output) so nothing is allocated"
            )
    jit_kwargs: dict[str, Any] = {"static_argnums": static_argnums, "donate_argnums": donate_argnums}
    if in_shardings is not None:
        jit_kwargs["in_shardings"] = in_shardings
    if out_shardings is not None:
        jit_kwargs["out_shardings"] = out_shardings
    return jax.jit(fn, **jit_kwargs).lower(*abstract_args, **abstract_kwargs).compile()
