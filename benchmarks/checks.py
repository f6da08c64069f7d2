"""The protected GEMM's checks alone: XLA's check GEMMs against the one-read Triton kernel's grids.

On a GPU a protected bf16 GEMM's checks, c = x·[c1, c2 terms] and mag = |x|·[Σ|w| terms]
(``ops.abft_checks``), are XLA GEMMs with few columns (7 per 128-column block with the default λ;
4 with ``weighted=False``), each reading x: at narrow products their reads, not their multiplies,
set the time (0.06-0.08 ms at 8192 x 4096 -> 1024 on an H100 against the plain GEMM's 0.100,
matmul-parts). The opt-in kernel (``pimlayers/ops/_checks_kernel.py``) reads x once, but with its
first grid (64 rows a program: 128 programs at M = 8192, one per SM) it took 0.073-0.084 ms there
too. This suite times it over other grids (``bm`` rows a program, K cut into ``splits`` slices whose
partial sums are added afterwards) at the checks of the Llama-3-8B step's GEMMs, by the kernels'
device time (profiler traces of one call), against XLA's checks and one f32 sum of x (one read of
its bytes: ``reads`` = time / that read's). Every kernel result is checked against ``abft_checks``
before it is timed (``benchmarks.matmul._same_checks``); a grid whose check fails is reported, not
timed. XLA's two check GEMMs are also timed apart (``c_us``, ``mag_us``): each is near one read of
x where x is long (H100, 2026-12-07, checks-s58: c 102.2 µs and mag 93.0 at K = 14336 against 76.3
for the read).
XLA's checks are also timed with K cut into 2, 4 and 8 slices (``xla_s{S}_us``), the slices'
products one batched GEMM: more output tiles for a narrow check GEMM with a long K. On an H100
(2026-12-06, checks-s53split) every cut was as slow or slower than XLA's uncut GEMMs (191.7 µs
uncut at K = 14336, 195.5-221.0 cut), so the protected GEMMs keep K whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pimlayers import ops
from pimlayers.ops import _abft
from pimlayers.ops._checks_kernel import checks_kernel, checks_kernel_applies

from .matmul import _same_checks
from .profile import kernel_us

__all__ = ["GRIDS", "run"]

# (bm, splits) the suite times; (64, 1) is the kernel's first grid.
GRIDS = ((64, 1), (64, 2), (64, 4), (32, 1), (32, 2), (32, 4), (16, 4))
LAM = 8.0  # FaultPolicy's default λ: the terms the protected GEMM's checks carry
# XLA's checks with K cut into this many slices (one batched GEMM, the partial products added).
XLA_SPLITS = (2, 4, 8)


def _cases(m: int) -> list[tuple[str, int, int, int, bool]]:
    """(name, rows of x, K, N of the checked product, transposed) at the Llama-3-8B step's GEMMs:
    the forward's (q, k, v share one check: N = 6144; the MLP's gate and up, 28672 columns, have
    too many for the kernel), and a weight gradient's transposed check (xᵀ @ dy over the tokens)."""
    return [
        ("fwd 4096->1024", m, 4096, 1024, False),
        ("fwd 4096->4096", m, 4096, 4096, False),
        ("fwd 4096->6144 (q,k,v)", m, 4096, 6144, False),
        ("fwd 14336->4096", m, 14336, 4096, False),
        ("dw 4096x1024 (xT dy)", 4096, m, 1024, True),  # (one weight of a batch: the kernel's form)
    ]


def run(m: int = 8192, grids=GRIDS, seed: int = 0) -> list[dict]:
    rows = []
    for name, r, k, n, transposed in _cases(m):
        ks = jax.random.split(jax.random.key(seed), 2)
        w = (jax.random.normal(ks[0], (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        enc = ops.abft_encode(w, 128)
        shape = (k, r) if transposed else (r, k)
        x = jax.random.normal(ks[1], shape, jnp.float32).astype(jnp.bfloat16)
        if transposed:  # the weight gradients' checks: a batch of weights, here of one
            enc = ops.WeightChecksums(enc.sums[None], enc.abs_sums[None])
            x = x[None]
        c_terms, mag_terms, scale = _abft._check_terms(k, LAM)
        abs_sums = enc.abs_sums * jnp.float32(scale)
        xla = jax.jit(
            lambda v, e, t=transposed: ops.abft_checks(v, e, transposed=t, lam=LAM, impl="reference")
        )
        plain = jax.jit(
            lambda v, e, t=transposed: ops.abft_checks(
                v, e, transposed=t, lam=LAM, weighted=False, impl="reference"
            )
        )
        read = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
        want = xla(x, enc)
        row = {
            "op": name,
            "x": f"{shape[0]}x{shape[1]}",
            "columns": (2 * c_terms + mag_terms) * enc.abs_sums.shape[-1],
            "read_us": _us(read, x),
            "xla_us": _us(xla, x, enc),
            "xla_plain_us": _us(plain, x, enc),
        }
        row.update(_xla_parts(x, enc, want, abs_sums, name, c_terms, mag_terms, transposed))
        row.update(_xla_splits(x, enc, want, name, transposed))
        if not checks_kernel_applies(x, enc.sums, c_terms, mag_terms, transposed):
            row["kernel"] = "not taken (checks_kernel_applies)"
        else:
            row.update(_grids(x, enc, abs_sums, want, name, c_terms, mag_terms, transposed, grids))
        timed = {kk[:-3]: v for kk, v in row.items() if kk.startswith("bm") and kk.endswith("_us")}
        if row["read_us"] is not None:
            row["xla_reads"] = row["xla_us"] / row["read_us"]
            if timed:
                best = min(timed, key=timed.get)
                row.update(best=best, best_us=timed[best], best_reads=timed[best] / row["read_us"])
                # The plain checks (c1 alone) on the best grid, against XLA's plain checks.
                bm, splits = (int(v) for v in best[2:].split("_s"))  # "bm{bm}_s{splits}"
                plain_args = (x, enc, abs_sums, plain(x, enc), name + " plain", c_terms, mag_terms)
                got = _grids(*plain_args, transposed, ((bm, splits),), weighted=False)
                row.update({f"plain_{kk}": v for kk, v in got.items()})
        rows.append(row)
        print(row, flush=True)
    return rows


def _xla_parts(x, enc, want, abs_sums, name, c_terms: int, mag_terms: int, transposed: bool) -> dict:
    """``c_us`` and ``mag_us``: XLA's two check GEMMs timed apart (c = x·[c1, c2 terms], mag =
    |x|·[Σ|w| terms], as ``_checks_reference`` forms them), both checked against XLA's checks
    first (``parts_error`` where they differ): how far each is from one read of x."""
    sums = enc.sums.reshape(*enc.sums.shape[:-2], -1)  # (*g, K, nb * 2)
    c_fn = jax.jit(lambda v, s: _abft._split_dot(v, s, c_terms, transposed))
    mag_fn = jax.jit(lambda v, a: _abft._split_dot(jnp.abs(v), a, mag_terms, transposed))
    got = (c_fn(x, sums).reshape(want[0].shape), mag_fn(x, abs_sums))
    try:
        _same_checks(f"{name} c, mag apart", want, got, x, enc, transposed)
    except AssertionError as err:
        return {"parts_error": str(err)}
    return {"c_us": _us(c_fn, x, sums), "mag_us": _us(mag_fn, x, abs_sums)}


def _xla_splits(x, enc, want, name, transposed, splits=XLA_SPLITS) -> dict:
    """``xla_s{S}_us``: XLA's checks with K cut into S slices (``_abft._split_dot(split=S)``), or
    ``..._error`` where they are not XLA's checks."""
    row = {}
    k = enc.abs_sums.shape[-2]
    for split in splits:
        if k % split:
            continue
        fn = jax.jit(lambda v, e, s=split: _abft._checks_reference(v, e, transposed, LAM, split=s))
        key = f"xla_s{split}"
        try:
            _same_checks(f"{name} {key}", want, fn(x, enc), x, enc, transposed)
        except AssertionError as err:
            row[f"{key}_error"] = str(err)
            continue
        row[f"{key}_us"] = _us(fn, x, enc)
    return row


def _us(fn, *args) -> float | None:
    """µs of device kernels in one call; None without a device timeline (a CPU)."""
    us = sum(kernel_us(fn, *args).values())
    return us or None


def _grids(x, enc, abs_sums, want, name, c_terms, mag_terms, transposed, grids, weighted=True) -> dict:
    """``bm{B}_s{S}_us`` per grid, or ``..._error`` where its checks are not XLA's."""
    row = {}
    for bm, splits in grids:
        grid = dict(transposed=transposed, bm=bm, splits=splits, weighted=weighted)
        fn = jax.jit(functools.partial(checks_kernel, c_terms=c_terms, mag_terms=mag_terms, **grid))
        key = f"bm{bm}_s{splits}"
        try:
            _same_checks(f"{name} {key}", want, fn(x, enc.sums, abs_sums), x, enc, transposed)
        except AssertionError as err:
            row[f"{key}_error"] = str(err)
            continue
        row[f"{key}_us"] = _us(fn, x, enc.sums, abs_sums)
    return row
