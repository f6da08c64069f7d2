"""Strict settings for the whole suite: 8 simulated CPU devices, strict dtype promotion, rank
promotion raises. XLA_FLAGS must be set before jax creates its backends, hence at import time here.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

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


@pytest.fixture
def cpu_mesh():
    devices = jax.devices("cpu")
    return jax.make_mesh((len(devices),), ("d",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
