"""protected_matmul against the plain XLA GEMM at Llama-3-8B shapes (bf16, M = 8192), one run.

Forward: y = x @ w. Forward+backward: value and gradient of sum(y * g) with respect to x and w
(three GEMMs on both sides). The protected version verifies (and would correct) every GEMM;
"ratio" = plain time / protected time, so 1.00 is free protection and 0.80 is a 25% overhead.
``protected`` is the default policy (the GEMM, then the native check pass over y; on a GPU that
runs it, what a check cannot locate is redone by the device kernel, ``FaultPolicy.recompute_kernel``'s
default, timed there after checking that it repairs two errors in one block); ``loop`` is
``FaultPolicy(recompute_kernel=False)``, the recompute loop whose predicate the host reads (the
default before 2026-12-05), timed where the default takes the kernel; ``loop_ratio`` = plain /
loop, alternating as ``ratio``. ``fused`` is ``FaultPolicy(fused=True)`` (on a Hopper GPU the forward
runs the fused kernel, whose epilogue forms the checked sums, its detected tiles redone on the
device kernel), timed in the same run at 128-column blocks on a Hopper GPU only. Files before
2026-12-05's ``s40`` run: ``protected`` was the loop, ``kernel`` the device redo and
``fused_redo_kernel`` the fused GEMM with it. ``c1_only`` is ``FaultPolicy(weighted_checks=False,
locate=False)`` (the plain checksums alone: 4 check columns per 128-column block on a GPU instead of
7; every detected block recomputed), timed where the checks are XLA's GEMMs (not a CPU-only process,
whose native checks form both). ``fused_c1`` is both (``FaultPolicy(fused=True, weighted_checks=False,
locate=False)``): on a Hopper GPU the fused kernel then forms c1 and mag itself from its own read of x
(``fused_gemm_checked``), so no check GEMM runs; timed with ``fused``, alternating as ``ratio``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pimlayers import FaultPolicy, native_info, ops
from pimlayers.faults import GemmFaults
from pimlayers.ops._abft import (
    WeightChecksums,
    checks_native_everywhere,
    encode_transposed_gemm,
    pair_applies,
)
from pimlayers.ops._checks_kernel import checks_kernel, checks_kernel_applies
from pimlayers.ops._fused_gemm import TILE, check_tiles_of, fused_gemm, fused_gemm_checked, hopper
from pimlayers.ops._redo_kernel import _device_runs_it, redo_kernel_chosen

from ._harness import environ, time_fn, time_pair
from .profile import device_ms, kernel_events

SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)]
SMALL_SHAPES = [(256, 1024), (1024, 256), (512, 512)]  # the CPU goal: "protected Dense at small sizes"


VARIANTS = ("fused", "loop", "checks_kernel", "c1_only", "fused_c1")


def run(
    m: int = 8192, shapes=SHAPES, dtype=jnp.bfloat16, block_ns=(None, 128), variants=VARIANTS
) -> list[dict]:
    """Rows per block width and shape; ``variants``: which of ``VARIANTS`` to time beside the default
    (each where it applies, as the module docstring says)."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"benchmarks.matmul: variants {sorted(unknown)}; expected some of {VARIANTS}")
    rows = []
    for block_n in block_ns:
        policy = FaultPolicy(block_n=block_n)
        for k, n in shapes:
            rows += _shape(m, k, n, dtype, policy, frozenset(variants))
    return rows


def pairs(m: int, k: int, n: int, dtype, policy: FaultPolicy) -> dict:
    """What the matmul suites time, per mode: (plain, protected, plain's args, protected's args).

    "fwd": y = x @ w. "fwd+bwd": value_and_grad of sum(y * g) with respect to x and w (the loss
    value needs y, so both sides run all three GEMMs, as training does), g a random cotangent
    passed as an argument: a constant (e.g. ones) lets XLA fold the backward.
    """
    kx, kw = jax.random.split(jax.random.key(k + n))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    g = jax.random.normal(jax.random.key(7), (m, n), jnp.float32).astype(dtype)
    enc = ops.abft_encode(w, policy.block_n)

    def loss_plain(a, b, c):
        return jnp.sum((jnp.matmul(a, b) * c).astype(jnp.float32))

    def loss_prot(a, b, e, c):
        return jnp.sum((ops.protected_matmul(a, b, e, policy=policy)[0] * c).astype(jnp.float32))

    return {
        "fwd": (
            jax.jit(lambda a, b: jnp.matmul(a, b)),
            jax.jit(lambda a, b, e: ops.protected_matmul(a, b, e, policy=policy)),
            (x, w),
            (x, w, enc),
        ),
        "fwd+bwd": (
            jax.jit(jax.value_and_grad(loss_plain, argnums=(0, 1))),
            jax.jit(jax.value_and_grad(loss_prot, argnums=(0, 1))),
            (x, w, g),
            (x, w, enc, g),
        ),
    }


def _shape(m: int, k: int, n: int, dtype, policy: FaultPolicy, variants=frozenset(VARIANTS)) -> list[dict]:
    rows = []
    # Elsewhere than a Hopper GPU (or at whole-row blocks) "fused" would time the default again.
    fused_here = hopper() and policy.block_n == TILE
    with_fused = fused_here and "fused" in variants
    cases = pairs(m, k, n, dtype, policy)
    fused = pairs(m, k, n, dtype, policy.replace(fused=True)) if with_fused else None
    # Where the default redoes on the device kernel (a GPU that runs it), the loop it replaced: on a
    # CPU the default is the loop itself.
    with_loop = _redo_kernel_timed(dtype, policy) and "loop" in variants
    loop = pairs(m, k, n, dtype, policy.replace(recompute_kernel=False)) if with_loop else None
    # The opt-in one-read checks kernel (PIMLAYERS_CHECKS_KERNEL=1), where a GPU runs it: the same
    # programs traced with it asked for (each check it takes; XLA's GEMMs for the rest).
    with_ck = jnp.dtype(dtype) == jnp.bfloat16 and _gpu_runs_checks_kernel() and "checks_kernel" in variants
    ck = None
    if with_ck:
        ck = {
            mode: (a, _asking_for_checks_kernel(b), c, d)
            for mode, (a, b, c, d) in pairs(m, k, n, dtype, policy).items()
        }
    # FaultPolicy(weighted_checks=False): the plain checksums alone (fewer check columns), where the
    # checks are XLA's GEMMs (a GPU); the native CPU checks form both either way.
    with_c1 = policy.block_n is not None and _c1_checks_timed() and "c1_only" in variants
    c1_policy = policy.replace(weighted_checks=False, locate=False)
    c1 = pairs(m, k, n, dtype, c1_policy) if with_c1 else None
    # The fused path with the plain checks: c1 and mag from the fused kernel itself (no check GEMMs).
    with_fused_c1 = fused_here and "fused_c1" in variants
    fused_c1 = pairs(m, k, n, dtype, c1_policy.replace(fused=True)) if with_fused_c1 else None
    plain, prot, args_p, args_q = cases["fwd"]
    y0 = plain(*args_p)
    others = [c["fwd"][1] for c in (fused, loop, ck, c1, fused_c1) if c is not None]
    for f in (prot, *others):
        y1, rep = f(*args_q)
        err = float(jnp.max(jnp.abs(y0.astype(jnp.float32) - y1.astype(jnp.float32))))
        if rep.to_dict()["gemm_detected"] or err > 0.05:
            raise AssertionError(f"protected_matmul {k}->{n}: report {rep.to_dict()}, max diff {err}")
    if with_loop:  # the default's device redo, and the fused path's on the same kernel
        _check_redo(policy, args_q, y0, f"{k}->{n}")
        if with_fused:
            _check_redo(policy.replace(fused=True), args_q, y0, f"fused {k}->{n}")
        if with_c1:
            _check_redo(c1_policy, args_q, y0, f"plain checks {k}->{n}")
        if with_fused_c1:
            _check_redo(c1_policy.replace(fused=True), args_q, y0, f"fused plain checks {k}->{n}")
    flops = 2.0 * m * k * n
    t0, t1, ratio = time_pair(plain, args_p, prot, args_q)
    extra = {}
    if with_fused:
        t2 = time_fn(fused["fwd"][1], *args_q)
        extra = dict(fused_ms=t2 * 1e3, fused_ratio=t0 / t2)
    if with_loop:
        extra |= _pair_cols(plain, args_p, loop["fwd"][1], args_q, "loop")
    if with_ck:
        extra |= _pair_cols(plain, args_p, ck["fwd"][1], args_q, "checks_kernel")
    if with_c1:
        extra |= _pair_cols(plain, args_p, c1["fwd"][1], args_q, "c1_only")
    if with_fused_c1:
        extra |= _pair_cols(plain, args_p, fused_c1["fwd"][1], args_q, "fused_c1")
    # What the default (``protected``) does with a detection it cannot locate, on this machine.
    extra["recompute"] = "device kernel" if _redo_kernel_timed(dtype, policy) else "loop"
    rows.append(_row(f"fwd {k}->{n}", m, policy, t0, t1, flops, ratio, **extra))

    plain_g, prot_g, args_p, args_q = cases["fwd+bwd"]
    (_, gp), (_, gq) = plain_g(*args_p), prot_g(*args_q)
    gerr = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(gp, gq, strict=True)
    )
    ck_gerr = None
    if with_ck:  # its gradients against the plain GEMM's, as max_grad_diff is the default's
        (_, gk) = ck["fwd+bwd"][1](*args_q)
        ck_gerr = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(gp, gk, strict=True)
        )
    t0, t1, ratio = time_pair(plain_g, args_p, prot_g, args_q)
    extra = {}
    if with_fused:
        t2 = time_fn(fused["fwd+bwd"][1], *args_q)
        extra = dict(fused_ms=t2 * 1e3, fused_ratio=t0 / t2)
    if with_loop:
        extra |= _pair_cols(plain_g, args_p, loop["fwd+bwd"][1], args_q, "loop")
    if with_ck:
        extra |= _pair_cols(plain_g, args_p, ck["fwd+bwd"][1], args_q, "checks_kernel")
        extra["checks_kernel_grad_diff"] = ck_gerr
    if with_c1:
        extra |= _pair_cols(plain_g, args_p, c1["fwd+bwd"][1], args_q, "c1_only")
    if with_fused_c1:
        extra |= _pair_cols(plain_g, args_p, fused_c1["fwd+bwd"][1], args_q, "fused_c1")
    extra["recompute"] = "device kernel" if _redo_kernel_timed(dtype, policy) else "loop"
    rows.append(_row(f"fwd+bwd {k}->{n}", m, policy, t0, t1, 3 * flops, ratio, max_grad_diff=gerr, **extra))
    return rows


def _fused_checked(x, w, enc: WeightChecksums):
    """``(fn, args)``: the fused kernel with the plain checks (``fused_gemm_checked``) alone, its check
    tiles built from ``enc`` as the protected GEMM builds them (default λ)."""
    tiles, terms = check_tiles_of(enc, FaultPolicy().lam)
    return jax.jit(lambda a, b, t: fused_gemm_checked(a, b, t, terms)), (x, w, tiles)


def _c1_checks_timed() -> bool:
    """Whether the checks are XLA's GEMMs here (not the native CPU pass, which forms c2 anyway), so
    that dropping c2 changes what runs: the ``c1_only`` columns."""
    return not checks_native_everywhere()


def _redo_kernel_timed(dtype, policy: FaultPolicy) -> bool:
    """Whether the default redoes on the device kernel here (a GPU that runs it; bf16 / f16 GEMMs), so
    that the suite also times the loop it replaced."""
    return redo_kernel_chosen(policy) and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def _gpu_runs_checks_kernel() -> bool:
    """Whether JAX's first device is a GPU that runs the opt-in one-read checks kernel."""
    return jax.devices()[0].platform != "cpu" and _device_runs_it()


def _checks_kernel_timed(x, enc: WeightChecksums) -> bool:
    """Whether the opt-in one-read checks kernel (``_checks_kernel``) runs here and takes these
    checks (f32-accurate: 3 + 2 terms, as ``abft_checks`` without λ forms them)."""
    return _gpu_runs_checks_kernel() and checks_kernel_applies(x, enc.sums, 3, 2, False)


def _asking_for_checks_kernel(fn):
    """``fn`` (jitted) traced with ``PIMLAYERS_CHECKS_KERNEL=1`` (its first call traces it; later calls
    reuse that program)."""

    def run(*args):
        with environ("PIMLAYERS_CHECKS_KERNEL", "1"):
            return fn(*args)

    return run


def _same_checks(what: str, want, got, x, enc: WeightChecksums, transposed: bool = False) -> None:
    """The kernel's (c, mag) against ``abft_checks``': within ``accumulation_tolerance(k)`` of each
    sum's magnitude (f32 accumulation in another order; the same split terms on both sides): |x|
    against |sums| for c, mag itself (a sum of non-negative products) for mag. Any batch of
    weights, x transposed or not (the tests' cases use it too)."""
    from pimlayers.ops._abft import _dot_x
    from pimlayers.ops._checks_kernel import accumulation_tolerance

    k = x.shape[-2] if transposed else x.shape[-1]
    tol = accumulation_tolerance(k)
    nb = enc.abs_sums.shape[-1]
    abs_sums = jnp.abs(enc.sums).reshape(*enc.sums.shape[:-2], nb * 2)
    c_scale = _dot_x(jnp.abs(x.astype(jnp.float32)), abs_sums, transposed, precision="highest")
    scales = (jnp.reshape(c_scale, jnp.shape(want[0])), want[1])
    for name, a, b, sc in zip(("c", "mag"), want, got, scales, strict=True):
        diff = np.asarray(jnp.abs(a - b), np.float64)
        sc = np.asarray(sc, np.float64)
        if not np.all(diff <= tol * sc):
            worst = float(np.max(diff / np.maximum(sc, 1e-30)))
            raise AssertionError(
                f"{what}: the checks kernel's {name} differs from abft_checks' by {worst:.3g} of its "
                f"magnitude, past the f32 accumulation's {tol:.3g} (K = {k})"
            )


def _refused(fns: dict, errors: dict, names: tuple[str, ...], check, *args) -> None:
    """Run ``check(*args)``; where it fails, drop the variants ``names`` from ``fns`` (they are not
    timed) and record why in ``errors`` (the row's ``{name}_error`` columns): one optional variant's
    failed check does not stop the rest of the suite."""
    try:
        check(*args)
    except AssertionError as err:
        for name in names:
            fns.pop(name, None)
            errors[name] = str(err)


def _kernel_cols(name: str, fn, args) -> dict:
    """``{name}_dev_ms`` (the device kernels' time in one call, copies included) and
    ``{name}_kernels`` (the six costliest, "name µs; ..."), from a profiler trace; none without a
    device timeline (a CPU). On an H100 the device redo's forward at 4096 -> 14336 took 0.085 ms
    more than recomputing nothing, about what a copy of its 235 MB product would take, where the
    redo kernel itself should only read the flags (2026-12-05, matmul-parts-s40): these columns say
    which kernel it is."""
    if not _device_timeline():  # a CPU: the trace would hold no device kernels
        return {}
    us = kernel_events(fn, *args, copies=True)[0]
    if not us:
        return {}
    top = "; ".join(f"{k} {v:.0f}" for k, v in us.most_common(6))
    return {f"{name}_dev_ms": sum(us.values()) / 1e3, f"{name}_kernels": top}


def _device_timeline() -> bool:
    """Whether JAX's first device is an accelerator, whose profiler trace has a device timeline."""
    return jax.devices()[0].platform != "cpu"


def _no_false_detection(fn_args, what: str) -> None:
    """A protected forward on clean inputs detects nothing."""
    fn, args = fn_args
    _, rep = fn(*args)
    if rep.to_dict()["gemm_detected"]:
        raise AssertionError(f"{what}: false detection {rep.to_dict()}")


def _pair_cols(plain, args_p, other, args_q, name: str) -> dict:
    """``{name}_ms`` and ``{name}_ratio`` (plain / it, alternating rounds as ``time_pair``)."""
    _, t, ratio = time_pair(plain, args_p, other, args_q)
    return {f"{name}_ms": t * 1e3, f"{name}_ratio": ratio}


def _check_redo(policy: FaultPolicy, args, y0, what: str) -> None:
    """Before timing the device redo (the default on a GPU that runs it): two errors no check locates
    in one block of row 17 must come back repaired, and be reported so. Two values of 1.1-1.9
    (exponent 127) with their exponent's top bit flipped become NaN: two non-finite values in a
    block are detected at any block width (a whole row of 14336 too, whose bound would pass errors
    of a few units) and never located."""
    v = np.abs(np.asarray(y0[17, :128], np.float32))
    cols = np.flatnonzero((v >= 1.1) & (v < 1.9))[:2]
    if len(cols) < 2:
        raise AssertionError(f"redo check {what}: no two values of 1.1-1.9 in row 17's first 128")
    i32 = lambda c: jnp.asarray(c, jnp.int32)
    sites = GemmFaults(i32([17, 17]), i32(cols), i32([30, 30]), jnp.ones((2,), bool))
    f = jax.jit(lambda a, b, e, fl: ops.protected_matmul(a, b, e, policy=policy, faults=fl))
    y, rep = f(*args, sites)
    d = rep.to_dict()
    err = float(jnp.max(jnp.abs(y0.astype(jnp.float32) - y.astype(jnp.float32))))
    if (d["gemm_recomputed"], d["gemm_uncorrectable"], d["nonfinite_gated"]) != (1, 0, 0) or err > 0.05:
        raise AssertionError(f"redo check {what}: report {d}, max diff {err}")


def _row(
    op: str, m: int, policy: FaultPolicy, t0: float, t1: float, flops: float, ratio: float, **extra
) -> dict:
    """ratio: plain / protected, the median of alternating rounds' ratios (time_pair)."""
    return dict(
        op=op,
        m=m,
        block_n=policy.block_n or "row",
        plain_ms=t0 * 1e3,
        protected_ms=t1 * 1e3,
        ratio=ratio,
        plain_tflops=flops / t0 / 1e12,
        protected_tflops=flops / t1 / 1e12,
        **extra,
    )


def parts(m: int = 8192, shapes=((4096, 14336), (4096, 1024)), dtype=jnp.bfloat16, block_ns=(None, 128)):
    """Where a protected forward GEMM's time goes: each stage timed alone, then together.

    plain (XLA, output in the operands' dtype, which the protected GEMM now writes too), the encode
    of w's checksum columns and of wᵀ's (the backward's, from w in place) by XLA's reductions
    (``impl="reference"``; the files up to 2026-12-02's ``matmul-parts-encnative`` timed "auto":
    on a GPU the reductions, and for wᵀ from 306a73c on the GEMM encode),
    ``encode_transposed_gemm`` the same sums as GEMMs against a block matrix (checked equal first),
    ``encode_native`` and ``encode_transposed_native`` the native handler with ``impl="native"``
    (what "auto" takes where there is one; checked against the reference first, None where the
    platform has none), ``encode_pair_native`` both from one read (``abft_encode_pair``, the GPU's
    kernel, where the shapes tile; checked against both references; None elsewhere), the checks
    (``abft_checks``), the GEMM with ``abft_finish`` on its output (in place for bf16), the three
    in one jit, and ``protected_matmul`` without its recompute, with the default recompute (a loop
    of 0 or 1 trips) and, with column blocks, with the branch-free redo of up to 32 flagged
    blocks (``FaultPolicy.recompute_blocks``) and, where the default redoes on the device kernel (a
    GPU that runs it), with the loop it replaced (``protected_loop``,
    ``FaultPolicy(recompute_kernel=False)``; before 2026-12-05's ``s40`` files ``protected`` was the
    loop and ``protected_redo_kernel`` the device redo); ``protected_fused`` is
    ``FaultPolicy(fused=True)`` (on a Hopper GPU, at 128-column blocks, the fused kernel, whose GEMM
    with its block sums alone is ``fused_kernel``). Each output is checked before timing; an optional
    variant (every ``protected_*`` but the default, the checks kernel) that fails its check is not
    timed and its ``{name}_error`` column says why, where the default failing stops the suite. On a
    GPU ``protected_dev_ms`` / ``protected_kernels`` (and the same for ``protected_no_recompute``)
    give one call's device kernels, copies included (:func:`_kernel_cols`).
    """
    rows = []
    native = _native_encode()
    pair = _native_encode("pimlayers_abft_encode_pair")
    for block_n in block_ns:
        policy = FaultPolicy(block_n=block_n)
        for k, n in shapes:
            x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
            w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
            enc = ops.abft_encode(w, block_n)
            kw = dict(k=k, block_n=block_n, out_dtype=dtype)

            def gemm_finish(a, b, c, d, kw=kw):
                return ops.abft_finish(jnp.matmul(a, b), c, d, **kw)

            def fused(a, b, e, kw=kw):
                return ops.abft_finish(jnp.matmul(a, b), *ops.abft_checks(a, e), **kw)

            def protected(p, args=(x, w, enc)):
                return jax.jit(lambda xx, ww, ee: ops.protected_matmul(xx, ww, ee, policy=p)), args

            c, mag = jax.jit(ops.abft_checks)(x, enc)
            bn = block_n
            errors = {}  # variants refused by their check before timing: {name: why}
            fns = {
                "plain": (jax.jit(jnp.matmul), (x, w)),
                # w's checksum columns (encode on write) and those of wᵀ (the backward's dx check,
                # encoded from w on the fly every step), by XLA's reductions
                "encode": (jax.jit(lambda ww, bn=bn: ops.abft_encode(ww, bn, impl="reference")), (w,)),
                "encode_transposed": (
                    jax.jit(lambda ww, bn=bn: ops.abft_encode(ww, bn, transposed=True, impl="reference")),
                    (w,),
                ),
                # the same sums as two GEMMs against a block matrix ("auto" without a native encode)
                "encode_transposed_gemm": (jax.jit(lambda ww, bn=bn: encode_transposed_gemm(ww, bn)), (w,)),
                # the native encodes ("auto" where the platform has them: _ENCODE_NATIVE_ON)
                **(_native_encodes(w, bn) if native else {}),
                # both from one read (the GPU's pair kernel, where the shapes tile)
                **({"encode_pair_native": (_pair(bn), (w,))} if pair and pair_applies(w.shape, bn) else {}),
                "checks": (jax.jit(ops.abft_checks), (x, enc)),
                "gemm_finish": (jax.jit(gemm_finish), (x, w, c, mag)),
                "gemm_checks_finish": (jax.jit(fused), (x, w, enc)),
                "protected": protected(policy),
                "protected_no_recompute": protected(policy.replace(recompute=False)),
            }
            if block_n is not None:
                fns["protected_redo_blocks"] = protected(policy.replace(recompute_blocks=32))
            if _redo_kernel_timed(dtype, policy):
                fns["protected_loop"] = protected(policy.replace(recompute_kernel=False))
            if _checks_kernel_timed(x, enc):  # the opt-in one-read checks, alone and in the GEMM
                fns["checks_kernel"] = (
                    jax.jit(lambda xx, s, a: checks_kernel(xx, s, a, 3, 2)),
                    (x, enc.sums, enc.abs_sums),
                )
                fns["protected_checks_kernel"] = (
                    _asking_for_checks_kernel(protected(policy)[0]),
                    (x, w, enc),
                )
                got = fns["checks_kernel"][0](*fns["checks_kernel"][1])
                _refused(
                    fns,
                    errors,
                    ("checks_kernel", "protected_checks_kernel"),
                    _same_checks,
                    f"{k}->{n}",
                    (c, mag),
                    got,
                    x,
                    enc,
                )
            if block_n == TILE and hopper():  # elsewhere "fused" would time the default again
                fns["protected_fused"] = protected(policy.replace(fused=True))
                fns["fused_kernel"] = (jax.jit(fused_gemm), (x, w))
                # With the plain checks the fused kernel forms c1 and mag itself: no check GEMMs.
                fns["protected_fused_c1"] = protected(
                    policy.replace(fused=True, weighted_checks=False, locate=False)
                )
                fns["fused_checked_kernel"] = _fused_checked(x, w, enc)
            want, got = (fns[f][0](w) for f in ("encode_transposed", "encode_transposed_gemm"))
            for a, b in zip(want, got, strict=True):  # equal to f32 rounding (another summation order)
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(a).max()))
            if native:
                for t, name, width in (
                    (False, "encode_native", min(bn or n, n)),
                    (True, "encode_transposed_native", min(bn or k, k)),
                ):
                    ref = jax.jit(
                        lambda ww, bn=bn, t=t: ops.abft_encode(ww, bn, transposed=t, impl="reference")
                    )
                    _same_encode(f"{name} {k}->{n}", ref(w), fns[name][0](w), width)
            if "encode_pair_native" in fns:
                both = fns["encode_pair_native"][0](w)
                for t, got, width in ((False, both[0], min(bn, n)), (True, both[1], min(bn, k))):
                    ref = ops.abft_encode(w, bn, transposed=t, impl="reference")
                    _same_encode(
                        f"encode_pair_native ({'transposed' if t else 'plain'}) {k}->{n}", ref, got, width
                    )
            _no_false_detection(fns["protected"], f"protected {k}->{n}")  # the default: must pass
            for v in ("redo_blocks", "loop", "fused", "fused_c1", "checks_kernel"):  # dropped if not
                name = f"protected_{v}"
                if name in fns:
                    _refused(fns, errors, (name,), _no_false_detection, fns[name], f"{name} {k}->{n}")
            row = dict(op=f"fwd {k}->{n}", m=m, block_n=block_n or "row")
            row.update({f"{name}_error": msg for name, msg in errors.items()})
            row.update({f"{name}_ms": time_fn(fn, *a) * 1e3 for name, (fn, a) in fns.items()})
            for name in ("protected", "protected_no_recompute"):  # where the device time goes
                row.update(_kernel_cols(name, *fns[name]))
            if not native:
                row.update(encode_native_ms=None, encode_transposed_native_ms=None)
            row.setdefault("encode_pair_native_ms", None)
            row["ratio"] = row["plain_ms"] / row["protected_ms"]
            if "protected_redo_blocks_ms" in row:
                row["ratio_redo_blocks"] = row["plain_ms"] / row["protected_redo_blocks_ms"]
            if "protected_loop_ms" in row:
                row["ratio_loop"] = row["plain_ms"] / row["protected_loop_ms"]
            if "protected_fused_ms" in row:
                row["ratio_fused"] = row["plain_ms"] / row["protected_fused_ms"]
            if "protected_fused_c1_ms" in row:
                row["ratio_fused_c1"] = row["plain_ms"] / row["protected_fused_c1_ms"]
            if "protected_checks_kernel_ms" in row:
                row["ratio_checks_kernel"] = row["plain_ms"] / row["protected_checks_kernel_ms"]
            rows.append(row)
    return rows


ENCODE_SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024))  # a Llama-3-8B layer's weights


def encodes(shapes=ENCODE_SHAPES, dtype=jnp.bfloat16, weights: int = 12) -> list[dict]:
    """The weight encodes' rates (128-column blocks): per shape and kernel, ms per weight and TB/s of
    w read, each timed over ``weights`` distinct weights in one jitted call (one weight per call, as
    ``matmul-parts`` times it, measures the host's dispatch at the smaller shapes). Kernels: the
    native pair (``abft_encode_pair``, one read for w's sums and wᵀ's; a GPU's, where the shape
    tiles), the native rows and transposed encodes (``abft_encode``, where the platform has them),
    and XLA's column sum of w in f32 (a read of the same bytes). Each native encode is checked
    against the pure-JAX reference on the first weight before it is timed. With a device timeline
    (a GPU) also ``dev_ms_per_weight`` and ``dev_tb_s``: the kernels' time from the profiler (the
    median of 5 calls), where the wall clock of the smaller shapes is mostly the host's dispatch (on
    an H100, 2026-12-06, an unchanged kernel's wall clock moved 40% between two runs)."""
    rows = []
    plain, pair = _native_encode(), _native_encode("pimlayers_abft_encode_pair")
    for k, n in shapes:
        ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.float32).astype(dtype) for i in range(weights)]
        fns = {"xla_column_sum": lambda v: jnp.sum(v.astype(jnp.float32), axis=0)}
        if pair and pair_applies((k, n), 128):
            fns["pair_native"] = lambda v: ops.abft_encode_pair(v, 128, impl="native")
        if plain:
            fns["rows_native"] = lambda v: ops.abft_encode(v, 128, impl="native")
            fns["transposed_native"] = lambda v: ops.abft_encode(v, 128, transposed=True, impl="native")
        want = [ops.abft_encode(ws[0], 128, transposed=t, impl="reference") for t in (False, True)]
        for name, f in fns.items():
            if name != "xla_column_sum":
                got = jax.jit(f)(ws[0])
                got = got if name == "pair_native" else (got, None) if name == "rows_native" else (None, got)
                for t, (g, width) in enumerate(((got[0], min(128, n)), (got[1], min(128, k)))):
                    if g is not None:
                        _same_encode(f"{name} {k}x{n} ({'transposed' if t else 'plain'})", want[t], g, width)
            batch = jax.jit(lambda vs, f=f: [f(v) for v in vs])
            t = time_fn(batch, ws, iters=10) / weights
            nbytes = k * n * jnp.dtype(dtype).itemsize
            row = dict(shape=f"{k}x{n}", dtype=jnp.dtype(dtype).name, kernel=name, weights=weights,
                       ms_per_weight=t * 1e3, tb_s=nbytes / t / 1e12)  # fmt: skip
            if _device_timeline():  # the kernels' own time: the wall clock's dispatch varies by ~40%
                dev = device_ms(batch, (ws,), calls=5) / weights
                row.update(dev_ms_per_weight=dev, dev_tb_s=nbytes / dev / 1e9)
            rows.append(row)
    return rows


def _pair(block_n):
    """``encode_pair_native``: abft_encode_pair with impl="native", on the weight passed at timing."""
    return jax.jit(lambda ww: ops.abft_encode_pair(ww, block_n, impl="native"))


def _native_encodes(w, block_n):
    """``encode_native`` and ``encode_transposed_native``: abft_encode with impl="native"."""
    plain = jax.jit(lambda ww: ops.abft_encode(ww, block_n, impl="native"))
    transposed = jax.jit(lambda ww: ops.abft_encode(ww, block_n, transposed=True, impl="native"))
    return {"encode_native": (plain, (w,)), "encode_transposed_native": (transposed, (w,))}


def _native_encode(target: str = "pimlayers_abft_encode") -> bool:
    """Whether the default device's platform has the native handler ``target`` registered (a GPU's
    CUDA one; missing from a CUDA module built before it, and from a build without nvcc; the pair's
    exists only for CUDA)."""
    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    info = native_info().get(platform)
    return info is not None and target in info.targets


def _same_encode(what: str, want: WeightChecksums, got: WeightChecksums, width: int) -> None:
    """got's block sums against want's, both f32 sums of the same terms in other orders: each within
    Higham & Mary's probabilistic bound of the exact sum (lam = 8, the check's own, csrc/abft.h), so
    within twice that of each other. Terms' magnitudes: abs_sums (want's) for s1 and sa, and at most
    width times that for the position-weighted s2."""
    tol = 16 * np.sqrt(width) * 2.0**-24 * np.asarray(want.abs_sums, np.float64)
    pairs = [(want.sums[..., 0], got.sums[..., 0], tol), (want.sums[..., 1], got.sums[..., 1], width * tol)]
    pairs.append((want.abs_sums, got.abs_sums, tol))
    for a, b, t in pairs:
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        if a.shape != b.shape or not np.all(diff <= t):
            raise AssertionError(f"{what}: sums differ from the reference's past f32 rounding")
