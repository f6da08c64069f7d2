"""The Llama-3 training step at Llama-3-8B dimensions, protection on and off, through the training
script itself (``train.llama3.train``): tokens/s and MFU against the device's bf16 peak.

python -m benchmarks.run --suite llama3 --layers 8 --devices 1     # one H200
XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python -m benchmarks.run --suite llama3 --layers 8 --devices 2
                                                                  # data + FSDP over two GPUs

Each configuration trains ``steps`` steps on the embedded corpus (byte tokenizer, T = 8192, one
sequence per device, bf16 compute, f32 parameters and AdamW moments, every block rematerialised,
by default keeping its linear layers' products: the issue's plain-JAX peer saves its dots too).
"Protection on" is the full protected step: parameters verified against their PimStore checksums
and repaired before every step, ABFT-checked GEMMs in the forward and backward pass, the fault-aware
optimizer, encode on write, and faults injected (bit flips in the parameters every ``flip_every``
steps, GEMM output errors) so the repair path runs mid-run. "Protection off" is stock arithmetic, no
store, no faults. The throughput is the median step (the first step, which compiles, is left out).
"""

from __future__ import annotations

import tempfile
from typing import NamedTuple

import jax
import numpy as np

from pimlayers.ops._checks_kernel import checks_kernel_wanted
from train.llama3 import TrainConfig, recompute_mode, train

from ._harness import environ

__all__ = ["Step", "run", "step_config"]


class Step(NamedTuple):
    """One configuration of the suite's steps (what ``step_config`` sets beyond the shared ones)."""

    protect: bool
    fused: bool = False
    flash: str = "auto"
    recompute_blocks: int | None = None
    recompute: bool = True
    recompute_kernel: bool | None = None
    weighted_checks: bool = True
    cast_on_scrub: bool = True
    fused_update: bool = True
    checks_kernel: bool = False  # PIMLAYERS_CHECKS_KERNEL=1 while this step is traced


def run(
    layers: int = 8,
    steps: int = 12,
    devices: int = 0,
    seq: int = 8192,
    config: str = "llama3_8b",
    dtype: str = "bfloat16",
    flip_every: int = 5,
    fused: bool = False,
    cudnn_peer: bool | None = None,
    redo_blocks: int = 0,
    no_recompute: bool = False,
    remat_policy: str = "gemms",
    loop: bool = False,
    plain_checks: bool = False,
    also_remat: tuple[str, ...] = (),
    no_cast: bool = False,
    unfused_update: bool = False,
    checks_kernel: bool = False,
) -> list[dict]:
    """``cudnn_peer`` (default: on a GPU) adds an unprotected step whose attention is cuDNN's flash
    kernel (``--flash on``): the plain-JAX step the performance goal compares against, where the
    library's own unprotected step keeps XLA's materialised attention. ``on_over_off`` stays
    against the latter; ``on_over_cudnn`` is against the former. ``redo_blocks`` > 0 adds a
    protected step with ``FaultPolicy(recompute_blocks=redo_blocks)``: each GEMM redoes its flagged
    column blocks without a branch, where the default's recompute loop has the host read a
    predicate per GEMM. ``no_recompute`` adds a protected step with ``FaultPolicy(recompute=False)``:
    what a check cannot locate skips the step instead of being recomputed, so no loop at all (with
    ``fused`` too, also on with the fused forward GEMM and no recompute). The default protected
    step redoes what a GEMM's check cannot locate on one device kernel each, with no branch, where a
    GPU runs it (``FaultPolicy.recompute_kernel``'s default; since the later runs of 2026-12-05 the
    attention's flash kernels redo theirs on the device too); ``loop`` adds one with
    ``FaultPolicy(recompute_kernel=False)``: the GEMMs' and the attention's recompute loops, whose
    predicates the host reads (the default before 2026-12-05; on a CPU the default is that loop).
    ``remat_policy`` is every configuration's (``TrainConfig.remat_policy``): "gemms" (the default,
    like the dot-saving peer the goal names) keeps the linear layers' products for the backward pass;
    "full" recomputes them (the training script's default: less memory); "gemms_weights" also keeps
    the kernels cast to bf16 (``layers.COMPUTE_WEIGHT``). ``plain_checks`` adds a
    protected step with ``FaultPolicy(weighted_checks=False, locate=False)``: every GEMM checked
    against its plain checksums alone (4 check columns per 128-column block on a GPU instead of 7),
    every detected block recomputed; with ``fused`` too, also the fused forward GEMM with the plain
    checks, which its kernel then forms itself from its own read of x (``fused_gemm_checked``).
    ``also_remat``: further remat policies under which the cuDNN peer (where it runs) and the default
    protected step run again in the same process, their rows' ``remat`` saying which; each row's
    ``on_over_cudnn`` is against the cuDNN step of its own policy (two policies' steps side by side
    on one card, e.g. "gemms_weights" against "gemms"). The protected steps multiply by the
    scrub's bf16 copies of the kernels (``TrainConfig.cast_on_scrub``); ``no_cast`` adds the
    default protected step with each layer casting its kernels instead (as before 2026-12-06);
    the protected steps take AdamW's step fused with the encode of its result
    (``TrainConfig.fused_update``); ``unfused_update`` adds the default protected step with the
    step, then the encode (as before 2026-12-06). ``checks_kernel`` adds the default protected step
    traced with ``PIMLAYERS_CHECKS_KERNEL=1``: the opt-in one-read Triton checks kernel in place of
    XLA's check GEMMs where it takes them (an NVIDIA GPU, up to 224 columns); a row's
    ``checks_kernel`` says whether it was asked for, ``checks_kernel_ran`` whether the kernel was on
    while the step was traced (the setting, by this option or the process's own, and a GPU that runs
    it: the checks it takes then ran in it; never on a CPU, where the setting changes nothing)."""
    n = devices or len(jax.devices())
    if cudnn_peer is None:
        cudnn_peer = jax.default_backend() == "gpu"
    rows: list[dict] = []
    # Off; off with cuDNN's attention; on; with ``fused`` also on with the fused forward GEMM, with
    # ``redo_blocks`` on with the branch-free recompute, with ``no_recompute`` on without recompute
    # (and with both, fused without recompute), with ``loop`` on with the recompute loops
    # (recompute_kernel None: the policy's default, the device kernel where a GPU runs it); then
    # without the position-weighted checks (``plain_checks``), without the scrub's compute copies
    # (``no_cast``), with AdamW's step then the encode (``unfused_update``).
    bare, guarded = Step(protect=False), Step(protect=True)
    configs = [bare]
    configs += [bare._replace(flash="on")] if cudnn_peer else []
    configs += [guarded]
    configs += [guarded._replace(fused=True)] if fused else []
    configs += [guarded._replace(recompute_blocks=redo_blocks)] if redo_blocks else []
    configs += [guarded._replace(recompute_kernel=False)] if loop else []
    configs += [guarded._replace(recompute=False)] if no_recompute else []
    configs += [guarded._replace(fused=True, recompute=False)] if no_recompute and fused else []
    configs += [guarded._replace(weighted_checks=False)] if plain_checks else []
    # Both: the fused forward GEMM forms the plain checks itself (no check GEMMs in the forward).
    configs += [guarded._replace(fused=True, weighted_checks=False)] if plain_checks and fused else []
    configs += [guarded._replace(cast_on_scrub=False)] if no_cast else []
    configs += [guarded._replace(fused_update=False)] if unfused_update else []
    configs += [guarded._replace(checks_kernel=True)] if checks_kernel else []
    runs = [(remat_policy, c) for c in configs]
    for extra in also_remat:
        runs += [(extra, bare._replace(flash="on"))] if cudnn_peer else []
        runs += [(extra, guarded)]
    for remat, c in runs:
        env = "1" if c.checks_kernel else None
        with tempfile.TemporaryDirectory() as tmp, environ("PIMLAYERS_CHECKS_KERNEL", env):
            cfg = step_config(layers, steps, n, seq, config, dtype, flip_every, remat, tmp, c)
            s = train(cfg)  # traces its step afresh: the setting is read as the GEMMs are traced
            kernel = checks_kernel_wanted()
        inj, g, m = s["injected"], s["gemm"], s["memory"]
        rows.append(
            {
                "config": f"{config} x{s['layers']} layers",
                "protect": c.protect,
                "fused": c.fused if c.protect else None,
                "recompute": _recompute_label(c.recompute_blocks, c.recompute, c.recompute_kernel)
                if c.protect
                else None,
                "checks": ("c1, c2" if c.weighted_checks else "c1 only") if c.protect else None,
                "weights": ("scrub's bf16 copy" if c.cast_on_scrub else "cast by each layer")
                if c.protect
                else None,
                "update": ("fused with the encode" if c.fused_update else "then encode")
                if c.protect
                else None,
                "checks_kernel": c.checks_kernel if c.protect else None,  # asked for
                "checks_kernel_ran": kernel if c.protect else None,  # on while it was traced
                "attention": _attention_label(c.protect, c.flash),
                "devices": s["devices"],
                "mesh": "x".join(f"{k}{v}" for k, v in s["mesh"].items()),
                "shape": f"B={cfg.batch} T={seq} {dtype}",
                "remat": remat,
                "params": s["params"],
                "steps": steps,
                "step_ms": 1e3 * cfg.batch * seq / s["tokens_per_s_median"],
                # The host's time in the step's call (median): near step_ms, the host waited on
                # the device inside the step (loops, branches) and could not queue ahead.
                "call_ms": 1e3 * float(np.median(s["call_seconds"])) if s["call_seconds"] else None,
                "tokens_per_s": s["tokens_per_s_median"],
                "tokens_per_s_per_device": s["tokens_per_s_median"] / s["devices"],
                "mfu": s["mfu_median"],
                # The step program's footprint per device (compiled memory analysis); peak_gb is
                # the process's allocator peak over every configuration run before it too.
                "program_gb": (s["step_program_bytes"] or 0) / 1e9,
                "peak_gb": (s["peak_bytes_in_use"] or 0) / 1e9,
                "limit_gb": (s["bytes_limit"] or 0) / 1e9,
                "flips_injected": inj["flips"],
                "banks_repaired": m["banks_repaired"],
                "gemm_injected": inj["gemm_injected"],
                "gemm_detected": g["gemm_detected"],
                "gemm_corrected": g["gemm_corrected"],
                "uncorrectable": g["gemm_uncorrectable"] + m["banks_uncorrectable"],
                "gemm_uncorrectable": g["gemm_uncorrectable"],
                "banks_uncorrectable": m["banks_uncorrectable"],
                "steps_skipped": s["injected"]["skipped"],
                "final_loss": s["curve"][-1][1],
            }
        )
    off = next(r for r in rows if not r["protect"])
    peer = lambda r: r["attention"] in ("cuDNN", "jax (XLA)")
    first = next((r for r in rows if peer(r)), None)
    for r in rows:
        r["on_over_off"] = r["tokens_per_s"] / off["tokens_per_s"]
        cudnn = next((c for c in rows if peer(c) and c["remat"] == r["remat"]), first)
        if cudnn is not None:
            r["on_over_cudnn"] = r["tokens_per_s"] / cudnn["tokens_per_s"]
    return rows


def step_config(
    layers: int,
    steps: int,
    devices: int,
    seq: int,
    config: str,
    dtype: str,
    flip_every: int,
    remat_policy: str,
    out_dir: str,
    step: Step,
) -> TrainConfig:
    """The training script's configuration for one of the suite's steps (one sequence per device;
    protected runs inject parameter flips every ``flip_every`` steps and GEMM faults at 0.2 a step)."""
    return TrainConfig(
        config=config,
        layers=layers,
        tokenizer="bytes",
        steps=steps,
        batch=devices,  # one sequence per device
        seq=seq,
        dtype=dtype,
        remat=True,
        remat_policy=remat_policy,
        devices=devices,
        eval_every=10**9,
        eval_windows=devices,
        warmup=max(steps // 4, 1),
        lr=3e-4,
        protect=step.protect,
        fused=step.fused,
        recompute_blocks=step.recompute_blocks,
        recompute=step.recompute,
        recompute_kernel=step.recompute_kernel,
        locate=step.weighted_checks,  # nothing to locate with without c2
        weighted_checks=step.weighted_checks,
        cast_on_scrub=step.cast_on_scrub,
        fused_update=step.fused_update,
        flash=step.flash,
        flip_every=flip_every if step.protect else 0,
        gemm_fault_rate=0.2 if step.protect else 0.0,
        nan_rate=0.0,
        out_dir=out_dir,
        quiet=True,
    )


def _recompute_label(blocks: int | None, recompute: bool, kernel: bool | None = None) -> str:
    """What the step's GEMMs recompute, as the policy resolves here (``recompute_kernel`` None: the
    device kernel where a GPU runs it; ``train.llama3.recompute_mode``)."""
    from pimlayers import FaultPolicy

    policy = FaultPolicy(recompute=recompute, recompute_blocks=blocks, recompute_kernel=kernel)
    return recompute_mode(policy)


def _attention_label(protect: bool, flash: str) -> str:
    """What the step's attention ran (layers.attention_core's choice for this machine)."""
    from pimlayers.ops._fused_gemm import hopper

    if protect:
        return "verified flash" if hopper() else "materialised, verified"
    if flash == "on":
        return "cuDNN" if jax.default_backend() == "gpu" else "jax (XLA)"
    return "materialised"


def quick(
    cudnn_peer: bool | None = None,
    redo_blocks: int = 0,
    no_recompute: bool = False,
    remat_policy: str = "gemms",
    also_remat: tuple[str, ...] = (),
    no_cast: bool = False,
    unfused_update: bool = False,
    checks_kernel: bool = False,
) -> list[dict]:
    """A smoke run of the suite's machinery at toy size (CI)."""
    return run(
        layers=1,
        steps=3,
        devices=1,
        seq=64,
        config="llama3_tiny",
        dtype="float32",
        flip_every=1,
        cudnn_peer=cudnn_peer,
        redo_blocks=redo_blocks,
        no_recompute=no_recompute,
        remat_policy=remat_policy,
        also_remat=also_remat,
        no_cast=no_cast,
        unfused_update=unfused_update,
        checks_kernel=checks_kernel,
    )
