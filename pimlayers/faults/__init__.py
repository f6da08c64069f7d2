"""Fault bookkeeping: what protected ops report (`FaultReport`) and are told to do (`FaultPolicy`),
and injection: GEMM output faults as data, memory faults written in place into live buffers."""

from ._inject import GemmFaults as GemmFaults
from ._inject import inject_gemm_faults as inject_gemm_faults
from ._memory import BitFlip as BitFlip
from ._memory import device_bytes as device_bytes
from ._memory import fail_bank as fail_bank
from ._memory import flip_bits as flip_bits
from ._memory import lose_shard as lose_shard
from ._memory import overwrite as overwrite
from ._memory import random_bit_flips as random_bit_flips
from ._policy import FaultPolicy as FaultPolicy
from ._report import FaultReport as FaultReport

__all__ = [
    "BitFlip",
    "FaultPolicy",
    "FaultReport",
    "GemmFaults",
    "device_bytes",
    "fail_bank",
    "flip_bits",
    "inject_gemm_faults",
    "lose_shard",
    "overwrite",
    "random_bit_flips",
]
