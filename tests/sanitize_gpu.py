"""Every CUDA handler once on ragged shapes, in one short process, for compute-sanitizer.

    K='regex=Abft|Checksum|Gate|Parity|Reconstruct|PimGemv|Guard|Finish|Many'
    compute-sanitizer --tool memcheck --kernel-name "$K" --error-exitcode 7 python tests/sanitize_gpu.py
    compute-sanitizer --tool racecheck --kernel-name "$K" --error-exitcode 7 python tests/sanitize_gpu.py

or one case per process (``--count`` prints how many there are, ``--case I`` runs the I-th, from 1),
so that the tool crashing in one case (below) leaves the others' verdicts standing:

    n=$(python tests/sanitize_gpu.py --count)
    seq "$n" | xargs -P 4 -I{} sh -c 'compute-sanitizer --tool memcheck --kernel-name "$K" \
        --error-exitcode 7 python tests/sanitize_gpu.py --case {} > memcheck-{}.log 2>&1; echo "{} rc=$?"'

(XLA_PYTHON_CLIENT_ALLOCATOR=platform gives every buffer its own allocation, so an access past a
buffer's end is not hidden inside XLA's pool.) The Pallas Mosaic-GPU flash attention kernel (Hopper)
and its backward kernels have their own cases, run with ``python tests/sanitize_gpu.py flash`` (or
``flash fwd``, ``flash bwd``: one kernel's; ``flash redo``: the device redo of the forward and
the backward, the same kernels skipping unflagged CTAs) and
``K='regex=mosaic'`` (the kernels are named ``entry_mosaic_gpu_kernel``). On an H200 (2026-12-01,
docs/gpu-tests.md) memcheck passed the forward's cases and then failed with CUDA_ERROR_INVALID_PC at
the first backward case; racecheck failed inside the tool at the first forward case: not clean.
The device redo's Triton kernel has ``python tests/sanitize_gpu.py redo``, run with
``--kernel-name regex=redo`` (the kernel is named ``pimlayers_redo_detected``) and
``XLA_FLAGS=--xla_gpu_autotune_level=0`` (its cases form bf16 GEMMs with XLA, whose autotuning the
tool cannot run): memcheck clean on an H100 (2026-12-05, docs/gpu-tests.md); without the filter the
tool crashed before the first case; racecheck crashed there too (a segmentation fault before the
first case, H100, 2026-12-05). The one-read checks kernel (opt-in, ``PIMLAYERS_CHECKS_KERNEL=1``)
has ``python tests/sanitize_gpu.py checks``, run the same way with ``--kernel-name
regex=checks_kernel``: memcheck 0 errors over the cases that ran (H100, 2026-12-05). The attention's
Triton bounds kernels (the default on a GPU) have ``python tests/sanitize_gpu.py bounds``, run with
``--kernel-name regex=bounds`` (``pimlayers_flash_bounds_*``, ``pimlayers_flash_bwd_bounds_*``) and
the same XLA_FLAGS: on an H100 (2026-12-05) memcheck 0 errors over the four cases in one process;
racecheck 0 hazards in each case run alone (``--case I``), where in one process the tool crashed
(a segmentation fault) at the third case.

The cases are tests/test_gpu.py's, called directly: the whole pytest session under the sanitizer
crashed the tool itself part-way (seen on an H200 with compute-sanitizer 2025.3.1), at a different
test each time.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp

_here = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_here), str(_here.parent)]  # the tests' helpers, and pimlayers from this checkout
import test_gpu as T  # noqa: E402
import test_gpu_adam_guard as TA  # noqa: E402
import test_gpu_memory as TM  # noqa: E402


def flash_cases(which: str = "") -> list:
    """The flash kernels' cases: the forward's (``which="fwd"``), the backward's ("bwd") or both."""
    import test_gpu_flash as TF
    import test_gpu_flash_bwd as TB

    fwd = [
        *[
            (TF.test_kernel_matches_reference, (None, shape, cfg))
            for cfg in (TF.ops.FlashConfig(), TF.V_APART)
            for shape in TF.SHAPES[:3]
        ],
        *[
            (TF.test_kernel_flags_the_rows_the_reference_flags, (None, shape, cfg))
            for cfg in (TF.ops.FlashConfig(), TF.V_APART)
            for shape in TF.SHAPES[:2]
        ],
    ]
    bwd = [
        *[
            (TB.test_bwd_kernels_match_the_reference, (None, shape, cfg))
            for cfg in (TB.TWO, TB.FUSED)
            for shape in TB.SHAPES[:4]
        ],
        *[
            (TB.test_bwd_kernels_flag_the_flipped_rows, (None, gemm, cfg, 30))
            for cfg in (TB.TWO, TB.FUSED)
            for gemm in ("dq", "dp_t", "dk")
        ],
    ]
    redo = [
        *[
            (TF.test_redo_kernel_rewrites_the_flagged_blocks_alone, (None, shape, cfg))
            for cfg in (TF.ops.FlashConfig(), TF.V_APART)
            for shape in TF.REDO_SHAPES
        ],
        (TF.test_redo_kernel_gates_its_rows, (None,)),
        *[(TB.test_bwd_redo_recomputes_the_flagged_blocks, (None, shape)) for shape in TB.REDO_SHAPES],
    ]
    if which == "redo":  # the device redo, forward and backward (not part of plain "flash")
        return redo
    return {"fwd": fwd, "bwd": bwd}.get(which, fwd + bwd)


def redo_cases() -> list:
    """The device redo's Triton kernel (``pimlayers/ops/_redo_kernel.py``): against its interpreter
    at a ragged and a transposed shape, and inside protected_matmul at a Llama-3-8B shape."""
    import test_gpu_redo_kernel as TR

    return [
        *[(TR.test_kernel_equals_its_interpreter, (None, *case)) for case in TR.CASES[1:]],
        (TR.test_llama_shape_unlocatable_faults_redone_and_clean_untouched, (None,)),
    ]


def checks_cases() -> list:
    """The one-read checks kernel (``pimlayers/ops/_checks_kernel.py``): exact against XLA at a ragged
    and a transposed batch shape, and against the XLA checks at a Llama-3-8B shape."""
    import test_gpu_checks_kernel as TC

    exact = TC.test_the_kernel_multiplies_exactly_what_xla_does_on_the_gpu
    return [
        (exact, (None, 1, 300, 200, 48, 8, False)),
        (exact, (None, 2, 129, 65, 288, 48, True)),
        (TC.test_the_kernel_is_the_xla_checks_at_llama_shapes, (None, 4096, 1024)),
    ]


def bounds_cases() -> list:
    """The attention kernels' opt-in Triton bounds kernels (``pimlayers/ops/_flash_bounds.py``,
    ``_flash_bwd_bounds.py``): the forward's and the backward's against XLA's at a ragged and a
    Llama-3-8B shape."""
    import test_gpu_flash as TF
    import test_gpu_flash_bwd as TB

    return [
        *[
            (TF.test_bounds_kernel_tiles_are_xlas_on_the_gpu, (None, s))
            for s in ((2, 384, 3, 64), (1, 8192, 8, 128))
        ],
        *[
            (TB.test_bounds_kernel_is_xlas_on_the_gpu, (None, s))
            for s in ((2, 384, 3, 1, 64), (1, 8192, 32, 8, 128))
        ],
    ]


def handler_cases(gpu) -> list:
    """The CUDA handlers' cases (tests/test_gpu.py's and tests/test_gpu_memory.py's tests) on ``gpu``."""
    return [
        *[(T.test_gate, (gpu, d, n)) for d in (jnp.float32, jnp.bfloat16) for n in (7, 4097)],
        *[
            (T.test_checksums_parity_reconstruct, (gpu, d, 4097, b))
            for d in (jnp.uint8, jnp.float32)
            for b in (16, 4096)
        ],
        *[(T.test_abft, (gpu, s, b)) for s in ((7, 129, 33), (257, 512, 4097)) for b in (None, 128)],
        *[
            (T.test_abft_finish, (gpu, 33, 128, 1152, 128, jnp.float32, o))
            for o in (jnp.float32, jnp.bfloat16)
        ],
        (T.test_abft_finish, (gpu, 9, 64, 200, 32, jnp.float32, jnp.float32)),
        (T.test_abft_finish, (gpu, 9, 64, 256, 128, jnp.bfloat16, jnp.bfloat16)),
        # The tile kernel's queue, with and without a gate limit, and (the large case) its overflow.
        *[(T.test_abft_finish_tiles, (gpu, jnp.bfloat16, lim, 37, 1280, 0.3)) for lim in (None, 3.0)],
        (T.test_abft_finish_tiles, (gpu, jnp.bfloat16, None, 4096, 5120, 1.0)),
        *[
            (T.test_bank_guard, (gpu, jnp.uint8, nb, b, g))
            for nb in (4098, (1 << 20) + 6)
            for b, g in ((16, 3), (4112, 3))
        ],
        (T.test_bank_guard_vmap_unaligned_examples, (gpu,)),
        *[
            (TM.test_pim_gemv_cuda_matches_reference, (gpu, jnp.float32, t, k, n, b))
            for t, k, n, b in ((3, 37, 50, 8), (1, 4096, 1000, 16))
        ],
        *[
            (T.test_abft_encode, (gpu, d, s, t))
            for d in (jnp.float32, jnp.bfloat16)
            for s in ((7, 129), (3, 65, 300), (2, 130, 256), (2048, 64))
            for t in (False, True)
        ],
        (T.test_abft_encode, (gpu, jnp.float16, (3, 65, 300), True)),
        (T.test_abft_encode_native_refuses_bad_input, (gpu,)),
        *[(T.test_abft_encode_pair, (gpu, d, (3, 256, 384))) for d in (jnp.float32, jnp.bfloat16)],
        # The finish at a block offset into a shared check GEMM's checks: tile, row, warp kernels.
        *[
            (T.test_abft_finish_block_offset, (gpu, d, o, n, b))
            for d, o, n, b in (
                (jnp.bfloat16, jnp.bfloat16, 1280, 128),
                (jnp.float32, jnp.float32, 1024, 256),
                (jnp.float32, jnp.bfloat16, 1024, 128),
                (jnp.bfloat16, jnp.bfloat16, 200, 32),
            )
        ],
        # The finish without c2 (FaultPolicy(weighted_checks=False)): tile, row and warp kernels.
        *[
            (T.test_abft_finish_without_weighted_checks, (gpu, d, o, m, n, b))
            for d, o, m, n, b in (
                (jnp.bfloat16, jnp.bfloat16, 37, 1280, 128),
                (jnp.float32, jnp.bfloat16, 64, 14336, 128),
                (jnp.bfloat16, jnp.bfloat16, 33, 200, 32),
            )
        ],
        # Last: on 2026-12-01 (H200, compute-sanitizer of CUDA 13) the tool itself segfaulted at the
        # first of these, under memcheck and racecheck, even with these kernels left uninstrumented.
        *[(T.test_bank_guard_and_verify_many, (gpu, 9, b, g)) for b, g in ((16, 3), (4096, 8), (4112, 11))],
        *[(T.test_verify_many_casts_as_xla_converts, (gpu, b, g)) for b, g in ((4096, 8), (4112, 3))],
        # AdamW's update fused with the guard: whole and ragged groups, both gradient dtypes.
        *[
            (TA.test_kernel_matches_reference, (gpu, d, 0.0, b, g))
            for d, b, g in ((jnp.bfloat16, 4096, 8), (jnp.float32, 512, 3))
        ],
    ]


def main(argv: list[str]) -> None:
    """``[flash [fwd|bwd] | redo | checks | bounds] [--count | --case I]``: the handlers' cases (or
    the flash kernels', the device redo's, the checks kernel's or the bounds kernels'), all of them,
    how many there are, or the I-th alone (from 1)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python tests/sanitize_gpu.py")
    ap.add_argument(
        "kernels",
        nargs="*",
        help="empty: the CUDA handlers; 'flash' [fwd|bwd|redo]: the flash kernels; 'redo': the device redo; "
        "'checks': the one-read checks kernel; 'bounds': the attention bounds kernels",
    )
    one = ap.add_mutually_exclusive_group()
    one.add_argument("--count", action="store_true", help="print the number of cases and stop")
    one.add_argument("--case", type=int, help="run only this case (from 1)")
    a = ap.parse_args(argv)
    if a.kernels[:1] == ["flash"] and a.kernels[1:] in ([], ["fwd"], ["bwd"], ["redo"]):
        cases = flash_cases(*a.kernels[1:])
    elif a.kernels == ["redo"]:
        cases = redo_cases()
    elif a.kernels == ["checks"]:
        cases = checks_cases()
    elif a.kernels == ["bounds"]:
        cases = bounds_cases()
    elif not a.kernels:  # (counting needs no GPU)
        cases = handler_cases(None if a.count else jax.devices("cuda")[0])
    else:
        ap.error(
            f"kernels {a.kernels}; expected nothing, 'flash', 'flash fwd', 'flash bwd', 'redo', 'checks'"
            " or 'bounds'"
        )
    if a.count:
        print(len(cases))
        return
    if a.case is not None and not 1 <= a.case <= len(cases):
        ap.error(f"--case {a.case}; expected 1 to {len(cases)}")
    for i, (fn, args) in enumerate(cases):
        if a.case in (None, i + 1):
            fn(*args)
            print(f"{i + 1}/{len(cases)} {fn.__name__}{tuple(str(x) for x in args[1:])} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
