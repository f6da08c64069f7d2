"""`PimStore`: checksums, parity and cross-device parity for a parameter pytree, kept beside it.

The store never holds or copies the parameters. It owns a geometry, an address map and compiled
programs; the protection data (`PimState`) is a pytree the caller keeps next to the parameters and
hands back to every call, like an optimizer state. Per device it holds, for each leaf's local shard:
stripe checksums, one parity block per group of G stripes (with their own checksums) and, over the
mesh axis ``axis``, a cross-device parity block of 1/(A - 1) of the shard (A devices on the axis).

- ``encode(params)`` → state: after init, checkpoint load, every optimizer update and every repair.
- ``scrub(params, state)`` → `ScrubResult`: per-stripe fault masks, a (devices, banks) fault table
  gathered on every device, and a `FaultReport` summed over devices. Reads the parameters once.
- ``repair(params, state)`` → (params, state, result): bit-exact rebuild of every group's one faulty
  stripe, written into the donated parameter buffers; more than one fault in a group is reported as
  uncorrectable and left flagged, never "repaired".
- ``adamw_update(params, grads, mu, nu, hyper)`` → (params, mu, nu, state): AdamW's step and the
  encode of its result in one pass over the parameters (encode on write, fused into the write).
- ``rebuild_shard(params, state, lost)`` → (params, state, report): one device's whole shard (data
  and protection data) rebuilt from the other devices on the axis.

Fault patterns, and which device was lost, are data: none of these recompiles for a new one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from .. import ops
from ..faults import FaultReport
from ..ops._common import check_byte_addressable, from_bytes, to_bytes
from . import _local
from .geometry import AddressMap, BankAddress, BankGeometry

__all__ = ["PimState", "PimStore", "RepairResult", "ScrubResult"]


class PimState(NamedTuple):
    """Protection data of every leaf; every array has a leading axis of one entry per device."""

    guards: tuple[_local.LeafGuard, ...]
    xparity: tuple[jax.Array, ...]  # uint8 (devices, chunk); chunk 0 without a second device


class ScrubResult(NamedTuple):
    stripe_faults: tuple[jax.Array, ...]  # bool (devices, stripes) per leaf
    parity_faults: tuple[jax.Array, ...]  # bool (devices, groups) per leaf
    bank_faults: jax.Array  # int32 (devices, banks): faulty stripes + parity blocks per physical bank
    report: FaultReport


class RepairResult(NamedTuple):
    params: Any
    state: PimState
    scrub: ScrubResult  # what the repair found, before repairing
    report: FaultReport  # banks_* counters: faulty, repaired, uncorrectable (stripes)
    compute: Any = None  # with repair(..., cast=): params in the dtypes asked for, after the repair


def _recast_into(c: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` cast to ``c``'s dtype, written over ``c``: the repair branch's copy then lives in the
    buffer of the scrub's copy, which the other branch passes through untouched. A fresh array
    there made XLA copy the pass-through on a GPU (1.3 ms a step for 4 Llama-3-8B-dimension
    layers' kernels, an H100); one update of the whole array XLA would turn into a fresh array,
    so it is written as two halves, each updated in place."""
    if x.ndim == 0 or x.shape[0] < 2:
        return x.astype(c.dtype)
    h, rest = x.shape[0] // 2, (0,) * (x.ndim - 1)
    c = lax.dynamic_update_slice(c, x[:h].astype(c.dtype), (0, *rest))
    return lax.dynamic_update_slice(c, x[h:].astype(c.dtype), (h, *rest))


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: P
    local_shape: tuple[int, ...]

    @property
    def local_nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize


def _bad(msg: str) -> ValueError:
    return ValueError(f"pimlayers.memory.PimStore: {msg}")


def _placement(x, path: str) -> tuple[Mesh | None, P]:
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding):
        return sh.mesh, sh.spec
    if sh is None or isinstance(sh, SingleDeviceSharding):
        return None, P()
    raise _bad(f"leaf {path} has a {type(sh).__name__}; expected a NamedSharding or one device")


def _local_shape(shape, spec: P, mesh: Mesh, path: str) -> tuple[int, ...]:
    out = []
    for d, n in enumerate(shape):
        entry = spec[d] if d < len(spec) else None
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        k = math.prod(mesh.shape[a] for a in names)
        if n % k:
            raise _bad(f"leaf {path}: dimension {d} of size {n} does not split evenly over {k} devices")
        out.append(n // k)
    return tuple(out)


class PimStore:
    """Bank-structured protection for a parameter pytree (see the module docstring).

    Args:
      params: the pytree to protect (jax arrays or ``jax.ShapeDtypeStruct`` with a sharding); only
        shapes, dtypes and shardings are read. Leaves on a mesh are protected per device shard.
      geometry: the physical bank model (`BankGeometry`; default an H200's HBM3e).
      mesh: the device mesh; default the leaves' own mesh, or their one device.
      axis: the mesh axis over which cross-device parity is kept (default: the mesh's only axis).
    """

    def __init__(
        self,
        params,
        geometry: BankGeometry | None = None,
        *,
        mesh: Mesh | None = None,
        axis: str | None = None,
    ) -> None:
        geometry = BankGeometry() if geometry is None else geometry
        if not isinstance(geometry, BankGeometry):
            raise TypeError(
                f"pimlayers.memory.PimStore: geometry is {type(geometry).__name__}; expected BankGeometry"
            )
        self.geometry = geometry
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        if not flat:
            raise _bad("the pytree has no leaves to protect")
        leaves = []
        meshes = set()
        for kp, x in flat:
            path = jax.tree_util.keystr(kp) or "<root>"
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise _bad(f"leaf {path} is a {type(x).__name__}; expected a jax array or ShapeDtypeStruct")
            try:
                check_byte_addressable("memory.PimStore", x)
            except TypeError as e:
                raise _bad(f"leaf {path}: {e}") from None
            if np.dtype(x.dtype) == np.bool_:
                # XLA reads a bool byte as 0/1, so a flip of bits 1..7 would be invisible to checksums.
                raise _bad(f"leaf {path} is bool; store it as uint8 to protect its bytes")
            m, spec = _placement(x, path)
            if m is not None:
                meshes.add(m)
            leaves.append((path, tuple(x.shape), np.dtype(x.dtype), spec))
        if mesh is None:
            if len(meshes) > 1:
                raise _bad(f"the leaves live on {len(meshes)} different meshes; pass mesh=")
            if meshes:
                mesh = meshes.pop()
            else:
                devs = {d for _, x in flat if hasattr(x, "devices") for d in x.devices()}
                dev = devs.pop() if len(devs) == 1 else jax.devices()[0]
                mesh = Mesh(np.array([dev]), ("pim",))
        elif any(m != mesh for m in meshes):
            raise _bad("a leaf is sharded over a mesh other than mesh=")
        if axis is None:
            if len(mesh.axis_names) != 1:
                raise _bad(f"mesh has axes {mesh.axis_names}; pass axis= (the axis for cross-device parity)")
            axis = mesh.axis_names[0]
        if axis not in mesh.axis_names:
            raise _bad(f"axis={axis!r} is not one of the mesh axes {mesh.axis_names}")
        self.mesh, self.axis = mesh, axis
        self.axis_size = mesh.shape[axis]
        self.ndev = mesh.devices.size
        self.devices = list(mesh.devices.flat)
        self._leaves = tuple(_Leaf(p, s, d, spec, _local_shape(s, spec, mesh, p)) for p, s, d, spec in leaves)
        self.address_map = AddressMap(
            geometry, [lf.path for lf in self._leaves], [lf.local_nbytes for lf in self._leaves]
        )
        self._dev_axes = tuple(mesh.axis_names)
        self._build()

    # --- public surface ---

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(lf.path for lf in self._leaves)

    def encode(self, params) -> PimState:
        """Checksums, parity and cross-device parity of ``params`` (one pass per kind over the bytes)."""
        return self._encode(self._check(params))

    def scrub(self, params, state: PimState) -> ScrubResult:
        """Verify every stripe and parity block; nothing is written."""
        return self._scrub(self._check(params), state)

    def repair(self, params, state: PimState, *, cast=None) -> RepairResult:
        """Scrub, then rebuild what parity can rebuild, in place (``params`` and ``state`` are donated:
        do not use the arrays passed in afterwards). Without a fault the slow path never runs.

        ``cast``: a pytree like ``params`` of dtypes (``pimlayers.flax.nnx.compute_dtypes`` gives
        the ones a model's forward pass reads its parameters in). ``RepairResult.compute`` then
        holds the repaired parameters in them: cast from the scrub's own read (on a GPU a float32
        -> bfloat16 copy costs the scrub a write, not the step another read of the weights), or,
        where a fault was repaired, cast again from the repaired leaves."""
        params = self._check(params)
        if cast is None:
            return self._repair(params, state)
        dtypes = self._check_cast(cast)
        if dtypes not in self._repair_cast:
            self._repair_cast[dtypes] = self._build_repair(dtypes)
        return self._repair_cast[dtypes](params, state)

    def rebuild_shard(self, params, state: PimState, lost) -> tuple[Any, PimState, FaultReport]:
        """Rebuild the whole shard (parameters and protection data) of device ``lost`` — its index along
        the parity axis, an int or int32 scalar, -1 for none — from the other devices on the axis.
        ``params`` and ``state`` are donated."""
        if self.axis_size < 2:
            raise _bad(
                f"rebuild_shard needs >= 2 devices on axis {self.axis!r}; the mesh has {self.axis_size}"
            )
        if not isinstance(lost, jax.core.Tracer):
            v = int(np.asarray(lost))
            if not -1 <= v < self.axis_size:
                raise _bad(
                    f"lost={v}; expected -1 or a device index 0..{self.axis_size - 1} along {self.axis!r}"
                )
        return self._rebuild(self._check(params), state, jnp.asarray(lost, jnp.int32))

    def apply_updates(self, params, updates) -> tuple[Any, PimState]:
        """``optax.apply_updates`` and encode in one traceable call (encode on write)."""
        new = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        return new, self.encode(new)

    def adamw_update(self, params, grads, mu, nu, hyper, *, decay=None) -> tuple[Any, Any, Any, PimState]:
        """AdamW's update and the encode of its result in one pass (``ops.adamw_guard_many``):
        ``(params', mu', nu', state)``. ``grads``, ``mu`` and ``nu`` are pytrees like ``params``
        (float32 moments; float32 or bfloat16 gradients), ``hyper`` an ``ops.AdamHyper``; the
        scalars and the moments usually come from ``pimlayers.optim.adamw_guarded``, which keeps
        them in optax's state. Every leaf must be float32. ``decay``: a pytree like ``params`` of
        Python bools, the leaves weight decay applies to (optax's ``mask``); None: every leaf."""
        params = self._check(params)
        flags = self._check_decay(decay)
        for name, t in (("grads", grads), ("mu", mu), ("nu", nu)):
            treedef = jax.tree_util.tree_structure(t)
            if treedef != self.treedef:
                raise _bad(f"{name} have structure {treedef}; the store was built for {self.treedef}")
        wide = [lf.path for lf in self._leaves if lf.dtype != np.float32]
        if wide:
            raise TypeError(
                f"pimlayers.PimStore.adamw_update: leaves {', '.join(wide)} are not float32; "
                "AdamW's fused update takes float32 parameters"
            )
        if flags not in self._adamw:
            self._adamw[flags] = self._build_adamw(flags)
        return self._adamw[flags](params, grads, mu, nu, hyper)

    def faulty_banks(self, result: ScrubResult | RepairResult) -> list[BankAddress]:
        """Host side: every (device, physical bank) with at least one faulty stripe or parity block."""
        table = result.scrub.bank_faults if isinstance(result, RepairResult) else result.bank_faults
        table = np.asarray(table)
        return [self.geometry.bank_address(int(b), int(d)) for d, b in zip(*np.nonzero(table), strict=True)]

    def overhead(self) -> dict[str, float]:
        """Bytes of protection data per device, and parity's share of the protected bytes (1/G plus the
        padding of each leaf's last group)."""
        g = self.geometry
        amap = self.address_map
        data = sum(lf.nbytes for lf in amap.leaves)
        parity = amap.total_groups * g.stripe_bytes
        sums = 8 * (sum(lf.nstripes for lf in amap.leaves) + amap.total_groups)
        x = sum(self._xchunk(lf) for lf in self._leaves)
        return {
            "protected_bytes": data,
            "parity_bytes": parity,
            "checksum_bytes": sums,
            "cross_device_parity_bytes": x,
            "parity_fraction": parity / data if data else 0.0,
            "group": g.group,
            "total_fraction": (parity + sums + x) / data if data else 0.0,
        }

    # --- validation ---

    def _check_cast(self, cast) -> tuple[np.dtype, ...]:
        flat, treedef = jax.tree_util.tree_flatten(cast)
        if treedef != self.treedef:
            raise _bad(f"cast has structure {treedef}; expected one dtype per parameter, as {self.treedef}")
        out = []
        for lf, d in zip(self._leaves, flat, strict=True):
            try:
                out.append(np.dtype(d))
            except TypeError as e:
                raise TypeError(f"pimlayers.PimStore: cast for {lf.path} is {d!r}; expected a dtype") from e
        return tuple(out)

    def _check_decay(self, decay) -> tuple[bool, ...]:
        if decay is None:
            return (True,) * len(self._leaves)
        flat, treedef = jax.tree_util.tree_flatten(decay)
        if treedef != self.treedef:
            raise _bad(f"decay has structure {treedef}; expected one bool per parameter, as {self.treedef}")
        for lf, d in zip(self._leaves, flat, strict=True):
            if not isinstance(d, (bool, np.bool_)):
                raise TypeError(
                    f"pimlayers.PimStore.adamw_update: decay for {lf.path} is {type(d).__name__}; "
                    "expected a Python bool (which leaves decay is part of the program)"
                )
        return tuple(bool(d) for d in flat)

    def _check(self, params):
        flat, treedef = jax.tree_util.tree_flatten(params)
        if treedef != self.treedef:
            raise _bad(f"params have structure {treedef}; the store was built for {self.treedef}")
        out = []
        for x, lf in zip(flat, self._leaves, strict=True):
            if tuple(x.shape) != lf.shape or np.dtype(x.dtype) != lf.dtype:
                raise _bad(
                    f"leaf {lf.path} is {np.dtype(x.dtype).name}{list(x.shape)}; "
                    f"the store was built for {lf.dtype.name}{list(lf.shape)}"
                )
            # One placement for every call (a single-device array is re-labelled as the store's
            # one-device mesh; the buffer is not copied), so the compiled programs are reused.
            want = NamedSharding(self.mesh, lf.spec)
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.sharding != want:
                x = jax.device_put(x, want)
            out.append(x)
        return jax.tree_util.tree_unflatten(self.treedef, out)

    # --- programs ---

    def _xchunk(self, lf: _Leaf) -> int:
        a = self.axis_size
        return 0 if a < 2 else -(-lf.local_nbytes // (a - 1))

    def _map(self, fn: Callable, in_specs, out_specs) -> Callable:
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _build(self) -> None:
        geo, axis, a = self.geometry, self.axis, self.axis_size
        dev = P(self._dev_axes)
        pspecs = jax.tree_util.tree_unflatten(self.treedef, [lf.spec for lf in self._leaves])
        n = len(self._leaves)
        gspec = _local.LeafGuard(dev, dev, dev)
        sspec = PimState(tuple(gspec for _ in range(n)), tuple(dev for _ in range(n)))
        rspec = P()  # a prefix: every counter replicated
        scrub_spec = ScrubResult((dev,) * n, (dev,) * n, P(), rspec)
        layout = _local.BankLayout.of(self.address_map)

        def xparity(leaves):  # each leaf's cross-device parity (nothing without a second device)
            if a < 2:
                return tuple(jnp.zeros((0,), jnp.uint8) for _ in leaves)
            return tuple(_local.xparity_encode(to_bytes(x), axis, a) for x in leaves)

        def enc_local(leaves):
            return _local.encode_leaves(leaves, geo), xparity(leaves)

        def lead(t):  # add the per-device leading axis
            return jax.tree.map(lambda v: v[None], t)

        def drop(t):
            return jax.tree.map(lambda v: v[0], t)

        def encode(params):
            leaves = jax.tree.leaves(params)
            guards, xs = enc_local(leaves)
            return PimState(lead(guards), lead(xs))

        def scrub_local(leaves, state, cast=None):
            guards = drop(state.guards)
            checks, faulty, casts = _local.check_leaves(leaves, guards, geo, cast)
            counts = _local.bank_table([c[1] for c in checks], [c[2] for c in checks], layout)
            table = lax.all_gather(counts, self._dev_axes, tiled=False).reshape(self.ndev, geo.nbanks)
            checked = sum(int(c[1].shape[0] + c[2].shape[0]) for c in checks)
            report = FaultReport(banks_checked=checked, banks_faulty=faulty).psum(self._dev_axes)
            result = ScrubResult(
                tuple(c[1][None] for c in checks), tuple(c[2][None] for c in checks), table, report
            )
            return checks, guards, result, casts

        def scrub(params, state):
            return scrub_local(jax.tree.leaves(params), state)[2]

        def repair(params, state, cast=None):
            leaves = jax.tree.leaves(params)
            checks, guards, found, casts = scrub_local(leaves, state, cast)

            # Only the leaves cast to another dtype have copies to carry through the branch.
            copied = [i for i, x in enumerate(leaves) if cast and np.dtype(x.dtype) != cast[i]]

            def slow(ops_):
                leaves, guards, casts = ops_
                fixed = [
                    _local.repair_leaf(x, gd, now, bad, bad_par, geo)
                    for x, gd, (now, bad, bad_par) in zip(leaves, guards, checks, strict=True)
                ]
                counts = [sum(getattr(f, k) for f in fixed) for k in ("faulty", "repaired", "uncorrectable")]
                # The scrub's copies were read before the repair: cast the repaired leaves again.
                again = [_recast_into(c, fixed[i].x) for c, i in zip(casts, copied, strict=True)]
                return [f.x for f in fixed], [f.guard for f in fixed], again, counts

            def fast(ops_):
                leaves, guards, casts = ops_
                return list(leaves), list(guards), list(casts), [jnp.int32(0)] * 3

            # Every device takes the same branch: the predicate is the all-gathered table.
            new_leaves, new_guards, new_casts, (faulty, repaired, lost) = lax.cond(
                jnp.any(found.bank_faults > 0), slow, fast, (leaves, list(guards), [casts[i] for i in copied])
            )
            if cast:
                new_casts = dict(zip(copied, new_casts, strict=True))
                new_casts = [new_casts.get(i, x) for i, x in enumerate(new_leaves)]
            counted = FaultReport(banks_faulty=faulty, banks_repaired=repaired, banks_uncorrectable=lost)
            report = counted.psum(self._dev_axes) + FaultReport(banks_checked=found.report.banks_checked)
            new_state = PimState(lead(tuple(new_guards)), state.xparity)
            out = jax.tree_util.tree_unflatten(self.treedef, new_leaves), new_state, found, report
            return out if cast is None else (*out, jax.tree_util.tree_unflatten(self.treedef, new_casts))

        def adamw(params, grads, mu, nu, hyper, decay):
            # One call for the decayed leaves and one with no decay for the rest (wd = 0: u + 0 p is
            # u for a finite p), each one kernel launch on a GPU.
            operands = [jax.tree.leaves(t) for t in (params, grads, mu, nu)]
            out = [None] * len(operands[0])
            for on in (True, False):
                idx = [i for i, d in enumerate(decay) if d == on]
                if not idx:
                    continue
                h = hyper if on else hyper._replace(wd=jnp.zeros_like(hyper.wd))
                res = ops.adamw_guard_many(
                    *([t[i] for i in idx] for t in operands),
                    h,
                    bank_bytes=geo.stripe_bytes,
                    group=geo.group,
                )
                for k, i in enumerate(idx):
                    out[i] = (res[0][k], res[1][k], res[2][k], res[3][k])
            ps, ms, vs, guards = (tuple(o[j] for o in out) for j in range(4))
            guards = tuple(_local.LeafGuard(*g) for g in guards)
            tree = functools.partial(jax.tree_util.tree_unflatten, self.treedef)
            return tree(ps), tree(ms), tree(vs), PimState(lead(guards), lead(xparity(ps)))

        def rebuild(params, state, lost):
            leaves = jax.tree.leaves(params)
            xs = drop(state.xparity)
            me = lax.axis_index(axis)
            new_leaves = [
                from_bytes(_local.xparity_rebuild(to_bytes(x), xp, lost, axis, a), x)
                for x, xp in zip(leaves, xs, strict=True)
            ]
            guards, new_xs = enc_local(new_leaves)
            stripes = sum(int(g.sums.shape[0]) for g in guards)
            report = FaultReport(banks_repaired=jnp.where(me == lost, stripes, 0)).psum(self._dev_axes)
            new_params = jax.tree_util.tree_unflatten(self.treedef, new_leaves)
            return new_params, PimState(lead(guards), lead(new_xs)), report

        enc = self._map(encode, (pspecs,), sspec)
        scr = self._map(scrub, (pspecs, sspec), scrub_spec)
        rep = self._map(repair, (pspecs, sspec), (pspecs, sspec, scrub_spec, rspec))
        reb = self._map(rebuild, (pspecs, sspec, P()), (pspecs, sspec, rspec))
        self._encode = jax.jit(enc)
        self._scrub = jax.jit(scr)
        self._repair = jax.jit(lambda p, s: RepairResult(*rep(p, s)), donate_argnums=(0, 1))
        self._rebuild = jax.jit(reb, donate_argnums=(0, 1))

        def build_repair(dtypes):  # repair with casts: one program per tuple of dtypes
            rep_cast = self._map(
                functools.partial(repair, cast=dtypes),
                (pspecs, sspec),
                (pspecs, sspec, scrub_spec, rspec, pspecs),
            )
            return jax.jit(lambda p, s: RepairResult(*rep_cast(p, s)), donate_argnums=(0, 1))

        self._build_repair, self._repair_cast = build_repair, {}

        def build_adamw(decay):  # one program per tuple of decay flags
            fn = self._map(
                functools.partial(adamw, decay=decay),
                (pspecs, pspecs, pspecs, pspecs, P()),
                (pspecs, pspecs, pspecs, sspec),
            )
            return jax.jit(fn, donate_argnums=(0, 2, 3))

        self._build_adamw, self._adamw = build_adamw, {}

    def compiled(self, params, state: PimState) -> dict[str, Any]:
        """The compiled encode, scrub, repair and rebuild_shard programs for these arguments (for
        ``memory_analysis()`` and cost inspection); compiling allocates nothing."""
        lost = jax.ShapeDtypeStruct((), jnp.int32)
        out = {
            "encode": self._encode.lower(params).compile(),
            "scrub": self._scrub.lower(params, state).compile(),
            "repair": self._repair.lower(params, state).compile(),
        }
        if self.axis_size > 1:
            out["rebuild_shard"] = self._rebuild.lower(params, state, lost).compile()
        return out

    def __repr__(self) -> str:
        o = self.overhead()
        return (
            f"PimStore({len(self._leaves)} leaves, {o['protected_bytes']} B per device, "
            f"{self.ndev} device(s), parity axis {self.axis!r} of {self.axis_size}; {self.address_map})"
        )
