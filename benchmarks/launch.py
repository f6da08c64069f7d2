"""What one more kernel costs a step: chains of tiny dependent kernels in one jitted program.

On an H200 the protected 4-layer training step launched ~1720 kernels per step against the
unprotected step's ~640, and its step time exceeded its kernels' own time by 12.3 ms against 7.4
(profiles and the llama3 suite of 2026-12-04): kernels that do little may cost more between them
than inside them. Each chain here is ``n`` elementwise updates of a small array, each the next one's
input with an optimization barrier between them (XLA cannot fuse them into one kernel), optionally
with one of the project's native custom calls (``ops.gate``, one CUDA kernel) after every ``every``
of them: XLA records runs of its own kernels into CUDA graphs, and a custom call it cannot record
ends a graph. On a Hopper GPU two more chains call a Pallas Mosaic-GPU kernel (an elementwise update
of the same array) instead: the custom call the verified flash attention and the fused GEMM run
through (``mosaic_gpu_v2``). On 2026-12-04 the protected step with the fused forward GEMM (28 such
calls per step more; kernels 107.2 and 111.5 ms per step in two profiles, against 106.4-107.7
without) took ~5 ms longer than without it.

``kernels`` are counted in a profiler trace of one call where there is a device timeline (on a CPU,
by construction: one per update and per native call); a native gate call is one kernel after a
memset of its count, and memsets are not counted as kernels (their time falls in the gaps). Per
kernel: ``wall_us`` (the program's wall time over its kernels: launch gaps and the host's
enqueueing included) and ``kernel_us`` (their own device time; NaN on a CPU), so ``gap_us`` = wall -
kernel is what a kernel costs beyond its work. ``per_call_us`` is the wall time per update (and
native call, where there is one): the chains' difference is what a native call adds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pimlayers import ops
from pimlayers.ops._fused_gemm import hopper

from ._harness import time_fn
from .profile import kernel_events


def _gate(x):
    return ops.gate(x)[0]


@jax.jit  # one traced kernel for all the chain's calls
def _mosaic(x):
    """x unchanged (x * 1 + 0), by a Pallas Mosaic-GPU kernel on (8, 128) tiles (its copies into
    shared memory take at most 256 values along a dimension): copied in, updated, copied out."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x2 = x.reshape(-1, 128)

    def body(x_gmem, o_gmem, x_smem, o_smem, barrier):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, barrier)
        plgpu.barrier_wait(barrier)
        o_smem[...] = x_smem[...] * jnp.float32(1.0) + jnp.float32(0.0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    smem = plgpu.SMEM(x2.shape, x2.dtype)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x2.shape, x2.dtype),
        scratch_types=(smem, smem, plgpu.Barrier()),
    )
    return kernel(x2).reshape(x.shape)


def _chain(n: int, every: int, call=_gate):
    def f(x):
        for i in range(n):
            x = lax.optimization_barrier(x * jnp.float32(0.5) + jnp.float32(1.0))
            if every and (i + 1) % every == 0:
                x = call(x)
        return x

    return jax.jit(f)


def run(n: int = 1000, size: int = 1024) -> list[dict]:
    """Chains of ``n`` XLA kernels on a float32 array of ``size`` values: alone, and with a native call
    (on a Hopper GPU also a Pallas Mosaic-GPU kernel) after every 10th and after every one."""
    x = jnp.arange(size, dtype=jnp.float32)
    rows = []
    chains = [(n, 0, "XLA fusions", _gate), (n, 10, "XLA fusions, a native call after every 10th", _gate),
              (n, 1, "XLA fusions, a native call after each", _gate)]  # fmt: skip
    if hopper() and size % 128 == 0:
        # Shorter: a chain of 1000 updates with a Mosaic-GPU call after each did not finish compiling
        # within 100 s on an H200 (2026-12-04). per_call_us is per update either way.
        m = min(n, 200)
        chains += [(m, 10, "XLA fusions, a Mosaic-GPU kernel after every 10th", _mosaic),
                   (m, 1, "XLA fusions, a Mosaic-GPU kernel after each", _mosaic)]  # fmt: skip
    for n, every, what, call in chains:
        f = _chain(n, every, call)
        want = jnp.full_like(x, 2.0)  # x -> x/2 + 1 converges to 2 (exactly, within 200 steps)
        got = f(x)
        if n >= 200 and not bool(jnp.all(got == want)):
            raise AssertionError(f"launch chain ({what}) computed {got[:4]}, expected 2.0")
        us, launched = kernel_events(f, x)
        kernels = sum(launched.values()) or n + (n // every if every else 0)
        wall = time_fn(f, x, iters=5)
        dev = sum(us.values()) / 1e6 or float("nan")
        rows.append(
            dict(
                chain=what,
                updates=n,
                kernels=kernels,
                wall_ms=wall * 1e3,
                per_call_us=wall / n * 1e6,
                wall_us=wall / kernels * 1e6,
                kernel_us=dev / kernels * 1e6,
                gap_us=(wall - dev) / kernels * 1e6,
            )
        )
    return rows
