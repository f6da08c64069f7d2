"""Parameter memory: HBM bank geometry, the address map, and `PimStore` (checksums, parity, scrub,
repair, cross-device shard rebuild), zero-copy adoption of foreign buffers, and the HBM-PIM timing
model of the "pim" Dense backend."""

from .adopt import adopt as adopt
from .adopt import aligned_empty as aligned_empty
from .adopt import buffer_pointer as buffer_pointer
from .geometry import AddressMap as AddressMap
from .geometry import BankAddress as BankAddress
from .geometry import BankGeometry as BankGeometry
from .pim_timing import AQUABOLT_XL as AQUABOLT_XL
from .pim_timing import PimTiming as PimTiming
from .store import PimState as PimState
from .store import PimStore as PimStore
from .store import RepairResult as RepairResult
from .store import ScrubResult as ScrubResult

__all__ = [
    "AQUABOLT_XL",
    "AddressMap",
    "BankAddress",
    "BankGeometry",
    "PimState",
    "PimStore",
    "PimTiming",
    "RepairResult",
    "ScrubResult",
    "adopt",
    "aligned_empty",
    "buffer_pointer",
]
