"""The native bridge: what loaded, and the fallback when nothing did."""

import os
import subprocess
import sys

import pimlayers as pl


def test_cpu_handlers_loaded_with_every_op():
    info = pl.native_info()
    assert info["cpu"].loaded, info["cpu"].reason
    assert set(info["cpu"].targets) == {
        "pimlayers_gate",
        "pimlayers_bank_checksums",
        "pimlayers_parity",
        "pimlayers_bank_guard",
        "pimlayers_bank_guard_many",
        "pimlayers_bank_verify_many",
        "pimlayers_reconstruct",
        "pimlayers_abft_check",
        "pimlayers_abft_finish",
        "pimlayers_abft_encode",
        "pimlayers_abft_checks",
        "pimlayers_pim_gemv",
    }
    assert "native" in str(info["cpu"])
    # A CUDA entry always says something: either what loaded or why not.
    assert info["cuda"].loaded or info["cuda"].reason


def test_without_native_the_references_run_and_say_so_once():
    code = (
        "import warnings; warnings.simplefilter('always');"
        "import jax.numpy as jnp, pimlayers as pl;"
        "import pimlayers._native;"
        "y, c = pl.ops.gate(jnp.array([1.0, jnp.nan]));"
        "print(pl.native_info()['cpu'].loaded, int(c), float(y[1]))"
    )
    env = dict(os.environ, PIMLAYERS_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "1", "0.0"]
    assert out.stderr.count("pure-JAX reference") == 1
