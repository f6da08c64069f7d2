"""Train a Llama 3 model built from pimlayers, with faults injected and repaired as it trains.

    python -m train.llama3                                  # what `make train` runs: a small model on
                                                            # the Python standard library's sources
    python -m train.llama3 --data ~/texts --steps 2000      # your own text files or folders
    python -m train.llama3 --config llama3_8b --layers 4 --seq 8192 --batch 1 --dtype bfloat16

Every step: the parameters are verified against their PimStore checksums and repaired from parity if
a bit flipped (verify on read; the same read writes the kernels' compute-dtype copies, which the
step multiplies by: ``--no-cast-on-scrub`` casts in each layer instead), the forward and backward
pass run with ABFT-checked GEMMs, the
fault-aware AdamW skips a step with non-finite gradients or an uncorrectable fault, and the new
parameters are encoded (encode on write; the update itself forms their checksums and parity,
``--no-fused-update`` encodes after it). Injected faults (``--flips``, ``--gemm-fault-rate``,
``--nan-rate``) are counted beside what the protection reported, so a silent fault would show.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama3 import CONFIGS, REMAT_POLICIES, Llama3, get_config
from pimlayers import faults
from pimlayers.faults import FaultPolicy, FaultReport, GemmFaults
from pimlayers.flax import nnx as pnnx
from pimlayers.memory import BankGeometry, PimStore
from pimlayers.optim import SKIP_NONE, adamw_guarded

from . import data as D

PEAK_FLOPS = {"H200": 989e12, "H100": 989e12}  # dense bf16 tensor-core peaks (NVIDIA datasheets)


@dataclasses.dataclass
class TrainConfig:
    config: str = "llama3_small"
    layers: int | None = None  # override the config's layer count
    data: list[str] | None = None  # files or folders; None: the standard library
    max_bytes: int | None = 3_000_000  # cap on the training text
    tokenizer: str = "bpe"  # "bpe" (trained on the corpus), "bytes", or a tokenizer.json
    steps: int = 300
    batch: int = 8
    seq: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0  # the gradient's global-norm clip (optax.clip_by_global_norm); 0 clips nothing
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: bool = False
    # With remat: "full" keeps each block's input alone; "gemms" also every linear layer's product and
    # the verified flash forward's output, so the backward pass recomputes no GEMM (nor a protected
    # GEMM's checks) and no flash forward (models.llama3.Llama3).
    remat_policy: str = "full"
    devices: int = 0  # devices to use (0: all)
    fsdp: int = 0  # of those, devices on the FSDP axis (0: all)
    seed: int = 0
    eval_every: int = 50
    eval_windows: int = 64
    scrub_every: int = 1  # verify (and repair) parameters every N steps
    # Protected: the scrub's read of the weights also writes the kernels' compute-dtype copies
    # (PimStore.repair(cast=)), which the step multiplies by, so no kernel is cast in the forward
    # pass nor again where the backward pass rematerialises its block (a step without a scrub casts
    # once, before the forward pass). The copies live through the step. --no-cast-on-scrub: each
    # layer casts its kernel where it uses it.
    cast_on_scrub: bool = True
    # Protected: AdamW's update and the encode of the new parameters in one pass (PimStore.adamw_update,
    # pimlayers.optim.adamw_guarded): on a GPU one kernel reads p, g, m, v, writes p, m, v and forms
    # the checksums and parity from what it writes, where the unfused step's encode reads every
    # parameter again (4 Llama-3-8B layers on an H100, `python -m benchmarks.run --suite update`:
    # 8.74 ms against 9.75 for optax's step then the encode, 8.45 for the step alone). The same
    # training either way, to an ulp (the kernel rounds each operation; XLA contracts some).
    # --no-fused-update: optax's step, then the encode.
    fused_update: bool = True
    flips: int = 2  # bits flipped in the parameters at each injection
    flip_every: int = 20  # steps between memory-fault injections (0: never)
    gemm_fault_rate: float = 0.2  # chance per step that one MLP GEMM output gets a flipped bit
    nan_rate: float = 0.02  # chance per step of a NaN burst in the gradients
    link_fault_rate: float = 0.0  # needs the model's attention routed over the sequence (not wired yet)
    protect: bool = True  # False: stock arithmetic, no store (the comparison run)
    fused: bool = False  # FaultPolicy.fused: the fused forward GEMM where it runs (Hopper, bf16)
    # FaultPolicy.recompute_blocks: each GEMM redoes up to N column blocks its check could not
    # correct, without a branch; None: it recomputes the whole GEMM in a loop of 0 or 1 trips,
    # whose predicate a GPU reads on the host (once per GEMM, every step).
    recompute_blocks: int | None = None
    # FaultPolicy.recompute: False corrects what a check locates and skips the step (fault_aware)
    # where it cannot, recomputing nothing: no loop in any GEMM or attention call, so nothing in the
    # step makes a GPU's host wait (on an H200, 4 layers, `python -m benchmarks.run --suite llama3
    # --no-recompute`: 126 ms against 141-147 ms with the loops; 158 against 176 with --remat-policy
    # full, an earlier code).
    recompute: bool = True
    # FaultPolicy.recompute_kernel: what a GEMM's check cannot locate is redone by one device kernel
    # that computes only the detected blocks (bf16 / f16 GEMMs; no branch, no capacity); attention's
    # own recompute is unchanged. None (default): the kernel on the GPUs that run it (NVIDIA, sm_80
    # or newer), the loop elsewhere; --recompute-kernel forces it (a CPU: Pallas' interpreter, slow),
    # --no-recompute-kernel keeps the loop.
    recompute_kernel: bool | None = None
    # FaultPolicy.locate: --no-locate never corrects a GEMM's output in place from its checksums;
    # every detected block is recomputed instead (two errors in one block cannot then pass for one).
    locate: bool = True
    # FaultPolicy.weighted_checks: --no-weighted-checks (with --no-locate) checks each GEMM against the
    # plain checksums alone: 4 check columns per 128-column block on a GPU instead of 7.
    weighted_checks: bool = True
    # Attention's flash kernel: "auto" = the verified kernel where it applies (protected, Hopper);
    # "on" = also unprotected (cuDNN's, unchecked; the fast unprotected peer); "off" = never.
    flash: str = "auto"
    out_dir: str = "runs/llama3"
    ckpt_every: int = 0  # 0: no checkpoints
    resume: bool = False
    stop_after: int | None = None  # leave after this many steps of this run (as a preempted job would)
    coordinator: str | None = None  # multi-host: jax.distributed.initialize(coordinator, ...)
    num_processes: int | None = None
    process_id: int | None = None
    baseline: bool = False  # also train without faults/protection and plot both curves
    quiet: bool = False
    # Write the training step's compiled program (optimized HLO text) here before the first step:
    # what benchmarks.collectives reads (one more compile of the step; "" writes nothing).
    hlo_path: str = ""


_FLASH = {"auto": None, "on": True, "off": False}  # --flash -> layers.attention_core's flash


def parse_args(argv=None) -> TrainConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        name = "--" + f.name.replace("_", "-")
        if f.type in ("bool", "bool | None"):  # --name / --no-name; a None default: neither given
            ap.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "data":
            ap.add_argument(name, nargs="+", default=None, help="text files or folders")
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type.split(" ")[0], str)
            ap.add_argument(name, type=kind, default=f.default)
    cfg = TrainConfig(**vars(ap.parse_args(argv)))
    if cfg.config not in CONFIGS:
        ap.error(f"--config {cfg.config}: expected one of {sorted(CONFIGS)}")
    if cfg.flash not in _FLASH:
        ap.error(f"--flash {cfg.flash}: expected one of {sorted(_FLASH)}")
    if cfg.recompute_kernel and (not cfg.recompute or cfg.recompute_blocks is not None):
        ap.error(
            "--recompute-kernel redoes what a check cannot locate: "
            "not with --no-recompute or --recompute-blocks"
        )
    if not cfg.locate and not cfg.recompute:
        ap.error("--no-locate corrects by recomputing: not with --no-recompute")
    if not cfg.weighted_checks and cfg.locate:
        ap.error("--no-weighted-checks forms nothing to locate with: add --no-locate")
    if cfg.remat_policy not in REMAT_POLICIES:
        ap.error(f"--remat-policy {cfg.remat_policy}: expected one of {sorted(REMAT_POLICIES)}")
    if cfg.link_fault_rate > 0:
        ap.error(
            "--link-fault-rate: the training script does not route its attention yet (pimlayers.routing."
            "routed_attention exists; the Llama 3 model does not call it); run without it"
        )
    return cfg


def _mesh(fsdp: int, count: int = 0):
    devices = jax.devices()[: count or None]
    n = len(devices)
    fsdp = n if fsdp in (0, None) else fsdp
    if n % fsdp:
        raise ValueError(f"--fsdp {fsdp} does not divide the {n} devices")
    return jax.make_mesh(
        (n // fsdp, fsdp), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices
    )


def _spec(shape, fsdp: int) -> P:
    """FSDP: the largest dimension that the axis divides is sharded; small leaves stay replicated."""
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % fsdp == 0 and shape[d] >= fsdp:
            return P(*[("fsdp" if i == d else None) for i in range(len(shape))])
    return P()


def _xent(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _aval(a: jax.Array) -> jax.ShapeDtypeStruct:
    """``a``'s shape, dtype and, where it is committed to devices, sharding (an uncommitted array
    goes wherever the program's other arguments are, as it would in the call)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if a.committed else None)


def _peak(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def recompute_mode(policy: FaultPolicy) -> str:
    """What a protected GEMM does with what its check detects but cannot locate (with
    ``locate=False``: with all it detects), as ``policy`` resolves on this machine
    (``recompute_kernel=None``: the device kernel where a GPU runs it)."""
    from pimlayers.ops._redo_kernel import redo_kernel_wanted

    if not (policy.corrects and policy.recompute):
        return "none (skip)"
    if policy.recompute_blocks is not None:
        mode = f"{policy.recompute_blocks} blocks"
    else:
        mode = "device kernel" if redo_kernel_wanted(policy) else "whole GEMM"
    return mode if policy.locate else f"{mode}, for every detection (nothing located)"


def _host_sum(total: FaultReport, report: FaultReport) -> FaultReport:
    """A running sum of reports on the host, in int64: a long run's checked counts pass 2^31 (each
    step's scrub of 4 Llama-3-8B-dimension layers checks ~0.96M parameter stripes, of 32 layers ~8M:
    past 2^31 within 300 steps), and summing device arrays ran a dozen small eager ops per step
    through the runtime."""
    return jax.tree.map(
        lambda t, r: np.asarray(t, np.int64) + np.asarray(r, np.int64), total, jax.device_get(report)
    )


def train(cfg: TrainConfig) -> dict:
    """Run one training; returns the summary (also written to ``out_dir/summary.json``)."""
    if not cfg.recompute and cfg.recompute_blocks is not None:
        raise ValueError(
            f"TrainConfig.recompute=False recomputes nothing; recompute_blocks={cfg.recompute_blocks} "
            f"would redo blocks: choose one (recompute_blocks=None with recompute=False)"
        )
    if cfg.recompute_kernel and (not cfg.recompute or cfg.recompute_blocks is not None):
        raise ValueError(
            f"TrainConfig.recompute_kernel=True redoes what a check cannot locate on a device kernel; "
            f"with recompute={cfg.recompute} and recompute_blocks={cfg.recompute_blocks} choose one "
            f"(recompute=True, recompute_blocks=None with it)"
        )
    if not cfg.locate and not cfg.recompute:
        raise ValueError(
            "TrainConfig.locate=False corrects every detected block by recomputing it; with "
            "recompute=False nothing would be corrected (keep locate=True or recompute=True)"
        )
    if not cfg.weighted_checks and cfg.locate:
        raise ValueError(
            "TrainConfig.weighted_checks=False forms no position-weighted checks, which locating "
            "reads: with it locate=False"
        )
    if cfg.remat_policy not in REMAT_POLICIES:
        raise ValueError(
            f"TrainConfig.remat_policy={cfg.remat_policy!r}; expected one of {sorted(REMAT_POLICIES)}"
        )
    if cfg.coordinator:
        jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    out = pathlib.Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if cfg.quiet else print

    # --- data ---
    t0 = time.perf_counter()
    corpus = D.load_corpus(cfg.data, cfg.max_bytes)
    model_cfg = get_config(cfg.config, **({"n_layers": cfg.layers} if cfg.layers else {}))
    tok = D.make_tokenizer(cfg.tokenizer, corpus, model_cfg.vocab_size, pathlib.Path(".cache/tokenizers"))
    model_cfg = model_cfg.replace(
        vocab_size=max(tok.vocab_size, 1), max_seq_len=max(model_cfg.max_seq_len, cfg.seq)
    )
    train_ids, valid_ids = tok.encode(corpus.train), tok.encode(corpus.valid)
    unigram = D.unigram_cross_entropy(train_ids, valid_ids, model_cfg.vocab_size)
    say(
        f"data: {corpus.source}: {corpus.files} files, {D.fmt_bytes(len(corpus.train))} train / "
        f"{D.fmt_bytes(len(corpus.valid))} held out; {tok.kind} tokenizer, vocab {tok.vocab_size}: "
        f"{len(train_ids):,} / {len(valid_ids):,} tokens ({time.perf_counter() - t0:.1f} s)"
    )
    say(f"unigram cross-entropy of the held-out tokens: {unigram:.3f} nats/token (the bar to beat)")

    # --- model, sharding, optimizer, store ---
    mesh = _mesh(cfg.fsdp, cfg.devices)
    if cfg.batch % mesh.size:
        raise ValueError(f"--batch {cfg.batch} does not split over the {mesh.size} devices of the mesh")
    # Checksums per 128-column block, not per whole row: the detection bound grows with the block's
    # sum of |x| |w|, and at the 8B widths (N = 14336) a whole-row bound is ~67, so an exponent flip
    # that turns a value of 2 into 0 would pass as rounding; per 128 columns it is ~0.2.
    policy = (
        FaultPolicy(
            block_n=128,
            fused=cfg.fused,
            recompute=cfg.recompute,
            recompute_blocks=cfg.recompute_blocks,
            recompute_kernel=cfg.recompute_kernel,
            locate=cfg.locate,
            weighted_checks=cfg.weighted_checks,
        )
        if cfg.protect
        else FaultPolicy.off()
    )
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    if cfg.flash not in _FLASH:
        raise ValueError(f"TrainConfig.flash={cfg.flash!r}; expected one of {sorted(_FLASH)}")
    model = Llama3(
        model_cfg,
        dtype=dtype,
        param_dtype=pdtype,
        policy=policy,
        remat=cfg.remat_policy if cfg.remat else False,
        flash=_FLASH[cfg.flash],
        rngs=nnx.Rngs(cfg.seed),
    )
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    model.activation_sharding = batch_sharding
    gemm_sites = cfg.batch * cfg.seq
    if cfg.protect:
        for layer in model.layers:  # fixed-shape injection sites; which fire is data, per step
            pnnx.inject(layer.mlp, {"up": GemmFaults.none(1)})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fsdp = mesh.shape["fsdp"]
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, _spec(x.shape, fsdp)), params)
    params = jax.device_put(params, shardings)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr / 10
    )
    # fault_aware(chain(clip_by_global_norm, adamw)), whose step can also run fused with the encode.
    opt = adamw_guarded(
        schedule, weight_decay=cfg.weight_decay, clip=cfg.clip if cfg.clip > 0 else None, policy=FaultPolicy()
    )
    tx = opt.tx
    # The moments are sharded like the parameters and the counters replicated on the mesh, as the
    # step returns them: otherwise XLA chooses the initial state's layout (the moments replicated on
    # every device) and the second step recompiles for the layout the first one returned.
    replicated = NamedSharding(mesh, P())
    abstract = jax.eval_shape(tx.init, params)
    state_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract, shardings, transform_non_params=lambda _: replicated
    )
    opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    store = PimStore(params, BankGeometry(), mesh=mesh, axis="fsdp") if cfg.protect else None
    f32_params = all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # what the fused step takes
    say(
        f"model: {cfg.config} ({model_cfg.n_layers} layers, dim {model_cfg.dim}), {n_params:,} parameters; "
        f"mesh {dict(mesh.shape)}; protection {'on' if cfg.protect else 'off'}"
        + (f" (GEMM recompute: {recompute_mode(policy)})" if cfg.protect else "")
        + (
            "; GEMMs checked on their plain checksums alone"
            if cfg.protect and not policy.weighted_checks
            else ""
        )
        + (f"; parity {store.overhead()['parity_fraction']:.3f} of the parameter bytes" if store else "")
        + ("; encoded by AdamW's step itself" if store and cfg.fused_update and f32_params else "")
    )

    # --- the step ---
    layers = model_cfg.n_layers
    compute = pnnx.compute_dtypes(model)  # each parameter's dtype in the forward pass

    def step_fn(params, rest, opt_state, pim_state, batch, key, scrub: bool):
        # The scrub and repair run inside the step's program, not as a call of their own before it:
        # their branch (repair only what is faulty) makes a GPU's host wait for the scrub's result,
        # and as a separate call that wait came between two dispatches, the device idle while the
        # host then queued the step (on an H200 the protected step's call took ~180 ms of host
        # time for ~140 ms of kernels). Inside, the host resumes queueing the step's own kernels.
        cast = compute if store is not None and cfg.cast_on_scrub else None
        if store is not None and scrub:
            fixed = store.repair(params, pim_state, cast=cast)
            params, mem, weights = fixed.params, fixed.report, fixed.compute
        else:
            mem = FaultReport.zeros()
            weights = None if cast is None else jax.tree.map(lambda p, d: p.astype(d), params, cast)
        kg, kl, kn = jax.random.split(key, 3)
        m = nnx.merge(graphdef, params if weights is None else weights, rest)
        if cfg.protect:
            fire = jax.random.uniform(kg) < cfg.gemm_fault_rate
            which = jax.random.randint(kl, (), 0, layers)
            # Bit 30 of the f32 output (the exponent's top bit): the value is scaled by 2^±128 or becomes
            # inf, an error far outside rounding, so every injection must be detected. Flips of low bits
            # can stay inside the rounding bound by design; the ABFT campaign measures those.
            for i, layer in enumerate(m.layers):
                f = GemmFaults.random(
                    jax.random.fold_in(kg, i),
                    (gemm_sites, model_cfg.ffn_dim),
                    1,
                    1.0,
                    bit=30,
                )
                pnnx.inject(layer.mlp, {"up": f._replace(active=f.active & fire & (which == i))})
            injected = fire.astype(jnp.int32)
        else:
            injected = jnp.int32(0)

        def loss_fn(mm):
            return _xent(mm(batch[:, :-1]), batch[:, 1:]), pnnx.fault_report(mm)

        # Protected: also differentiate the layers' FaultTap zeros, whose gradient is the backward
        # GEMMs' report (dx, dw), so a backward fault is counted and an uncorrectable one skips the
        # step like a forward one (before, backward faults were corrected but never counted).
        wrt = (nnx.Param, pnnx.FaultTap) if cfg.protect else nnx.Param
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True, argnums=nnx.DiffState(0, wrt))
        (loss, report), grads = grad_fn(m)
        if cfg.protect:
            report = report + pnnx.backward_report(grads)
            grads = nnx.state(grads, nnx.Param)
        fused = store is not None and cfg.fused_update and f32_params  # the fused step takes float32
        if weights is not None and not fused:  # the gradient of a cast: the copy's, as a float32
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        nan = jax.random.uniform(kn) < cfg.nan_rate
        grads = jax.tree.map(lambda g: jnp.where(nan, jnp.asarray(jnp.nan, g.dtype), g), grads)
        if fused:  # a bf16 copy's gradient is read as it is (widened exactly in the update's read)
            params, opt_state, pim = opt.update_and_guard(grads, opt_state, params, store, report=report)
        else:
            updates, opt_state = tx.update(grads, opt_state, params, report=report)
            params = optax.apply_updates(params, updates)
            pim = store.encode(params) if store is not None else None
        stats = dict(
            loss=loss,
            injected_gemm=injected,
            nan_burst=nan.astype(jnp.int32),
            skipped=(opt_state.last_skip_reason != SKIP_NONE).astype(jnp.int32),
        )
        return params, opt_state, pim, stats, report, mem

    step = jax.jit(step_fn, donate_argnums=(0, 2, 3), static_argnames="scrub")
    eval_loss = jax.jit(lambda p, r, b: _xent(nnx.merge(graphdef, p, r)(b[:, :-1]), b[:, 1:]))
    windows = jax.device_put(jnp.asarray(D.eval_windows(valid_ids, cfg.seq, cfg.eval_windows)))

    def evaluate(params):
        return float(
            np.mean(
                [
                    eval_loss(params, rest, windows[i : i + cfg.batch])
                    for i in range(0, len(windows), cfg.batch)
                ]
            )
        )

    # --- checkpoints (Orbax) ---
    start = 0
    mngr = None
    if cfg.ckpt_every:
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(
            out.resolve() / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2)
        )
        if cfg.resume and mngr.latest_step() is not None:
            last = mngr.latest_step()
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
            got = mngr.restore(last, args=ocp.args.StandardRestore(abstract))
            params, opt_state, start = got["params"], got["opt"], last
            say(f"resumed from step {last}")
    pim_state = store.encode(params) if store is not None else None

    # --- loop ---
    from tqdm import tqdm

    totals = dict(flips=0, gemm_injected=0, nan_bursts=0, skipped=0)
    report_sum = memory = _host_sum(FaultReport.zeros(), FaultReport.zeros())
    log = (out / "log.jsonl").open("a" if cfg.resume else "w")
    curve, evals = [], []
    tokens_per_step = cfg.batch * cfg.seq
    flops_tok = model_cfg.flops_per_token(cfg.seq)
    peak = _peak(jax.devices()[0])
    peak = peak * mesh.size if peak else None  # every device of the mesh contributes its peak
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=cfg.quiet, dynamic_ncols=True)
    stream = D.batches(train_ids, cfg.batch, cfg.seq, cfg.seed, start_step=start)
    t_last, tok_s = time.perf_counter(), 0.0
    step_s: list[float] = []  # wall time of each step after the first of this run (that one compiles)
    # Host time of each step's call (after the first): queueing it, and waiting wherever its program
    # makes the host wait (a GPU reads loop and branch predicates on the host). Near the step time,
    # the host and not the device sets the pace.
    call_s: list[float] = []
    # The logged learning rate of every step, evaluated once here. Evaluated per step (the schedule
    # is a handful of small jnp ops), it was a program queued behind the step just dispatched, and
    # reading it made the host wait for that whole step, so the device could idle while the host
    # logged and queued the next one (on an H200 both steps spent ~10 ms per step outside their
    # program; with the schedule evaluated here, 0.03 ms: 2026-12-04, docs/gpu-tests.md).
    lrs = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(cfg.steps)), np.float64)

    def finish(s, stats, report, mem, timed: bool) -> None:
        """Read step s's counters (waits for it), log it and move the bar. ``timed``: the interval
        since the last read is step s's time (see the loop)."""
        nonlocal report_sum, memory, t_last, tok_s
        stats = {k: float(v) for k, v in jax.device_get(stats).items()}
        report_sum, memory = _host_sum(report_sum, report), _host_sum(memory, mem)
        totals["gemm_injected"] += int(stats["injected_gemm"])
        totals["nan_bursts"] += int(stats["nan_burst"])
        totals["skipped"] += int(stats["skipped"])
        now = time.perf_counter()
        if s > start and timed:
            step_s.append(now - t_last)
        tok_s = tokens_per_step / (now - t_last) if s > start else 0.0
        t_last = now
        mfu = flops_tok * tok_s / peak if peak else None
        rec = dict(
            step=s + 1,
            loss=stats["loss"],
            tokens_per_s=tok_s,
            mfu=mfu,
            lr=float(lrs[s]),
            **totals,
            **{k: int(v) for k, v in _host_sum(report_sum, memory).to_dict().items() if v},
        )
        if (s + 1) % cfg.eval_every == 0 or s + 1 == cfg.steps:
            rec["eval_loss"] = evaluate(params)  # read before the next step is queued (below)
            evals.append((s + 1, rec["eval_loss"]))
            t_last = time.perf_counter()  # the next step's interval starts after the evaluation
        curve.append((s + 1, stats["loss"]))
        log.write(json.dumps(rec) + "\n")
        bar.set_postfix(
            loss=f"{stats['loss']:.3f}",
            tok_s=f"{tok_s:,.0f}",
            mfu="n/a" if mfu is None else f"{mfu:.1%}",
            gemm=f"{int(report_sum.gemm_corrected)}/{totals['gemm_injected']}",
            flips=f"{int(memory.banks_repaired)}/{totals['flips']}",
            skip=totals["skipped"],
        )

    # Step s's counters are read once step s + 1 is queued, so the host's reading, logging and next
    # dispatch overlap the device's work instead of following it (this only pays once nothing in
    # the step makes the host wait: see step_fn's scrub and fault_aware's select). Steps that
    # evaluate, checkpoint or end the run are read before anything else is queued.
    #
    # Step times are the intervals between reads (bit flips injected between steps included). A step
    # read right after the one before it in the same iteration (the run's last, or one before an
    # evaluation) is left out of the median: where the step makes the host wait (a loop or branch
    # on a GPU), its time was mostly spent inside the previous interval, which ended only once this
    # step had been queued.
    #
    # The first step (it compiles, and is not timed) is read before the next is queued, so the first
    # timed interval starts when the device has finished it. Read after the next step was queued,
    # as the others are, its read waited for that call, and a call slow on the host moved time from
    # the first timed interval into the untimed one: on an H100 (2026-12-07) the plain checks'
    # step timed its first step at 11-17 ms against ~108 for the others. Read as now, the same step's
    # first timed step took ~135 ms (H100, step-ab-s65wc): the loaded program's first run is ~25 ms
    # longer than the rest, which the median leaves out.
    pending, first = None, None
    for s in bar:
        if store is not None and cfg.flip_every and s > 0 and s % cfg.flip_every == 0:
            faults.random_bit_flips(store, params, cfg.flips, seed=cfg.seed * 1_000_003 + s)
            totals["flips"] += cfg.flips
        batch = jax.device_put(jnp.asarray(next(stream)), batch_sharding)
        args = (params, rest, opt_state, pim_state, batch, jax.random.key(cfg.seed * 7919 + s))
        scrub = store is not None and s % cfg.scrub_every == 0
        if s == start:  # the step's arguments as the program sees them, kept before they are donated
            first = (jax.tree.map(_aval, args), scrub)
        if cfg.hlo_path and s == start:
            pathlib.Path(cfg.hlo_path).write_text(step.lower(*args, scrub=scrub).compile().as_text())
        t_call = time.perf_counter()
        params, opt_state, new_pim, stats, report, mem = step(*args, scrub=scrub)
        if s > start:
            call_s.append(time.perf_counter() - t_call)
        if new_pim is not None:
            pim_state = new_pim
        read_before = pending is not None
        if read_before:
            finish(*pending, timed=True)
        pending = (s, stats, report, mem)
        stop = bool(cfg.stop_after) and s + 1 - start >= cfg.stop_after
        ckpt = mngr is not None and (s + 1) % cfg.ckpt_every == 0
        if s == start or stop or ckpt or (s + 1) % cfg.eval_every == 0 or s + 1 == cfg.steps:
            finish(*pending, timed=not read_before)
            pending = None
        if ckpt:
            import orbax.checkpoint as ocp

            mngr.save(s + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
            t_last = time.perf_counter()
        if stop:
            break
    if pending is not None:
        finish(*pending, timed=True)
    if mngr is not None:
        mngr.wait_until_finished()
    log.close()
    if store is not None:  # a last look: nothing may be left faulty
        fixed = store.repair(params, pim_state)
        params, pim_state, memory = fixed.params, fixed.state, _host_sum(memory, fixed.report)
    final_eval = evaluate(params)
    # The median step (the step with its scrub and repair, and the host reading its counters) is the
    # throughput figure; the last step alone is what the progress bar showed.
    median_tok_s = tokens_per_step / float(np.median(step_s)) if step_s else 0.0
    mem = jax.devices()[0].memory_stats() or {}
    # The first step's program as compiled (after the run: no step waits on it). Its footprint on
    # one device (arguments, outputs not aliased to them, temporaries) is the step's own; the
    # allocator's peak is the process's, over every program it ran.
    program = None if first is None else step.lower(*first[0], scrub=first[1]).compile().memory_analysis()
    program_bytes = (
        None
        if program is None
        else program.argument_size_in_bytes
        + program.output_size_in_bytes
        - program.alias_size_in_bytes
        + program.temp_size_in_bytes
    )
    summary = dict(
        config=cfg.config,
        steps=cfg.steps,
        tokens=cfg.steps * tokens_per_step,
        params=n_params,
        final_eval_loss=final_eval,
        unigram_cross_entropy=unigram,
        protect=cfg.protect,
        recompute=recompute_mode(policy) if cfg.protect else None,
        injected=totals,
        gemm=report_sum.to_dict(),
        memory=memory.to_dict(),
        curve=curve,
        evals=evals,
        tokens_per_s=tok_s,
        mfu=(flops_tok * tok_s / peak) if peak else None,
        step_seconds=step_s,
        call_seconds=call_s,
        step_programs=step._cache_size(),  # compiled step programs: one per scrub setting used
        tokens_per_s_median=median_tok_s,
        mfu_median=(flops_tok * median_tok_s / peak) if peak else None,
        flops_per_token=flops_tok,
        peak_bytes_in_use=mem.get("peak_bytes_in_use"),  # the process's, all programs so far
        step_program_bytes=program_bytes,  # the step program's footprint per device
        bytes_limit=mem.get("bytes_limit"),
        mesh=dict(mesh.shape),
        layers=model_cfg.n_layers,
        seq=cfg.seq,
        batch=cfg.batch,
        dtype=cfg.dtype,
        device=f"{jax.devices()[0].platform}:{getattr(jax.devices()[0], 'device_kind', '')}",
        devices=mesh.size,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return dict(summary, params_final=params)


def fault_table(s: dict) -> str:
    """Injected faults beside what the protection reported: every line must close."""
    inj, g, m = s["injected"], s["gemm"], s["memory"]
    rows = [
        (
            "GEMM output bit flips",
            inj["gemm_injected"],
            g["gemm_detected"],
            g["gemm_corrected"],
            g["gemm_uncorrectable"],
        ),
        (
            "parameter bit flips (HBM)",
            inj["flips"],
            m["banks_faulty"],
            m["banks_repaired"],
            m["banks_uncorrectable"],
        ),
        ("NaN bursts in gradients", inj["nan_bursts"], inj["skipped"], inj["skipped"], 0),
    ]
    lines = [f"{'fault':<28}{'injected':>10}{'detected':>10}{'fixed':>10}{'uncorr.':>10}{'silent':>8}"]
    for name, n, det, fix, lost in rows:
        silent = max(n - det, 0)
        lines.append(f"{name:<28}{n:>10}{det:>10}{fix:>10}{lost:>10}{silent:>8}")
    lines.append(
        "fixed: GEMMs corrected (in place or by recomputing); stripes rebuilt from parity; steps the"
    )
    lines.append("optimizer skipped. silent: injected but never detected.")
    return "\n".join(lines)


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        label = "protected, faults injected" if r["protect"] else "unprotected, no faults"
        steps, loss = zip(*r["curve"], strict=True)
        ax.plot(steps, loss, lw=1, alpha=0.6, label=f"train ({label})")
        if r["evals"]:
            es, el = zip(*r["evals"], strict=True)
            ax.plot(es, el, "o-", label=f"held out ({label})")
    ax.axhline(runs[0]["unigram_cross_entropy"], color="grey", ls="--", label="unigram cross-entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{runs[0]['config']}: {runs[0]['params']:,} parameters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    t0 = time.perf_counter()
    s = train(cfg)
    runs = [s]
    if cfg.baseline:
        base = dataclasses.replace(
            cfg,
            protect=False,
            flip_every=0,
            gemm_fault_rate=0.0,
            nan_rate=0.0,
            out_dir=str(pathlib.Path(cfg.out_dir) / "baseline"),
            baseline=False,
            resume=False,
            ckpt_every=0,
        )
        runs.append(train(base))
    out = pathlib.Path(cfg.out_dir)
    plot(runs, out / "loss.png")
    print()
    print(fault_table(s))
    print()
    below = s["final_eval_loss"] < s["unigram_cross_entropy"]
    print(
        f"held-out loss {s['final_eval_loss']:.3f} nats/token vs unigram cross-entropy "
        f"{s['unigram_cross_entropy']:.3f}: {'below' if below else 'NOT below'}"
    )
    if cfg.baseline:
        print(f"baseline (no protection, no faults) held-out loss {runs[1]['final_eval_loss']:.3f}")
    mfu = "n/a (no peak known for this device)" if s["mfu_median"] is None else f"{s['mfu_median']:.1%}"
    print(
        f"{s['tokens_per_s_median']:,.0f} tokens/s (median step), MFU {mfu}; "
        f"{time.perf_counter() - t0:.0f} s in all"
    )
    print(f"wrote {out / 'log.jsonl'}, {out / 'summary.json'}, {out / 'loss.png'}")
    silent = s["injected"]["gemm_injected"] - s["gemm"]["gemm_detected"]
    silent += s["injected"]["nan_bursts"] - s["injected"]["skipped"]
    return 1 if silent > 0 and cfg.protect else 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
