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

Outside ``shard_map`` nothing varies and nothing is cast. The varying axes are read from JAX's
abstract values (``jax.typeof(x).mat.varying`` in jax 0.10; ``.vma`` in older ones); where neither
is there, or ``jax.lax.pcast`` is missing, nothing is cast and a gradient inside ``shard_map`` with
the checks on raises JAX's error as before (``check_vma=False`` then works).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["vary_alike", "zero_cotangent"]


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


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def vary_alike(*trees):
    """``trees`` with every float leaf cast to vary over the union of the mesh axes any leaf varies
    over (module docstring); unchanged outside ``shard_map``."""
    leaves = [x for x in jax.tree.leaves(trees) if hasattr(x, "dtype")]
    axes = frozenset().union(*(_varying(x) for x in leaves))
    pcast = getattr(lax, "pcast", None)
    if not axes or pcast is None:
        return trees

    def cast(x):
        missing = axes - _varying(x) if _is_float(x) else frozenset()
        return pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(cast, trees)


def zero_cotangent(x):
    """A zero cotangent (or tangent) of ``x`` with its type: zeros for a float, float0 zeros
    otherwise, formed from x as JAX's own rules form them (``frexp``'s exponent), so inside
    ``shard_map`` they vary as x does: a NumPy float0 constant varies over no axis, which JAX's
    custom_jvp check refused there (``ops.gate``'s counts, a TypeError on jax 0.10.2)."""
    if _is_float(x):
        return jnp.zeros_like(x)
    return lax.full_like(x, 0, jax.dtypes.float0)
