// bank_guard: in one read of x, its bank checksums (as bank_checksums), the XOR parity of each
// group of banks (as parity) and the checksum of each parity row (as bank_checksums of the parity).
#pragma once

#include "parity.h"

namespace pimlayers {

// Shape checks shared by the CPU and CUDA bindings. sums: (..., nbanks, 2) uint32; parity:
// (..., ngroups, bank_bytes) uint8; psums: (..., ngroups, 2) uint32; one batch for all three.
inline ffi::Error MakeGuardLayout(const ffi::AnyBuffer& x, const ffi::AnyBuffer& sums,
                                  const ffi::AnyBuffer& parity, const ffi::AnyBuffer& psums,
                                  int64_t bank_bytes, int64_t group, ParityLayout* P) {
  const std::string op = "bank_guard";
  if (auto e = MakeParityLayout(op, x, parity, bank_bytes, group, P); e.failure()) return e;
  const int64_t batch = P->banks.batch;
  const struct {
    const ffi::AnyBuffer* buf;
    const char* name;
    int64_t rows;
  } outs[2] = {{&sums, "sums", P->banks.nbanks}, {&psums, "parity sums", P->ngroups}};
  for (const auto& o : outs) {
    auto d = o.buf->dimensions();
    if (o.buf->element_type() != ffi::DataType::U32 || d.size() < 2 || d[d.size() - 1] != 2 ||
        d[d.size() - 2] != o.rows || LeadingCount(d, 2) != batch) {
      return BadArg(op, std::string(o.name) + " is " + DtypeName(o.buf->element_type()) +
                            ShapeString(d) + "; expected uint32 of " + std::to_string(batch) +
                            " example(s) of (" + std::to_string(o.rows) + ", 2)");
    }
  }
  return ffi::Error::Success();
}

}  // namespace pimlayers
