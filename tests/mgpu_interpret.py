"""The project's Pallas Mosaic-GPU kernels on the CPU, through jax's GPU interpret mode.

jax (0.10) can interpret a Mosaic-GPU kernel on the CPU (``force_gpu_interpret_mode``): threads,
shared memory, barriers, TMA copies and wgmma simulated by host callbacks. Some things the
project's kernels use are not in it yet, and :func:`interpret` adds them while it is active:

* ``pl.run_state`` (a wgmma accumulator carried from one step to the next, as
  ``plgpu.ACC.init(acc)``): its refs become registers initialised with the given values, the body
  is interpreted, and their final values are read back;
* ``plgpu.wgmma`` with its A operand in registers (flash attention's p·v) or a transposed operand
  (k·qᵀ), on the host as the stock callback multiplies;
* ``plgpu.load`` and layouts (``plgpu.layout_cast``: an interpreted value has no register layout);
* a ref handed to a kernel (the device redo's outputs, updated in place): placed in global memory;
* a barrier whose last phases a thread never waits for: the stock interpreter raises when such a
  barrier is freed, but a producer that stops refilling a pipeline's slots does exactly that on the
  hardware (it waits for a slot's release only to refill it), so the check is left out. Waiting for
  a phase other than the next one still raises, as on the hardware it would hang or pass early.

The interpreter multiplies with numpy (f32 accumulation of the bf16 operands) in program order, so a
kernel's results match the GPU's up to the summation order of its products; it does not model
asynchronous wgmma or the hardware's approximate exp2. It is slow (every memory access is a
callback): small shapes only. What it checks: indexing, masking, pipelining and barriers, the
checksums and their bounds, fault injection, everything but speed and the hardware's own races.

It can deadlock: every simulated warpgroup is a jitted program whose barrier waits block inside
host callbacks, and on a 2-core machine the backward kernels' warpgroups have been seen all waiting
on one that never started (in one process after other kernels had run; the same test alone passed).
Run it under a timeout.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

try:
    from jax._src import callback
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu import core as mgpu_core
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
    from jax._src.state import discharge, indexing
    from jax._src.state import types as state_types

    AVAILABLE = hasattr(ji.JaxprInterpreter, "interpret")
except ImportError:  # a jax without the GPU interpreter
    AVAILABLE = False

__all__ = ["AVAILABLE", "interpret"]


def _at(self) -> dict:
    """Where a callback runs: the simulated device, grid point and thread."""
    return dict(
        device_id=jnp.int32(self.device_info.device_id),
        grid_point_coords=self.grid_point_coords,
        thread_id=self.thread_id,
    )


def _regs(self, token, value, source_info):
    """A per-thread register buffer holding ``value``: (token, key)."""
    token, request = cb.call_make_allocation_request_array(
        token=token,
        memory_space_id=cb.get_memory_space_idx(mgpu_core.MemorySpace.REGS),
        device_id=jnp.int32(self.device_info.device_id),
        thread_id=jnp.int32(self.thread_id),
        initial_ref_count=1,
    )
    return cb.call_allocate_buffer(
        token=token,
        **_at(self),
        allocation_request_as_array=request,
        value=value,
        source_info=source_info,
    )


def _free(self, token, key, source_info):
    return cb.call_deallocate_buffer(
        token=token,
        **_at(self),
        allocation_key_as_array=key,
        source_info=source_info,
    )


def _run_state(self, eqn, token, invals):
    """``run_state``: each value a register buffer holding it (a ref from outside, such as a barrier
    or a shared-memory buffer the body closes over, is passed through), the body interpreted, the
    buffers' final values returned and the outside refs as they came (as run_state's own rule)."""
    jaxpr = eqn.params["jaxpr"]
    if not all(eqn.params["is_initialized"]):
        raise NotImplementedError("run_state with uninitialized refs")
    outer_ref = [isinstance(v.aval, state_types.AbstractRef) for v in eqn.invars]
    keys = []
    for value, is_ref in zip(invals, outer_ref, strict=True):
        if not is_ref:
            token, value = _regs(self, token, value, eqn.source_info)
        keys.append(value)
    token, _ = self.interpret(jaxpr, token, *keys)
    outs = []
    for var, key, is_ref in zip(jaxpr.invars, keys, outer_ref, strict=True):
        if is_ref:
            outs.append(key)
            continue
        token, value = cb.call_get(
            token=token,
            result_shape_and_dtype=var.aval.inner_aval,
            **_at(self),
            allocation_key_as_array=key,
            transforms=(),
            source_info=eqn.source_info,
        )
        token = _free(self, token, key, eqn.source_info)
        outs.append(value)
    return token, outs


def _load(self, eqn, token, invals):
    """``plgpu.load``: a read of the ref, as ``ref[...]`` is interpreted."""
    token, value = cb.call_get(
        token=token,
        result_shape_and_dtype=eqn.outvars[0].aval,
        **_at(self),
        allocation_key_as_array=invals[0],
        transforms=jax.tree.unflatten(eqn.params["tree"], invals[1:]),
        source_info=eqn.source_info,
    )
    return token, [value]


# Primitives the stock interpreter lacks: (self, eqn, token, invals) -> (token, outs). A layout says
# how a value sits in registers; interpreted, a value has none.
HANDLERS = {
    discharge.run_state_p: _run_state,
    gpu_primitives.load_p: _load,
    mgpu_core.layout_cast_p: lambda self, eqn, token, invals: (token, [invals[0]]),
}


def _segments(jaxpr):
    """The eqns split into runs the stock interpreter takes and lone eqns of HANDLERS."""
    run: list = []
    for eqn in jaxpr.eqns:
        if eqn.primitive in HANDLERS:
            if run:
                yield False, run
                run = []
            yield True, [eqn]
        else:
            run.append(eqn)
    if run:
        yield False, run


def _interpret(stock):
    def interpret(self, jaxpr, token, *args):
        if not any(e.primitive in HANDLERS for e in jaxpr.eqns):
            return stock(self, jaxpr, token, *args)
        env = dict(zip(jaxpr.constvars + jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
        parts = list(_segments(jaxpr))
        for i, (special, eqns) in enumerate(parts):
            if special:
                (eqn,) = eqns
                token, outs = HANDLERS[eqn.primitive](self, eqn, token, [read(v) for v in eqn.invars])
                env.update(zip(eqn.outvars, outs, strict=True))
                continue
            # A run of ordinary eqns as a jaxpr of its own: in, the vars it reads from before it;
            # out, the vars it defines that later eqns or the jaxpr's outputs read.
            defined = {v for e in eqns for v in e.outvars}
            free = list(
                dict.fromkeys(
                    v for e in eqns for v in e.invars if isinstance(v, jax_core.Var) and v not in defined
                )
            )
            later = [v for _, es in parts[i + 1 :] for e in es for v in e.invars] + list(jaxpr.outvars)
            live = list(dict.fromkeys(v for v in later if isinstance(v, jax_core.Var) and v in defined))
            effects = jax_core.join_effects(*(e.effects for e in eqns))
            sub = jax_core.Jaxpr([], free, live, eqns, effects)
            token, outs = stock(self, sub, token, *(env[v] for v in free))
            env.update(zip(live, outs, strict=True))
        return token, [read(v) for v in jaxpr.outvars]

    return interpret


def _apply(transform, value):
    """One ref transform, host side: an index or a transpose (tiling and swizzling change nothing here:
    the interpreter keeps buffers in their logical layout)."""
    if isinstance(transform, cb.NOOP_TRANSFORMS):
        return value
    if isinstance(transform, indexing.NDIndexer):
        return value[interpret_utils.to_range((transform,))]
    if isinstance(transform, state_types.TransposeTransform):
        return np.transpose(value, transform.permutation)
    raise NotImplementedError(f"wgmma operand transform {transform} in the GPU interpreter")


def _host_wgmma(token, device_id, grid, thread_id, acc, acc_tf, a, a_tf, b, b_tf, *, a_in_regs, acc_dtype):
    """acc[...] += a @ b on the host: the stock callback with transposed operands (k·qᵀ) and A from
    registers (p·v) besides."""
    mem = cb._get_shared_memory()
    tid = int(thread_id)
    gtid = mem.get_global_thread_id(int(device_id), tid)
    info = interpret_utils.GPULoggingInfo(
        device_id=int(device_id),
        grid_point_coords=tuple(int(g) for g in grid),
        thread_id=tid,
        source_info=None,
    )

    def read(key, transforms):
        value, _, _ = mem.get_buffer_content(
            cb.HostAllocationKey.from_array(key), (), gtid, logging_info=info
        )
        for t in jax.tree.map(int, transforms):
            value = _apply(t, value)
        return value

    a = np.asarray(a) if a_in_regs else read(a, a_tf)
    acc_key = cb.HostAllocationKey.from_array(acc)
    where = interpret_utils.to_range(jax.tree.map(int, cb._remove_noop_transforms(acc_tf)))
    old, _, _ = mem.get_buffer_content(acc_key, where, gtid, logging_info=info)
    mem.store_buffer_content(
        acc_key, where, old + np.matmul(a, read(b, b_tf), dtype=acc_dtype), gtid, logging_info=info
    )
    return token


def _wgmma(self, eqn, token, get_invals):
    acc, a, b, *leaves = get_invals()
    trees = [eqn.params[f"{n}_transforms_tree"] or jax.tree.structure([]) for n in ("acc", "a", "b")]
    acc_tf, a_tf, b_tf = jax.tree.unflatten(jax.tree_util.treedef_tuple(trees), leaves)
    host = functools.partial(
        _host_wgmma,
        a_in_regs=not isinstance(eqn.invars[1].aval, state_types.AbstractRef),
        acc_dtype=eqn.invars[0].aval.dtype,
    )
    args = (jnp.int32(self.device_info.device_id), self.grid_point_coords, self.thread_id)
    token = callback.io_callback(
        host, cb.TOKEN_SHAPE_DTYPE, token, *args, acc, acc_tf, a, a_tf, b, b_tf, ordered=True
    )
    return token, []


def _free_barrier(barrier) -> None:
    with barrier.cv:
        barrier.ref_count -= 1


def _gmem_or_unplaced(stock, space) -> bool:
    """A kernel operand with no memory space is a ref handed to the kernel (the device redo's, from
    ``run_state``): it lives in global memory, as on the hardware, where the stock interpreter
    tried to allocate it in a memory space named None."""
    return space is None or stock(space)


@contextlib.contextmanager
def interpret(**params):
    """Run Mosaic-GPU kernels traced inside the block through the extended interpreter on the CPU.

    ``params``: :class:`InterpretGPUParams` fields (e.g. ``detect_races=True``)."""
    if not AVAILABLE:
        raise RuntimeError("this jax has no Pallas GPU interpreter")
    cls = ji.JaxprInterpreter
    stock = cls.interpret, cls._interpret_wgmma_ref_p, gpu_memory.Barrier.deallocate, cb.is_gmem_memory_space
    cls.interpret, cls._interpret_wgmma_ref_p = _interpret(stock[0]), _wgmma
    gpu_memory.Barrier.deallocate = _free_barrier
    cb.is_gmem_memory_space = functools.partial(_gmem_or_unplaced, stock[3])
    try:
        with force_gpu_interpret_mode(InterpretGPUParams(**params)):
            yield
    finally:
        cls.interpret, cls._interpret_wgmma_ref_p = stock[:2]
        gpu_memory.Barrier.deallocate, cb.is_gmem_memory_space = stock[2:]
