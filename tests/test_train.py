"""The training script: faults injected while training are all reported; a resumed run continues
bit-exactly; bad options are refused. Small models and a slice of the default corpus."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from train import llama3 as T


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's schedules mix Python floats with int32 step counts, which the suite's strict dtype
    # promotion refuses; the training script runs under JAX's default ("standard") promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _cfg(tmp_path, **kw):
    base = dict(
        config="llama3_tiny", max_bytes=200_000, steps=10, batch=8, seq=32, eval_every=5, eval_windows=8,
        warmup=2, out_dir=str(tmp_path / "run"), quiet=True,
    )  # fmt: skip
    base.update(kw)
    return T.TrainConfig(**base)


@pytest.mark.slow
def test_every_injected_fault_is_reported_and_the_run_learns(tmp_path):
    cfg = _cfg(tmp_path, steps=12, flips=3, flip_every=3, gemm_fault_rate=1.0, nan_rate=0.25, seed=1)
    s = T.train(cfg)
    inj, g, m = s["injected"], s["gemm"], s["memory"]
    assert inj["gemm_injected"] == 12 and g["gemm_detected"] == 12 and g["gemm_uncorrectable"] == 0
    assert g["gemm_corrected"] >= 12
    # Forward and backward GEMMs are both counted: per step, each of the 2 layers runs q, k, v, o,
    # gate, up, down (1 each) and the two attention GEMMs (batch 8 x 2 KV heads each), plus the
    # LM head; the backward pass checks dx and dw for every one of them (read from the FaultTaps),
    # x's gradient through q, k and v as one GEMM (2 fewer a layer; gate's and up's stay two here:
    # summed they would copy more than they save, ops._protected_matmul._sums_dx).
    forward = 2 * (7 + 2 * 8 * 2) + 1
    assert g["gemm_checked"] == 12 * (3 * forward - 2 * 2)
    assert inj["flips"] == 9 and m["banks_faulty"] == 9 and m["banks_repaired"] == 9
    assert m["banks_uncorrectable"] == 0
    assert inj["nan_bursts"] > 0 and inj["skipped"] == inj["nan_bursts"]
    assert s["curve"][-1][1] < s["curve"][0][1]  # it learns despite the faults
    assert s["recompute"] == "whole GEMM"  # the CPU's default: the loop
    table = T.fault_table(s)
    assert "silent" in table and all(line.split()[-1] == "0" for line in table.splitlines()[1:4])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 12 and "eval_loss" in log[4] and log[-1]["flips"] == 9
    # Timed steps (each read once the next is queued): not step 0 (compiles), nor one read right
    # after another in its own iteration (4 and 9 evaluate, 11 ends the run).
    assert len(s["step_seconds"]) == len([1, 2, 3, 5, 6, 7, 8, 10])
    # Every step scrubs (scrub_every=1): one program for all twelve, faults or not. The optimizer's
    # first state is laid out as the step returns it (moments sharded like the parameters), else
    # the second step recompiled.
    assert s["step_programs"] == 1
    T.plot([s], tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.slow
def test_resume_continues_bit_exactly(tmp_path):
    # One device: the point is the checkpoint, not the mesh (the test above trains on all eight).
    kw = dict(steps=8, devices=1, seed=3, gemm_fault_rate=0.5, flip_every=3, nan_rate=0.2, ckpt_every=4)
    straight = T.train(_cfg(tmp_path, out_dir=str(tmp_path / "a"), **kw))  # checkpoints at 4 and 8
    # A run "preempted" after step 4: its out_dir holds the step-4 checkpoint and nothing later.
    shutil.copytree(tmp_path / "a" / "ckpt" / "4", tmp_path / "b" / "ckpt" / "4")
    resumed = T.train(_cfg(tmp_path, out_dir=str(tmp_path / "b"), resume=True, **kw))
    assert resumed["curve"][0][0] == 5  # it started after the checkpoint
    for a, b in zip(
        jax.tree.leaves(straight["params_final"]), jax.tree.leaves(resumed["params_final"]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert straight["curve"][-4:] == resumed["curve"][-4:]


def test_the_loop_never_evaluates_the_schedule_on_the_device_per_step(monkeypatch, tmp_path):
    # An eager schedule(s) per step was a program queued behind the step just dispatched; reading it
    # made the host wait for that step, so the device idled while the next one was queued. The
    # loop logs learning rates evaluated once, in a traced program; the optimizer's own calls are
    # traced inside the step.
    import optax

    eager = []
    make = optax.warmup_cosine_decay_schedule

    def counting(*a, **k):
        sched = make(*a, **k)

        def wrapped(step):
            eager.append(not isinstance(step, jax.core.Tracer))
            return sched(step)

        return wrapped

    monkeypatch.setattr(T.optax, "warmup_cosine_decay_schedule", counting)
    T.train(_cfg(tmp_path, steps=4, eval_every=100, devices=1))
    assert eager and not any(eager)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    want = make(0.0, 3e-3, 2, 4, 3e-4)  # TrainConfig.lr, the config warmup of 2, 4 steps
    assert [r["lr"] for r in log] == pytest.approx([float(want(s)) for s in range(4)], rel=1e-6)


def test_the_first_timed_step_counts_the_host_time_before_its_call(monkeypatch, tmp_path):
    # The compiling step is read before step 1 is queued, so step 1's interval starts when step 0
    # has finished and holds whatever the host spent before and in step 1's call (here a batch
    # that takes 0.4 s to read). Read after step 1's call, as the other steps are, step 0's read
    # ended that wait, and the time fell into the untimed interval: on an H100 a call for step 1
    # that returned late left a step of ~108 ms timed at 11-17 ms.
    import time

    real = T.D.batches

    def slow_second(*a, **k):
        for i, b in enumerate(real(*a, **k)):
            if i == 1:
                time.sleep(0.4)
            yield b

    monkeypatch.setattr(T.D, "batches", slow_second)
    s = T.train(_cfg(tmp_path, steps=4, eval_every=100, devices=1))
    assert len(s["step_seconds"]) == 2  # steps 1 and 2 (each read once the next is queued)
    assert s["step_seconds"][0] >= 0.4
    assert max(s["step_seconds"][1:]) < 0.4


def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        T.parse_args(["--link-fault-rate", "0.5"])
    assert "routed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.parse_args(["--config", "gpt2"])
    with pytest.raises(SystemExit):
        T.parse_args(["--remat-policy", "dots"])
    assert "gemms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.parse_args(["--recompute-kernel", "--no-recompute"])
    assert "--recompute-kernel" in capsys.readouterr().err
    assert T.parse_args(["--recompute-kernel"]).recompute_kernel is True
    assert T.parse_args(["--no-recompute-kernel"]).recompute_kernel is False
    assert T.parse_args([]).recompute_kernel is None  # the kernel where a GPU runs it, else the loop
    with pytest.raises(SystemExit):
        T.parse_args(["--no-locate", "--no-recompute"])
    assert "--no-locate" in capsys.readouterr().err
    assert T.parse_args(["--no-locate"]).locate is False and T.parse_args([]).locate is True
    with pytest.raises(SystemExit):
        T.parse_args(["--no-weighted-checks"])
    assert "--no-locate" in capsys.readouterr().err
    plain = T.parse_args(["--no-weighted-checks", "--no-locate"])
    assert plain.weighted_checks is False and T.parse_args([]).weighted_checks is True
    for bad, match in (
        (dict(locate=False, recompute=False), "locate=False .*recompute=False"),
        (dict(weighted_checks=False), r"weighted_checks=False .*locate=False"),
        (dict(recompute=False, recompute_blocks=4), "choose one"),
        (dict(recompute=False, recompute_kernel=True), "recompute_kernel=True .*choose one"),
        (dict(recompute_blocks=4, recompute_kernel=True), "recompute_kernel=True .*choose one"),
        (dict(remat_policy="dots"), "remat_policy='dots'"),
    ):
        with pytest.raises(ValueError, match=match):
            T.train(T.TrainConfig(**bad))
    cfg = T.parse_args(["--steps", "5", "--no-protect", "--data", "a.txt", "b"])
    assert cfg.steps == 5 and not cfg.protect and cfg.data == ["a.txt", "b"]


def test_recompute_mode_says_what_the_policy_resolves_to_here(monkeypatch):
    from pimlayers.faults import FaultPolicy
    from pimlayers.ops import _redo_kernel

    modes = {
        FaultPolicy(): "whole GEMM",  # a CPU: the loop
        FaultPolicy(recompute=False): "none (skip)",
        FaultPolicy.off(): "none (skip)",
        FaultPolicy(recompute_blocks=8): "8 blocks",
        FaultPolicy(recompute_kernel=True): "device kernel",
        FaultPolicy(locate=False): "whole GEMM, for every detection (nothing located)",
    }
    assert {p: T.recompute_mode(p) for p in modes} == modes
    monkeypatch.setattr(_redo_kernel, "redo_kernel_chosen", lambda p: p.recompute_blocks is None)  # a GPU
    assert T.recompute_mode(FaultPolicy()) == "device kernel"
    assert T.recompute_mode(FaultPolicy(recompute_kernel=False)) == "whole GEMM"


@pytest.mark.slow
def test_bf16_training_with_the_device_redo_matches_the_loop(tmp_path):
    """``--recompute-kernel``: the bf16 step with every GEMM's recompute on the device kernel (here
    under Pallas' interpreter) corrects the same injected faults as the loop, to the same loss."""
    runs = [
        # One layer, two steps: the kernel's interpreted programs dominate the time (~20 s here).
        T.train(
            _cfg(
                tmp_path / str(k),
                steps=2,
                layers=1,
                dtype="bfloat16",
                gemm_fault_rate=1.0,
                recompute_kernel=k,
            )
        )
        for k in (False, True)
    ]
    (a, b) = runs
    assert a["gemm"] == b["gemm"] and a["gemm"]["gemm_uncorrectable"] == 0
    assert a["injected"]["gemm_injected"] == 2 and a["gemm"]["gemm_corrected"] >= 2
    assert a["curve"][-1][1] == b["curve"][-1][1]


@pytest.mark.slow
def test_casting_on_the_scrub_trains_as_the_layers_casting(tmp_path):
    """``--cast-on-scrub`` (the default): the bf16 step multiplies by the scrub's compute copies of
    the kernels (and casts once on a step without a scrub) and trains as the step whose layers
    cast each kernel themselves, with bits flipped in the weights and repaired mid-run (the repair's
    copies cast again from the repaired kernels)."""
    kw = dict(steps=6, layers=1, devices=1, dtype="bfloat16", flips=2, flip_every=2, scrub_every=2,
              gemm_fault_rate=0.0, nan_rate=0.0, seed=4)  # fmt: skip
    a, b = (T.train(_cfg(tmp_path / str(c), cast_on_scrub=c, **kw)) for c in (False, True))
    assert a["memory"] == b["memory"] and b["memory"]["banks_repaired"] == b["injected"]["flips"] > 0
    for x, y in zip(jax.tree.leaves(a["params_final"]), jax.tree.leaves(b["params_final"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a["curve"] == b["curve"]
    # Each step program's footprint is read from it (compiled memory analysis), not from the
    # process's peak; the copies add the kernels' bf16 bytes at most.
    kernels = sum(x.size * 2 for x in jax.tree.leaves(b["params_final"]) if x.ndim == 2)
    assert a["step_program_bytes"] > 0 and b["step_program_bytes"] <= a["step_program_bytes"] + kernels


@pytest.mark.slow
def test_fused_update_trains_as_optax_then_encode(tmp_path):
    """``--fused-update`` (the default): AdamW's step and the encode in one pass
    (PimStore.adamw_update), the bf16 copies' gradients read as they are; the same run as optax's
    step and the store's encode (``--no-fused-update``), with flips repaired and NaN bursts skipped
    (to an ulp where XLA contracts a multiply-add differently in the two programs)."""
    kw = dict(steps=6, layers=1, devices=1, dtype="bfloat16", flips=2, flip_every=2, nan_rate=0.3,
              gemm_fault_rate=0.0, seed=5)  # fmt: skip
    a, b = (T.train(_cfg(tmp_path / str(f), fused_update=f, **kw)) for f in (False, True))
    assert a["memory"] == b["memory"] and b["memory"]["banks_repaired"] == b["injected"]["flips"] > 0
    assert a["injected"] == b["injected"] and b["injected"]["skipped"] > 0
    for x, y in zip(jax.tree.leaves(a["params_final"]), jax.tree.leaves(b["params_final"]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([c[1] for c in a["curve"]], [c[1] for c in b["curve"]], rtol=1e-4)
