"""The verified flash attention's bounds alone: what XLA computes around the kernels.

``flash_bounds`` (the forward's checksum and bound tiles, from k and v: XLA's,
``FlashConfig(bounds_kernel=False)``, and the one-pass Pallas kernels', the default on a GPU since
2026-12-05, whose tiles are checked against XLA's first)
and ``flash_bwd_bounds`` (the backward's, from q, k, v, do, with δ = rowsum(do ∘ out) from the same
read of do) at one attention layer of the Llama-3-8B step, timed by their kernels' device time
(profiler traces of one call), against XLA reading the same inputs once (a sum of each in f32) in
the same run. Both are bandwidth-bound: their outputs are small next to their inputs, so
``reads`` (bounds time / one read's) says how many times over they read their inputs' bytes.
Every result is checked against the reference before timing: the tiles against a pure-XLA
materialisation of the same sums (``_check``). On a GPU, rows after them time the backward's Pallas
bounds with their queries kernel (0.13 ms a layer in the 4-layer Llama-3-8B step on an H100, about
two reads of q, do and out) at 4, 8 and 16 warps per program (``query_warps``; 8 is the default,
chosen before any timing), each checked against the default's arrays first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pimlayers.ops._flash import FlashConfig, flash_bounds
from pimlayers.ops._flash_bwd import FlashBwdConfig, _c_block, flash_bwd_bounds

from .profile import kernel_us

__all__ = ["run"]


def _inputs(b: int, t: int, h: int, kv: int, d: int):
    keys = jax.random.split(jax.random.key(0), 5)
    shapes = ((b, t, h, d), (b, t, kv, d), (b, t, kv, d), (b, t, h, d), (b, t, h, d))
    return [
        jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16)
        for key, s in zip(keys, shapes, strict=True)
    ]


def _check(bd: dict, q, k, do, out, lam: float, bq: int = 64, bk: int = 64) -> None:
    """Spot checks of the backward's results for query head 0 (KV head 0) against f64 sums on the
    host: a wrong layout or reduction fails them."""
    f64 = lambda x: np.asarray(x, np.float64)
    qh, kh = f64(q[0, :, 0, :]), f64(k[0, :, 0, :])  # (T, D), (S, D)
    kmax = np.abs(kh).reshape(-1, bk, kh.shape[-1]).sum(axis=1).max(axis=0)  # (D,)
    want = dict(
        qs=qh.reshape(-1, bq, qh.shape[-1]).sum(axis=1),  # block sums (T/bq, D): the tile's hi + lo
        delta=(f64(do[0, :, 0, :]) * f64(out[0, :, 0, :])).sum(axis=-1),
        tol_s=_c_block(lam, qh.shape[-1], bk) * (np.abs(qh) @ kmax),
    )
    got = dict(qs=f64(bd["qs"][0, 0, :, 0]) + f64(bd["qs"][0, 0, :, 1]), delta=f64(bd["delta"][0, 0]))
    got["tol_s"] = f64(bd["tol_s"][0, 0])
    for name, w in want.items():
        err = np.max(np.abs(got[name] - w)) / np.max(np.abs(w))
        if not err <= 1e-5:
            raise AssertionError(f"bounds: {name} differs from the host's f64 sums by {err:.3g} (relative)")


def _same_tile(what: str, a, w, sums: tuple[int, ...], mag: int | None = None) -> None:
    """One Pallas tile (..., CS, n) against XLA's: the hi + lo rows at each of ``sums`` as close as
    two splits of f32 sums in other orders can be (below), the ``mag`` row (a bf16 magnitude) within
    one bf16 rounding (its f32 value may round across a bf16 boundary the other way), every other
    row equal.

    hi = bf16(s), lo = bf16(s - hi) carry s to 2^-16 of its value (lo's own rounding), so two f32 sums
    one ulp apart can split into pairs up to ~2^-16 |s| apart; the f32 sums themselves (64-128 bf16
    terms) differ by a few ulps of their terms' scale, counted as 2^-18 of the tile's largest sum.
    (A 2^-20-of-the-largest test, the first version, failed on an H100 at the Llama shape by an
    amount it did not print; that the Triton kernels sum in other orders than XLA, which the CPU's
    interpreter does not, is one way it can, not yet shown to be the one.)"""
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    rest = set(range(a.shape[-2]))
    for i in sums:
        ha, hw = a[..., i, :] + a[..., i + 1, :], w[..., i, :] + w[..., i + 1, :]
        tol = 2.0**-15 * np.abs(hw) + 2.0**-18 * np.max(np.abs(hw))
        if not np.all(np.abs(ha - hw) <= tol):
            at = np.unravel_index(np.argmax(np.abs(ha - hw) - tol), ha.shape)
            raise AssertionError(
                f"bounds: {what} rows {i}, {i + 1} differ from XLA's: by up to "
                f"{np.max(np.abs(ha - hw)) / np.max(np.abs(hw)):.3g} of their largest, "
                f"at {tuple(map(int, at))}: {ha[at]!r} against {hw[at]!r}"
            )
        rest -= {i, i + 1}
    if mag is not None:
        if not np.all(np.abs(a[..., mag, :] - w[..., mag, :]) <= 2.0**-7 * np.abs(w[..., mag, :])):
            raise AssertionError(f"bounds: {what} magnitude row differs from XLA's")
        rest.discard(mag)
    rest = sorted(rest)
    if not np.array_equal(a[..., rest, :], w[..., rest, :]):
        raise AssertionError(f"bounds: {what} constant rows differ from XLA's")


def _same_tiles(got, want) -> None:
    """The forward's Pallas tiles (ks, vs, km) against XLA's (:func:`_same_tile`)."""
    for a, w, sums in zip(got, want, ((0,), (0, 3), (0,)), strict=True):
        _same_tile("the Pallas tiles'", a, w, sums)


# The backward's tiles: the rows holding hi/lo pairs of sums, and a row holding a bf16 magnitude.
_BWD_SUMS = dict(ks=(0,), vs=(0,), qs=(0,), dos=(0,), kd=(0,), dod=(0,), qd=(3,))
_BWD_MAGS = dict(kd=2, dod=2)


def _same_bwd(got: dict, want: dict) -> None:
    """The backward's Pallas bounds against XLA's: the same keys, shapes and dtypes; the tiles as
    :func:`_same_tile` says; the f32 rows within 2^-20 of their largest value."""
    if set(got) != set(want):
        raise AssertionError(
            f"bounds: the backward's Pallas keys {sorted(got)} differ from XLA's {sorted(want)}"
        )
    for name, w in want.items():
        a = got[name]
        if jnp.shape(a) != jnp.shape(w) or jnp.result_type(a) != jnp.result_type(w):
            raise AssertionError(
                f"bounds: the backward's Pallas {name} is {jnp.result_type(a)}{jnp.shape(a)}"
            )
        if name in _BWD_SUMS:
            _same_tile(f"the backward's Pallas {name}", a, w, _BWD_SUMS[name], _BWD_MAGS.get(name))
            continue
        # f32 rows within 2^-20 of their largest; the bf16 qm tile within one rounding (its f32
        # value may round across a bf16 boundary the other way)
        rel = 2.0**-7 if jnp.result_type(a) == jnp.bfloat16 else 2.0**-20
        a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
        if not np.max(np.abs(a - w), initial=0.0) <= rel * np.max(np.abs(w), initial=0.0):
            raise AssertionError(f"bounds: the backward's Pallas {name} differs from XLA's")


def run(b: int = 1, t: int = 8192, h: int = 32, kv: int = 8, d: int = 128, lam: float = 8.0) -> list[dict]:
    q, k, v, do, out = _inputs(b, t, h, kv, d)
    xla, cfg = FlashConfig(bounds_kernel=False), FlashConfig(bounds_kernel=True)
    fwd = jax.jit(lambda k, v: flash_bounds(k, v, lam=lam, config=xla))
    fwd_kernel = jax.jit(lambda k, v: flash_bounds(k, v, lam=lam, config=cfg))
    _same_tiles(fwd_kernel(k, v), fwd(k, v))
    bxla = FlashBwdConfig(bounds_kernel=False)
    bwd = jax.jit(lambda q, k, v, do, out: flash_bwd_bounds(q, k, v, do, lam=lam, out=out, config=bxla))
    _check(bwd(q, k, v, do, out), q, k, do, out, lam)
    bcfg = FlashBwdConfig(bounds_kernel=True)
    bwd_kernel = jax.jit(
        lambda q, k, v, do, out: flash_bwd_bounds(q, k, v, do, lam=lam, out=out, config=bcfg)
    )
    _check(bwd_kernel(q, k, v, do, out), q, k, do, out, lam)
    _same_bwd(bwd_kernel(q, k, v, do, out), bwd(q, k, v, do, out))
    read = jax.jit(lambda *xs: sum(jnp.sum(x, dtype=jnp.float32) for x in xs))
    rows = []
    cases = (
        ("forward", fwd, (k, v)),
        ("forward, Pallas kernels", fwd_kernel, (k, v)),
        ("backward", bwd, (q, k, v, do, out)),
        ("backward, Pallas kernels", bwd_kernel, (q, k, v, do, out)),
    )
    for name, fn, args in cases:
        us, read_us = kernel_us(fn, *args), kernel_us(read, *args)
        nbytes = sum(x.size * x.dtype.itemsize for x in args)
        # NaN without a device timeline (a CPU): kernel_us is empty there.
        dev = sum(us.values()) / 1e3 if us else float("nan")
        rd = sum(read_us.values()) / 1e3 if read_us else float("nan")
        top = us.most_common(1)[0] if us else ("", float("nan"))
        rows.append(
            dict(
                bounds=name,
                shape=f"B{b} T{t} H{h}/{kv} D{d}",
                mb=nbytes / 1e6,
                dev_ms=dev,
                gbs=nbytes / dev / 1e6,
                kernels=len(us),
                largest=top[0][:48],
                largest_ms=top[1] / 1e3,
                xla_read_dev_ms=rd,
                # > 1: the bounds read their inputs' bytes that many times over XLA's one read.
                reads=dev / rd,
            )
        )
    if jax.default_backend() == "gpu":
        rows += query_warps(q, k, v, do, out, lam)
    return rows


def query_warps(q, k, v, do, out, lam: float, warps=(4, 8, 16), interpret: bool = False) -> list[dict]:
    """The backward's Pallas bounds with its queries kernel (the largest of the three: it reads q, do
    and out) at each of ``warps`` warps per program, each checked against the default's arrays
    first; rows with the queries kernel's device time (NaN without a device timeline) and the
    three kernels' together."""
    from pimlayers.ops._flash import CS
    from pimlayers.ops._flash_bwd_bounds import flash_bwd_bounds_kernel

    cfg = FlashBwdConfig()
    bq, bk, d = cfg.block_q, cfg.block_kv, q.shape[-1]
    kw = dict(bq=bq, bk=bk, cs=CS, c_b=_c_block(lam, d, bk), c_q=_c_block(lam, d, bq), interpret=interpret)
    base = flash_bwd_bounds_kernel(q, k, v, do, out, **kw)
    rows = []
    for w in warps:
        fn = jax.jit(functools.partial(flash_bwd_bounds_kernel, **kw, q_warps=w))
        _same_bwd(fn(q, k, v, do, out), base)
        us = kernel_us(fn, q, k, v, do, out)
        queries = sum(t for name, t in us.items() if "bounds_queries" in name)
        rows.append(
            dict(
                bounds=f"backward, Pallas kernels, queries kernel {w} warps",
                shape=f"B{q.shape[0]} T{q.shape[1]} H{q.shape[2]}/{k.shape[2]} D{d}",
                dev_ms=sum(us.values()) / 1e3 if us else float("nan"),
                queries_ms=queries / 1e3 if us else float("nan"),
            )
        )
    return rows
