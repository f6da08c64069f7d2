"""The one-read checks kernel (``pimlayers/ops/_checks_kernel.py``, opt-in with
``PIMLAYERS_CHECKS_KERNEL=1`` on a GPU): c and mag of a bf16 GEMM from one pass over x, equal to the
XLA checks (``_checks_reference``) up to the order of the f32 accumulation.

On the CPU the kernel runs under Pallas' interpreter; it is lowered for a GPU here too (one Triton
call in place of the two check GEMMs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.matmul import _same_checks
from pimlayers import ops
from pimlayers._native import has_native
from pimlayers.ops import _abft, _checks_kernel
from pimlayers.ops._abft import WeightChecksums
from pimlayers.ops._checks_kernel import (
    MAX_COLUMNS,
    accumulation_tolerance,
    checks_kernel,
    checks_kernel_applies,
)


def _weights(g, k, n, block_n, seed=0):
    w = jax.random.normal(jax.random.key(seed), (*g, k, n)) / np.sqrt(k)
    if not g:
        return ops.abft_encode(w, block_n)
    encs = [ops.abft_encode(w[i], block_n) for i in range(g[0])]
    return WeightChecksums(jnp.stack([e.sums for e in encs]), jnp.stack([e.abs_sums for e in encs]))


def _x(shape, seed=1):
    x = jax.random.normal(jax.random.key(seed), shape)
    return x.at[..., 3].multiply(40.0).astype(jnp.bfloat16)  # an outlier feature, as LLM activations have


def _same(got, want, scale, k: int, what: str = ""):
    """Equal up to the order of f32 accumulation over k products (``accumulation_tolerance``) of
    the magnitude each sum carries (the kernel's own arithmetic is tested exactly below; this checks
    the terms' split and sum around it)."""
    got, want, scale = (np.asarray(v, np.float64) for v in (got, want, scale))
    assert got.shape == want.shape
    tol = accumulation_tolerance(k)
    worst = np.max(np.abs(got - want) / (scale + 1e-30))
    assert np.all(np.abs(got - want) <= tol * scale + 1e-30), f"{what}: {worst:.3g} > {tol:.3g} (k={k})"


def _fake_gpu(monkeypatch):
    """A process asking for the kernel whose first device is a GPU that runs it."""
    monkeypatch.setenv("PIMLAYERS_CHECKS_KERNEL", "1")
    monkeypatch.setattr(_checks_kernel, "_gpu_runs_it", lambda: True)


@pytest.mark.parametrize(
    ("x_shape", "g", "k", "n", "block_n", "transposed", "lam"),
    [
        ((3, 50, 200), (), 200, 300, 128, False, None),  # leading axes, ragged K and rows, partial block
        ((70, 96), (), 96, 512, 64, False, 8.0),  # the default λ's terms (3 + 1)
        ((2, 70, 96), (2,), 96, 160, 32, False, 64.0),  # a weight per batch entry; λ_dw's terms (2 + 1)
        ((2, 96, 70), (2,), 96, 160, 32, True, 8.0),  # xᵀ stored (the weight gradients' layout)
        ((130, 64), (), 64, 1024, 128, False, None),  # 8 blocks: 48 + 16 columns, two pieces each
    ],
)
def test_the_kernel_is_the_xla_checks(x_shape, g, k, n, block_n, transposed, lam):
    enc = _weights(g, k, n, block_n)
    x = _x(x_shape)
    c_terms, mag_terms, scale = _abft._check_terms(k, lam)
    abs_sums = enc.abs_sums * jnp.float32(scale) if scale != 1.0 else enc.abs_sums
    want_c, want_mag = _abft._checks_reference(x, enc, transposed, lam)
    got_c, got_mag = jax.jit(
        lambda x, s, a: checks_kernel(x, s, a, c_terms, mag_terms, transposed=transposed)
    )(x, enc.sums, abs_sums)
    _same_checks("checks kernel", (want_c, want_mag), (got_c, got_mag), x, enc, transposed)


def test_every_term_of_the_split_reaches_the_checks():
    # Checksum columns whose second and third bf16 terms are 2^-9 and 7·2^-20 of them (heads in
    # [1, 1.1): the third stays under half the second's last place, never rounding into it), against a
    # positive x (no cancellation): leaving out the third term moves c by 6.7e-6 of its magnitude,
    # past the comparison's tolerance (3.8e-6 at K = 96), which the first check shows.
    k, rows, nb = 96, 70, 4
    key_a, key_x = jax.random.split(jax.random.key(5))
    head = jax.random.uniform(key_a, (k, nb * 2), minval=1.0, maxval=1.1).astype(jnp.bfloat16)
    head = head.astype(jnp.float32)
    sums = head * (1.0 + 2.0**-9 + 7 * 2.0**-20)  # bf16 terms: head, head·2^-9, ~head·7·2^-20
    enc = WeightChecksums(sums.reshape(k, nb, 2), jnp.ones((k, nb), jnp.float32))
    x = jnp.abs(jax.random.normal(key_x, (rows, k))).astype(jnp.bfloat16)
    want_c, _ = _abft._checks_reference(x, enc, False, None)  # three terms
    scale = np.asarray(want_c, np.float64)
    two = _abft._split_dot(x, sums, 2).reshape(want_c.shape)
    with pytest.raises(AssertionError):
        _same(two, want_c, scale, k)  # a check that drops a term is told apart
    got_c, _ = jax.jit(lambda x, s, a: checks_kernel(x, s, a, 3, 2))(x, enc.sums, enc.abs_sums)
    _same(got_c, want_c, scale, k)


@pytest.mark.parametrize(
    ("g", "r", "k", "wc", "wm", "a_t"),
    [
        (1, 50, 200, 48, 8, False),  # ragged rows and K; two pieces and one
        (2, 70, 96, 192, 32, False),
        (2, 129, 65, 288, 48, True),  # xᵀ stored; 256 + 32 and 32 + 16
        (1, 64, 64, 16, 16, True),
    ],
)
def test_the_kernel_multiplies_exactly_what_xla_does(g, r, k, wc, wm, a_t):
    _exactly_xlas(g, r, k, wc, wm, a_t)


@pytest.mark.parametrize(
    ("g", "r", "k", "a_t", "bm", "splits"),
    [
        (1, 50, 200, False, 32, 3),  # 4 steps of K in 2 slices of 2; two row tiles, the last ragged
        (2, 40, 300, True, 16, 2),  # 5 steps in 2 slices of 3: the last step past K, one ragged
        (1, 20, 64, False, 16, 5),  # one step of K: one slice, whatever was asked
    ],
)
def test_any_grid_multiplies_exactly_what_xla_does(g, r, k, a_t, bm, splits):
    slices, steps = _checks_kernel._split_steps(k, splits)
    assert (slices - 1) * steps < -(-k // 64) <= slices * steps  # every step in one slice, none empty
    _exactly_xlas(g, r, k, 48, 8, a_t, bm=bm, splits=splits)


def test_the_grid_arguments_are_checked():
    enc = _weights((), 64, 256, 128)
    x = _x((8, 64))
    for kw, what in (({"bm": 48}, "bm=48"), ({"splits": 0}, "splits=0"), ({"splits": 2.0}, "splits=2.0")):
        with pytest.raises(ValueError, match=what):
            checks_kernel(x, enc.sums, enc.abs_sums, 3, 1, **kw)


def _exactly_xlas(g, r, k, wc, wm, a_t, **grid):
    # Small integers: every product and partial sum is exact in f32, so any order of accumulation
    # gives XLA's result bit for bit, and a wrong index, mask or piece shows as a difference.
    ks = jax.random.split(jax.random.key(3), 3)
    ints = lambda key, shape: jax.random.randint(key, shape, -8, 9).astype(jnp.bfloat16)
    x = ints(ks[0], (g, k, r) if a_t else (g, r, k))
    pc = ints(ks[1], (g, k, _checks_kernel._padded(wc)))
    pm = ints(ks[2], (g, k, _checks_kernel._padded(wm)))
    got_c, got_m = _checks_kernel._call(x, pc, pm, a_t=a_t, interpret=True, **grid)
    xr = jnp.swapaxes(x, 1, 2) if a_t else x
    want_c = jnp.matmul(xr, pc, preferred_element_type=jnp.float32)
    want_m = jnp.matmul(jnp.abs(xr), pm, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got_c), np.asarray(want_c))
    np.testing.assert_array_equal(np.asarray(got_m), np.asarray(want_m))


def test_pieces_cover_each_width_with_powers_of_two():
    assert _checks_kernel._pieces(192) == ((0, 128), (128, 64))
    assert _checks_kernel._pieces(48) == ((0, 32), (32, 16))
    assert _checks_kernel._pieces(8) == ((0, 16),)
    assert _checks_kernel._pieces(288) == ((0, 256), (256, 32))
    for width in range(1, 700):
        pieces = _checks_kernel._pieces(width)
        total = sum(w for _, w in pieces)
        assert width <= total < width + 16 and all(w & (w - 1) == 0 and w >= 16 for _, w in pieces)
        assert [off for off, _ in pieces] == list(np.cumsum([0] + [w for _, w in pieces])[:-1])


def test_it_takes_the_checks_it_can_hold_and_refuses_the_rest():
    sums = jnp.zeros((4096, 32, 2), jnp.float32)  # a 4096-wide product's 32 blocks: 192 + 32 columns
    x = jnp.zeros((8, 4096), jnp.bfloat16)
    assert checks_kernel_applies(x, sums, 3, 1, False)
    wide = jnp.zeros((4096, 224, 2), jnp.float32)  # the MLP's gate and up: 1,568 columns
    assert not checks_kernel_applies(x, wide, 3, 1, False)
    assert _checks_kernel._padded(2 * 224 * 3) > MAX_COLUMNS
    assert not checks_kernel_applies(x.astype(jnp.float32), sums, 3, 1, False)  # f32 x: XLA's HIGHEST
    assert not checks_kernel_applies(x, sums, 3, 1, True)  # transposed needs the batch axis
    with pytest.raises(ValueError, match="expected a bf16 x"):
        checks_kernel(x, wide, wide[..., 0], 3, 1)


@pytest.mark.parametrize(("x_shape", "g", "transposed"), [((70, 200), (), False), ((2, 200, 40), (2,), True)])
def test_the_plain_checks_are_the_xla_plain_checks(x_shape, g, transposed):
    # FaultPolicy(weighted_checks=False): c1's terms alone (and mag), c2 zero, as abft_checks'.
    enc = _weights(g, 200, 384, 128)
    x = _x(x_shape)
    c_terms, mag_terms, scale = _abft._check_terms(200, 8.0)
    want = _abft._checks_reference(x, enc, transposed, 8.0, weighted=False)
    got = checks_kernel(
        x,
        enc.sums,
        enc.abs_sums * jnp.float32(scale),
        c_terms,
        mag_terms,
        transposed=transposed,
        weighted=False,
    )
    _same_checks("plain checks kernel", want, got, x, enc, transposed)
    assert not np.any(np.asarray(got[0][..., 1]))


def test_the_plain_checks_take_twice_the_blocks():
    # 3 + 1 columns a block instead of 3 + 3 + 1: 80 blocks (a 10240-wide product) take 240 + 80
    # columns plain, within MAX_COLUMNS, and 480 + 80 weighted, past it.
    x = jnp.zeros((8, 4096), jnp.bfloat16)
    sums = jnp.zeros((4096, 80, 2), jnp.float32)
    assert checks_kernel_applies(x, sums, 3, 1, False, weighted=False)
    assert not checks_kernel_applies(x, sums, 3, 1, False)


def test_it_is_wanted_only_when_asked_on_a_gpu(monkeypatch):
    # Asked for on a CPU-only process: not wanted (the interpreter would stand in for a GPU).
    monkeypatch.setenv("PIMLAYERS_CHECKS_KERNEL", "1")
    assert not _checks_kernel.checks_kernel_wanted()
    _fake_gpu(monkeypatch)
    assert _checks_kernel.checks_kernel_wanted()
    monkeypatch.setenv("PIMLAYERS_CHECKS_KERNEL", "0")
    assert not _checks_kernel.checks_kernel_wanted()


def test_asked_for_the_checks_lower_to_it_for_a_gpu_and_stay_xlas_elsewhere(monkeypatch):
    # abft_checks' GPU path (its "reference", which a process with a GPU dispatches to): where the
    # kernel is wanted and takes the checks, a platform switch between it (cuda) and XLA's dots.
    enc = _weights((), 128, 512, 128)
    x = _x((256, 128))
    xla = lambda v, s, a: _abft._checks_reference(v, WeightChecksums(s, a), False, 8.0)
    assert _abft._with_checks_kernel(xla, x, enc, 128, False, 8.0) is xla  # not asked for
    _fake_gpu(monkeypatch)
    both = jax.jit(_abft._with_checks_kernel(xla, x, enc, 128, False, 8.0))
    text = both.trace(x, enc.sums, enc.abs_sums).lower(lowering_platforms=("cuda",)).as_text()
    # (Lowered for one platform, the switch is a case on a constant index holding both branches,
    # which XLA folds away.)
    assert text.count('name = "pimlayers_checks_kernel"') == 1
    cpu = both.trace(x, enc.sums, enc.abs_sums).lower(lowering_platforms=("cpu",)).as_text()
    assert "pimlayers_checks_kernel" not in cpu and cpu.count("stablehlo.dot_general") == 2
    for got, want in zip(both(x, enc.sums, enc.abs_sums), xla(x, enc.sums, enc.abs_sums), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # on the CPU: XLA's dots
    wide = _weights((), 128, 256 * 128, 128)  # 256 blocks: too many columns, XLA's dots stay
    assert _abft._with_checks_kernel(xla, x, wide, 128, False, 8.0) is xla
    # 40 blocks (280 columns): the kernel holds them, but at that width XLA's checks were faster
    # (PROTECTED_COLUMNS), so the protected GEMMs keep them.
    mid = _weights((), 128, 40 * 128, 128)
    assert checks_kernel_applies(x, mid.sums, 3, 1, False)
    assert not checks_kernel_applies(x, mid.sums, 3, 1, False, max_columns=_checks_kernel.PROTECTED_COLUMNS)
    assert _abft._with_checks_kernel(xla, x, mid, 128, False, 8.0) is xla
    # Transposed checks contract over the rows a data-parallel x has split: with several devices
    # (this suite runs 8 CPU devices) XLA's dots, which add the partial sums, stay.
    batch = _weights((2,), 128, 512, 128)
    xt = _x((2, 128, 64))
    assert jax.device_count() > 1
    assert _abft._with_checks_kernel(xla, xt, batch, 128, True, 8.0) is xla
    assert _abft._with_checks_kernel(xla, _x((2, 64, 128)), batch, 128, False, 8.0) is not xla


@pytest.mark.skipif(not has_native("cpu"), reason="needs the native CPU checks (an op XLA cannot split)")
def test_asked_for_each_device_checks_its_own_rows(monkeypatch, cpu_mesh):
    # x's rows split over the mesh: the kernel's switch is partitioned as the native checks are
    # (row_parallel), so nothing gathers x to run it, and each device's rows get their own checks.
    # Compiled for the CPU the switch runs its other branch, here the native CPU checks standing in
    # for a call XLA cannot partition (as the Triton kernel is): left to XLA it gathers x.
    enc = _weights((), 128, 512, 128)
    x = _x((16 * cpu_mesh.size, 128))
    opaque = lambda v, s, a: _abft._checks_native(v, s, a, False)
    xs = jax.device_put(x, NamedSharding(cpu_mesh, P("d")))
    alone = jax.jit(opaque).lower(xs, enc.sums, enc.abs_sums).compile().as_text()
    assert "all-gather" in alone  # XLA's way with an op it cannot split: the property below could fail
    _fake_gpu(monkeypatch)
    fn = jax.jit(_abft._with_checks_kernel(opaque, x, enc, 128, False, 8.0))
    hlo = fn.lower(xs, enc.sums, enc.abs_sums).compile().as_text()
    assert "all-gather" not in hlo
    c, mag = fn(xs, enc.sums, enc.abs_sums)
    assert c.sharding.spec[0] == "d" and mag.sharding.spec[0] == "d"
    want_c, want_mag = jax.jit(opaque)(x, enc.sums, enc.abs_sums)  # per row: equal bit for bit
    np.testing.assert_array_equal(np.asarray(c), np.asarray(want_c))
    np.testing.assert_array_equal(np.asarray(mag), np.asarray(want_mag))


def test_the_gpu_lowering_is_one_triton_call_in_place_of_the_check_gemms():
    # Lowered for CUDA here (no GPU needed): the checks' program holds the kernel's custom call and
    # no dot of XLA's.
    enc = _weights((), 256, 1024, 128)
    x = _x((512, 256))
    c_terms, mag_terms, _ = _abft._check_terms(256, 8.0)
    fn = jax.jit(lambda x, s, a: checks_kernel(x, s, a, c_terms, mag_terms, interpret=False))
    text = fn.trace(x, enc.sums, enc.abs_sums).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
    assert "stablehlo.dot_general" not in text  # (the kernel's own IR is serialised in the call)
