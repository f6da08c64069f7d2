"""How close clean GEMMs come to the ABFT detection bound: a diagnostic for tuning ``lam``.

Inside ``with check_margins() as log:``, every protected GEMM traced (forward, the backward's dx
and dw, and the recompute) also reports, through ``jax.debug.callback``, the largest ratio of its
residuals to the bound (|r1| / B1 and |r2| / (n B1), the quantities the check compares; see
``_abft``). A ratio at or above 1 is a detection. On clean data that ratio is the detection
bound's headroom: if a model's GEMMs sit at 0.5 of the bound, rounding alone will one day cross it.
Each record also says how the largest ratio arose: the block's |sum of y| over its magnitude
(``|s1| / mag``: near 1 means same-sign products, whose rounding errors do not cancel) and whether
any check or output was non-finite.

The extra pass is pure JAX over the product (one more read of it per GEMM): a diagnostic, not
for timing. It applies to functions traced inside the context (jit caches what it traced before).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ._abft import abft_bound
from ._common import UNIT_ROUNDOFF

__all__ = ["CheckMargin", "MarginLog", "check_margins"]


@dataclasses.dataclass(frozen=True)
class CheckMargin:
    """One protected GEMM call's closest approach to the bound (host-side values)."""

    role: str  # "y" (forward), "dx", "dw" (backward), "redo" (recompute)
    shape: tuple[int, int, int, int]  # (G, R, K, N): G GEMMs of (R, K) @ (K, N)
    dtype: str  # operand dtype
    block_n: int
    ratio: float  # max over blocks of max(|r1| / B1, |r2| / (n B1)); >= 1 is a detection
    over: int  # blocks at or above the bound
    sum_over_mag: float  # |s1| / mag of the block with the largest ratio
    mag: float  # that block's mag (sum of |x| |w|)
    nonfinite_checks: int  # blocks whose checks or mag are not finite
    nonfinite_y: int  # non-finite values in the product


class MarginLog(list):
    """The records of a ``check_margins`` context, in the order the device produced them."""

    def worst(self, n: int = 10) -> list[CheckMargin]:
        return sorted(self, key=lambda m: -m.ratio)[:n]

    def table(self, n: int = 10) -> str:
        head = f"{'role':<5}{'G x R x K x N':>26}{'dtype':>10}{'ratio':>10}{'over':>6}{'|s1|/mag':>10}"
        lines = [head]
        for m in self.worst(n):
            g, r, k, nn = m.shape
            lines.append(
                f"{m.role:<5}{f'{g}x{r}x{k}x{nn}':>26}{m.dtype:>10}{m.ratio:>10.3g}{m.over:>6}"
                f"{m.sum_over_mag:>10.3g}"
            )
        return "\n".join(lines)


_ACTIVE: MarginLog | None = None


@contextlib.contextmanager
def check_margins() -> Iterator[MarginLog]:
    """Record every protected GEMM's margin to the detection bound (see the module docstring).

    Call ``jax.effects_barrier()`` (or block on the results) before reading the log.
    """
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, MarginLog()
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = prev


def active() -> bool:
    return _ACTIVE is not None


def record(
    role: str, y, checks, mag, dtype, *, k: int, block_n: int | None, lam: float, weighted: bool = True
) -> None:
    """Inside ``check_margins``: emit one record for y (G, R, N) f32 or bf16 (a product over K = k
    of ``dtype`` operands) against checks (G, R, nb, 2) and mag (G, R, nb) (``weighted=False``: no
    c2 in the checks, the plain sums' ratio alone). Elsewhere: nothing."""
    log = _ACTIVE
    if log is None:
        return
    g, r, n = y.shape
    block_n = n if block_n is None else block_n
    u = 2.0**-24  # the f32 accumulation's unit roundoff, as in the check
    u_y = 0.0 if y.dtype == jnp.float32 else UNIT_ROUNDOFF[jnp.dtype(y.dtype)]  # y's storage
    y = y.astype(jnp.float32)
    nb = checks.shape[-2]
    yb = jnp.pad(y, ((0, 0), (0, 0), (0, nb * block_n - n))).reshape(g, r, nb, block_n)
    # Explicit shapes throughout (rank promotion may be set to raise).
    width = jnp.minimum(block_n, n - jnp.arange(nb) * block_n).astype(jnp.float32).reshape(1, 1, nb)
    finite = jnp.isfinite(yb)
    yz = jnp.where(finite, yb, 0.0)
    col = jnp.arange(1, block_n + 1, dtype=jnp.float32).reshape(1, 1, 1, block_n)
    s1, s2 = yz.sum(-1), (yz * col).sum(-1)
    b1 = abft_bound(mag, jnp.abs(yz).sum(-1), k, width, lam, u, u_y)
    if not weighted:  # c2 was not formed: the check reads c1 alone
        checks = checks[..., :1]
    ok = jnp.isfinite(checks).all(-1) & jnp.isfinite(mag)
    ratio = jnp.abs(s1 - checks[..., 0]) / b1
    if weighted:
        ratio = jnp.maximum(ratio, jnp.abs(s2 - checks[..., 1]) / (width * b1))
    ratio = jnp.where(ok & (b1 > 0), ratio, 0.0)
    i = jnp.argmax(ratio)
    mag_i = mag.reshape(-1)[i]
    args = (
        ratio.reshape(-1)[i],
        jnp.sum(ratio >= 1.0, dtype=jnp.int32),
        jnp.abs(s1.reshape(-1)[i]) / jnp.where(mag_i > 0, mag_i, 1.0),
        mag_i,
        jnp.sum(~ok, dtype=jnp.int32),
        jnp.sum(~finite, dtype=jnp.int32),
    )
    shape = (int(g), int(r), int(k), int(n))
    dtype = str(np.dtype(dtype))

    def sink(ratio, over, som, mg, nfc, nfy):
        log.append(
            CheckMargin(
                role,
                shape,
                dtype,
                int(block_n),
                float(ratio),
                int(over),
                float(som),
                float(mg),
                int(nfc),
                int(nfy),
            )
        )

    jax.debug.callback(sink, *args)
