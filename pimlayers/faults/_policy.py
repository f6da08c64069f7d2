"""`FaultPolicy`: what protected ops do about faults; static configuration, hashable for `jit`."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar

import numpy as np

__all__ = ["FaultPolicy"]


@dataclasses.dataclass(frozen=True)
class FaultPolicy:
    """How protected ops check, correct and gate; pass it as a static argument to `jit`.

    Frozen and hashable (fields are plain Python values, normalised in `__post_init__`), so two equal
    policies hit the same compilation cache entry. The policy never holds arrays: faults are data,
    configuration is not.
    """

    MODES: ClassVar[tuple[str, ...]] = ("off", "detect", "correct")

    mode: str = "correct"  # "off": no checks; "detect": check and count; "correct": also locate and fix.
    gate: bool = True  # Insulation gates where values leave a protected op (finite values and gradients).
    gate_fill: float = 0.0  # What a gate writes in place of a rejected value; 0 is neutral for sums.
    gate_limit: float | None = None  # Gate |x| > gate_limit as well; None gates only NaN/Inf.
    # Safety factor λ of the probabilistic rounding-error bound used by ABFT checks (Higham & Mary 2019,
    # "A new approach to probabilistic rounding error analysis"): the bound fails for a dot product with
    # probability at most 2·exp(-λ²/2). λ = 8 gives ≈ 2.5e-14, so false alarms stay negligible even over
    # ~1e12 checked dot products per run; smaller λ catches smaller corruptions but alarms more often.
    lam: float = 8.0
    # ABFT column-block width; None checks a whole output row as one block. 128 by default: a whole row
    # of N = 14336 has a rounding bound of ~67 (an exponent flip of a value ~2 passes), 128 columns ~0.24;
    # measured on an H200 (docs/benchmarks.md, 2026-11-30) it costs 0-9% more than whole rows at the
    # Llama-3-8B MLP shapes and ~27% at 4096 -> 1024.
    block_n: int | None = 128
    recompute: bool = True  # Recompute what a check detected but could not locate (see recompute_blocks).
    # None (default): the GEMM is recomputed (a loop of 0 or 1 trips) when a block could not be located.
    # An int (with column blocks, block_n set): the GEMM instead redoes up to this many flagged (row,
    # block) dot products itself, found and gathered with fixed shapes: no branch, so no host round trip
    # (on a GPU the branch costs ~0.15-0.3 ms per GEMM); flagged blocks beyond it are
    # reported uncorrectable (`fault_aware` then skips the step). Not the default: its first version
    # measured slower than the branch on an H200 (docs/benchmarks.md, matmul-parts, 2026-11-30).
    recompute_blocks: int | None = None
    skip_on_uncorrectable: bool = (
        True  # `pimlayers.optim.fault_aware` skips a step with uncorrectable faults.
    )
    # λ for the weight-gradient GEMMs (dw = xᵀ·dy, the backward's reduction over tokens; last, so the
    # fields before it keep their positions). `lam`'s bound assumes unbiased, independent rounding
    # errors; tokens are correlated, and a GPU's tensor cores accumulate in f32 with truncation, so a
    # dw product's partial sums drift far from its (cancelling) result and the rounding error grows
    # nearer K than √K. On an H200 the clean GEMMs of the Llama-3-8B-dims training step
    # (benchmarks.margins, 2026-11-30) reached 0.88 and 1.0 of the λ = 8 bound in dw (a false
    # detection, recomputed to the same value, so "uncorrectable" and a skipped step), against <= 0.08
    # in the forward and dx GEMMs. 64 leaves 8x that headroom; a dw error must then be 8x larger to be
    # seen (an error in one weight gradient of one step).
    lam_dw: float = 64.0
    # On a Hopper GPU, run a bf16 forward GEMM (128-column blocks, correcting, no gate limit) on the
    # fused kernel, whose epilogue forms the block sums (pimlayers/ops/_fused_gemm.py): no second pass
    # over y and no branch. Its repair is the branch-free redo of up to two 128 x 128 tiles; more
    # detected tiles than that are reported uncorrectable (the unfused path recomputes the whole
    # GEMM instead); with recompute=False every detected block is reported uncorrectable (nothing is
    # located in place: that needs y, which the fused path never reads). Not the default: on an
    # H200 it made the forward GEMM alone faster (4096 -> 14336, M = 8192: 1.65-1.71 ms against
    # 1.78-1.88) but the 4-layer Llama-3-8B-dims training step slower (419.0 against 410.3 ms, same
    # run, with the tile redo on every forward GEMM; docs/gpu-tests.md, 2026-12-01), and without
    # recompute, so without the redo, 123.7 against 118.7 ms unfused (2026-12-04). The kernel is
    # chosen when the program is traced, by JAX's first device. Over several devices each runs the
    # kernel on its own rows of x (pimlayers/ops/_fused_rows.py), but the two-tile redo is XLA's
    # gathers and slices, which XLA partitions by gathering y to every device: there the device
    # kernel redoes instead (recompute_kernel, by default on the GPUs that run it; then nothing is
    # gathered; tested on 8 CPU devices with XLA standing in for the fused kernel). Not tested on a
    # GPU under vmap, sharding, or for the CPU of a GPU host. With weighted_checks=False and
    # locate=False the kernel forms c1 and mag itself where the product is at most 1024 columns wide
    # (ops._protected_matmul.CHECKED_MAX_N: there it beat the check GEMMs on an H200; wider, its
    # extra small tensor-core product per K step cost 22-31%, 2026-12-06). Projections of one input
    # (protected_matmuls: q/k/v, gate/up) share one check GEMM on the fused path too since
    # 2026-12-06; the step measurements above predate that (each fused product read x for its own
    # checks). Measured since on an H100 (2026-12-06): the 4-layer step 116.8 ms fused against
    # 115.5 unfused; the fused kernel ran slower than cuBLAS on that card (1.437 against 1.355 ms
    # at 4096 -> 14336), where on an H200 it was faster (1.344 against 1.416).
    fused: bool = False
    # Recompute what a check detected but could not locate with one device kernel (bf16 / f16
    # operands; pimlayers/ops/_redo_kernel.py): launched over every tile of the product, it computes
    # only the tiles holding a detected block and writes their detected rows in place. No branch,
    # so no host round trip per GEMM on a GPU, and no capacity (every detected block is redone); a
    # clean product costs a launch whose programs read their flags and exit.
    # None (default): the kernel where JAX's first device is an NVIDIA GPU of compute capability
    # 8.0 or newer, where it was measured to win (an H100, 2026-12-05, docs/gpu-tests.md: the
    # 4-layer Llama-3-8B-dims step 116.1 ms against 132.0 with the loop and 117.1 recomputing
    # nothing; the forward GEMM at 8192 x 4096 -> 1024, 128-column blocks, 0.190 ms against 0.433
    # with the loop and 0.186 recomputing nothing), and the loop
    # elsewhere (a CPU, where the loop costs no host round trip and the kernel would run under
    # Pallas' interpreter; other GPUs), for f32 GEMMs (Triton's f32 dot would need its slow IEEE
    # mode to stay inside the bound), blocks no power-of-two tile divides, and under
    # recompute_blocks. True: the kernel wherever it runs, a CPU included (its interpreter: tests).
    # False: the loop. Over several devices each device redoes its own rows
    # (pimlayers/ops/_redo_sharding.py); where the contraction is split (dw under data
    # parallelism) the operands are gathered only under a branch taken on a detection, the loop's
    # host round trip in that case. Tested under vmap, on one device and on 8 CPU devices (data
    # parallel, data + FSDP), not yet on several GPUs. With `fused` it replaces the fused path's
    # two-tile redo. The attention's verified flash kernels follow the same setting: None or True
    # reruns them on the device over the CTAs whose rows failed (ops.flash_attention_redo,
    # ops.flash_attention_bwd_with_redo; None wherever those kernels run, True also for their XLA
    # twins off a Hopper GPU), False keeps their loop (a host round trip per call: on an H100 the
    # forward ran at 0.858x of cuDNN with it, 0.914x with the redo, 2026-12-05).
    recompute_kernel: bool | None = None
    # Correct a detected block in place from its checksums where they locate a single error (True,
    # default), or never (False): every detected block is then recomputed (the device redo, the
    # loop or recompute_blocks, whichever the policy runs), and one the recompute cannot clear is
    # reported uncorrectable. Location trusts that one value is wrong; two errors in one block can
    # pass for one (two equal errors at columns of even sum look like one midway between them,
    # tests/test_abft.py) and be "corrected" into a third wrong value. Recomputing costs a redo of
    # the detected block (on GPUs with the device redo, its tile rows alone) where locating costs
    # nothing, and needs recompute=True; for hardware whose faults come in bursts. In mode
    # "correct" only; the checksums and the checks are the same either way (but see weighted_checks).
    locate: bool = True
    # Form the position-weighted checks c2 = x·Σ (j+1) w_j beside the plain c1 = x·Σ w_j (True,
    # default), or not (False; needs locate=False in mode "correct": locating reads c2). c2 serves
    # location and a second detection test (|r2| <= 128·B1) that catches errors whose plain sums
    # cancel within the bound (two in one 128-column block, of equal size and opposite sign) when
    # |e|·|j_a - j_b| exceeds 128·B1; without it a block is judged on r1 alone. What it saves: the
    # check GEMMs carry 4 bf16 columns per 128-column block instead of 7 on a GPU (c1's 3 terms and
    # mag's 1, where c2 took 3 more), ~43% of the checks' GEMM work, which reads x for every
    # protected product; the finish still reads y once. On the CPU the native checks form c2 anyway
    # (one pass over x). On an H200 (2026-12-06, with locate=False) the 4-layer Llama-3-8B-dims
    # step took 109.6 ms against the default's 110.8, the protected GEMMs 1-2% less
    # (docs/gpu-tests.md, forty-seventh session): kept opt-in.
    weighted_checks: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            raise TypeError(f"FaultPolicy.mode must be a str, one of {self.MODES}; got {self.mode!r}.")
        if self.mode not in self.MODES:
            raise ValueError(f"FaultPolicy.mode must be one of {self.MODES}; got {self.mode!r}.")
        for name in ("gate", "recompute", "skip_on_uncorrectable", "fused", "locate", "weighted_checks"):
            self._set(name, _as_bool(name, getattr(self, name)))
        if self.recompute_kernel is not None:
            self._set(
                "recompute_kernel", _as_bool("recompute_kernel", self.recompute_kernel, "a bool or None")
            )
        self._set("gate_fill", _as_float("gate_fill", self.gate_fill))
        if self.gate_limit is not None:
            limit = _as_float("gate_limit", self.gate_limit)
            if not limit > 0:
                raise ValueError(
                    f"FaultPolicy.gate_limit must be a finite float > 0 or None (gate only NaN/Inf); "
                    f"got {limit!r}."
                )
            self._set("gate_limit", limit)
        lam = _as_float("lam", self.lam)
        if not lam > 0:
            raise ValueError(f"FaultPolicy.lam must be a finite float > 0 (8.0 is the default); got {lam!r}.")
        self._set("lam", lam)
        lam_dw = _as_float("lam_dw", self.lam_dw)
        if not lam_dw > 0:
            raise ValueError(
                f"FaultPolicy.lam_dw must be a finite float > 0 (64.0 is the default); got {lam_dw!r}."
            )
        self._set("lam_dw", lam_dw)
        if self.block_n is not None:
            if isinstance(self.block_n, (bool, np.bool_)) or not isinstance(self.block_n, numbers.Integral):
                raise TypeError(
                    f"FaultPolicy.block_n must be an int >= 1 or None (whole row); "
                    f"got {type(self.block_n).__name__} {self.block_n!r}."
                )
            if self.block_n < 1:
                raise ValueError(f"FaultPolicy.block_n must be an int >= 1 or None; got {self.block_n!r}.")
            self._set("block_n", int(self.block_n))
        rb = self.recompute_blocks
        if rb is not None:
            if isinstance(rb, (bool, np.bool_)) or not isinstance(rb, numbers.Integral):
                raise TypeError(
                    f"FaultPolicy.recompute_blocks must be an int >= 1 or None (recompute the whole "
                    f"GEMM); got {type(rb).__name__} {rb!r}."
                )
            if rb < 1:
                raise ValueError(f"FaultPolicy.recompute_blocks must be an int >= 1 or None; got {rb!r}.")
            if self.block_n is None:
                raise ValueError(
                    f"FaultPolicy.recompute_blocks={rb} recomputes column blocks; it needs block_n "
                    f"(got block_n=None: whole rows recompute the GEMM, recompute_blocks=None)."
                )
            self._set("recompute_blocks", int(rb))
            if self.recompute_kernel:
                raise ValueError(
                    f"FaultPolicy.recompute_blocks={rb} and recompute_kernel=True are two ways to redo "
                    f"detected blocks without a branch; choose one."
                )
        if not self.weighted_checks and self.locate and self.mode == "correct":
            raise ValueError(
                "FaultPolicy(weighted_checks=False) forms no position-weighted checks, which locating "
                "an error reads; pass locate=False too (every detected block is then recomputed)."
            )
        if not self.locate and not self.recompute and self.mode == "correct":
            raise ValueError(
                "FaultPolicy(locate=False) corrects by recomputing, and recompute=False recomputes "
                "nothing: nothing would be corrected (mode='detect' checks and counts only)."
            )

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # Normalise a field of the frozen dataclass.

    @classmethod
    def off(cls) -> FaultPolicy:
        """No checks and no gates: the stock layers' behaviour, the baseline for benchmarks."""
        return cls(mode="off", gate=False, recompute=False, skip_on_uncorrectable=False)

    @property
    def enabled(self) -> bool:
        """Whether ABFT checks run at all (mode is not "off")."""
        return self.mode != "off"

    @property
    def corrects(self) -> bool:
        """Whether detected errors are located and corrected (mode "correct")."""
        return self.mode == "correct"

    @property
    def false_alarm_bound(self) -> float:
        """Upper bound 2·exp(-λ²/2) on the probability that one dot product's check fails spuriously."""
        return 2.0 * math.exp(-0.5 * self.lam * self.lam)

    def replace(self, **changes: Any) -> FaultPolicy:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _as_bool(name: str, value: Any, what: str = "a bool") -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"FaultPolicy.{name} must be {what}; got {type(value).__name__} {value!r}.")
    return bool(value)


def _as_float(name: str, value: Any) -> float:
    # numbers.Real covers Python and NumPy ints and floats; a jax array (maybe a tracer) is refused,
    # because a policy is static configuration that `jit` hashes.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"FaultPolicy.{name} must be a Python float (static configuration, not an array); "
            f"got {type(value).__name__} {value!r}."
        )
    out = float(value)
    if not math.isfinite(out):
        # NaN would also break the policy's equality, and with it jit's compilation cache.
        raise ValueError(f"FaultPolicy.{name} must be finite; got {out!r}.")
    return out
