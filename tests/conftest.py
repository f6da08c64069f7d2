"""Strict settings for the whole suite: 8 simulated CPU devices, strict dtype promotion, rank
promotion raises. XLA_FLAGS must be set before jax creates its backends, hence at import time here.

Compiled programs go to a persistent compilation cache that lives for one session (a fresh
temporary folder; set JAX_COMPILATION_CACHE_DIR to choose another): the training tests and the
notebooks compile the same small training step several times (a resumed run, a second kernel), and
on a 2-core machine that compile is most of their time (`pytest tests/test_train.py --durations=3`:
test_resume_continues_bit_exactly, three runs of one step function, 80 s with the cache and 114 s
without). Every program is stored, however short its compile: most of the suite's ~10,000 compiles
are small programs, some of them the same in both xdist workers and across parametrized tests
(`pytest -n 2 tests/test_flash.py`: 107 s storing every program, 120 s storing only those that took
0.5 s or more).
"""

import atexit
import importlib.metadata
import os
import shutil
import tempfile

# LLVM at -O0: the suite is mostly XLA compiles (56% of its time, most of them small programs run
# once); measured on a 2-core machine, -O0 took 15-20% off compile-heavy and run-heavy tests alike
# (test_resume_continues_bit_exactly 80 -> 68 s). It sets LLVM's optimisation of the machine code,
# not XLA's HLO passes (fusion, layouts), and no fast-math either way; but two different dot kernels
# (a whole GEMM, a gathered block of it) may then sum in different orders where -O3 happened to
# agree, so tests compare such pairs to f32 rounding, not bit for bit.
#
# XLA:CPU's older loop emitters instead of its MLIR fusion emitters: small programs compiled in
# about half the time (a scratch timing of 92 one-op programs, not kept) and `pytest -n 2
# tests/test_abft.py` took 71 s against 87 on a 2-core machine (jaxlib 0.10.2; set XLA_FLAGS
# without the flag to compare). Both are XLA:CPU's own code generators; the flag is added for
# jaxlib 0.10 only, where it was measured (XLA refuses to start on a flag it does not know).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + (" --xla_cpu_use_fusion_emitters=false" * importlib.metadata.version("jaxlib").startswith("0.10.")),
)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # inherited by the notebooks' kernels
    _cache = tempfile.mkdtemp(prefix="pimlayers-test-jit-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def _has_cuda() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    # The tests marked slow (the suite's longest, 15-85 s each in CI) run first: xdist hands tests
    # out in this order, so a minute-long test no longer starts last while the other worker idles.
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture
def cpu_mesh():
    """A mesh of the CPU devices, the test run with the CPU as the default device: on a machine with
    a GPU its references (computed outside the mesh) and its kernel choices (``ops.hopper``) are
    the CPU's too."""
    devices = jax.devices("cpu")
    with jax.default_device(devices[0]):
        auto = (jax.sharding.AxisType.Auto,)
        yield jax.make_mesh((len(devices),), ("d",), devices=devices, axis_types=auto)


@pytest.fixture
def on_cpu():
    """Run the test on the CPU device, for an op whose native handler is CPU-only (abft_checks): on a
    machine with a GPU, JAX would otherwise place the computation there, where no handler exists."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield
