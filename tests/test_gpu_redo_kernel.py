"""The device redo's Triton kernel on a GPU (skipped elsewhere): against Pallas' interpreter of the same
kernel, and inside protected_matmul at a Llama-3-8B shape."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_redo_kernel import KERNEL, _case, _close, _two_in_a_block, _xw

from pimlayers import ops
from pimlayers.ops._abft import ABFT_DETECTED
from pimlayers.ops._redo_kernel import _redo_call

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if jax.devices()[0].platform != "gpu":
        pytest.skip("the redo kernel's Triton build needs a CUDA GPU")


# (r, k, n, block_n, a_t, b_t): a Llama-3-8B shape, a ragged one with whole-row blocks and xᵀ, and
# narrow blocks with wᵀ (also tests/sanitize_gpu.py's cases)
CASES = [
    (8192, 4096, 1024, 128, False, False),
    (300, 200, 500, None, True, False),
    (256, 128, 384, 32, False, True),
]


@pytest.mark.parametrize(("r", "k", "n", "block_n", "a_t", "b_t"), CASES)
def test_kernel_equals_its_interpreter(cuda, r, k, n, block_n, a_t, b_t):
    a, b, c, mag = _case(1, r, k, n, block_n, jnp.bfloat16)
    y = jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
    nb = mag.shape[-1]
    rng = np.random.default_rng(0)
    flags = np.zeros((1, r, nb), np.int32)
    flags[0, rng.choice(r, 20, replace=False), rng.integers(0, nb, 20)] = ABFT_DETECTED
    rows = jnp.asarray(np.any(flags > 0, axis=-1))[..., None]
    y = jnp.where(rows, jnp.bfloat16(7.0), y)  # the detected rows overwritten: the redo restores them
    aa = jnp.swapaxes(a, 1, 2) if a_t else a
    bb = jnp.swapaxes(b, 1, 2) if b_t else b
    kw = dict(block_n=block_n, off=0, a_t=a_t, b_t=b_t, gate=True, fill=0.0, limit=3.0e38, lam=8.0)
    args = (aa, bb, jnp.asarray(flags), jnp.zeros_like(jnp.asarray(flags)), c, mag, y)
    got = _redo_call(*args, **kw)
    want = jax.jit(functools.partial(_redo_call, **kw, interpret=True))(*args)
    _close(got[0], want[0])  # the tensor cores' f32 order against XLA's: one bf16 rounding
    # Per program: nothing still failing, nothing gated, redone where a block was detected.
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert int(np.asarray(got[1])[..., 0].sum()) == 0 and int(np.asarray(got[1])[..., 3].sum()) > 0
    untouched = ~np.broadcast_to(np.asarray(rows), y.shape)
    assert np.array_equal(np.asarray(got[0], np.float32)[untouched], np.asarray(y, np.float32)[untouched])


def test_llama_shape_unlocatable_faults_redone_and_clean_untouched(cuda):
    x, w = _xw(8192, 4096, 1024)
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
    f = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, policy=KERNEL, faults=fl))
    y, r = f(x, w, _two_in_a_block(clean, 4000, 128))
    d = r.to_dict()
    keys = ("gemm_detected", "gemm_recomputed", "gemm_corrected", "gemm_uncorrectable")
    assert tuple(d[c] for c in keys) == (1, 1, 1, 0)
    _close(y, clean)
    y0, r0 = jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=KERNEL))(x, w)
    y1, _ = jax.jit(lambda a, b: ops.protected_matmul(a, b, policy=KERNEL.replace(recompute=False)))(x, w)
    assert np.asarray(y0).tobytes() == np.asarray(y1).tobytes() and r0.to_dict()["gemm_recomputed"] == 0


def test_the_default_policy_redoes_on_the_kernel_on_this_gpu(cuda):
    """FaultPolicy()'s recompute_kernel=None takes the kernel on an NVIDIA GPU of sm_80 or newer: no
    loop left for the host, and an unlocatable pair repaired as the explicit kernel repairs it."""
    from helpers import host_control_flow

    from pimlayers import FaultPolicy
    from pimlayers.ops._redo_kernel import redo_kernel_chosen

    if float(jax.devices()[0].compute_capability) < 8.0:
        pytest.skip("the kernel needs sm_80 or newer; the loop stays the default here")
    assert redo_kernel_chosen(FaultPolicy())
    x, w = _xw(512, 256, 384)
    flow = host_control_flow(jax.make_jaxpr(lambda a, b: ops.protected_matmul(a, b)[0])(x, w))
    assert flow == {"cond": 0, "while": 0}
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
    y, r = jax.jit(lambda a, b, fl: ops.protected_matmul(a, b, faults=fl))(
        x, w, _two_in_a_block(clean, 300, 128)
    )
    assert (r.to_dict()["gemm_recomputed"], r.to_dict()["gemm_uncorrectable"]) == (1, 0)
    _close(y, clean)


def test_plain_checks_at_the_llama_shape_redo_every_detection(cuda):
    """FaultPolicy(weighted_checks=False, locate=False) at 8192 x 4096 -> 1024: a clean product
    equals the default's bit for bit with nothing reported; a single error (which the default
    locates) and an unlocatable pair are both redone on the kernel, checked again on c1 alone."""
    from test_weighted_checks import PLAIN, _single

    x, w = _xw(8192, 4096, 1024)
    clean = jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)
    f = jax.jit(lambda a, b, fl=None: ops.protected_matmul(a, b, policy=PLAIN, faults=fl))
    y0, r0 = f(x, w)
    ref, _ = jax.jit(lambda a, b: ops.protected_matmul(a, b)[0:2])(x, w)
    assert np.asarray(y0).tobytes() == np.asarray(ref).tobytes() and r0.to_dict()["gemm_detected"] == 0
    keys = ("gemm_detected", "gemm_recomputed", "gemm_corrected", "gemm_uncorrectable")
    for faults in (_single(clean, 4000), _two_in_a_block(clean, 4000, 128)):
        y, r = f(x, w, faults)
        assert tuple(r.to_dict()[c] for c in keys) == (1, 1, 1, 0)
        _close(y, clean)
