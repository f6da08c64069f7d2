"""A first-order timing model of GEMV on a published HBM-PIM part, to set against a GPU's measured GEMV.

The part: Samsung's Aquabolt-XL HBM-PIM (Kwon et al., "A 20nm 6GB Function-In-Memory DRAM, Based on
HBM2 with a 1.2TFLOPS Programmable Computing Unit Using Bank-Level Parallelism", ISSCC 2021; Lee et
al., ISCA 2021). Per cube: 128 programmable computing units (one per two banks, 256 banks), each a
16-lane FP16 SIMD unit at 300 MHz → 128 x 16 x 2 FLOP x 300 MHz = 1.23 TFLOP/s, the paper's 1.2
TFLOPS. A unit reads its bank's row buffer 256 bits (16 FP16 weights) per cycle, so weights stream at
128 x 32 B x 300 MHz = 1.23 TB/s inside a cube: a GEMV (2 FLOP per weight per token) is exactly
balanced between that bandwidth and the SIMD rate. The host interface is HBM2 at 2.4 Gb/s per pin
x 1024 pins = 307 GB/s per cube; inputs are broadcast to all banks of a pseudo-channel through it
and outputs read back through it.

What the model counts, per GEMV of a (K, N) FP16 weight with T tokens on ``cubes`` cubes (weights
spread evenly, whole rows per bank as `pimlayers.ops.pim_pack` lays them out):
- compute/weight streaming: each token re-streams the weights (units hold one input vector's slice at
  a time): ``T * 2*K*N / (cubes * peak)``;
- input broadcast: ``T * K * 2 B`` written to each pseudo-channel (16 per cube) over the host link;
- output read-back: ``T * N * 2 B`` over the host link;
- ``launch_s`` per call (host-side command issue; not given in the papers, default 0 — stated so).
It leaves out DRAM refresh, row activations between rows (hidden by the all-bank mode in the paper's
measurements) and contention with ordinary memory traffic: an optimistic estimate for the part.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AQUABOLT_XL", "PimTiming"]


@dataclasses.dataclass(frozen=True)
class PimTiming:
    name: str = "Samsung Aquabolt-XL HBM-PIM"
    cubes: int = 1
    units_per_cube: int = 128  # one per two banks
    simd_lanes: int = 16  # FP16
    clock_hz: float = 300e6
    pseudo_channels_per_cube: int = 16
    host_link_bytes_per_s: float = 307.2e9  # per cube: 2.4 Gb/s x 1024 pins
    launch_s: float = 0.0

    @property
    def peak_flops(self) -> float:
        """FP16 FLOP/s of all cubes (2 per lane per cycle: one multiply-add)."""
        return self.cubes * self.units_per_cube * self.simd_lanes * 2 * self.clock_hz

    @property
    def weight_bytes_per_s(self) -> float:
        """Internal weight-streaming rate: 16 FP16 (32 B) per unit per cycle."""
        return self.cubes * self.units_per_cube * self.simd_lanes * 2 * self.clock_hz

    def gemv_seconds(self, k: int, n: int, tokens: int = 1) -> dict[str, float]:
        """Estimated time of ``tokens`` x (K) @ (K, N) in FP16, and its parts."""
        compute = tokens * max(2.0 * k * n / self.peak_flops, 2.0 * k * n / self.weight_bytes_per_s)
        link = self.cubes * self.host_link_bytes_per_s
        broadcast = tokens * k * 2.0 * self.pseudo_channels_per_cube * self.cubes / link
        readback = tokens * n * 2.0 / link
        total = compute + broadcast + readback + self.launch_s
        return {"total": total, "compute": compute, "broadcast": broadcast, "readback": readback}


AQUABOLT_XL = PimTiming()
