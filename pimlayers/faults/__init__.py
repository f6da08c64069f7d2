"""Fault bookkeeping: what protected ops report (`FaultReport`) and are told to do (`FaultPolicy`)."""

from ._inject import GemmFaults as GemmFaults
from ._inject import inject_gemm_faults as inject_gemm_faults
from ._policy import FaultPolicy as FaultPolicy
from ._report import FaultReport as FaultReport

__all__ = ["FaultPolicy", "FaultReport", "GemmFaults", "inject_gemm_faults"]
