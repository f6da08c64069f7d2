"""PimStore: geometry, scrub, repair (bit-exact), double faults reported, shard rebuild over 8 CPU
devices, zero-copy (pointers, donation, temporary bytes), no recompilation, fault injection in place."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_GEOMETRY
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pimlayers import faults, ops
from pimlayers.memory import AddressMap, BankGeometry, PimStore, adopt, aligned_empty

GEO = SMALL_GEOMETRY


def _params(rng, scale: int = 1):
    return {
        "emb": jnp.asarray(rng.standard_normal((96 * scale, 40)), jnp.bfloat16),
        "w": jnp.asarray(rng.standard_normal((64, 33 * scale)), jnp.float32),
        "h": jnp.asarray(rng.standard_normal((257,)), jnp.float16),
        "q": jnp.asarray(rng.integers(-128, 128, (3, 1000 * scale)), jnp.int8),
        "step": jnp.asarray(rng.integers(0, 2**31, (5,)), jnp.int32),
        "u": jnp.asarray(rng.integers(0, 256, (129,)), jnp.uint8),
    }


def _host(tree):
    # .copy(): np.asarray of a CPU jax.Array can be a view of its device buffer, which a fault
    # injected later would change too.
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def _same(tree, host) -> bool:
    return all(
        np.array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8))
        for a, b in zip(jax.tree.leaves(tree), host, strict=True)
    )


# --- geometry and address map ---


def test_default_geometry_models_an_h200_and_aquabolt():
    g = BankGeometry()
    assert g.nbanks == 6 * 32 * 4 * 4
    assert g.capacity_bytes >= 141 * 10**9  # holds the H200's 141 GB
    a = BankGeometry.aquabolt_xl()
    assert a.nbanks == 256 and a.capacity_bytes == 6 * 2**30
    for b in (0, 1, 7, 255):
        addr = a.bank_address(b)
        flat = addr.stack + a.stacks * (
            addr.pseudo_channel + a.pseudo_channels * (addr.bank_group + a.bank_groups * addr.bank)
        )
        assert flat == b == addr.flat


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stripe_bytes": 100}, "multiple of 16"),
        ({"group": 1}, "group=1"),
        (
            {"stacks": 1, "pseudo_channels": 1, "bank_groups": 1, "banks_per_group": 6, "group": 4},
            "multiple of the group",
        ),
        (
            {"stacks": 1, "pseudo_channels": 1, "bank_groups": 1, "banks_per_group": 4, "group": 4},
            "larger than it",
        ),
        ({"stacks": 0}, "stacks=0"),
        ({"bank_bytes": 16, "stripe_bytes": 32}, "smaller than"),
    ],
)
def test_bad_geometry_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BankGeometry(**kwargs)
    with pytest.raises(TypeError, match="must be an int"):
        BankGeometry(stacks=2.0)


def test_address_map_interleaves_and_keeps_groups_apart():
    sizes = [1, 255, 256, 257, 4096 * 3 + 5, 70_000, 12]
    amap = AddressMap(GEO, [f"l{i}" for i in range(len(sizes))], sizes)
    for i, lf in enumerate(amap.leaves):
        assert lf.first_stripe % GEO.group == 0  # every leaf starts a fresh group
        banks = amap.stripe_bank(i)
        padded = np.full(lf.ngroups * GEO.group, -1)
        padded[: banks.size] = banks
        for g, members in enumerate(padded.reshape(lf.ngroups, GEO.group)):
            used = [b for b in members if b >= 0] + [int(amap.parity_bank(i)[g])]
            assert len(set(used)) == len(used), (i, g, used)
    # One physical bank holds stripes of many tensors, and consecutive stripes go to different banks.
    assert (amap.leaves_per_bank() >= 2).mean() > 0.5
    big = amap.stripe_bank(5)
    assert (big[1:] != big[:-1]).all()
    counts = np.bincount(big, minlength=GEO.nbanks)
    assert counts.max() - counts.min() <= 2  # spread evenly (partial rows at both ends)
    with pytest.raises(ValueError, match="do not fit"):
        AddressMap(GEO, ["x"], [GEO.capacity_bytes])


@pytest.mark.parametrize("geo", [GEO, BankGeometry.aquabolt_xl()], ids=["small", "aquabolt"])
def test_bank_table_counts_each_faulty_stripe_and_parity_block_in_its_bank(geo):
    """The scrub's branch-free table against the address map's own per-stripe bank tables."""
    from pimlayers.memory._local import BankLayout, bank_table

    sizes = [1, 255, 4096 * 3 + 5, 70_000, 12, 4096 * 40]
    amap = AddressMap(geo, [f"l{i}" for i in range(len(sizes))], [s * geo.stripe_bytes // 64 for s in sizes])
    layout = BankLayout.of(amap)
    rng = np.random.default_rng(0)
    table = jax.jit(lambda b, p: bank_table(b, p, layout))
    for density in (0.0, 0.01, 0.5, 1.0):
        bads = [rng.random(lf.nstripes) < density for lf in amap.leaves]
        pars = [rng.random(lf.ngroups) < density for lf in amap.leaves]
        want = np.zeros(geo.nbanks, np.int64)
        for i, (b, p) in enumerate(zip(bads, pars, strict=True)):
            np.add.at(want, amap.stripe_bank(i), b)
            np.add.at(want, amap.parity_bank(i), p)
        got = np.asarray(table([jnp.asarray(b) for b in bads], [jnp.asarray(p) for p in pars]))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want, err_msg=f"density {density}")
        assert got.sum() == sum(b.sum() for b in bads) + sum(p.sum() for p in pars)
    with pytest.raises(ValueError, match="masks of"):
        bank_table([jnp.asarray(b) for b in bads[:-1]], [jnp.asarray(p) for p in pars[:-1]], layout)


# --- construction errors ---


def test_unprotectable_pytrees_give_clear_errors(cpu_mesh):
    with pytest.raises(ValueError, match=r"leaf \['a'\] is a int"):
        PimStore({"a": 3}, GEO)
    with pytest.raises(ValueError, match="bool"):
        PimStore({"m": jnp.zeros(4, bool)}, GEO)
    with pytest.raises(ValueError, match="no leaves"):
        PimStore({}, GEO)
    with pytest.raises(ValueError, match="complex64"):
        PimStore({"c": jnp.zeros(4, jnp.complex64)}, GEO)
    x = jax.ShapeDtypeStruct((12, 4), jnp.float32, sharding=NamedSharding(cpu_mesh, P(None, "d")))
    with pytest.raises(ValueError, match="does not split evenly"):
        PimStore({"x": x}, GEO)
    with pytest.raises(TypeError, match="BankGeometry"):
        PimStore({"x": jnp.zeros(3)}, geometry=(1, 2))
    store = PimStore({"x": jnp.zeros(30)}, GEO)
    state = store.encode({"x": jnp.zeros(30)})
    with pytest.raises(ValueError, match=r"float32\[31\]"):
        store.scrub({"x": jnp.zeros(31)}, state)
    with pytest.raises(ValueError, match="structure"):
        store.scrub({"y": jnp.zeros(30)}, state)
    with pytest.raises(ValueError, match="needs >= 2 devices"):
        store.rebuild_shard({"x": jnp.zeros(30)}, state, 0)


def test_encode_matches_the_ops_and_overhead_is_one_over_g():
    rng = np.random.default_rng(0)
    params = {
        "a": jnp.asarray(rng.standard_normal((16, 64)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16),
    }
    store = PimStore(params, GEO)
    state = store.encode(params)
    for i, x in enumerate(jax.tree.leaves(params)):
        np.testing.assert_array_equal(
            state.guards[i].sums[0], ops.bank_checksums_reference(x, GEO.stripe_bytes)
        )
        np.testing.assert_array_equal(
            state.guards[i].parity[0], ops.parity_reference(x, GEO.stripe_bytes, GEO.group)
        )
    o = store.overhead()
    assert o["protected_bytes"] == 16 * 64 * 4 + 8 * 64 * 2
    assert o["parity_fraction"] == pytest.approx(1 / GEO.group)  # both leaves fill whole groups
    assert o["checksum_bytes"] == 8 * (o["protected_bytes"] // 256 + o["parity_bytes"] // 256)
    res = store.scrub(params, state)
    assert int(res.report.banks_faulty) == 0 and int(res.report.banks_checked) == 20 + 5
    assert not store.faulty_banks(res)


# --- single-bit flips, bursts, whole banks ---


def test_ten_thousand_bit_flips_detected_and_repaired_bit_exact():
    """>= 10^4 seeded single-bit flips over six dtypes: each round flips up to one bit per parity
    group (so each is correctable on its own), scrub must find exactly the flipped stripes and repair
    must restore every byte."""
    rng = np.random.default_rng(1)
    params = _params(rng, scale=2)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    ngroups = sum(lf.ngroups for lf in store.address_map.leaves)
    total = rounds = 0
    while total < 10_000:
        flips = faults.random_bit_flips(store, params, ngroups // 2, seed=1000 + rounds)
        want = {(f.leaf, f.byte // GEO.stripe_bytes) for f in flips}
        found = store.scrub(params, state)
        got = {
            (i, int(s)) for i, m in enumerate(found.stripe_faults) for s in np.flatnonzero(np.asarray(m)[0])
        }
        assert got == want
        out = store.repair(params, state)
        params, state = out.params, out.state
        r = out.report
        assert (int(r.banks_faulty), int(r.banks_repaired), int(r.banks_uncorrectable)) == (
            len(want),
            len(want),
            0,
        )
        assert _same(params, clean)
        total += len(flips)
        rounds += 1
    assert total >= 10_000
    assert int(store.scrub(params, state).report.banks_faulty) == 0


def test_bursts_within_a_stripe_are_repaired():
    rng = np.random.default_rng(2)
    params = _params(rng)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    leaves = jax.tree.leaves(params)
    for trial in range(20):
        i = int(rng.integers(len(leaves)))
        n = store.address_map.leaves[i].nbytes
        s = int(rng.integers(-(-n // GEO.stripe_bytes)))
        lo = s * GEO.stripe_bytes
        hi = min(lo + GEO.stripe_bytes, n)
        start = int(rng.integers(lo, hi))
        length = int(rng.integers(1, hi - start + 1))
        data = np.asarray(leaves[i]).reshape(-1).view(np.uint8)[start : start + length] ^ rng.integers(
            1, 256, length, dtype=np.uint8
        )
        faults.overwrite(leaves[i], start, data)
        out = store.repair(params, state)
        params, state, leaves = out.params, out.state, jax.tree.leaves(out.params)
        assert int(out.report.banks_repaired) == 1 and int(out.report.banks_uncorrectable) == 0, trial
        assert _same(params, clean)


def test_bursts_across_several_stripes_of_one_bank_are_repaired():
    """A burst in one physical bank that runs over the end of one stripe into the next ones the bank
    holds (2-4 stripes, possibly of different leaves): the stripes of one bank sit in different
    parity groups, so each group has one faulty member and every stripe is rebuilt bit-exactly."""
    rng = np.random.default_rng(12)
    params = _params(rng)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    amap = store.address_map
    sb = GEO.stripe_bytes
    holds = {
        b: [(i, int(s)) for i, kind, idx in amap.bank_contents(b) if kind == "data" for s in idx]
        for b in range(GEO.nbanks)
    }
    banks = [b for b, held in holds.items() if len(held) >= 4]
    assert len(banks) >= GEO.nbanks // 2
    hit_total = 0
    for trial in range(60):
        bank = int(rng.choice(banks))
        held = holds[bank]
        span = int(rng.integers(2, 5))
        first = int(rng.integers(len(held) - span + 1))
        chosen = held[first : first + span]
        leaves = jax.tree.leaves(params)
        for j, (i, stripe) in enumerate(chosen):
            n = amap.leaves[i].nbytes
            lo, hi = stripe * sb, min(stripe * sb + sb, n)
            # The burst's tail end of the first stripe, whole middle stripes, the head of the last.
            start = int(rng.integers(lo, hi)) if j == 0 else lo
            stop = int(rng.integers(start + 1, hi + 1)) if j == len(chosen) - 1 else hi
            old = np.asarray(leaves[i]).reshape(-1).view(np.uint8)[start:stop]
            faults.overwrite(leaves[i], start, old ^ rng.integers(1, 256, stop - start, dtype=np.uint8))
        found = store.scrub(params, state)
        assert [b.flat for b in store.faulty_banks(found)] == [bank], trial
        out = store.repair(params, state)
        params, state = out.params, out.state
        assert int(out.report.banks_repaired) == len(chosen), trial
        assert int(out.report.banks_uncorrectable) == 0, trial
        assert _same(params, clean), trial
        hit_total += len(chosen)
    assert hit_total >= 150  # 60 bursts over 2-4 stripes each


@pytest.mark.parametrize("bank", [0, 5, 11, 15])
def test_a_whole_failed_bank_is_located_and_rebuilt(bank):
    rng = np.random.default_rng(3)
    params = _params(rng, scale=3)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    hit = faults.fail_bank(store, params, state, bank, seed=bank)
    assert hit >= 10  # the bank holds stripes of several leaves and parity blocks
    found = store.scrub(params, state)
    table = np.asarray(found.bank_faults)
    assert table.shape == (1, GEO.nbanks)
    assert np.flatnonzero(table[0]).tolist() == [bank]  # located: only that bank reads faulty
    assert [b.flat for b in store.faulty_banks(found)] == [bank]
    out = store.repair(params, state)
    assert int(out.report.banks_uncorrectable) == 0 and int(out.report.banks_repaired) == int(table.sum())
    assert _same(out.params, clean)
    again = store.scrub(out.params, out.state)  # parity blocks in the bank were refreshed too
    assert int(again.report.banks_faulty) == 0
    np.testing.assert_array_equal(out.state.guards[0].parity, store.encode(out.params).guards[0].parity)


# --- what parity cannot fix is reported, never "repaired" ---


def test_double_fault_in_one_group_is_reported_not_hidden():
    rng = np.random.default_rng(4)
    params = {"w": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)}  # 16 stripes, 4 groups
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    x = params["w"]
    faults.flip_bits(x, [0, 256 + 3], [1, 6])  # stripes 0 and 1: both in group 0
    faults.flip_bits(x, [3 * 1024 + 7], [2])  # group 3: alone, correctable
    broken = np.asarray(x).copy()
    out = store.repair(params, state)
    r = out.report
    assert (int(r.banks_faulty), int(r.banks_repaired), int(r.banks_uncorrectable)) == (3, 1, 2)
    assert bool(r.any_uncorrectable())
    got = np.asarray(out.params["w"]).reshape(-1).view(np.uint8)
    want = clean[0].reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(got[:512], broken.reshape(-1).view(np.uint8)[:512])  # left as found
    np.testing.assert_array_equal(got[512:], want[512:])  # the rest repaired
    still = store.scrub(out.params, out.state)
    assert np.flatnonzero(np.asarray(still.stripe_faults[0])[0]).tolist() == [0, 1]  # still flagged


def test_a_fault_in_a_stripe_and_its_parity_is_uncorrectable():
    rng = np.random.default_rng(5)
    params = {"w": jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)}
    store = PimStore(params, GEO)
    state = store.encode(params)
    faults.flip_bits(params["w"], [10], [3])
    faults.flip_bits(state.guards[0].parity, [20], [0])
    out = store.repair(params, state)
    assert int(out.report.banks_uncorrectable) == 2 and int(out.report.banks_repaired) == 0


def test_flipped_checksum_entries_and_parity_blocks_are_refreshed_not_used():
    rng = np.random.default_rng(6)
    params = {"w": jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)}
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    faults.flip_bits(state.guards[0].sums, [8 * 2 + 1], [4])  # the checksum entry of stripe 2
    faults.flip_bits(state.guards[0].parity, [256 + 9], [7])  # group 1's parity block
    out = store.repair(params, state)
    assert (int(out.report.banks_faulty), int(out.report.banks_repaired)) == (2, 2)
    assert _same(out.params, clean)
    fresh = store.encode(out.params)
    for a, b in zip(jax.tree.leaves(out.state.guards), jax.tree.leaves(fresh.guards), strict=True):
        np.testing.assert_array_equal(a, b)


# --- compiled once; in place ---


def test_new_fault_patterns_never_recompile():
    rng = np.random.default_rng(7)
    params = _params(rng)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    out = store.repair(params, state)  # compiles scrub+repair once (clean: the fast branch)
    params, state = out.params, out.state
    store.scrub(params, state)
    with jax.no_tracing():
        for seed in range(4):
            faults.random_bit_flips(store, params, 5 + seed, seed=seed)
            assert int(store.scrub(params, state).report.banks_faulty) > 0
            out = store.repair(params, state)
            params, state = out.params, out.state
        faults.fail_bank(store, params, state, 3)
        out = store.repair(params, state)
    assert _same(out.params, clean)
    assert store._repair._cache_size() == 1 and store._scrub._cache_size() == 1


def test_repair_writes_in_place_and_scrub_copies_nothing():
    rng = np.random.default_rng(8)
    params = {"w": jnp.asarray(rng.standard_normal((512, 256)), jnp.float32)}  # 512 KiB
    store = PimStore(params, GEO)
    state = store.encode(params)
    before = params["w"].unsafe_buffer_pointer()
    faults.flip_bits(params["w"], [12345], [5])
    out = store.repair(params, state)
    assert out.params["w"].unsafe_buffer_pointer() == before  # donated and written in place
    assert int(out.report.banks_repaired) == 1
    compiled = store.compiled(out.params, out.state)
    nbytes = 512 * 256 * 4
    parity, sums = store.overhead()["parity_bytes"], store.overhead()["checksum_bytes"]
    # Temporaries stay far below one copy of the parameters: the scrub holds the fresh checksum table
    # and masks; the repair the freshly computed parity (1/G of the bytes) it may refresh from and
    # three checksum tables (stored, before, after).
    assert compiled["scrub"].memory_analysis().temp_size_in_bytes < sums + 4096
    assert compiled["repair"].memory_analysis().temp_size_in_bytes < parity + 3 * sums + 4096
    assert compiled["repair"].memory_analysis().alias_size_in_bytes >= nbytes  # the output is the input
    # The scrub is branch-free (a branch's predicate makes a GPU's host wait for the scrub's
    # kernel); the repair keeps one branch, around the rebuild of what the scrub found.
    assert " conditional(" not in compiled["scrub"].as_text()
    assert compiled["repair"].as_text().count(" conditional(") == 1


@pytest.mark.parametrize("sharded", [False, True])
def test_repair_casts_from_its_read_and_again_after_a_repair(cpu_mesh, sharded):
    """``repair(cast=)``: the compute copies are the repaired parameters cast (a float32 leaf to
    bfloat16 by the scrub's kernel, others by XLA), whether the step repaired something or not;
    one program for both."""
    rng = np.random.default_rng(13)
    params = _sharded(cpu_mesh, rng) if sharded else _params(rng)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    cast = {k: jnp.bfloat16 if k in ("w", "w1", "h") else v.dtype for k, v in params.items()}
    want = [np.asarray(jnp.asarray(x).astype(cast[k])) for k, x in zip(sorted(params), clean, strict=True)]
    flips = 0
    for round_ in range(3):  # clean, then bits flipped in w (a leaf cast by the kernel) and in h
        if round_:
            flips += len(faults.random_bit_flips(store, params, 6, seed=round_))
        out = store.repair(params, state, cast=cast)
        params, state = out.params, out.state
        assert int(out.report.banks_repaired) == int(out.report.banks_faulty) and _same(params, clean)
        for k, c, w in zip(sorted(params), jax.tree.leaves(out.compute), want, strict=True):
            assert c.dtype == cast[k] and np.array_equal(np.asarray(c).view(np.uint8), w.view(np.uint8)), k
        if sharded:
            assert out.compute["w1"].sharding.is_equivalent_to(params["w1"].sharding, 2)
    assert flips > 0 and len(store._repair_cast) == 1
    with pytest.raises(ValueError, match=r"cast has structure .*; expected one dtype per parameter"):
        store.repair(params, state, cast={"q": jnp.bfloat16})
    with pytest.raises(TypeError, match=r"cast for .*q.* is 'bogus'; expected a dtype"):
        store.repair(params, state, cast={**cast, "q": "bogus"})


def test_adopt_wraps_numpy_buffers_without_a_copy():
    a = aligned_empty((300, 7), np.float32)
    a[...] = np.arange(2100, dtype=np.float32).reshape(300, 7)
    tree, copied = adopt({"a": a})
    assert copied == [] and tree["a"].unsafe_buffer_pointer() == a.ctypes.data
    a[0, 0] = 42.0  # one memory: a write through numpy is seen by JAX
    assert float(tree["a"][0, 0]) == 42.0
    raw = np.empty(4096 + 16, np.uint8)
    off = 16 if raw.ctypes.data % 64 == 0 else (16 - raw.ctypes.data % 64) % 64 or 16
    bad = raw[off : off + 4096].view(np.float32)
    assert bad.ctypes.data % 64 != 0
    with pytest.raises(ValueError, match="would be copied"):
        adopt({"b": bad})
    _, copied = adopt({"b": bad}, require_zero_copy=False)
    assert copied == ["['b']"]


def test_apply_updates_encodes_on_write():
    rng = np.random.default_rng(9)
    params = {"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)}
    store = PimStore(params, GEO)
    upd = {"w": jnp.full((64, 32), 0.5, jnp.float32)}
    new, state = jax.jit(store.apply_updates)(params, upd)
    np.testing.assert_array_equal(new["w"], params["w"] + 0.5)
    assert int(store.scrub(new, state).report.banks_faulty) == 0


# --- 8 simulated devices: sharded scrub, repair, and the loss of a whole shard ---


def _sharded(cpu_mesh, rng):
    put = lambda x, spec: jax.device_put(x, NamedSharding(cpu_mesh, spec))
    return {
        "emb": put(jnp.asarray(rng.standard_normal((128, 48)), jnp.bfloat16), P("d")),
        "w1": put(jnp.asarray(rng.standard_normal((64, 80)), jnp.float32), P(None, "d")),
        "norm": put(jnp.asarray(rng.standard_normal((40,)), jnp.float32), P()),
        "q": put(jnp.asarray(rng.integers(-128, 128, (8, 1000)), jnp.int8), P("d")),
    }


def test_lose_any_one_of_eight_shards_and_rebuild_it_bit_exact(cpu_mesh):
    rng = np.random.default_rng(10)
    params = _sharded(cpu_mesh, rng)
    clean = _host(params)
    store = PimStore(params, GEO)
    assert store.ndev == 8 and store.axis_size == 8
    state = store.encode(params)
    fresh = _host(state)
    xbytes = store.overhead()["cross_device_parity_bytes"]
    assert xbytes == sum(-(-lf.nbytes // 7) for lf in store.address_map.leaves)
    for k in range(8):
        destroyed = faults.lose_shard(store, params, state, k, seed=k)
        assert destroyed > 0
        assert int(store.scrub(params, state).report.banks_faulty) > 0
        ctx = jax.no_tracing() if k else contextlib.nullcontext()
        with ctx:
            params, state, report = store.rebuild_shard(params, state, k)
        assert int(report.banks_repaired) == sum(lf.nstripes for lf in store.address_map.leaves)
        assert _same(params, clean), k
        assert all(np.array_equal(a, b) for a, b in zip(_host(state), fresh, strict=True)), k
    assert store._rebuild._cache_size() == 1


def test_sharded_scrub_gathers_one_fault_table_and_repairs_each_device(cpu_mesh):
    rng = np.random.default_rng(11)
    params = _sharded(cpu_mesh, rng)
    clean = _host(params)
    store = PimStore(params, GEO)
    state = store.encode(params)
    flips = faults.random_bit_flips(store, params, 40, seed=3)
    found = store.scrub(params, state)
    table = np.asarray(found.bank_faults)
    assert table.shape == (8, GEO.nbanks)
    assert table.sum() == len({(f.leaf, f.device, f.byte // GEO.stripe_bytes) for f in flips})
    assert {b.device for b in store.faulty_banks(found)} == {f.device for f in flips}
    # The table is replicated: every device holds all of it (it decides the repair branch).
    assert all(np.array_equal(np.asarray(s.data), table) for s in found.bank_faults.addressable_shards)
    out = store.repair(params, state)
    assert int(out.report.banks_repaired) == table.sum() and int(out.report.banks_uncorrectable) == 0
    assert _same(out.params, clean)
    faults.fail_bank(store, out.params, out.state, 9, device=5)
    found = store.scrub(out.params, out.state)
    assert [(b.device, b.flat) for b in store.faulty_banks(found)] == [(5, 9)]
    out = store.repair(out.params, out.state)
    assert int(out.report.banks_uncorrectable) == 0
    assert _same(out.params, clean)


def test_store_on_a_two_axis_mesh_keeps_parity_over_one_axis():
    devices = np.array(jax.devices("cpu")[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp"))
    rng = np.random.default_rng(12)
    w = jax.device_put(
        jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), NamedSharding(mesh, P("fsdp"))
    )
    params = {"w": w}
    clean = _host(params)
    with pytest.raises(ValueError, match="pass axis="):
        PimStore(params, GEO)
    store = PimStore(params, GEO, axis="fsdp")
    assert store.axis_size == 4 and store.ndev == 8
    state = store.encode(params)
    faults.lose_shard(store, params, state, 6)  # data=1, fsdp=2
    params, state, _ = store.rebuild_shard(params, state, 2)
    assert _same(params, clean)


def test_an_injected_flip_waits_for_work_already_dispatched():
    # A computation dispatched before the flip reads the bytes as they were; only later work sees it.
    x = jnp.ones((1 << 22,), jnp.float32)
    x.block_until_ready()

    @jax.jit
    def slow_sum(x):  # ~0.1 s of reads of x on a CPU core
        return jax.lax.fori_loop(0, 64, lambda i, acc: acc + jnp.sum(x * (i + 1.0)), jnp.float32(0))

    before = slow_sum(x).block_until_ready()
    for _ in range(3):
        pending = slow_sum(x)  # dispatched, not finished
        faults.flip_bits(x, [3], [6])  # bit 30 of element 0: 1.0 -> 2**128 = inf
        assert float(pending) == float(before)
        faults.flip_bits(x, [3], [6])  # back
    faults.flip_bits(x, [3], [6])
    assert not np.isfinite(float(slow_sum(x)))
