// CPU handlers of parity and reconstruct.
#include "parity.h"

#include <cstring>

namespace pimlayers {
namespace {

ffi::Error ParityCpu(ffi::AnyBuffer x, int64_t bank_bytes, int64_t group,
                     ffi::Result<ffi::AnyBuffer> parity) {
  ParityLayout P;
  if (auto e = MakeParityLayout("parity", x, *parity, bank_bytes, group, &P); e.failure()) return e;
  const BankLayout& L = P.banks;
  const uint8_t* in = static_cast<const uint8_t*>(x.untyped_data());
  uint8_t* out = static_cast<uint8_t*>(parity->untyped_data());
  for (int64_t e = 0; e < L.batch; ++e) {
    const uint8_t* ex = in + e * L.bytes;
    for (int64_t g = 0; g < P.ngroups; ++g) {
      uint8_t* o = out + (e * P.ngroups + g) * bank_bytes;
      std::memset(o, 0, bank_bytes);
      for (int64_t b = g * group; b < (g + 1) * group && b < L.nbanks; ++b) {
        int64_t n = L.bytes - b * bank_bytes < bank_bytes ? L.bytes - b * bank_bytes : bank_bytes;
        const uint8_t* src = ex + b * bank_bytes;
        for (int64_t j = 0; j < n; ++j) o[j] ^= src[j];
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error ReconstructCpu(ffi::AnyBuffer x, ffi::AnyBuffer parity, ffi::AnyBuffer lost,
                          int64_t bank_bytes, int64_t group, ffi::Result<ffi::AnyBuffer> out) {
  ParityLayout P;
  if (auto e = MakeParityLayout("reconstruct", x, parity, bank_bytes, group, &P); e.failure())
    return e;
  const BankLayout& L = P.banks;
  if (out->element_type() != x.element_type() || out->size_bytes() != x.size_bytes()) {
    return BadArg("reconstruct", "output must have x's dtype and shape");
  }
  if (lost.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(lost.element_count()) != L.batch * P.ngroups) {
    return BadArg("reconstruct", "lost must be int32 of shape (..., " + std::to_string(P.ngroups) +
                                     "), got " + DtypeName(lost.element_type()) +
                                     ShapeString(lost.dimensions()));
  }
  uint8_t* o = static_cast<uint8_t*>(out->untyped_data());
  if (o != x.untyped_data()) std::memcpy(o, x.untyped_data(), x.size_bytes());
  const uint8_t* par = static_cast<const uint8_t*>(parity.untyped_data());
  const int32_t* lo = static_cast<const int32_t*>(lost.untyped_data());
  for (int64_t e = 0; e < L.batch; ++e) {
    uint8_t* ex = o + e * L.bytes;
    for (int64_t g = 0; g < P.ngroups; ++g) {
      int64_t l = lo[e * P.ngroups + g];
      int64_t b = g * group + l;
      // Out-of-range entries mean "nothing lost here" (the wrapper validates concrete inputs).
      if (l < 0 || l >= group || b >= L.nbanks) continue;
      const uint8_t* pg = par + (e * P.ngroups + g) * bank_bytes;
      int64_t n = L.bytes - b * bank_bytes < bank_bytes ? L.bytes - b * bank_bytes : bank_bytes;
      for (int64_t j = 0; j < n; ++j) {
        uint8_t v = pg[j];
        for (int64_t m = g * group; m < (g + 1) * group && m < L.nbanks; ++m) {
          if (m != b) v ^= BankByte(ex, L.bytes, bank_bytes, m, j);
        }
        ex[b * bank_bytes + j] = v;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlParityCpu, pimlayers::ParityCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: any byte-addressable array
                                  .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
                                  .Attr<int64_t>("group")        // banks per parity group
                                  .Ret<xla::ffi::AnyBuffer>());  // (..., ngroups, bank_bytes) u8

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PlReconstructCpu, pimlayers::ReconstructCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()    // x: the damaged array
        .Arg<xla::ffi::AnyBuffer>()    // parity: (..., ngroups, bank_bytes)
        .Arg<xla::ffi::AnyBuffer>()    // lost: (..., ngroups) int32, -1 none
        .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
        .Attr<int64_t>("group")        // banks per parity group
        .Ret<xla::ffi::AnyBuffer>());  // x repaired (aliases x)
