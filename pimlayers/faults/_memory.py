"""Memory fault injection: change bytes of live JAX buffers in place, behind XLA's back.

What a flipped HBM cell does to a running job: the bytes of a parameter change, and no JAX operation
was involved. These functions get each device buffer's address (``unsafe_buffer_pointer``) and write
through it — a host pointer on CPU, CuPy over ``__cuda_array_interface__`` on GPU — after all work
already dispatched has finished (so a flip made after ``encode`` is never seen by that encode).
Nothing is copied, and the jax.Array objects stay the same objects.

Devices are named by their index in ``arr.sharding``'s device order for sharded arrays (the store's
``devices`` list for a `PimStore`), or by a ``jax.Device``.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import jax
import numpy as np

__all__ = [
    "BitFlip",
    "device_bytes",
    "fail_bank",
    "flip_bits",
    "lose_shard",
    "overwrite",
    "random_bit_flips",
]


class BitFlip(NamedTuple):
    leaf: int  # index in the pytree's flattened leaves
    device: int  # index in the store's device list
    byte: int  # byte offset in that device's local shard of the leaf
    bit: int  # 0..7


def _shard(x: jax.Array, device) -> jax.Array:
    shards = x.addressable_shards
    if device is None:
        if len(shards) != 1:
            raise ValueError(
                f"pimlayers.faults: the array has {len(shards)} addressable shards; pass device="
            )
        return shards[0].data
    if isinstance(device, jax.Device):
        for s in shards:
            if s.device == device:
                return s.data
        raise ValueError(f"pimlayers.faults: no shard of the array lives on {device}")
    mesh = getattr(x.sharding, "mesh", None)
    devs = list(mesh.devices.flat) if mesh is not None else [sh.device for sh in shards]
    if isinstance(device, bool) or not isinstance(device, int | np.integer) or not 0 <= device < len(devs):
        raise ValueError(
            f"pimlayers.faults: device={device!r}; expected a jax.Device or an index 0..{len(devs) - 1}"
        )
    return _shard(x, devs[int(device)])


def device_bytes(x: jax.Array, device=None):
    """A writable uint8 view of one device buffer of ``x`` (numpy on CPU, CuPy on GPU), zero-copy.

    Waits for pending work on the buffer first. Writes through the view change ``x`` itself.
    """
    buf = _shard(x, device)
    # The write must come after every computation already dispatched. block_until_ready on the buffer
    # only waits for the work that *writes* it; a computation still *reading* it (an encode dispatched
    # just before) would otherwise see the flip, and the flip would look like the truth. Every pending
    # computation has live outputs, so waiting for all live arrays orders the write after them.
    jax.block_until_ready(jax.live_arrays())
    n = buf.nbytes
    platform = next(iter(buf.devices())).platform
    if platform == "cpu":
        if n == 0:
            return np.zeros((0,), np.uint8)
        raw = (ctypes.c_uint8 * n).from_address(buf.unsafe_buffer_pointer())
        return np.ctypeslib.as_array(raw)
    if platform in ("gpu", "cuda"):
        try:
            import cupy as cp
        except ImportError as e:  # pragma: no cover - GPU machines have CuPy
            raise RuntimeError("pimlayers.faults: in-place GPU injection needs CuPy") from e
        ptr = buf.unsafe_buffer_pointer()
        mem = cp.cuda.UnownedMemory(ptr, n, buf, device_id=next(iter(buf.devices())).id)
        return cp.ndarray((n,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
    raise ValueError(f"pimlayers.faults: in-place injection on platform {platform!r} is not supported")


def _sync(view) -> None:
    if not isinstance(view, np.ndarray):
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


def _refresh_host_copy(x: jax.Array, device, view) -> None:
    # jax.Arrays cache the host copy made by np.asarray; after an in-place write it would be stale.
    # The cache cannot be emptied from Python, so it is overwritten with the buffer's new bytes.
    buf = _shard(x, device)
    if getattr(buf, "_npy_value", None) is None and getattr(x, "_npy_value", None) is None:
        return  # nothing cached: no host copy to make (a whole-buffer transfer per injection otherwise)
    host = view.get() if hasattr(view, "get") else np.array(view)
    local = host.view(np.dtype(buf.dtype)).reshape(buf.shape) if host.size else np.zeros(buf.shape, buf.dtype)
    local.flags.writeable = False
    if getattr(buf, "_npy_value", None) is not None:
        buf._npy_value = local
    if buf is not x and getattr(x, "_npy_value", None) is not None:
        whole = np.array(x._npy_value)
        index = next(
            s.index
            for s in x.addressable_shards
            if s.data.unsafe_buffer_pointer() == buf.unsafe_buffer_pointer()
        )
        whole[index] = local
        whole.flags.writeable = False
        x._npy_value = whole


def flip_bits(x: jax.Array, byte: np.ndarray, bit: np.ndarray, *, device=None) -> None:
    """Flip bit ``bit[i]`` (0..7) of byte ``byte[i]`` of one device buffer of ``x``, in place."""
    byte = np.atleast_1d(np.asarray(byte, np.int64))
    bit = np.atleast_1d(np.asarray(bit, np.int64))
    view = device_bytes(x, device)
    n = view.shape[0]
    if byte.size and (byte.min() < 0 or byte.max() >= n):
        raise ValueError(f"pimlayers.faults.flip_bits: byte offsets must be in 0..{n - 1}")
    if bit.size and (bit.min() < 0 or bit.max() > 7):
        raise ValueError("pimlayers.faults.flip_bits: bits must be in 0..7")
    # One byte named twice gets both flips (XOR accumulates), as two upsets of one word would.
    where, inverse = np.unique(byte, return_inverse=True)
    masks = np.zeros(where.shape, np.uint8)
    np.bitwise_xor.at(masks, inverse, (np.uint8(1) << bit.astype(np.uint8)).astype(np.uint8))
    if isinstance(view, np.ndarray):
        view[where] ^= masks
    else:
        import cupy as cp

        idx = cp.asarray(where)
        view[idx] = view[idx] ^ cp.asarray(masks)
    _sync(view)
    _refresh_host_copy(x, device, view)


def overwrite(x: jax.Array, start: int, data: np.ndarray, *, device=None) -> None:
    """Overwrite bytes ``start .. start + len(data)`` of one device buffer of ``x`` in place."""
    view = device_bytes(x, device)
    data = np.asarray(data, np.uint8).reshape(-1)
    end = min(start + data.size, view.shape[0])
    if end > start:
        if isinstance(view, np.ndarray):
            view[start:end] = data[: end - start]
        else:
            import cupy as cp

            view[start:end] = cp.asarray(data[: end - start])
    _sync(view)
    _refresh_host_copy(x, device, view)


def random_bit_flips(store, params, count: int, *, seed: int, one_per_group: bool = True) -> list[BitFlip]:
    """Flip ``count`` random bits of ``params`` in place (leaves chosen in proportion to their bytes,
    devices uniformly) and return where. ``one_per_group`` keeps to one flip per parity group, so every
    flip is correctable by itself; False draws freely (two in one group are then uncorrectable)."""
    rng = np.random.default_rng(seed)
    amap = store.address_map
    g = store.geometry
    leaves = jax.tree.leaves(params)
    sizes = np.array([lf.nbytes for lf in amap.leaves], np.float64)
    if sizes.sum() == 0:
        raise ValueError("pimlayers.faults.random_bit_flips: the parameters have no bytes")
    flips: list[BitFlip] = []
    used: set[tuple[int, int, int]] = set()
    ngroups = sum(lf.ngroups for lf in amap.leaves) * store.ndev
    if one_per_group and count > ngroups:
        raise ValueError(f"pimlayers.faults.random_bit_flips: {count} flips > {ngroups} parity groups")
    while len(flips) < count:
        i = int(rng.choice(len(sizes), p=sizes / sizes.sum()))
        d = int(rng.integers(store.ndev))
        byte = int(rng.integers(amap.leaves[i].nbytes))
        bit = int(rng.integers(8))
        key = (i, d, byte // (g.stripe_bytes * g.group)) if one_per_group else (i, d, byte * 8 + bit)
        if key in used:
            continue
        used.add(key)
        flips.append(BitFlip(i, d, byte, bit))
    for i, d in sorted({(f.leaf, f.device) for f in flips}):
        mine = [f for f in flips if f.leaf == i and f.device == d]
        flip_bits(leaves[i], [f.byte for f in mine], [f.bit for f in mine], device=_dev(store, leaves[i], d))
    return flips


def _dev(store, x: jax.Array, d: int):
    return store.devices[d] if len(x.addressable_shards) > 1 else None


def fail_bank(store, params, state, bank: int, *, device: int = 0, seed: int = 0) -> int:
    """Destroy physical bank ``bank`` of device ``device``: every data stripe and parity block the
    address map puts there is overwritten with random bytes, in place. Returns the stripes hit."""
    rng = np.random.default_rng(seed)
    g = store.geometry
    if not 0 <= bank < g.nbanks:
        raise ValueError(f"pimlayers.faults.fail_bank: bank={bank}; expected 0..{g.nbanks - 1}")
    leaves = jax.tree.leaves(params)
    hit = 0
    for leaf, kind, idx in store.address_map.bank_contents(bank):
        target = leaves[leaf] if kind == "data" else state.guards[leaf].parity
        n = store.address_map.leaves[leaf].nbytes if kind == "data" else None
        for s in idx.tolist():
            start = s * g.stripe_bytes
            size = g.stripe_bytes if n is None else min(g.stripe_bytes, n - start)
            overwrite(
                target, start, rng.integers(0, 256, size, dtype=np.uint8), device=_dev(store, target, device)
            )
            hit += 1
    return hit


def lose_shard(store, params, state, device: int, *, seed: int = 0) -> int:
    """Destroy everything one device holds — its shard of every parameter and all of its protection
    data — by overwriting the buffers with random bytes, in place. Returns the bytes destroyed."""
    rng = np.random.default_rng(seed)
    total = 0
    for x in jax.tree.leaves(params) + jax.tree.leaves(state):
        dev = store.devices[device]
        view_n = _shard(x, dev).nbytes
        overwrite(x, 0, rng.integers(0, 256, view_n, dtype=np.uint8), device=dev)
        total += view_n
    return total
