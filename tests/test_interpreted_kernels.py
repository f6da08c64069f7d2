"""The Hopper kernels (Pallas Mosaic GPU) on this CPU, through jax's GPU interpreter
(``mgpu_interpret``): the GPU tests' own bodies at shapes the interpreter runs in seconds, and its
race detector over the pipelines' shared-memory buffers.

What this covers that the CPU suite did not: the kernels' indexing, causal masking, GQA grouping,
TMA pipelining and barriers, their in-kernel checksums, bounds and fault injection, against the same
XLA references the GPU tests use, and the device redo's kernels (refs handed to a kernel and updated
in place: ``mgpu_interpret`` places them in global memory). What it cannot: speed, asynchronous
wgmma, the hardware's approximate exp2 and its own races (``compute-sanitizer`` on a GPU), nor
Mosaic GPU's lowering (register layouts' tiles, the shared memory a CTA may have), which
``tests/test_flash.py`` checks on the CPU by lowering each kernel variant for a GPU. Not interpreted
yet: the opt-in fused backward kernel (``FlashBwdConfig(fused=True)``: it accumulates dq by TMA
reduce-adds, which the interpreter does not support, "reduction_op not supported") and the Triton
bounds kernels, the attention's default on a GPU, which the GPU interpreter cannot run (Pallas' own
interpreter runs those, ``test_flash.py``): here the bounds are XLA's
(``PIMLAYERS_BOUNDS_KERNEL=0``).

The interpreter can deadlock: each simulated warpgroup is a jitted program whose barrier waits
block inside host callbacks, and on a 2-core machine a backward kernel's warpgroups have all waited
on one that never started (in one process after another kernel had run, under the suite's XLA
flags and once without them; 8 or 32 CPU devices did not change it; every case alone in a fresh
process passed). So the default run (CI) runs a few cases, each in a fresh process with a time
limit and one retry (``test_kernel_interpreted_in_a_fresh_process``); the whole matrix in one
process is opt-in: ``PIMLAYERS_INTERPRET=1 timeout 1200 python -m pytest -q -n 2
tests/test_interpreted_kernels.py -o faulthandler_timeout=300``. Skipped on a machine with a CUDA
GPU, where the GPU tests run the kernels themselves. ``python tests/test_interpreted_kernels.py
CASE`` runs one of ``CASES`` here.
"""

import contextlib
import os
import pathlib
import subprocess
import sys

import jax
import mgpu_interpret
import pytest
import test_fused as gpu_gemm
import test_gpu_flash as gpu_fwd
import test_gpu_flash_bwd as gpu_bwd
from conftest import HAS_CUDA

from pimlayers import ops

pytestmark = [
    pytest.mark.skipif(HAS_CUDA, reason="a CUDA GPU runs the kernels themselves (tests/test_gpu_*.py)"),
    pytest.mark.skipif(not mgpu_interpret.AVAILABLE, reason="this jax has no Pallas GPU interpreter"),
]
in_process = pytest.mark.skipif(
    os.environ.get("PIMLAYERS_INTERPRET") != "1",
    reason="opt-in (PIMLAYERS_INTERPRET=1): in one process the GPU interpreter can deadlock",
)


@contextlib.contextmanager
def _interpreting():
    """The kernels' Hopper gates open, the bounds XLA's (the GPU interpreter cannot run the Triton
    bounds kernels) and the interpreter on."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIMLAYERS_BOUNDS_KERNEL", "0")
        for mod in (ops._flash, ops._flash_bwd, ops._fused_gemm):
            mp.setattr(mod, "hopper", lambda: True)
        mp.setattr(ops._fused_gemm, "_sm_count", lambda: 2)  # a persistent grid of two CTAs
        # The backward cases' out and logsumexp from XLA's forward (the forward cases interpret its kernel).
        mp.setattr(gpu_bwd, "FORWARD", ops.flash_attention_reference)
        with mgpu_interpret.interpret():
            yield


@pytest.fixture(scope="module")
def interpreted():
    with _interpreting():
        yield


FWD_SHAPES = [  # (B, T, H, KV, D, causal): one or two key blocks per CTA, GQA, D = 64 and 128
    (1, 128, 2, 1, 64, True),
    (1, 256, 4, 2, 128, False),
    (2, 128, 2, 2, 64, True),
]


@in_process
@pytest.mark.parametrize(
    "config",
    [ops.FlashConfig(), ops.FlashConfig(fuse_e=False), gpu_fwd.V_APART],
    ids=["default", "e-apart", "v-apart"],
)
@pytest.mark.parametrize("shape", FWD_SHAPES)
def test_forward_kernel_matches_the_reference(interpreted, shape, config):
    gpu_fwd.test_kernel_matches_reference(None, shape, config)


@in_process
@pytest.mark.parametrize("config", [ops.FlashConfig(), gpu_fwd.V_APART], ids=["default", "v-apart"])
@pytest.mark.parametrize("shape", FWD_SHAPES)
def test_forward_kernel_flags_the_rows_the_reference_flags(interpreted, shape, config):
    gpu_fwd.test_kernel_flags_the_rows_the_reference_flags(None, shape, config)


@in_process
@pytest.mark.parametrize("shape", [(1, 128, 4, 2, 64, True), (1, 256, 2, 2, 128, False)])
def test_backward_kernels_match_the_reference(interpreted, shape):
    gpu_bwd.test_bwd_kernels_match_the_reference(None, shape, gpu_bwd.TWO)


@in_process
@pytest.mark.parametrize("gemm", ops.FlashBwdFaults._fields)
def test_backward_kernels_flag_the_flipped_rows(interpreted, gemm):
    gpu_bwd.test_bwd_kernels_flag_the_flipped_rows(
        None, gemm, gpu_bwd.TWO, 30, shape=(1, 128, 4, 2, 64, True)
    )


@in_process
@pytest.mark.parametrize("shape", [(256, 64, 256), (512, 192, 768)])
def test_fused_gemm_kernel_matches_the_reference(interpreted, shape):
    gpu_gemm.test_kernel_matches_reference_on_hopper(shape)


@in_process
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("shape", [(256, 64, 256), (256, 192, 512)])
def test_checked_fused_gemm_kernel_matches_the_reference(interpreted, shape, b_t):
    gpu_gemm.test_checked_kernel_matches_reference_on_hopper(shape, b_t)


@in_process
@pytest.mark.parametrize("config", [ops.FlashConfig(), gpu_fwd.V_APART], ids=["default", "v-apart"])
def test_pipelines_have_no_races(interpreted, config):
    """The race detector (vector clocks through the barriers) over a forward with three key blocks per
    CTA, so the two-stage K/V pipeline refills its slots (by default the transposed value tile and
    the checksum tile under one barrier of two arrivals; ``fuse_v=False``: the value tile alone, the
    checksum tile under a barrier of its own), and a GQA backward. The detector's state is
    the last kernel's (each call starts afresh): of the backward's two kernels, the dk/dv one."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    q, k, v = gpu_fwd._qkv(1, 384, 2, 1, 64, seed=4)
    with mgpu_interpret.interpret(detect_races=True):
        out, lse, _ = ops.flash_attention(q, k, v, causal=False, config=config)
        jax.block_until_ready(out)
        races = gpu_callbacks.get_races()
        assert races.reads and not races.races_found  # it watched the kernel's reads, found no race
        if config.fuse_v is False:
            return  # the backward kernels take no FlashConfig: the default's case runs them
        do = gpu_fwd._qkv(1, 384, 2, 1, 64, seed=5)[0]
        jax.block_until_ready(ops.flash_attention_bwd(q, k, v, out, lse, do, causal=False))
        races = gpu_callbacks.get_races()
        assert races.reads and not races.races_found


REDO_FWD, REDO_BWD = (1, 256, 2, 1, 64, False), (1, 256, 2, 1, 64, True)  # two CTAs a head, GQA 2:1


@in_process
@pytest.mark.parametrize("config", [ops.FlashConfig(), gpu_fwd.V_APART], ids=["default", "v-apart"])
@pytest.mark.parametrize("shape", [REDO_FWD, (1, 256, 4, 2, 128, True)])
def test_forward_redo_rewrites_the_flagged_blocks_alone(interpreted, shape, config):
    gpu_fwd.test_redo_kernel_rewrites_the_flagged_blocks_alone(None, shape, config)


@in_process
def test_persistent_forward_redo_runs_several_units_a_cta(interpreted):
    gpu_fwd.test_persistent_redo_runs_several_units_a_cta(None)


@in_process
def test_forward_redo_gates_its_rows(interpreted):
    gpu_fwd.test_redo_kernel_gates_its_rows(None)


@in_process
def test_forward_with_redo_equals_the_clean_kernel(interpreted):
    gpu_fwd.test_with_redo_shares_the_bounds_and_equals_the_clean_kernel(None)


@in_process
@pytest.mark.parametrize("shape", [REDO_BWD, (1, 256, 4, 2, 128, False)])
def test_backward_redo_recomputes_the_flagged_blocks(interpreted, shape):
    gpu_bwd.test_bwd_redo_recomputes_the_flagged_blocks(None, shape)


BWD = (1, 128, 2, 1, 64, True)  # GQA groups of two, causal, two key blocks per CTA
CASES = {  # the default run's cases, each in a fresh process
    "forward": lambda: test_forward_kernel_matches_the_reference(
        None, (1, 256, 2, 1, 128, False), ops.FlashConfig()
    ),
    "forward-flags": lambda: test_forward_kernel_flags_the_rows_the_reference_flags(
        None, FWD_SHAPES[2], ops.FlashConfig()
    ),
    # The output check in a wgmma of its own (``fuse_v=False``; by default its columns are the
    # output accumulator's last eight): a fault in the output accumulator flagged where the
    # reference flags it.
    "forward-flags-v-apart": lambda: test_forward_kernel_flags_the_rows_the_reference_flags(
        None, FWD_SHAPES[0], gpu_fwd.V_APART
    ),
    "backward": lambda: test_backward_kernels_match_the_reference(None, BWD),
    "backward-flags-dk": lambda: test_backward_kernels_flag_the_flipped_rows(None, "dk"),
    "backward-flags-scores": lambda: test_backward_kernels_flag_the_flipped_rows(None, "scores"),
    "fused-gemm": lambda: test_fused_gemm_kernel_matches_the_reference(None, (256, 64, 256)),
    "fused-gemm-checked": lambda: test_checked_fused_gemm_kernel_matches_the_reference(
        None, (256, 192, 512), False
    ),
    "fused-gemm-checked-bt": lambda: test_checked_fused_gemm_kernel_matches_the_reference(
        None, (256, 192, 512), True
    ),
    "races": lambda: test_pipelines_have_no_races(None, ops.FlashConfig()),
    # The device redo: only flagged CTAs rewritten, bit for bit the fault-free kernels' rows.
    "redo-forward": lambda: test_forward_redo_rewrites_the_flagged_blocks_alone(
        None, REDO_FWD, ops.FlashConfig()
    ),
    "redo-persistent": lambda: test_persistent_forward_redo_runs_several_units_a_cta(None),
    "redo-backward": lambda: test_backward_redo_recomputes_the_flagged_blocks(None, REDO_BWD),
}
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("case", CASES)
def test_kernel_interpreted_in_a_fresh_process(case):
    # The suite's XLA flags (conftest: 8 CPU devices, LLVM at -O0, on jaxlib 0.10 the loop
    # emitters): the interpreter's programs compile about twice as fast with them (all twelve cases,
    # two at a time on a 2-core machine: 181 s against 329). The deadlock above, once seen more often
    # under these flags, was of kernels sharing a process; each case here has its own (four runs of
    # all twelve under the flags, two at a time: no hang). A hang (the interpreter's, not a
    # kernel's: every case passed alone) gets one retry, then fails.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, case]
    for attempt in (1, 2):
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            break
        except subprocess.TimeoutExpired:
            if attempt == 2:
                pytest.fail(f"{case}: the GPU interpreter hung twice (300 s each)")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"{case}: passed" in done.stdout


if __name__ == "__main__":
    with _interpreting():
        CASES[sys.argv[1]]()
    print(f"{sys.argv[1]}: passed")
