// CPU handler of the insulation gate.
#include "gate.h"

namespace pimlayers {
namespace {

ffi::Error GateCpu(ffi::AnyBuffer x, float fill, float limit, ffi::Result<ffi::AnyBuffer> y,
                   ffi::Result<ffi::AnyBuffer> counts) {
  FloatKind kind;
  int64_t rows, row_len;
  if (auto err = CheckGate(x, *y, *counts, &kind, &rows, &row_len); err.failure()) return err;
  if (counts->element_type() != ffi::DataType::S32) return BadArg("gate", "counts must be int32");
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  int32_t* cnt = static_cast<int32_t*>(counts->untyped_data());
  for (int64_t r = 0; r < rows; ++r) {
    int32_t c = 0;
    for (int64_t j = r * row_len; j < (r + 1) * row_len; ++j) {
      float v = LoadF(in, j, kind);
      bool keep = GateKeeps(v, limit);
      c += keep ? 0 : 1;
      // Kept values are copied bit for bit (no f32 round trip changes a NaN payload or -0).
      if (kind == FloatKind::kF32) {
        static_cast<float*>(out)[j] = keep ? v : fill;
      } else {
        uint16_t h = static_cast<const uint16_t*>(in)[j];
        uint16_t f = kind == FloatKind::kBF16 ? F32ToBf16(fill) : F32ToF16(fill);
        static_cast<uint16_t*>(out)[j] = keep ? h : f;
      }
    }
    cnt[r] = c;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlGateCpu, pimlayers::GateCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: (..., n) f32|bf16|f16
                                  .Attr<float>("fill")           // replacement value
                                  .Attr<float>("limit")          // |x| > limit is replaced too
                                  .Ret<xla::ffi::AnyBuffer>()    // y: like x
                                  .Ret<xla::ffi::AnyBuffer>());  // counts: (...) int32
