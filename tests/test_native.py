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
        "pimlayers_adamw_guard_many",
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


def _prims(f, *args) -> list[str]:
    import jax
    from helpers import jaxpr_eqns

    return [e.primitive.name for e, _ in jaxpr_eqns(jax.make_jaxpr(f)(*args).jaxpr)]


def test_auto_calls_the_one_branch_every_present_platform_picks(monkeypatch):
    # platform_dependent traces every branch; where all the process's platforms pick the same one,
    # dispatch calls it alone (the unused references were ~40% of a training step's trace).
    import jax.numpy as jnp

    from pimlayers.ops import _dispatch

    x = jnp.ones((8, 64))
    gate = lambda a: pl.ops.gate(a, limit=1e3)
    sums = lambda a: pl.ops.bank_checksums(a, bank_bytes=256)
    assert "cpu" in _dispatch.present_platforms()  # jax always has its CPU backend
    # A CPU-only process (as CI's; on a GPU machine the CUDA backend is present too).
    monkeypatch.setattr(_dispatch, "present_platforms", lambda: frozenset({"cpu"}))
    for f in (gate, sums):
        alone = _prims(f, x)
        assert "ffi_call" in alone and "platform_index" not in alone
    assert "is_finite" not in _prims(gate, x)  # the reference's test is not traced
    assert "is_finite" in _prims(lambda a: pl.ops.gate(a, limit=1e3, impl="reference"), x)

    # A process with a GPU too (new shapes each time: jit caches traces): the checksums are native
    # on both, one call; the gate is native on the CPU only (XLA's select wins on the GPU), so its
    # per-platform switch over both branches stays.
    monkeypatch.setattr(_dispatch, "present_platforms", lambda: frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(_dispatch, "has_native", lambda p: True)
    assert "platform_index" not in _prims(sums, x[:4])
    both = _prims(gate, x[:4])
    assert "platform_index" in both and "ffi_call" in both and "is_finite" in both
    # jax without the listing: the switch stays for every op.
    monkeypatch.setattr(_dispatch, "present_platforms", lambda: frozenset())
    assert "platform_index" in _prims(sums, x[:2])


def test_the_protected_gemms_cuda_handlers_alone_are_registered_for_command_buffers(monkeypatch):
    # XLA records a handler into its CUDA graphs only when it was registered with the trait; the
    # guards, the scrub and the fused update copy host tables per call and must never be recorded.
    from pimlayers import _native

    monkeypatch.delenv("PIMLAYERS_COMMAND_BUFFERS", raising=False)
    assert not any(_native._traits("cuda", n) for n in _native.COMMAND_BUFFER_TARGETS)  # opt-in
    monkeypatch.setenv("PIMLAYERS_COMMAND_BUFFERS", "1")
    trait = {n: _native._traits("cuda", n) for n in pl.native_info()["cpu"].targets}
    marked = {n for n, t in trait.items() if t}
    assert marked == {"pimlayers_abft_check", "pimlayers_abft_finish", "pimlayers_abft_encode"}
    assert _native._traits("cuda", "pimlayers_abft_encode_pair")  # a CUDA-only handler
    assert all(int(t["traits"]) == 1 for t in trait.values() if t)  # COMMAND_BUFFER_COMPATIBLE
    assert not any(_native._traits("cpu", n) for n in trait)  # a CPU program has no command buffers
    monkeypatch.setenv("PIMLAYERS_COMMAND_BUFFERS", "0")
    assert not any(_native._traits("cuda", n) for n in _native.COMMAND_BUFFER_TARGETS)


def test_loading_the_cuda_handlers_passes_their_traits_to_xla(monkeypatch):
    # The wiring, not only _traits: what _load hands jax.ffi.register_ffi_target per target.
    import importlib
    import sys
    import types

    import jax

    from pimlayers import _native

    try:  # the built extension's own target names, where it is built (CI builds it with nvcc)
        importlib.import_module("pimlayers._pimlayers_cuda")
    except ImportError:  # a build without CUDA: a stand-in registering those targets and one more
        stand_in = types.ModuleType("pimlayers._pimlayers_cuda")
        names = [*sorted(_native.COMMAND_BUFFER_TARGETS), "pimlayers_gate"]
        stand_in.registrations = lambda: {n: object() for n in names}
        monkeypatch.setitem(sys.modules, "pimlayers._pimlayers_cuda", stand_in)
    seen = {}
    record = lambda name, capsule, platform, **kw: seen.update({name: kw})
    monkeypatch.setattr(jax.ffi, "register_ffi_target", record)
    monkeypatch.setenv("PIMLAYERS_COMMAND_BUFFERS", "1")
    assert _native._load("cuda").loaded
    assert {n for n, kw in seen.items() if kw.get("traits")} == _native.COMMAND_BUFFER_TARGETS
    monkeypatch.setenv("PIMLAYERS_COMMAND_BUFFERS", "0")
    seen.clear()
    assert _native._load("cuda").loaded and seen and not any(seen.values())
