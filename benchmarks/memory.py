"""PimStore on one device: scrub bandwidth, encode-on-write cost, repair latency, background scrub,
and the "pim" backend's banked GEMV against the plain GEMV (with the HBM-PIM timing model).

Parameters are the weights of Llama-3-8B decoder layers (bf16, dim 4096, FFN 14336, 8 KV heads),
protected with the default H200 geometry (4 KiB stripes, parity groups of 8). Peers, measured in the
same run: the device copy (read + write every byte) and a read-only XLA reduction over the same bytes;
the H200 datasheet's 4.8 TB/s is printed beside them. Copy, read, encode, scrub and update are timed
as device time (`_harness.device_time` / `carried_time`: calls in one jitted loop), as a training
step pays them; `call_ms` adds one call from Python, dispatch included; the `dev_*` columns are the
kernels' own time in one call (a profiler trace), without the loop's per-trip overhead.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pimlayers import faults, ops
from pimlayers._native import has_native
from pimlayers.memory import BankGeometry, PimStore, PimTiming

from ._harness import carried_time, device_time, fold_firsts, time_fn
from .profile import kernel_events

DATASHEET_TBS = 4.8  # NVIDIA H200: 4.8 TB/s HBM3e
DIM, FFN, KV = 4096, 14336, 1024


def _layer(key, dims, dtype=jnp.bfloat16):
    d, f, kv = dims
    shapes = {
        "q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d),
        "gate": (d, f), "up": (d, f), "down": (f, d), "norm1": (d,), "norm2": (d,),
    }  # fmt: skip
    keys = jax.random.split(key, len(shapes))
    return {
        n: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype)
        for (n, s), k in zip(shapes.items(), keys, strict=True)
    }


def _params(layers: int, dims):
    return {f"layer{i}": _layer(jax.random.key(i), dims) for i in range(layers)}


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _once(fn, prepare, repeats: int = 5) -> float:
    """Median seconds of single calls of fn(*prepare()) (prepare runs outside the timed region)."""
    samples = []
    for _ in range(repeats):
        args = prepare()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _dev(nbytes: int, fn, *args, read_s: float | None = None, main: bool = False) -> dict:
    """Columns from the device kernels of one call of ``fn(*args)`` (a profiler trace; none on a
    CPU): ms, GB/s, against the datasheet (and an XLA read of as many bytes, where given), and the
    kernels by time. ``main``: one kernel moves all the bytes (the encode's, the scrub's), so its own
    rate (``dev_main_gbs``) is told apart from the small XLA kernels around it (``dev_rest_us``:
    the scrub's per-bank table, say)."""
    us, count = kernel_events(fn, *args)
    if not us:
        nan = float("nan")
        return dict(dev_ms=nan, dev_gbs=nan, dev_vs_datasheet=nan)
    seconds = sum(us.values()) / 1e6
    gbs = nbytes / seconds / 1e9
    out = dict(dev_ms=seconds * 1e3, dev_gbs=gbs, dev_vs_datasheet=gbs / (DATASHEET_TBS * 1e3))
    if read_s is not None:
        out["dev_vs_read"] = read_s / seconds
    top = us.most_common()
    out["dev_kernels"] = [[name, round(t, 2), count[name]] for name, t in top[:8]]
    if main:
        out["dev_main_gbs"] = nbytes / (top[0][1] / 1e6) / 1e9
        out["dev_rest_us"] = sum(t for _, t in top[1:])
    return out


def run_store(layers: int = 4, dims=(DIM, FFN, KV), m: int = 4096) -> list[dict]:
    rows: list[dict] = []
    params = _params(layers, dims)
    nbytes = _nbytes(params)
    gb = nbytes / 1e9
    flat = [x.reshape(-1) for x in jax.tree.leaves(params)]

    # Device time (n calls in one jitted loop): what a training step that calls these pays. A call
    # from Python over this 36-leaf pytree also pays its dispatch (`call_ms`, dispatch included).
    copy = jax.tree.map(lambda p: jax.lax.bitcast_convert_type(p, jnp.uint16), flat)
    t_copy = carried_time(lambda c: [x ^ np.uint16(1) for x in c], copy)
    copy_gbs = 2 * nbytes / t_copy / 1e9

    def read(ps):
        return sum(jnp.sum(jax.lax.bitcast_convert_type(p, jnp.uint16), dtype=jnp.uint32) for p in ps)

    t_read = device_time(read, flat, fold=lambda s: s)
    read_gbs = nbytes / t_read / 1e9
    rows.append(dict(op="device copy (XLA, read+write)", gbytes=gb, ms=t_copy * 1e3, gbs=copy_gbs))
    read_dev = _dev(nbytes, jax.jit(read), flat)
    d_read = read_dev["dev_ms"] / 1e3
    rows.append(
        dict(
            op="one read of the parameters (XLA sum)",
            gbytes=gb,
            ms=t_read * 1e3,
            gbs=read_gbs,
            **read_dev,
        )
    )

    store = PimStore(params, BankGeometry())
    state = store.encode(params)
    over = store.overhead()
    # Encode reads the parameters and writes the parity blocks.
    encoded = nbytes + over["parity_bytes"]
    t_enc = device_time(store._encode, params)
    rows.append(
        dict(
            op="encode (checksums, parity, parity checksums)",
            gbytes=gb,
            ms=t_enc * 1e3,
            gbs=encoded / t_enc / 1e9,
            vs_one_read=t_enc / t_read,
            parity_fraction=over["parity_fraction"],
            call_ms=time_fn(store._encode, params, iters=10) * 1e3,
            **_dev(encoded, store._encode, params, main=True),
        )
    )

    # The same, one bank_guard per leaf (what encode ran before bank_guard_many).
    geo = store.geometry

    def per_leaf(ps):
        return [
            ops.bank_guard(x, bank_bytes=geo.stripe_bytes, group=geo.group, parity_sums=True)
            for x in jax.tree.leaves(ps)
        ]

    t_enc1 = device_time(per_leaf, params)
    rows.append(
        dict(op="encode, one bank_guard per leaf", gbytes=gb, ms=t_enc1 * 1e3, gbs=encoded / t_enc1 / 1e9,
             vs_one_read=t_enc1 / t_read)
    )  # fmt: skip

    # Scrub reads the parameters and the parity blocks.
    scrubbed = nbytes + over["parity_bytes"]
    t_scrub = device_time(store._scrub, params, state)
    sc_gbs = scrubbed / t_scrub / 1e9
    rows.append(
        dict(
            op="scrub (verify every stripe + parity)",
            gbytes=scrubbed / 1e9,
            ms=t_scrub * 1e3,
            gbs=sc_gbs,
            vs_copy=sc_gbs / copy_gbs,
            vs_read=sc_gbs / read_gbs,
            vs_datasheet=sc_gbs / (DATASHEET_TBS * 1e3),
            call_ms=time_fn(store._scrub, params, state, iters=10) * 1e3,
            **_dev(scrubbed, store._scrub, params, state, read_s=d_read * scrubbed / nbytes, main=True),
        )
    )
    # The same store over float32 parameters: what a training step's scrub reads (its master
    # weights), twice the bytes.
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    store32 = PimStore(p32, BankGeometry())
    state32 = store32.encode(p32)
    scrubbed32 = _nbytes(p32) + store32.overhead()["parity_bytes"]
    t32 = device_time(store32._scrub, p32, state32)
    rows.append(
        dict(
            op="scrub, float32 parameters",
            gbytes=scrubbed32 / 1e9,
            ms=t32 * 1e3,
            gbs=scrubbed32 / t32 / 1e9,
            vs_datasheet=scrubbed32 / t32 / 1e9 / (DATASHEET_TBS * 1e3),
            **_dev(scrubbed32, store32._scrub, p32, state32, main=True),
        )
    )
    del p32, store32, state32

    # The scrub's check one op per leaf (what scrub ran before bank_verify_many): checksums of each
    # leaf and of its parity, compared, and the faulty count summed.
    def per_leaf_check(ps, st):
        bad = []
        for x, gd in zip(jax.tree.leaves(ps), st.guards, strict=True):
            now = ops.bank_checksums(x, bank_bytes=geo.stripe_bytes)
            bad.append(jnp.any(now != gd.sums[0], axis=-1))
            bad.append(
                jnp.any(ops.bank_checksums(gd.parity[0], bank_bytes=geo.stripe_bytes) != gd.psums[0], -1)
            )
        return sum(jnp.sum(b, dtype=jnp.int32) for b in bad)

    t_chk1 = device_time(per_leaf_check, params, state)
    rows.append(
        dict(op="scrub's check, one op per leaf", gbytes=scrubbed / 1e9, ms=t_chk1 * 1e3,
             gbs=scrubbed / t_chk1 / 1e9, vs_datasheet=scrubbed / t_chk1 / 1e9 / (DATASHEET_TBS * 1e3))
    )  # fmt: skip

    # Encode on write inside the update: new = p + u, then encode, against the plain update; both as
    # a loop of updates whose parameters are carried, as in training. The protection data is either
    # a fresh output of every step (as a jitted training step writes it) or carried in the loop too,
    # where XLA copies the encode's parity into the loop's buffers (a cost of the loop, not of encode).
    upd = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

    def add(p):
        return jax.tree.map(lambda a, b: (a + b).astype(a.dtype), p, upd)

    def fresh(c):
        new, st = store.apply_updates(c[0], upd)
        return new, c[1] ^ fold_firsts(st)

    def carried(c):
        return store.apply_updates(c[0], upd)

    t_plain = carried_time(add, params)
    for op, t in (
        ("update + encode vs update", carried_time(fresh, (params, jnp.uint32(0)))),
        ("update + encode vs update (state carried)", carried_time(carried, (params, state))),
    ):
        rows.append(
            dict(
                op=op,
                gbytes=gb,
                ms=t * 1e3,
                peer_ms=t_plain * 1e3,
                extra_ms=(t - t_plain) * 1e3,
                extra_reads=(t - t_plain) / t_read,
            )
        )

    # Repair: the clean fast path, then one failed physical bank (every stripe it holds).
    holder = {"p": params, "s": state}

    def clean_prepare():
        return holder["p"], holder["s"]

    def call(p, s):
        out = store.repair(p, s)
        holder["p"], holder["s"] = out.params, out.state
        return out.report

    t_clean = _once(call, clean_prepare)
    rows.append(dict(op="repair, nothing faulty (scrub + skip)", gbytes=gb, ms=t_clean * 1e3))
    reports = []

    def bank_prepare():
        used = np.unique(store.address_map.stripe_bank(0))  # a bank that holds data
        faults.fail_bank(
            store, holder["p"], holder["s"], int(np.random.default_rng(len(reports)).choice(used))
        )
        return holder["p"], holder["s"]

    def bank_call(p, s):
        r = call(p, s)
        reports.append(r)
        return r

    ptr = jax.tree.leaves(holder["p"])[0].unsafe_buffer_pointer()
    t_bank = _once(bank_call, bank_prepare)
    rep = reports[-1]
    assert int(rep.banks_uncorrectable) == 0 and int(rep.banks_repaired) > 0
    in_place = jax.tree.leaves(holder["p"])[0].unsafe_buffer_pointer() == ptr
    clean = store.scrub(holder["p"], holder["s"])
    assert int(clean.report.banks_faulty) == 0
    compiled = store.compiled(holder["p"], holder["s"])
    rows.append(
        dict(
            op="repair one failed bank",
            gbytes=gb,
            ms=t_bank * 1e3,
            stripes_rebuilt=int(rep.banks_repaired),
            in_place=in_place,
            temp_mb=compiled["repair"].memory_analysis().temp_size_in_bytes / 1e6,
            scrub_temp_mb=compiled["scrub"].memory_analysis().temp_size_in_bytes / 1e6,
        )
    )

    # Background scrub: a training-like step (fwd+bwd through the MLP weights of every layer, M = 4096)
    # alone, then with a scrub dispatched after every step and after every 10th.
    params = holder["p"]
    state = holder["s"]
    x = jax.random.normal(jax.random.key(9), (m, dims[0]), jnp.bfloat16)

    def loss(ps, x):
        h = x
        for i in range(layers):
            lp = ps[f"layer{i}"]
            a = jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])
            h = h + a @ lp["down"]
        return jnp.mean(h.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss))
    t_step = time_fn(step, params, x, iters=10)

    def step_and_scrub(every):
        def f(ps, x, st):
            out = None
            for i in range(10):
                out = step(ps, x)
                if i % every == 0:
                    store._scrub(ps, st)  # dispatched asynchronously, nothing waits on it
            return out

        return f

    for every in (1, 10):
        t = time_fn(step_and_scrub(every), params, x, state, warmup=1, iters=2) / 10
        rows.append(
            dict(
                op=f"train step + scrub every {every}",
                gbytes=gb,
                ms=t * 1e3,
                peer_ms=t_step * 1e3,
                overhead=t / t_step - 1,
            )
        )
    return rows


def run_pim(banks: int = 128, dims=(DIM, FFN, KV), stream_mb: int = 512) -> list[dict]:
    """The banked GEMV (native kernel, checksum bank included) against XLA's plain GEMV, bf16, and
    the Aquabolt-XL model's estimate for six cubes (one per H200 stack).

    A single GEMV lasts microseconds, less than a dispatch from Python, and a small weight would stay
    in L2. So each timed program runs C GEMVs over C distinct weight copies (C x weight >= stream_mb,
    C <= 64), the way decoding walks through layers, and the time is per GEMV.
    """
    rows: list[dict] = []
    model = PimTiming(cubes=6)
    d, f, kv = dims
    for k, n in ((d, f), (f, d), (d, d), (d, kv)):
        wbytes = k * n * 2
        copies = int(min(64, max(1, -(-stream_mb * 2**20 // wbytes))))
        keys = jax.random.split(jax.random.key(k + n), copies)
        ws = [(0.02 * jax.random.normal(kk, (k, n), jnp.float32)).astype(jnp.bfloat16) for kk in keys]
        packs = [ops.pim_pack(w, banks) for w in ws]
        plain = jax.jit(lambda x, ws: [jnp.matmul(x, w, preferred_element_type=jnp.float32) for w in ws])
        pim = jax.jit(lambda x, ps: [ops.pim_linear(x, p, impl="native")[0] for p in ps])
        for t in (1, 8):
            x = jax.random.normal(jax.random.key(t), (t, k), jnp.float32).astype(jnp.bfloat16)
            ref = np.asarray(
                jnp.matmul(x.astype(jnp.float32), ws[0].astype(jnp.float32), precision="highest")
            )
            scale = float(np.abs(ref).max())
            got = np.asarray(pim(x, packs[:1])[0].astype(jnp.float32))
            ok = jnp.ones((banks,), jnp.int32).at[3].set(0)
            one_failed = jax.jit(lambda x, p, o: ops.pim_linear(x, p, o, impl="native")[0])
            got1 = np.asarray(one_failed(x, packs[0], ok).astype(jnp.float32))
            if not (np.allclose(got, ref, atol=1e-2 * scale) and np.allclose(got1, ref, atol=1e-2 * scale)):
                raise AssertionError(f"pim_linear {k}->{n}: wrong result, not timing it")
            t_plain = time_fn(plain, x, ws, iters=5) / copies
            t_pim = time_fn(pim, x, packs, iters=5) / copies
            est = model.gemv_seconds(k, n, tokens=t)
            rows.append(
                dict(
                    op=f"gemv {k}->{n}",
                    tokens=t,
                    plain_ms=t_plain * 1e3,
                    pim_kernel_ms=t_pim * 1e3,
                    ratio=t_plain / t_pim,
                    plain_gbs=wbytes / t_plain / 1e9,
                    pim_kernel_gbs=wbytes * (1 + 2 / banks) / t_pim / 1e9,
                    aquabolt_x6_est_ms=est["total"] * 1e3,
                    est_vs_gpu=t_plain / est["total"],
                )
            )
    return rows


def run_shard(layers: int | None = None, dims=None) -> list[dict]:
    """Every device of the default backend as one mesh axis; parameters sharded over it (FSDP style):
    a sharded scrub, and one device's whole shard rebuilt from the others. GPUs get four Llama-3-8B
    layers; simulated CPU devices two layers of a quarter of the width."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) < 2:
        return []
    gpu = devices[0].platform != "cpu"
    layers = layers or (4 if gpu else 2)
    dims = dims or ((DIM, FFN, KV) if gpu else (1024, 3584, 256))
    mesh = jax.make_mesh((len(devices),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp"))), _params(layers, dims))
    gb = _nbytes(params) / 1e9
    store = PimStore(params, BankGeometry())
    holder = {"p": params, "s": store.encode(params)}
    t_scrub = time_fn(store._scrub, holder["p"], holder["s"], iters=5)
    rows = [dict(op=f"sharded scrub ({len(devices)} devices)", gbytes=gb, ms=t_scrub * 1e3, gbs=gb / t_scrub)]

    def rebuild(p, s, lost):
        out = store.rebuild_shard(p, s, lost)
        holder["p"], holder["s"] = out[0], out[1]
        return out[2]

    def snapshot():  # every device's bytes of every leaf (parameters and protection data), copied
        leaves = jax.tree.leaves(holder["p"]) + jax.tree.leaves(holder["s"])
        return [{sh.device: np.asarray(sh.data).copy() for sh in x.addressable_shards} for x in leaves]

    def same(a, b, dev):
        return all(
            np.array_equal(x[dev].view(np.uint8), y[dev].view(np.uint8)) for x, y in zip(a, b, strict=True)
        )

    clean = snapshot()
    axis = list(store.devices)  # device i along the parity axis
    checks = {"others_untouched": True, "lost_destroyed": True, "bit_exact": True}

    def lose():
        lost = int(np.random.default_rng(len(checks) + lose.calls).integers(len(devices)))
        lose.calls += 1
        checks["bit_exact"] &= all(same(snapshot(), clean, d) for d in axis)  # the last rebuild's work
        faults.lose_shard(store, holder["p"], holder["s"], lost, seed=lost)
        hit = snapshot()
        checks["others_untouched"] &= all(same(hit, clean, d) for i, d in enumerate(axis) if i != lost)
        checks["lost_destroyed"] &= not same(hit, clean, axis[lost])
        return holder["p"], holder["s"], lost

    lose.calls = 0
    rebuild(*lose())  # compile
    t_shard = _once(rebuild, lose)
    checks["bit_exact"] &= all(same(snapshot(), clean, d) for d in axis)
    compiles = store._rebuild._cache_size()
    rows.append(
        dict(
            op=f"rebuild one device's whole shard ({len(devices)} devices)",
            gbytes=gb / len(devices),
            ms=t_shard * 1e3,
            overhead_x=store.overhead()["cross_device_parity_bytes"] / store.overhead()["protected_bytes"],
            losses=lose.calls,
            compiles=compiles,
            **checks,
        )
    )
    if not all(checks.values()) or compiles != 1:
        raise AssertionError(f"shard loss: {checks}, {compiles} compiled rebuild programs")
    assert int(store.scrub(holder["p"], holder["s"]).report.banks_faulty) == 0
    return rows


def run_update(layers: int = 4, dims=(DIM, FFN, KV)) -> list[dict]:
    """AdamW's step over float32 weights, then the encode of the result, against AdamW's step alone
    (the unprotected step's update) and the step fused with the encode (`optim.adamw_guarded`'s
    ``update_and_guard``: on CUDA one kernel). Gradients in bfloat16, as a step multiplying by the
    scrub's bf16 copies has them; the unfused steps widen them first, as the training step does.
    Each is a loop of steps carrying (and donating) the parameters and the optimizer's state, as
    training does. The fused step is checked against the unfused one before timing: parameters
    and moments within 16 float32 epsilons of the magnitudes each sums (XLA's arithmetic is not
    rounded per operation as the kernel's is: tests/test_gpu_adam_guard.py), counters equal, and
    its protection data equal to an encode of its own result."""
    import optax

    from pimlayers.ops._adam_guard import _misfit
    from pimlayers.optim import adamw_guarded

    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)

    params = jax.tree.map(lambda x: x.astype(jnp.float32), _params(layers, dims))
    grads = jax.tree.map(lambda p: (1e-3 * jnp.sin(p * 1e3)).astype(jnp.bfloat16), params)
    n = sum(x.size for x in jax.tree.leaves(params))
    opt = adamw_guarded(optax.constant_schedule(1e-4), weight_decay=0.1, clip=1.0)
    store = PimStore(params, BankGeometry())
    state = opt.init(params)
    wide = lambda g: jax.tree.map(lambda x: x.astype(jnp.float32), g)

    # The gradients ride in the loop's carry: a closed-over array would be a constant of the
    # program, which XLA then folds (its finiteness check over 1.75 GB ran for minutes).
    def plain(c):
        u, st = opt.update(wide(c[-1]), c[1], c[0])
        return optax.apply_updates(c[0], u), st, c[-1]

    def unfused(c):
        new, st, g = plain((c[0], c[1], c[3]))
        return new, st, c[2] ^ fold_firsts(store.encode(new)), g

    def fused(c):
        new, st, pim = opt.update_and_guard(c[3], c[1], c[0], store)
        return new, st, c[2] ^ fold_firsts(pim), c[3]

    # Checked before timing: one step each from the same start.
    first = jax.jit(lambda p, s, g: opt.update_and_guard(g, s, p, store))
    a = jax.jit(plain)((params, state, grads))[:2]
    b = first(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), grads)
    adam = lambda st: next(s for s in jax.tree.leaves(st, is_leaf=is_adam) if is_adam(s))
    h = opt.hyper(grads, state)[0]
    leaves = [jax.tree.leaves(t) for t in (params, grads, adam(state).mu, adam(state).nu)]
    misfit = jax.jit(_misfit)
    unfused_out = [jax.tree.leaves(t) for t in (a[0], adam(a[1]).mu, adam(a[1]).nu)]
    fused_out = [jax.tree.leaves(t) for t in (b[0], adam(b[1]).mu, adam(b[1]).nu)]
    for i in range(len(leaves[0])):
        got = misfit(*([t[i] for t in out] for out in (fused_out, unfused_out)), *(t[i] for t in leaves), h)
        if np.any(np.asarray(got)):
            raise AssertionError(f"the fused AdamW step differs from optax's in leaf {i} (p, m, v: {got})")
    for x, y in ((a[1].total_steps, b[1].total_steps), (adam(a[1]).count, adam(b[1]).count)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(b[2]), jax.tree.leaves(store.encode(b[0])), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    del a, b

    # Bytes: p, m, v read and written, g (bf16) read; the encode reads p again and writes parity.
    moved = n * (12 + 12 + 2)
    parity = store.overhead()["parity_bytes"]
    t_plain = carried_time(plain, (params, state, grads))
    rows = [dict(op="AdamW step (optax)", params=n, gbytes=moved / 1e9, ms=t_plain * 1e3,
                 gbs=moved / t_plain / 1e9)]  # fmt: skip
    native = "kernel" if jax.default_backend() == "gpu" and has_native("cuda") else "reference"
    for op, fn, nbytes in (
        ("AdamW step, then encode", unfused, moved + 4 * n + parity),
        (f"AdamW step fused with the encode ({native})", fused, moved + parity),
    ):
        t = carried_time(fn, (params, state, jnp.uint32(0), grads))
        rows.append(dict(op=op, params=n, gbytes=nbytes / 1e9, ms=t * 1e3, gbs=nbytes / t / 1e9,
                         peer_ms=t_plain * 1e3, extra_ms=(t - t_plain) * 1e3))  # fmt: skip
    return rows


def run(quick: bool = False) -> list[dict]:
    if quick:  # a smoke run at toy sizes (CI checks that the suite runs; figures come from the GPU)
        small = (256, 512, 64)
        return run_store(layers=1, dims=small, m=64) + run_pim(banks=8, dims=small, stream_mb=1)
    return run_store() + run_pim()
