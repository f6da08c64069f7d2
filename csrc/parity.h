// XOR parity over groups of `group` consecutive banks, and the rebuild of one lost bank per group.
#pragma once

#include "banks.h"

namespace pimlayers {

struct ParityLayout {
  BankLayout banks;
  int64_t group = 0;    // banks per parity group
  int64_t ngroups = 0;  // groups of one example
};

inline ffi::Error MakeParityLayout(const std::string& op, const ffi::AnyBuffer& x,
                                   const ffi::AnyBuffer& parity, int64_t bank_bytes, int64_t group,
                                   ParityLayout* P) {
  auto pd = parity.dimensions();
  if (parity.element_type() != ffi::DataType::U8 || pd.size() < 2) {
    return BadArg(op, "parity must be uint8 of shape (..., ngroups, bank_bytes)");
  }
  if (group <= 0) return BadArg(op, "group=" + std::to_string(group) + "; expected >= 1");
  if (auto e = MakeLayout(op, x, bank_bytes, LeadingCount(pd, 2), &P->banks); e.failure()) return e;
  P->group = group;
  P->ngroups = CeilDiv(P->banks.nbanks, group);
  if (pd[pd.size() - 2] != P->ngroups || pd[pd.size() - 1] != bank_bytes) {
    return BadArg(op, "parity has shape " + ShapeString(pd) + "; expected (..., " +
                          std::to_string(P->ngroups) + ", " + std::to_string(bank_bytes) + ")");
  }
  return ffi::Error::Success();
}

// Byte j of bank b of one example (0 past the end of the data).
PL_HD uint8_t BankByte(const uint8_t* ex, int64_t bytes, int64_t bank_bytes, int64_t b, int64_t j) {
  int64_t off = b * bank_bytes + j;
  return off < bytes ? ex[off] : 0;
}

}  // namespace pimlayers
