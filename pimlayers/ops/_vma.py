"""Inside ``shard_map``: the custom VJPs' operands typed as varying over the same mesh axes.

Under ``shard_map``'s varying-axes checks (``check_vma=True``, the default) a custom VJP's backward
must return each cotangent with its operand's type. A weight replicated over the mesh (invariant)
multiplied by rows split over it (varying) gets a per-device cotangent, which varies: the backward
cannot return it as the weight's. JAX's own primitives avoid this by casting the invariant operand
to varying before they use it, whose transpose sums the cotangents over the devices. ``vary_alike``
does that for the library's custom VJPs: every float operand that varies over fewer mesh axes than
the union of all of them is cast (``jax.lax.pcast(..., to="varying")``: a change of type, no data
moves), so the gradient of a replicated weight comes back summed over the devices, as for a plain
``x @ w``. Integer operands (fault sites) keep their type: their cotangents are float0 zeros formed
from them (``zero_cotangent``), so those match whatever they are.

A Pallas kernel's results are typed by the caller (``jax.ShapeDtypeStruct``): inside ``shard_map``
with the checks on JAX refuses them unless they say which mesh axes they vary over
(``manual_axis_type``). ``typed_like`` gives them the axes their operands vary over.

Outside ``shard_map`` nothing varies and nothing is cast. The varying axes are read from JAX's
abstract values (``jax.typeof(x).mat.varying`` in jax 0.10; ``.vma`` in older ones); where neither
is there, or ``jax.lax.pcast`` is missing, nothing is cast and a gradient inside ``shard_map`` with
the checks on raises JAX's error as before (``check_vma=False`` then works).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["typed_like", "varies", "vary_alike", "vary_as", "zero_cotangent"]


def _varying(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside it, or unknown)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def _axes(trees) -> frozenset:
    """The mesh axes any array in ``trees`` varies over (their union)."""
    return frozenset().union(*(_varying(x) for x in jax.tree.leaves(trees) if hasattr(x, "dtype")))


def varies(*trees) -> bool:
    """Whether any array in ``trees`` varies over a mesh axis (inside ``shard_map``, checks on)."""
    return bool(_axes(trees))


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def vary_alike(*trees):
    """``trees`` with every float leaf cast to vary over the union of the mesh axes any leaf varies
    over (module docstring); unchanged outside ``shard_map``."""
    axes = _axes(trees)
    if not axes:
        return trees
    return jax.tree.map(lambda x: _cast(x, axes) if _is_float(x) else x, trees)


def vary_as(results, *operands):
    """``results`` (a kernel's, any pytree of arrays) cast to vary over the mesh axes any of
    ``operands`` varies over. A Pallas kernel's results are typed as its ``out_shape`` says, and
    where JAX traces a custom VJP's backward with the varying-axes checks off (their transposition)
    it drops what ``typed_like`` wrote there: the results come back invariant, and the backward's
    cotangents then do not match their operands' types. Unchanged outside ``shard_map``."""
    axes = _axes(operands)
    if not axes:
        return results
    return jax.tree.map(lambda x: _cast(x, axes), results)


def _cast(x, axes: frozenset):
    """x cast to vary over ``axes`` as well (a change of type; no data moves)."""
    pcast = getattr(lax, "pcast", None)
    missing = axes - _varying(x) if hasattr(x, "dtype") else frozenset()
    if not missing or pcast is None:
        return x
    return pcast(x, tuple(sorted(missing)), to="varying")


def zero_cotangent(x):
    """A zero cotangent (or tangent) of ``x`` with its type: zeros for a float, float0 zeros
    otherwise, formed from x as JAX's own rules form them (``frexp``'s exponent), so inside
    ``shard_map`` they vary as x does: a NumPy float0 constant varies over no axis, which JAX's
    custom_jvp check refused there (``ops.gate``'s counts, a TypeError on jax 0.10.2)."""
    if _is_float(x):
        return jnp.zeros_like(x)
    return lax.full_like(x, 0, jax.dtypes.float0)


def typed_like(out, *operands):
    """``out`` (a pytree of ``jax.ShapeDtypeStruct``, a kernel's results) typed to vary over the mesh
    axes any of ``operands`` varies over: a kernel's output row depends on its operands' rows, so it
    varies where they do. Unchanged outside ``shard_map`` (or on a jax whose abstract values carry
    no ``mat``)."""
    axes = _axes(operands)
    if not axes:
        return out
    first = next(x for x in jax.tree.leaves(operands) if hasattr(x, "dtype"))
    mat = getattr(jax.typeof(first), "mat", None)
    if mat is None:
        return out
    mat = mat.update(varying=axes)
    is_struct = lambda a: isinstance(a, jax.ShapeDtypeStruct)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, manual_axis_type=mat) if is_struct(a) else a,
        out,
        is_leaf=is_struct,
    )
