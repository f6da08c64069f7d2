"""The benchmark suites' own checks run (tiny sizes): a broken campaign must not wait for the GPU."""

from benchmarks import abft_campaign


def test_abft_campaign_quick_has_no_false_positive_and_misses_nothing():
    fp, cov = abft_campaign.run(quick=True)
    assert fp["gemms"] > 0 and fp["detected"] == 0
    assert cov["injections"] > 0 and cov["detected_above"] == cov["above_bound"]
    assert cov["uncorrectable"] == 0
    assert cov["worst_error_over_bound"] <= 1.0


def test_memory_suite_quick_runs_and_repairs():
    from benchmarks import memory

    rows = {r["op"]: r for r in memory.run(quick=True)}
    bank = rows["repair one failed bank"]
    assert bank["stripes_rebuilt"] > 0 and bank["in_place"]
    assert rows["scrub (verify every stripe + parity)"]["gbs"] > 0
    assert any(op.startswith("gemv") for op in rows)


def test_routing_suite_quick_checks_every_kernel_and_reports_the_overhead():
    from benchmarks import routing

    rows = routing.run(quick=True)
    ops = {(r["mode"], r["op"]) for r in rows if "ms" in r}
    for mode in ("fwd", "fwd+bwd"):
        assert (mode, "routed_attention (1-device mesh)") in ops and (mode, "local kernel alone") in ops
    assert all("routing_overhead" in r for r in rows if r["op"].startswith("routed"))
