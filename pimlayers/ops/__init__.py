"""Native ops with pure-JAX twins: the insulation gate, bank checksums, parity (and both in one read:
bank_guard; for many arrays in one call: bank_guard_many, and their check: bank_verify_many), ABFT
checks, the banked (PIM) GEMV; flash attention and its backward with every GEMM verified inside the
kernels (Hopper)."""

from ._abft import ABFT_CLEAN as ABFT_CLEAN
from ._abft import ABFT_CORRECTED as ABFT_CORRECTED
from ._abft import ABFT_DETECTED as ABFT_DETECTED
from ._abft import WeightChecksums as WeightChecksums
from ._abft import abft_check as abft_check
from ._abft import abft_check_reference as abft_check_reference
from ._abft import abft_checks as abft_checks
from ._abft import abft_encode as abft_encode
from ._abft import abft_encode_reference as abft_encode_reference
from ._abft import abft_finish as abft_finish
from ._abft import abft_finish_reference as abft_finish_reference
from ._checksum import bank_checksums as bank_checksums
from ._checksum import bank_checksums_reference as bank_checksums_reference
from ._checksum import num_banks as num_banks
from ._flash import FlashChecks as FlashChecks
from ._flash import FlashConfig as FlashConfig
from ._flash import FlashFaults as FlashFaults
from ._flash import flash_attention as flash_attention
from ._flash import flash_attention_reference as flash_attention_reference
from ._flash import flash_supported as flash_supported
from ._flash_bwd import FlashBwdChecks as FlashBwdChecks
from ._flash_bwd import FlashBwdConfig as FlashBwdConfig
from ._flash_bwd import FlashBwdFaults as FlashBwdFaults
from ._flash_bwd import flash_attention_bwd as flash_attention_bwd
from ._flash_bwd import flash_attention_bwd_reference as flash_attention_bwd_reference
from ._flash_bwd import flash_bwd_supported as flash_bwd_supported
from ._gate import gate as gate
from ._gate import gate_reference as gate_reference
from ._guard import bank_guard as bank_guard
from ._guard import bank_guard_reference as bank_guard_reference
from ._guard_many import Verified as Verified
from ._guard_many import bank_guard_many as bank_guard_many
from ._guard_many import bank_guard_many_reference as bank_guard_many_reference
from ._guard_many import bank_verify_many as bank_verify_many
from ._guard_many import bank_verify_many_reference as bank_verify_many_reference
from ._margins import CheckMargin as CheckMargin
from ._margins import MarginLog as MarginLog
from ._margins import check_margins as check_margins
from ._parity import num_groups as num_groups
from ._parity import parity as parity
from ._parity import parity_reference as parity_reference
from ._parity import reconstruct as reconstruct
from ._parity import reconstruct_reference as reconstruct_reference
from ._pim import PimWeights as PimWeights
from ._pim import pim_gemv as pim_gemv
from ._pim import pim_gemv_reference as pim_gemv_reference
from ._pim import pim_linear as pim_linear
from ._pim import pim_pack as pim_pack
from ._protected_matmul import protected_bmm as protected_bmm
from ._protected_matmul import protected_bmm_grads as protected_bmm_grads
from ._protected_matmul import protected_matmul as protected_matmul
from ._protected_matmul import report_from_tap as report_from_tap
from ._protected_matmul import zero_tap as zero_tap
