// Bank layout shared by bank_checksums, parity and reconstruct: an array's bytes (per batch
// example) cut into banks of `bank_bytes`; the last bank may be partial and reads as zero-padded.
#pragma once

#include "common.h"

namespace pimlayers {

inline bool ByteAddressable(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
    case ffi::DataType::TOKEN:
    case ffi::DataType::INVALID:
      return false;
    default:
      return true;
  }
}

struct BankLayout {
  int64_t batch = 1;  // independent examples (vmap)
  int64_t bytes = 0;  // bytes of one example
  int64_t bank_bytes = 0;
  int64_t nbanks = 0;  // banks of one example
};

// out_rank_tail: how many trailing dims of `out` describe one example (bank or group axes).
inline ffi::Error MakeLayout(const std::string& op, const ffi::AnyBuffer& x, int64_t bank_bytes,
                             int64_t batch, BankLayout* L) {
  if (!ByteAddressable(x.element_type())) {
    return BadArg(op, std::string("x has dtype ") + DtypeName(x.element_type()) +
                          "; expected a byte-addressable dtype");
  }
  if (bank_bytes <= 0 || bank_bytes % 16 != 0 || bank_bytes > (int64_t{1} << 31)) {
    return BadArg(op, "bank_bytes=" + std::to_string(bank_bytes) +
                          "; expected a positive multiple of 16 of at most 2^31");
  }
  int64_t total = static_cast<int64_t>(x.size_bytes());
  if (batch <= 0 || total % batch != 0) {
    return BadArg(op, "x of shape " + ShapeString(x.dimensions()) + " does not split into " +
                          std::to_string(batch) + " examples");
  }
  L->batch = batch;
  L->bytes = total / batch;
  L->bank_bytes = bank_bytes;
  L->nbanks = CeilDiv(L->bytes, bank_bytes);
  return ffi::Error::Success();
}

// Little-endian 16-bit word i of a byte range of length n (a missing high byte reads as 0).
PL_HD uint32_t HalfwordAt(const uint8_t* p, int64_t n, int64_t i) {
  uint32_t lo = p[2 * i];
  uint32_t hi = (2 * i + 1 < n) ? p[2 * i + 1] : 0u;
  return lo | (hi << 8);
}

}  // namespace pimlayers
