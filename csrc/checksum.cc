// CPU handler of bank_checksums: (S1, S2) mod 2^31-1 per bank (see common.h for the math).
#include "banks.h"

namespace pimlayers {
namespace {

void ChecksumBank(const uint8_t* p, int64_t n, uint32_t* out) {
  int64_t words = (n + 1) / 2;
  uint64_t a = 0, b = 0;
  // Each term of b is below 2^47; reducing every 2^15 words keeps the sum below 2^63.
  for (int64_t start = 0; start < words; start += 32768) {
    int64_t end = start + 32768 < words ? start + 32768 : words;
    for (int64_t i = start; i < end; ++i) {
      uint64_t h = HalfwordAt(p, n, i);
      a += h;
      b += static_cast<uint64_t>(i + 1) * h;
    }
    a = ModM31(a);
    b = ModM31(b);
  }
  out[0] = ModM31(a);
  out[1] = ModM31(b);
}

ffi::Error ChecksumCpu(ffi::AnyBuffer x, int64_t bank_bytes, ffi::Result<ffi::AnyBuffer> out) {
  auto od = out->dimensions();
  if (out->element_type() != ffi::DataType::U32 || od.size() < 2 || od[od.size() - 1] != 2) {
    return BadArg("bank_checksums", "output must be uint32 of shape (..., nbanks, 2)");
  }
  BankLayout L;
  if (auto e = MakeLayout("bank_checksums", x, bank_bytes, LeadingCount(od, 2), &L); e.failure())
    return e;
  if (od[od.size() - 2] != L.nbanks) {
    return BadArg("bank_checksums", "output has " + std::to_string(od[od.size() - 2]) +
                                        " banks; the layout has " + std::to_string(L.nbanks));
  }
  const uint8_t* base = static_cast<const uint8_t*>(x.untyped_data());
  uint32_t* o = static_cast<uint32_t*>(out->untyped_data());
  for (int64_t e = 0; e < L.batch; ++e) {
    for (int64_t b = 0; b < L.nbanks; ++b) {
      int64_t off = b * L.bank_bytes;
      int64_t n = L.bytes - off < L.bank_bytes ? L.bytes - off : L.bank_bytes;
      ChecksumBank(base + e * L.bytes + off, n, o + 2 * (e * L.nbanks + b));
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankChecksumsCpu, pimlayers::ChecksumCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: any byte-addressable array
                                  .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
                                  .Ret<xla::ffi::AnyBuffer>());  // (..., nbanks, 2) uint32
