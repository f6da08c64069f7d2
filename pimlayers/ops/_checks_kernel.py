"""checks_kernel: a bf16 GEMM's checks, c = x @ [w1, w2] and mag = |x| @ wa, from one read of x.

On a GPU the checks of a protected bf16 GEMM (``_abft._checks_reference``) are two XLA GEMMs of x
against the weight's checksum columns split into bf16 terms: one against the sums' terms, one of |x|
against the absolute sums' (``_abft._split_dot``). Each reads x (M x K, as large as the GEMM's own
operand: 64 MB at 8192 x 4096, 235 MB at 8192 x 14336), and where XLA does not fuse the |x| into its
GEMM it writes |x| out and reads it again; the columns are few (7 per 128-column block with the
default λ), so at narrow products these reads, not the multiply, set the time: at 8192 x 4096 ->
1024 on an H100 the checks took 0.070 ms against the plain GEMM's 0.100 (matmul-parts, 2026-12-05).

Here one Pallas (Triton) kernel reads each (BM rows x BK) tile of x once, takes its absolute value in
registers and multiplies both against their columns' tiles (bf16 x bf16 products exact in f32,
accumulated in f32, as the XLA GEMMs do with ``preferred_element_type=f32``). A program holds BM rows
and every column, so x is read once; the columns are padded to pieces of power-of-two widths
(Triton's tiles), each its own accumulator: at most ``MAX_COLUMNS`` in all, beyond which (the MLP's
gate and up, 1,568 columns) the check is a GEMM of its own size and XLA's stays. The terms are then
added as ``_split_dot`` adds them (smallest first), so the results equal the reference's up to the
order of the f32 accumulation (the bound's own assumption for c).

Opt-in, as it did not pay on an H100 (2026-12-05, ``python -m benchmarks.run --suite matmul``): the
protected forward GEMM 2-4% faster at 4096 -> 1024 and 4096 -> 4096, 2% slower at 14336 -> 4096,
forward+backward no faster. With the grid below (``protected_grid``; H100, 2026-12-06): 8% faster
at 4096 -> 1024 forward and forward+backward, elsewhere within the run's spread (-1.4% to +2%).
``PIMLAYERS_CHECKS_KERNEL=1`` in the environment of a process with an NVIDIA GPU of compute
capability 8.0 or newer (read when a protected GEMM is traced), or :func:`checks_kernel` called
directly. On a CPU it runs under Pallas' interpreter (tests).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from ._redo_kernel import _first_device, _gpu_runs_it, load_a_tile, plt
from ._vma import typed_like, vary_as

__all__ = [
    "MAX_COLUMNS",
    "PROTECTED_COLUMNS",
    "accumulation_tolerance",
    "checks_kernel",
    "checks_kernel_applies",
    "checks_kernel_wanted",
    "protected_grid",
]

_BM = 64  # rows per program (default): 128 programs at M = 8192, about one per SM of an H100 / H200
_BK = 64  # K per step of the dot loop
_BMS = (16, 32, 64, 128)  # rows per program a caller may ask for (Triton's dot wants >= 16)
_MIN_PIECE = 16  # Triton's smallest dot width
# Columns (the c and mag terms together, padded) a program accumulates: 64 x 384 f32 over 8 warps is
# 96 registers a thread. Enough for attention's q/k/v together (368 padded) and every 4096-wide
# product's checks (224); not the MLP's gate and up (1,568), whose check GEMM XLA keeps.
MAX_COLUMNS = 384
# What the protected GEMMs' checks take when asked for the kernel, from `python -m benchmarks.run
# --suite checks` (H200, M = 8192, 2026-12-06, checks-s47, µs against XLA's checks): 64-row programs
# with K cut in 2 slices for x·[...] (40.7 against 48.2 at 4096 -> 1024's 56 columns, 51.7 against
# 56.0 at 4096 -> 4096's 224, 154.3 against 168.9 at K = 14336; one slice took 49.1, 56.9, 172.7),
# in 4 for the transposed checks (xᵀ·[...], the weight gradients': 40.3 against 47.2; one slice
# 79.4), and only up to 224 columns padded: at q/k/v's 336 (weighted) the best grid took 83.4
# against XLA's 65.0.
PROTECTED_COLUMNS = 224


def protected_grid(transposed: bool) -> tuple[int, int]:
    """``(bm, splits)`` for the protected GEMMs' checks (``PROTECTED_COLUMNS``'s measurement)."""
    return _BM, 4 if transposed else 2


def accumulation_tolerance(k: int) -> float:
    """How far two f32 sums of the same ``k`` exact products, accumulated in different orders, may
    differ, relative to the sum of the products' magnitudes: what the kernel's checks and XLA's may
    differ by. Rounded to nearest (a CPU, the interpreter), each order errs by about 2^-24·sqrt(k) of
    that magnitude: 2^-22·sqrt(k) covers both. The tensor cores truncate their partial sums instead
    (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021):
    for products of one sign, as mag's are, the partial sum grows linearly and each 16-product step
    loses up to its last place, about k·2^-28 of the total in all, biased toward zero, so two tile
    orders drift apart. On an H100 (2026-12-05) a Llama-shape comparison differed by 7.0e-5 at
    k = 14336 (k·2^-27.6) and matmul-parts' mag at k = 4096 by more than 2^-18. k·2^-26 takes four
    times the estimate. Both terms are far below the checks' own bound (λ u (sqrt(k) + ...) of the
    magnitude, u = 2^-24, for c; mag only scales that bound); at k = 96 their sum is 3.8e-6, under
    a dropped third split term's 6.7e-6 (tests/test_checks_kernel.py)."""
    return 2.0**-22 * k**0.5 + k * 2.0**-26


def _pieces(width: int) -> tuple[tuple[int, int], ...]:
    """``((offset, width), ...)``: ``width`` rounded up to a multiple of 16, cut into power-of-two
    pieces, largest first (192 -> 128 + 64; 48 -> 32 + 16; 8 -> 16)."""
    w = -(-width // _MIN_PIECE) * _MIN_PIECE
    out, off, bit = [], 0, 1 << (w.bit_length() - 1)
    while w:
        if w & bit:
            out.append((off, bit))
            off += bit
            w -= bit
        bit >>= 1
    return tuple(out)


def _padded(width: int) -> int:
    return sum(w for _, w in _pieces(width))


def checks_kernel_wanted() -> bool:
    """Whether this process asked for the kernel (``PIMLAYERS_CHECKS_KERNEL=1``) and the device
    JAX computes on runs it (an NVIDIA GPU of compute capability 8.0 or newer with Pallas' Triton backend)."""
    return os.environ.get("PIMLAYERS_CHECKS_KERNEL", "0") == "1" and _gpu_runs_it()


def checks_kernel_applies(
    x,
    sums,
    c_terms: int,
    mag_terms: int,
    transposed: bool,
    weighted: bool = True,
    max_columns: int = MAX_COLUMNS,
) -> bool:
    """Whether :func:`checks_kernel` takes these checks: a bf16 x (the split-term checks; an f16 or
    f32 x has XLA's f32 GEMMs) of one weight's checks (sums (K, nb, 2)) or a batch matching the
    weights' (x (G, R, K) or, ``transposed``, (G, K, R) against sums (G, K, nb, 2)), non-empty, and
    at most ``max_columns`` (``MAX_COLUMNS``, what it holds; the protected GEMMs ask for
    ``PROTECTED_COLUMNS``, where it won) columns padded (c1's and c2's terms, or ``weighted=False``
    c1's alone, and mag's)."""
    if x.dtype != jnp.bfloat16 or plt is None:
        return False
    *g, _, nb, _ = sums.shape
    if g and (x.ndim != len(g) + 2 or tuple(x.shape[: len(g)]) != tuple(g)):
        return False
    if transposed and not g:
        return False
    if min(x.shape, default=0) <= 0 or nb <= 0:
        return False
    columns = _padded((2 if weighted else 1) * nb * c_terms) + _padded(nb * mag_terms)
    return columns <= min(max_columns, MAX_COLUMNS)


def _kernel(x_ref, pc_ref, pm_ref, oc_ref, om_ref, *, r, k, a_t, bm, steps, pieces_c, pieces_m):
    """One (batch entry, tile of ``bm`` rows, slice of K): every column of c's and mag's terms over
    its ``steps`` steps of K (all of K with one slice)."""
    g, i, sk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(i * bm, bm)
    rmask = i * bm + jnp.arange(bm) < r

    def step(s, accs):
        k0 = (sk * steps + s) * _BK
        ks = k0 + jnp.arange(_BK)
        kmask = ks < k
        x = load_a_tile(x_ref, g, rows, rmask, k0, kmask, a_t)  # (BK, bm) with a_t
        ax = jnp.abs(x)  # exact: |x| of a bf16 value is a bf16 value
        operands = [(pc_ref, off, w, x) for off, w in pieces_c] + [
            (pm_ref, off, w, ax) for off, w in pieces_m
        ]
        out = []
        for acc, (ref, off, w, v) in zip(accs, operands, strict=True):
            p = plt.load(ref.at[g, pl.ds(k0, _BK), pl.ds(off, w)], mask=kmask[:, None], other=0.0)
            # bf16 x bf16 products are exact in f32; the accumulation is f32, as XLA's.
            out.append(acc + plt.dot(v, p, trans_a=a_t).astype(jnp.float32))
        return tuple(out)

    init = tuple(jnp.zeros((bm, w), jnp.float32) for _, w in (*pieces_c, *pieces_m))
    # The last slice may hold fewer steps (and steps past K load nothing: kmask).
    accs = lax.fori_loop(0, steps, step, init)
    outputs = [(oc_ref, off, w) for off, w in pieces_c] + [(om_ref, off, w) for off, w in pieces_m]
    for acc, (ref, off, w) in zip(accs, outputs, strict=True):
        plt.store(ref.at[sk, g, rows, pl.ds(off, w)], acc, mask=rmask[:, None])


def _split_steps(k: int, splits: int) -> tuple[int, int]:
    """``(slices, steps per slice)``: K's ``_BK`` steps cut into at most ``splits`` slices of equal
    step counts (fewer slices where K has fewer steps than ``splits``)."""
    total = pl.cdiv(k, _BK)
    steps = pl.cdiv(total, max(1, min(splits, total)))
    return pl.cdiv(total, steps), steps


@functools.partial(jax.jit, static_argnames=("a_t", "interpret", "bm", "splits"))
def _call(x, pc, pm, *, a_t: bool, interpret: bool = False, bm: int = _BM, splits: int = 1):
    """``(x @ pc, |x| @ pm)`` in f32 for x (G, R, K) (``a_t``: (G, K, R)) and column sets (G, K, W)
    whose widths are already padded to their pieces. ``bm`` rows per program; ``splits`` > 1 cuts K
    into that many slices, each a program of its own (more programs in flight where M / bm is about
    the GPU's SM count), whose partial sums are added afterwards, in slice order (f32)."""
    g = x.shape[0]
    r, k = (x.shape[2], x.shape[1]) if a_t else (x.shape[1], x.shape[2])
    wc, wm = pc.shape[-1], pm.shape[-1]
    slices, steps = _split_steps(k, splits)
    kern = functools.partial(
        _kernel, r=r, k=k, a_t=a_t, bm=bm, steps=steps, pieces_c=_pieces(wc), pieces_m=_pieces(wm)
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    # 8 warps hold 64 rows x 384 f32 columns in 96 registers a thread; fewer rows, fewer warps.
    warps = 8 if bm >= 64 else 4
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=warps, num_stages=3))
    yc, ym = pl.pallas_call(
        kern,
        out_shape=typed_like(
            (
                jax.ShapeDtypeStruct((slices, g, r, wc), jnp.float32),
                jax.ShapeDtypeStruct((slices, g, r, wm), jnp.float32),
            ),
            x,
            pc,
            pm,
        ),
        grid=(g, pl.cdiv(r, bm), slices),
        in_specs=[any_spec] * 3,
        out_specs=(any_spec, any_spec),
        interpret=interpret,
        name="pimlayers_checks_kernel",
        **params,
    )(x, pc, pm)
    yc, ym = vary_as((yc, ym), x, pc, pm)  # inside shard_map: ops._vma
    return yc.sum(0), ym.sum(0)


def _pad_to_pieces(p: jax.Array) -> jax.Array:
    width = p.shape[-1]
    return jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, _padded(width) - width)])


def checks_kernel(
    x: Float[Array, "*g m k"],
    sums: Float[Array, "*g k nb 2"],
    abs_sums: Float[Array, "*g k nb"],
    c_terms: int,
    mag_terms: int,
    *,
    transposed: bool = False,
    interpret: bool | None = None,
    bm: int = _BM,
    splits: int = 1,
    weighted: bool = True,
) -> tuple[Float[Array, "*g m nb 2"], Float[Array, "*g m nb"]]:
    """``(c, mag)`` as ``_abft._checks_reference`` forms them for a bf16 x (``abs_sums`` already
    scaled as it scales them), from one read of x. ``interpret``: Pallas' interpreter (default: on
    a CPU); on a GPU the Triton kernel. Shapes as :func:`checks_kernel_applies` takes them. ``bm``
    (16, 32, 64 or 128) rows per program and ``splits`` slices of K, each a program of its own: the
    grid's size (``python -m benchmarks.run --suite checks`` times the choices). ``weighted=False``:
    c1 alone (half of c's columns); c[..., 1] is 0, as ``abft_checks(weighted=False)`` returns it."""
    from ._abft import _split_parts, _sum_terms

    if bm not in _BMS:
        raise ValueError(f"pimlayers.checks_kernel: bm={bm!r}; expected one of {_BMS}")
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ValueError(f"pimlayers.checks_kernel: splits={splits!r}; expected an int >= 1")
    if not checks_kernel_applies(x, sums, c_terms, mag_terms, transposed, weighted):
        raise ValueError(
            f"pimlayers.checks_kernel: x {x.dtype}{tuple(x.shape)} against sums {tuple(sums.shape)} "
            f"(transposed={transposed}, {c_terms} + {mag_terms} terms); expected a bf16 x of one weight's "
            f"checks or a batch matching the weights', at most {MAX_COLUMNS} columns padded"
        )
    *g, k, nb, _ = sums.shape
    per = 2 if weighted else 1  # c1 and c2 per block, or c1 alone
    sums = sums if weighted else sums[..., :1]
    lead = x.shape[:-1] if not g else x.shape[:-2]
    if not g:  # one weight: x's rows, flattened
        x3 = x.reshape(1, -1, k)
        s3, a3 = sums.reshape(1, k, per * nb), abs_sums.reshape(1, k, nb)
    else:
        x3 = x.reshape(-1, *x.shape[-2:])
        s3, a3 = sums.reshape(-1, k, per * nb), abs_sums.reshape(-1, k, nb)
    pc = _pad_to_pieces(_split_parts(s3, c_terms))
    pm = _pad_to_pieces(_split_parts(a3, mag_terms))
    interp = _first_device().platform == "cpu" if interpret is None else interpret
    yc, ym = _call(x3, pc, pm, a_t=transposed, interpret=interp, bm=bm, splits=splits)
    rows = yc.shape[1]
    c = _sum_terms(yc[..., : c_terms * per * nb], c_terms, per * nb)
    mag = _sum_terms(ym[..., : mag_terms * nb], mag_terms, nb)
    if not weighted:  # (..., nb) -> (..., nb, 2) with c2 zero
        c = jnp.stack([c, jnp.zeros_like(c)], axis=-1)
    if not g:
        return c.reshape(*lead, nb, 2), mag.reshape(*lead, nb)
    return c.reshape(*lead, rows, nb, 2), mag.reshape(*lead, rows, nb)
