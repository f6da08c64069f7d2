// CPU handler of abft_check (the math and its bound are in abft.h).
#include "abft.h"

#include <cstring>

namespace pimlayers {
namespace {

ffi::Error AbftCheckCpu(ffi::AnyBuffer y, ffi::AnyBuffer checks, ffi::AnyBuffer mag,
                        int64_t block_n, int64_t k, float u, float lam, bool correct,
                        ffi::Result<ffi::AnyBuffer> y_out, ffi::Result<ffi::AnyBuffer> flags) {
  FloatKind kind;
  int64_t rows, n_all, nb;
  if (auto e =
          CheckAbftShapes(y, checks, mag, block_n, k, *y_out, *flags, &kind, &rows, &n_all, &nb);
      e.failure())
    return e;
  void* out = y_out->untyped_data();
  if (out != y.untyped_data()) std::memcpy(out, y.untyped_data(), y.size_bytes());
  const float* ck = static_cast<const float*>(checks.untyped_data());
  const float* mg = static_cast<const float*>(mag.untyped_data());
  int32_t* fl = static_cast<int32_t*>(flags->untyped_data());
  AbftParams p{k, u, lam, StorageRoundoff(kind), correct};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      int64_t j0 = r * n_all + b * block_n;
      int64_t n = n_all - b * block_n < block_n ? n_all - b * block_n : block_n;
      double s1 = 0, s2 = 0, sa = 0;
      int64_t nonfinite = 0, nf_loc = -1;
      for (int64_t j = 0; j < n; ++j) {
        float v = LoadF(out, j0 + j, kind);
        if (!IsFiniteF(v)) {
          ++nonfinite;
          nf_loc = j;
          continue;
        }
        s1 += v;
        s2 += static_cast<double>(j + 1) * v;
        sa += fabs(v);
      }
      int64_t cb = r * nb + b;
      AbftDecision d =
          AbftDecide(s1, s2, sa, nonfinite, nf_loc, ck[2 * cb], ck[2 * cb + 1], mg[cb], n, p);
      if (d.flag == kAbftCorrected) {
        double others = 0;
        for (int64_t j = 0; j < n; ++j) {
          if (j != d.loc) others += LoadF(out, j0 + j, kind);
        }
        StoreF(out, j0 + d.loc, static_cast<float>(ck[2 * cb] - others), kind);
      }
      fl[cb] = d.flag;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftCheckCpu, pimlayers::AbftCheckCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // y: (..., M, N) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()    // checks: (..., M, nb, 2) f32
                                  .Arg<xla::ffi::AnyBuffer>()    // mag: (..., M, nb) f32
                                  .Attr<int64_t>("block_n")      // column block width
                                  .Attr<int64_t>("k")            // GEMM inner dimension
                                  .Attr<float>("unit_roundoff")  // u of the accumulation
                                  .Attr<float>("lam")            // safety factor of the bound
                                  .Attr<bool>("correct")         // rebuild located errors
                                  .Ret<xla::ffi::AnyBuffer>()    // y_out: like y (aliases y)
                                  .Ret<xla::ffi::AnyBuffer>());  // flags: (..., M, nb) int32
