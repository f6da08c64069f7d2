"""``abft_finish`` alone at every product the protected Llama-3-8B training step checks.

The finish reads a GEMM's product once (in place for bf16: nothing is written where nothing is
corrected or gated), so its speed limit is the device's read bandwidth. Each row times it at one
product of the step, carried through a jitted loop in place as the step runs it, against XLA
reading the same bytes (a sum of y in f32) in the same run. The last row adds the rows up as a
step of ``layers`` layers runs them (each product once per layer), which the profiler's
``AbftRowKernel`` total per step can be set against.

Products per GEMM x (M, K) @ w (K, N): the forward's y (M, N), the backward's dx = dy @ wᵀ (M, K)
and dw = xᵀ @ dy (K, N, summed over the M tokens). The checks come from a real GEMM and
``abft_checks``, and the finish must find every block clean before it is timed.

Two timings of each: ``finish_ms`` / ``xla_read_ms`` are wall clock per trip of a 10-trip loop,
which on a GPU includes the loop's own overhead per trip (more than a 67 MB read takes on an H200);
the ``*_dev_*`` columns are the kernels' device time alone, from profiler traces (``device_time``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.llama3 import LlamaConfig, get_config
from pimlayers import ops

from ._harness import carried_time
from .profile import kernel_us

__all__ = ["LLAMA3_8B_GEMMS", "layer_gemms", "products", "run"]


def layer_gemms(cfg: LlamaConfig) -> tuple[tuple[str, int, int], ...]:
    """(name, K, N) of one decoder layer's linear layers."""
    d, kv, f = cfg.dim, cfg.n_kv_heads * cfg.hd, cfg.ffn_dim
    return (
        ("q", d, d),
        ("k", d, kv),
        ("v", d, kv),
        ("o", d, d),
        ("gate", d, f),
        ("up", d, f),
        ("down", f, d),
    )


LLAMA3_8B_GEMMS = layer_gemms(get_config("llama3_8b"))


def products(m: int, gemms=LLAMA3_8B_GEMMS) -> list[tuple[str, int, int, int]]:
    """(role, rows, cols, inner K) of every product a layer's protected GEMMs check, M tokens."""
    out = []
    for name, k, n in gemms:
        out += [(f"{name} y", m, n, k), (f"{name} dx", m, k, n), (f"{name} dw", k, n, m)]
    return out


def run(
    m: int = 8192, gemms=LLAMA3_8B_GEMMS, dtype=jnp.bfloat16, block_n: int = 128, layers: int = 4
) -> list[dict]:
    rows, sums = [], np.zeros(5)  # bytes, finish and read seconds (wall, device) of one layer
    for role, r, n, k in products(m, gemms):
        x = jax.random.normal(jax.random.key(0), (r, k), jnp.float32).astype(dtype)
        w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
        y = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype))(x, w)
        c, mag = jax.jit(ops.abft_checks)(x, ops.abft_encode(w, block_n))
        del x, w
        kw = dict(k=k, block_n=block_n, out_dtype=dtype)
        _, flags, _ = jax.jit(lambda a, b, d, kw=kw: ops.abft_finish(a, b, d, **kw))(y, c, mag)
        flagged = int(jnp.count_nonzero(flags))
        if flagged:
            raise AssertionError(f"finish {role} {r}x{n}: {flagged} clean blocks flagged")

        def step(carry, kw=kw):  # in place: y is carried and donated, as the step's GEMM output is
            yy, cc, mm = carry
            return ops.abft_finish(yy, cc, mm, **kw)[0], cc, mm

        t_finish = carried_time(step, (y, c, mag))
        t_read = carried_time(_read, (y, jnp.float32(0)))
        d_finish, d_read = device_time(step, (y, c, mag)), device_time(_read, (y, jnp.float32(0)))
        nbytes = y.size * y.dtype.itemsize
        sums += (nbytes, t_finish, t_read, d_finish, d_read)
        rows.append(_row(role, (r, n), k, nbytes, t_finish, t_read, d_finish, d_read))
    rows.append(_row(f"step, {layers} layers", None, None, *(layers * sums)))
    return rows


def device_time(step, init, n: int = 10) -> float:
    """Seconds of device kernels per ``carry = step(carry)``, from profiler traces of jitted loops of
    n and 2n trips, differenced (the loop's one-off copy of the carry cancels): the kernels' own time,
    without the loop's per-trip overhead that ``carried_time`` includes (on an H200 more than a
    67 MB read takes). NaN without a device timeline (a CPU)."""
    totals = []
    for trips in (n, 2 * n):
        loop = jax.jit(lambda c, trips=trips: lax.fori_loop(0, trips, lambda i, c: step(c), c))
        totals.append(sum(kernel_us(loop, init).values()))
    return (totals[1] - totals[0]) / n / 1e6 if totals[1] else float("nan")


def _read(carry):
    """XLA reading y once (a sum in f32). y passes through a barrier with the loop's running sum,
    so XLA can neither hoist the read out of the loop nor skip it (`device_time`'s loop let the
    CPU's XLA do one or the other: 200 GB/s on a 2-core machine)."""
    y, acc = lax.optimization_barrier(carry)
    return y, acc + jnp.sum(y, dtype=jnp.float32)


def _row(role, shape, k, nbytes, t_finish, t_read, d_finish, d_read) -> dict:
    return dict(
        product=role,
        shape="x".join(map(str, shape)) if shape else "",
        k=k or "",
        mb=nbytes / 1e6,
        finish_ms=t_finish * 1e3,
        finish_gbs=nbytes / t_finish / 1e9,
        xla_read_ms=t_read * 1e3,
        xla_read_gbs=nbytes / t_read / 1e9,
        # 1: the finish reads y as fast as XLA's reduction does
        vs_xla_read=t_read / t_finish,
        # The same from the kernels' device time alone (profiler traces; NaN on a CPU).
        finish_dev_ms=d_finish * 1e3,
        finish_dev_gbs=nbytes / d_finish / 1e9,
        xla_read_dev_ms=d_read * 1e3,
        dev_vs_xla_read=d_read / d_finish,
    )
