// CPU handler of pim_gemv (see pim.h).
#include "pim.h"

#include <vector>

namespace pimlayers {
namespace {

ffi::Error PimGemvCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer wsum, ffi::AnyBuffer ok,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> c) {
  PimShape s;
  if (auto e = CheckPimShapes(x, w, wsum, ok, *y, *c, &s); e.failure()) return e;
  // x once in f32, token-major: every row below reads it K times per token.
  std::vector<float> xf(static_cast<size_t>(s.tokens * s.k));
  for (int64_t i = 0; i < s.tokens * s.k; ++i) xf[i] = LoadF(x.untyped_data(), i, s.kind);
  const int32_t* bank_ok = static_cast<const int32_t*>(ok.untyped_data());
  const float* cs = static_cast<const float*>(wsum.untyped_data());
  float* yo = static_cast<float*>(y->untyped_data());
  float* co = static_cast<float*>(c->untyped_data());
  std::vector<float> row(static_cast<size_t>(s.k));
  for (int64_t b = 0; b <= s.nb; ++b) {  // b == nb: the checksum bank
    const bool live = b == s.nb || bank_ok[b] != 0;
    for (int64_t r = 0; r < s.rows; ++r) {
      if (live) {
        if (b < s.nb) {
          for (int64_t j = 0; j < s.k; ++j)
            row[j] = LoadF(w.untyped_data(), (b * s.rows + r) * s.k + j, s.kind);
        } else {
          for (int64_t j = 0; j < s.k; ++j) row[j] = cs[r * s.k + j];
        }
      }
      for (int64_t t = 0; t < s.tokens; ++t) {
        float acc = 0.0f;
        if (live) {
          const float* xt = xf.data() + t * s.k;
          for (int64_t j = 0; j < s.k; ++j) acc += row[j] * xt[j];
        }
        if (b < s.nb) {
          yo[(t * s.nb + b) * s.rows + r] = acc;
        } else {
          co[t * s.rows + r] = acc;
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlPimGemvCpu, pimlayers::PimGemvCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: (T, K) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()    // w: (banks, R, K), x's dtype
                                  .Arg<xla::ffi::AnyBuffer>()    // wsum: (R, K) f32
                                  .Arg<xla::ffi::AnyBuffer>()    // bank_ok: (banks,) int32
                                  .Ret<xla::ffi::AnyBuffer>()    // y: (T, banks, R) f32
                                  .Ret<xla::ffi::AnyBuffer>());  // c: (T, R) f32
