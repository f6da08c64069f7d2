"""Native ops against their peers: the XLA reference and the device copy bandwidth, one run.

Each row names the op, its size, its time, the bytes it must move (each input read once, each
output written once), the achieved GB/s, the peer's time and the ratio peer/ours (> 1: ours faster).
Every native result is compared with the reference before it is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pimlayers import ops

from ._harness import time_fn


def _check(name, a, b):
    if np.asarray(a).tobytes() != np.asarray(b).tobytes():
        raise AssertionError(f"{name}: native and reference disagree; not timing a wrong kernel")


def _row(op: str, mbytes, moved: int, t: float, peer: str, t_peer: float, copy_gbs: float) -> dict:
    """One bandwidth row: ``moved`` bytes in ``t`` seconds against ``peer`` in ``t_peer``."""
    gbs = moved / t / 1e9
    return dict(
        op=op,
        mbytes=mbytes,
        ms=t * 1e3,
        gbs=gbs,
        peer=peer,
        peer_ms=t_peer * 1e3,
        ratio=t_peer / t,
        copy_fraction=gbs / copy_gbs,
    )


def run(size_mb: int = 1024) -> list[dict]:
    dev = jax.devices()[0]
    rows: list[dict] = []
    n32 = size_mb * (1 << 20) // 4
    key = jax.random.key(0)
    x32 = jax.device_put(jax.random.normal(key, (n32 // 4096, 4096), jnp.float32), dev)
    u32 = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    nbytes = x32.size * 4

    copy = jax.jit(lambda a: a ^ np.uint32(1))  # read + write every byte
    t_copy = time_fn(copy, u32)
    copy_gbs = 2 * nbytes / t_copy / 1e9
    rows.append(dict(op="device copy (XLA xor)", mbytes=size_mb, ms=t_copy * 1e3, gbs=copy_gbs))
    reduce_ = jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32))  # read-only ceiling through XLA
    t_red = time_fn(reduce_, u32)
    rows.append(
        dict(op="XLA uint32 sum (read only)", mbytes=size_mb, ms=t_red * 1e3, gbs=nbytes / t_red / 1e9)
    )

    for bank in (4096, 65536):
        nat = jax.jit(lambda a, b=bank: ops.bank_checksums(a, bank_bytes=b, impl="native"))
        ref = jax.jit(lambda a, b=bank: ops.bank_checksums(a, bank_bytes=b, impl="reference"))
        _check("bank_checksums", nat(x32), ref(x32))
        t_n, t_r = time_fn(nat, x32), time_fn(ref, x32)
        rows.append(_row(f"bank_checksums bank={bank}", size_mb, nbytes, t_n, "XLA reference", t_r, copy_gbs))

    for dtype in (jnp.float32, jnp.bfloat16):
        x = x32.astype(dtype).at[::97, 5].set(jnp.nan)
        nb = x.size * x.dtype.itemsize
        nat = jax.jit(lambda a: ops.gate(a, limit=1e4, impl="native"))
        ref = jax.jit(lambda a: ops.gate(a, limit=1e4, impl="reference"))
        _check("gate", nat(x)[0], ref(x)[0])
        t_n, t_r = time_fn(nat, x), time_fn(ref, x)
        name = f"gate {jnp.dtype(dtype).name}"
        rows.append(_row(name, nb >> 20, 2 * nb, t_n, "XLA fused where+sum", t_r, copy_gbs))

    nat = jax.jit(lambda a: ops.parity(a, bank_bytes=4096, group=8, impl="native"))
    ref = jax.jit(lambda a: ops.parity(a, bank_bytes=4096, group=8, impl="reference"))
    _check("parity", nat(x32), ref(x32))
    t_n, t_r = time_fn(nat, x32), time_fn(ref, x32)
    pb = nbytes * 9 // 8
    rows.append(_row("parity bank=4096 G=8", size_mb, pb, t_n, "XLA reference", t_r, copy_gbs))

    # bank_guard: what encode-on-write stores (checksums, parity, parity checksums) in one read of x,
    # against the three native ops run separately (two reads of x), as the store did before.
    fused = jax.jit(lambda a: ops.bank_guard(a, bank_bytes=4096, group=8, parity_sums=True, impl="native"))

    def separate(a):
        par = ops.parity(a, bank_bytes=4096, group=8, impl="native")
        sums = ops.bank_checksums(a, bank_bytes=4096, impl="native")
        return sums, par, ops.bank_checksums(par, bank_bytes=4096, impl="native")

    separate = jax.jit(separate)
    for got, want in zip(fused(x32), separate(x32), strict=True):
        _check("bank_guard", got, want)
    t_n, t_r = time_fn(fused, x32), time_fn(separate, x32)
    peer = "bank_checksums + parity (native, separate)"
    rows.append(_row("bank_guard bank=4096 G=8 (+parity sums)", size_mb, pb, t_n, peer, t_r, copy_gbs))

    # bank_guard_many on the same one array: the register-resident kernel the store uses (one CTA
    # per parity group, no shared-memory staging) against bank_guard's own kernel.
    many = jax.jit(lambda a: ops.bank_guard_many([a], bank_bytes=4096, group=8, impl="native")[0])
    for got, want in zip(many(x32), fused(x32), strict=True):
        _check("bank_guard_many", got, want)
    t_m = time_fn(many, x32)
    op = "bank_guard_many, one array, bank=4096 G=8"
    rows.append(_row(op, size_mb, pb, t_m, "bank_guard (native)", t_n, copy_gbs))

    # abft_check on a Llama-3-8B MLP output (M=8192, N=14336, f32 before rounding), and abft_finish:
    # the same check, then the gate and the cast to bf16 in the same pass (what a protected GEMM runs).
    m, n, k = (8192 if size_mb >= 512 else 512), 14336, 4096
    y = jax.device_put(jax.random.normal(key, (m, n), jnp.float32), dev)
    for block_n in (None, 128):
        nbk = 1 if block_n is None else -(-n // block_n)
        c = jnp.stack([y.reshape(m, nbk, -1).sum(-1), jnp.zeros((m, nbk))], -1)
        mag = jnp.full((m, nbk), 1e6, jnp.float32)
        kw = dict(k=k, block_n=block_n)
        fkw = dict(kw, out_dtype=jnp.bfloat16)
        cases = (
            (
                "abft_check",
                lambda impl, kw=kw: jax.jit(lambda a, b, d: ops.abft_check(a, b, d, impl=impl, **kw)),
                4,
            ),
            (
                "abft_finish f32->bf16 gated",
                lambda impl, kw=fkw: jax.jit(lambda a, b, d: ops.abft_finish(a, b, d, impl=impl, **kw)),
                6,
            ),
        )
        for name, make, bytes_per in cases:
            nat, ref = make("native"), make("reference")
            _check(f"{name} flags", nat(y, c, mag)[1], ref(y, c, mag)[1])
            t_n, t_r = time_fn(nat, y, c, mag), time_fn(ref, y, c, mag)
            ab = y.size * bytes_per
            op = f"{name} {m}x{n} block_n={block_n}"
            rows.append(_row(op, ab >> 20, ab, t_n, "XLA reference", t_r, copy_gbs))
    return rows
