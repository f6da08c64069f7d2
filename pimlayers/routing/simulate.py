"""Step-time estimates for routed attention on a `PhotonicMesh`: ring, bidirectional ring, torus and
all-gather, with and without link faults, by Monte Carlo over the same fault model and the same
route choice the compiled step uses.

The model, per round of a circulating schedule: every device attends its current block while the
next block is in flight (``overlap=True``; on simulated CPU devices compute and copies share the
cores, so ``overlap=False`` adds them); a transfer attempt lasts as long as its slowest device's
route (hops x (latency + bytes / bandwidth + |jitter|)) plus a fixed per-attempt cost (checksum and
launch); attempts repeat until every device holds a verified block, each retry choosing the route
with the most expected deliveries per hop among the devices still waiting. All-gather moves n - 1 blocks
in a pipelined ring, then computes. Compute: attention FLOPs of the blocks each device really runs
(zigzag: a full diagonal block, then half-size GEMMs; contiguous: the busiest device) at
``device_flops``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .attention import SCHEDULES, streams
from .links import PhotonicMesh

__all__ = ["Estimate", "estimate"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per attention call (forward), over Monte Carlo draws of the link faults."""

    schedule: str
    devices: int
    fault_rate: float
    mean_s: float
    p95_s: float
    compute_s: float  # the busiest device's attention compute
    transfer_s: float  # mean time in transfers not hidden behind compute
    attempts: float  # mean transfer attempts per call (all rounds)
    abandoned: float  # mean transfers given up after max_attempts, per call

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _block_flops(b, h, tq, s, d) -> float:
    return 4.0 * b * h * tq * s * d  # two GEMMs, 2 flops per multiply-add


def _compute_per_round(layout, causal, n, b, h, tl, d, device_flops):
    """(diagonal block seconds, off-diagonal block seconds for the busiest device)."""
    diag = _block_flops(b, h, tl, tl, d) / device_flops
    if not causal or layout in ("striped", "contiguous"):
        return diag, diag  # contiguous: the last device sees every earlier block in full
    return diag, _block_flops(b, h, tl, tl / 2, d) / device_flops if n > 1 else diag


def _attempts(pm: PhotonicMesh, hop, p_ok, rng, draws: int) -> np.ndarray:
    """Per draw: (attempt count, route hop count per attempt summed, abandoned transfers) for one
    transfer round, following the step's route choice."""
    routes = pm.routes(*hop)
    tables = [pm.route_links(r) for r in routes]
    route_ok = np.stack([np.prod(p_ok[t], axis=1) for t in tables])  # (routes, devices)
    out = np.zeros((draws, 3))
    for i in range(draws):
        need = np.ones(pm.ndev, bool)
        attempts = hops = 0
        while need.any() and attempts < pm.max_attempts:
            r = int(np.argmax((route_ok * need).sum(axis=1) / [len(rt) for rt in routes]))
            delivered = rng.random(pm.ndev) < route_ok[r]
            need &= ~delivered
            attempts += 1
            hops += len(routes[r])
        out[i] = attempts, hops, need.sum()
    return out


def estimate(
    pm: PhotonicMesh,
    *,
    schedule: str = "ring",
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int = 2,
    causal: bool = True,
    layout: str = "zigzag",
    fault_rate: float | np.ndarray = 0.0,
    dead=(),
    device_flops: float = 400e12,
    attempt_overhead_s: float = 10e-6,
    transfer_overhead_s: float = 0.0,
    overlap: bool = True,
    draws: int = 200,
    seed: int = 0,
) -> Estimate:
    """Estimate one forward call. ``fault_rate``: one value or one per link; ``dead``: link ids.

    ``device_flops``: the attention rate one device sustains (a measured figure, not the peak).
    ``attempt_overhead_s`` is paid per transfer attempt, ``transfer_overhead_s`` once per transfer.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"estimate: schedule={schedule!r}; expected one of {SCHEDULES}")
    n = pm.ndev
    if seq_len % n:
        raise ValueError(f"estimate: seq_len={seq_len} is not divisible by {n} devices")
    tl = seq_len // n
    block_bytes = 2.0 * batch * tl * kv_heads * head_dim * dtype_bytes  # K and V
    p = np.broadcast_to(np.asarray(fault_rate, np.float64), (pm.nlinks,)).copy()
    alive = np.ones(pm.nlinks, bool)
    alive[list(dead)] = False
    p_ok = np.where(alive, 1.0 - p, 0.0)
    rng = np.random.default_rng(seed)
    diag, off = _compute_per_round(layout, causal, n, batch, heads, tl, head_dim, device_flops)
    hop_s = pm.latency_s + block_bytes / pm.bandwidth_bytes_per_s
    jitter = lambda size: np.abs(rng.normal(0.0, pm.jitter_s, size))

    if schedule == "allgather" or n == 1:
        compute = diag + (n - 1) * off
        xfer = (n - 1) * (hop_s + attempt_overhead_s + transfer_overhead_s) + jitter(
            (draws, max(n - 1, 1))
        ).sum(axis=1) * (n > 1)
        return _summary(schedule, n, p, compute + xfer, compute, float(n - 1), 0.0)

    sts = streams(schedule, pm)
    rounds = max(len(st) for st in sts)
    total = np.full(draws, diag)
    hidden_compute = 0.0
    attempts_sum = np.zeros(draws)
    abandoned = np.zeros(draws)
    for r in range(rounds):
        xfer = np.zeros(draws)
        blocks = 0
        for st in sts:
            if r >= len(st):
                continue
            blocks += 1
            a = _attempts(pm, st[r], p_ok, rng, draws)
            # Streams run at once on different links; each attempt waits for its slowest device.
            t = (
                a[:, 1] * hop_s
                + a[:, 0] * attempt_overhead_s
                + jitter((draws,)) * a[:, 0]
                + transfer_overhead_s
            )
            xfer = np.maximum(xfer, t)
            attempts_sum += a[:, 0]
            abandoned += a[:, 2]
        compute = blocks * off
        hidden_compute += compute
        total += np.maximum(xfer, compute) if overlap else xfer + compute
    return _summary(
        schedule, n, p, total, diag + hidden_compute, float(attempts_sum.mean()), float(abandoned.mean())
    )


def _summary(schedule, n, p, total, compute_s, attempts, abandoned) -> Estimate:
    """An Estimate from the Monte Carlo step times (transfer time: whatever compute does not explain)."""
    mean = float(total.mean())
    return Estimate(
        schedule,
        n,
        float(np.mean(p)),
        mean,
        float(np.quantile(total, 0.95)),
        compute_s,
        mean - compute_s,
        attempts,
        abandoned,
    )
