"""`PhotonicMesh`: a seeded model of an optical interconnect's links, and `LinkState`, its health as data.

Topology. A ring of n devices, or a 2-D torus of r x c, over the mesh axes that shard the sequence.
Every device has one outgoing directed link per (axis, direction): link id
``device * 2 * naxes + 2 * axis + (direction > 0)``, device numbered row-major over the mesh axes.
On an axis of two devices the +1 and -1 links reach the same neighbour over two separate waveguides.

Faults. A silicon-photonic link filters its wavelength with a microring resonator; heat shifts the
ring's resonance (thermo-optic drift, about 0.08 nm/K, Bogaerts et al. 2012, Laser & Photonics
Reviews 6:47) and a transfer fails when the phase error exceeds what the receiver tolerates. The model:
phase error = kappa * dT_link + N(0, sigma^2) per transfer, fault when |error| > tolerance, so
``p_fault(link) = 1 - [Phi((tol - mu)/sigma) - Phi((-tol - mu)/sigma)]`` with ``mu = kappa * dT``.
A fault corrupts the payload (one flipped bit) or loses it (nothing arrives), in the proportion
``drop_fraction``. A link marked dead drops everything. ``fault_rate=`` sets p directly for the
stress tests. Which transfers fail is drawn inside the compiled step from ``LinkState.key``, so a
new fault pattern is new data and never a new compilation.

Timing (used by :mod:`pimlayers.routing.simulate`, never slept inside a step): per-hop latency,
per-link bandwidth and Gaussian latency jitter. Defaults are a 2020s co-packaged-optics link:
16 wavelengths x 56 Gb/s per direction (~112 GB/s), 200 ns per hop including SerDes and
time-of-flight, 20 ns jitter — stated assumptions, change them to the part you model.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, UInt32

__all__ = ["LinkState", "PhotonicMesh"]


@dataclasses.dataclass(frozen=True)
class PhotonicMesh:
    """Static description of the interconnect (hashable: a static argument of compiled steps)."""

    shape: tuple[int, ...]  # (n,) for a ring, (r, c) for a torus; one entry per sequence mesh axis
    latency_s: float = 200e-9  # per hop: SerDes + time of flight over a few metres of fibre
    bandwidth_bytes_per_s: float = 112e9  # per directed link: 16 wavelengths x 56 Gb/s
    jitter_s: float = 20e-9  # standard deviation of the per-hop latency
    kappa_rad_per_k: float = 0.35  # phase shift per kelvin of ring detuning (0.08 nm/K over a 0.23 nm FWHM)
    sigma_rad: float = 0.25  # per-transfer random phase noise
    tolerance_rad: float = 1.0  # phase error the receiver's eye still opens at
    drop_fraction: float = 0.5  # of faulty transfers, the share lost outright (the rest arrive corrupted)
    max_attempts: int = 160  # per transfer; 0.88**160 = 1.3e-9, so at 88% faults a route is rarely abandoned

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in np.atleast_1d(self.shape))
        if len(shape) not in (1, 2) or min(shape) < 1:
            raise ValueError(
                f"PhotonicMesh.shape={self.shape!r}; expected (n,) for a ring or (r, c) for a torus, "
                "sizes >= 1"
            )
        object.__setattr__(self, "shape", shape)
        for name in ("latency_s", "bandwidth_bytes_per_s", "sigma_rad", "tolerance_rad"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"PhotonicMesh.{name}={getattr(self, name)!r}; expected a positive number")
        if not 0.0 <= float(self.drop_fraction) <= 1.0:
            raise ValueError(f"PhotonicMesh.drop_fraction={self.drop_fraction!r}; expected 0..1")
        if int(self.max_attempts) < 1:
            raise ValueError(f"PhotonicMesh.max_attempts={self.max_attempts!r}; expected >= 1")

    # --- topology ---

    @property
    def topology(self) -> str:
        return "ring" if len(self.shape) == 1 else "torus"

    @property
    def ndev(self) -> int:
        return math.prod(self.shape)

    @property
    def naxes(self) -> int:
        return len(self.shape)

    @property
    def nlinks(self) -> int:
        return self.ndev * 2 * self.naxes

    def coords(self, device: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(device, self.shape))

    def device(self, coords) -> int:
        return int(
            np.ravel_multi_index([int(c) % s for c, s in zip(coords, self.shape, strict=True)], self.shape)
        )

    def neighbour(self, device: int, axis: int, direction: int) -> int:
        c = list(self.coords(device))
        c[axis] += direction
        return self.device(c)

    def link_id(self, device: int, axis: int, direction: int) -> int:
        """The directed link leaving ``device`` along ``axis`` in ``direction`` (+1 or -1)."""
        return device * 2 * self.naxes + 2 * axis + (1 if direction > 0 else 0)

    def routes(self, axis: int, direction: int) -> list[tuple[tuple[int, int], ...]]:
        """Candidate routes for a one-hop shift, as hop lists of (axis, direction); the direct hop first.

        Ring: the direct link, or the long way round the other direction (n - 1 hops). Torus: also
        the two three-hop detours through the neighbouring row (or column).
        """
        n = self.shape[axis]
        out = [((axis, direction),)]
        for other in range(self.naxes):
            if other != axis and self.shape[other] > 1:
                for s in (1, -1):
                    out.append(((other, s), (axis, direction), (other, -s)))
        if n > 1:
            out.append(((axis, -direction),) * (n - 1))
        return out

    def route_links(self, route) -> np.ndarray:
        """int32 (ndev, hops): the link each hop of ``route`` crosses, for the payload landing on
        each device."""
        table = np.zeros((self.ndev, len(route)), np.int32)
        for dst in range(self.ndev):
            at = dst
            for h in range(len(route) - 1, -1, -1):  # walk the route backwards from the receiver
                a, s = route[h]
                src = self.neighbour(at, a, -s)
                table[dst, h] = self.link_id(src, a, s)
                at = src
        return table

    # --- health as data ---

    def fault_probability(self, temperature_rise_k) -> np.ndarray:
        """Per-link fault probability from each link's ring detuning (kelvin): the thermal model above."""
        mu = self.kappa_rad_per_k * np.asarray(temperature_rise_k, np.float64)
        phi = lambda z: 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
        inside = phi((self.tolerance_rad - mu) / self.sigma_rad) - phi(
            (-self.tolerance_rad - mu) / self.sigma_rad
        )
        return np.clip(1.0 - inside, 0.0, 1.0)

    def state(
        self,
        *,
        fault_rate: float | None = None,
        temperature_rise_k=None,
        dead=(),
        seed: int = 0,
        step: int = 0,
    ) -> LinkState:
        """Link health for one step: ``fault_rate`` (every link) or per-link ``temperature_rise_k``
        (a scalar or one value per link; default: none, so only the random phase noise), links in
        ``dead`` never deliver. ``step`` picks the step's fault draws (same seed and step, same faults)."""
        if fault_rate is not None and temperature_rise_k is not None:
            raise ValueError("PhotonicMesh.state: pass fault_rate or temperature_rise_k, not both")
        if fault_rate is not None:
            if not 0.0 <= float(fault_rate) <= 1.0:
                raise ValueError(f"PhotonicMesh.state: fault_rate={fault_rate!r}; expected 0..1")
            p = np.full(self.nlinks, float(fault_rate))
        else:
            t = np.broadcast_to(
                np.asarray(0.0 if temperature_rise_k is None else temperature_rise_k), (self.nlinks,)
            )
            p = self.fault_probability(t)
        alive = np.ones(self.nlinks, bool)
        for lk in dead:
            if not 0 <= int(lk) < self.nlinks:
                raise ValueError(
                    f"PhotonicMesh.state: dead link {lk!r}; expected link ids 0..{self.nlinks - 1}"
                )
            alive[int(lk)] = False
        key = jax.random.key_data(jax.random.fold_in(jax.random.key(int(seed)), int(step)))
        return LinkState(self, jnp.asarray(p, jnp.float32), jnp.asarray(alive), jnp.asarray(key, jnp.uint32))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LinkState:
    """Per-link fault probability, liveness and the step's random key: data, so new values never recompile.

    The `PhotonicMesh` rides along as static structure (changing it is a new program).
    """

    mesh: PhotonicMesh
    p_fault: Float[Array, " links"]
    alive: Bool[Array, " links"]
    key: UInt32[Array, " 2"]

    def tree_flatten(self):
        return (self.p_fault, self.alive, self.key), self.mesh

    @classmethod
    def tree_unflatten(cls, mesh, leaves):
        return cls(mesh, *leaves)

    def at_step(self, step) -> LinkState:
        """The same links with the fault draws of another step (``step`` may be traced)."""
        k = jax.random.fold_in(jax.random.wrap_key_data(self.key), step)
        return LinkState(self.mesh, self.p_fault, self.alive, jax.random.key_data(k))
