"""FaultPolicy: defaults, validation messages, normalisation, hashability as a jit static argument."""

import os
import sys

if "jax" not in sys.modules:  # Same device setup as the other modules; harmless if jax is already up.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimlayers.faults import FaultPolicy


def test_defaults_and_properties():
    p = FaultPolicy()
    assert (p.mode, p.gate, p.gate_fill, p.gate_limit, p.lam, p.block_n) == (
        "correct",
        True,
        0.0,
        None,
        8.0,
        128,
    )
    assert p.recompute and p.skip_on_uncorrectable and p.lam_dw == 64.0 and p.locate and p.weighted_checks
    assert p.enabled and p.corrects
    d = FaultPolicy(mode="detect")
    assert d.enabled and not d.corrects
    off = FaultPolicy.off()
    assert off.mode == "off" and not off.enabled and not off.corrects and not off.gate
    assert [f.name for f in dataclasses.fields(FaultPolicy)] == [
        "mode",
        "gate",
        "gate_fill",
        "gate_limit",
        "lam",
        "block_n",
        "recompute",
        "recompute_blocks",
        "skip_on_uncorrectable",
        "lam_dw",
        "fused",
        "recompute_kernel",
        "locate",
        "weighted_checks",
    ]


def test_false_alarm_bound_follows_higham_mary():
    assert FaultPolicy(lam=8.0).false_alarm_bound == pytest.approx(2 * math.exp(-32.0), rel=1e-12)
    assert FaultPolicy(lam=1.0).false_alarm_bound > FaultPolicy(lam=2.0).false_alarm_bound


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"mode": "fix"}, ValueError, r"mode must be one of \('off', 'detect', 'correct'\); got 'fix'"),
        ({"mode": "Correct"}, ValueError, r"got 'Correct'"),
        ({"mode": 1}, TypeError, r"mode must be a str.*got 1"),
        ({"gate": 1}, TypeError, r"gate must be a bool; got int 1"),
        ({"recompute": "yes"}, TypeError, r"recompute must be a bool; got str 'yes'"),
        ({"recompute_blocks": 0}, ValueError, r"recompute_blocks must be an int >= 1 or None; got 0"),
        (
            {"recompute_blocks": 2.0},
            TypeError,
            r"recompute_blocks must be an int >= 1 or None .*got float 2.0",
        ),
        ({"recompute_blocks": 8, "block_n": None}, ValueError, r"recompute_blocks=8 .*needs block_n"),
        ({"skip_on_uncorrectable": None}, TypeError, r"skip_on_uncorrectable must be a bool"),
        ({"gate_fill": float("nan")}, ValueError, r"gate_fill must be finite; got nan"),
        ({"gate_fill": True}, TypeError, r"gate_fill must be a Python float"),
        ({"gate_fill": jnp.float32(0.0)}, TypeError, r"gate_fill must be a Python float .*not an array"),
        ({"gate_limit": 0.0}, ValueError, r"gate_limit must be a finite float > 0 or None.*got 0.0"),
        ({"gate_limit": -3}, ValueError, r"gate_limit .* got -3.0"),
        ({"gate_limit": float("inf")}, ValueError, r"gate_limit must be finite; got inf"),
        ({"gate_limit": "big"}, TypeError, r"gate_limit must be a Python float.*got str"),
        ({"lam": 0}, ValueError, r"lam must be a finite float > 0 .*got 0.0"),
        ({"lam": -1.0}, ValueError, r"lam must be a finite float > 0"),
        ({"lam_dw": 0.0}, ValueError, r"lam_dw must be a finite float > 0 .*got 0.0"),
        ({"lam_dw": "8"}, TypeError, r"lam_dw must be a Python float.*got str"),
        ({"block_n": 0}, ValueError, r"block_n must be an int >= 1 or None; got 0"),
        ({"block_n": 64.0}, TypeError, r"block_n must be an int >= 1 or None.*got float 64.0"),
        ({"block_n": True}, TypeError, r"block_n .*got bool True"),
    ],
)
def test_validation_names_field_value_and_expectation(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        FaultPolicy(**kwargs)


def test_numbers_are_normalised_to_plain_python_types():
    p = FaultPolicy(
        gate_fill=0, gate_limit=np.float32(1e4), lam=np.int64(6), block_n=np.int64(128), gate=np.True_
    )
    assert type(p.gate_fill) is float and type(p.gate_limit) is float and type(p.lam) is float
    assert type(p.block_n) is int and p.block_n == 128 and type(p.gate) is bool
    assert p == FaultPolicy(gate_fill=0.0, gate_limit=1e4, lam=6.0, block_n=128)


def test_frozen_hashable_and_equal_by_value():
    a, b = FaultPolicy(mode="detect", gate_limit=1e4), FaultPolicy(mode="detect", gate_limit=1e4)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != FaultPolicy(mode="detect", gate_limit=1e3)
    assert len({a, b, FaultPolicy()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mode = "off"  # type: ignore[misc]
    r = a.replace(mode="correct")
    assert r.mode == "correct" and r.gate_limit == 1e4 and a.mode == "detect"
    with pytest.raises(ValueError, match="mode must be one of"):
        a.replace(mode="bogus")  # replace validates too.


def test_usable_as_jit_static_argument_and_cached_by_value():
    traces = []

    @functools.partial(jax.jit, static_argnames="policy")
    def clip(x: jax.Array, policy: FaultPolicy) -> jax.Array:
        traces.append(policy)
        if not policy.gate:  # A Python branch on static config is fine.
            return x
        bad = ~jnp.isfinite(x)
        if policy.gate_limit is not None:
            bad |= jnp.abs(x) > policy.gate_limit
        return jnp.where(bad, policy.gate_fill, x)

    x = jnp.array([1.0, jnp.nan, 50.0, -jnp.inf])
    np.testing.assert_array_equal(clip(x, policy=FaultPolicy(gate_limit=10.0)), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(clip(x, policy=FaultPolicy(gate_limit=10.0)), [1.0, 0.0, 0.0, 0.0])
    assert len(traces) == 1  # An equal (not identical) policy hits the cache.
    np.testing.assert_array_equal(clip(x, policy=FaultPolicy(gate_fill=-1.0)), [1.0, -1.0, 50.0, -1.0])
    np.testing.assert_array_equal(clip(x, policy=FaultPolicy.off()), x)
    assert len(traces) == 3  # A different policy compiles once more each.
