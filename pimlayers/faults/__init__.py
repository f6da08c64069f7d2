"""Fault bookkeeping: what protected ops report (`FaultReport`) and are told to do (`FaultPolicy`)."""

from ._policy import FaultPolicy as FaultPolicy
from ._report import FaultReport as FaultReport

__all__ = ["FaultPolicy", "FaultReport"]
