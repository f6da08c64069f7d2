// CUDA handler of the insulation gate. One pass, 16-byte loads and stores; the per-row count is an
// atomic add taken only for replaced values, so the common (clean) path writes nothing extra.
#include "cuda_util.h"
#include "gate.h"

namespace pimlayers {
namespace {

template <typename Bits>
__device__ __forceinline__ Bits GateOne(Bits bits, float v, float limit, Bits fill, int64_t i,
                                        int64_t row_len, int32_t* counts) {
  if (GateKeeps(v, limit)) return bits;
  atomicAdd(&counts[i / row_len], 1);
  return fill;
}

__global__ void GateKernel(const void* __restrict__ x, void* __restrict__ y, int64_t n,
                           int64_t row_len, FloatKind kind, float fill, float limit,
                           int32_t* counts, bool aligned) {
  const int64_t per_vec = kind == FloatKind::kF32 ? 4 : 8;
  const int64_t nvec = aligned ? n / per_vec : 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (kind == FloatKind::kF32) {
    const uint32_t f = __float_as_uint(fill);
    for (int64_t v = tid; v < nvec; v += stride) {
      uint4 in = reinterpret_cast<const uint4*>(x)[v];
      uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
      for (int q = 0; q < 4; ++q)
        w[q] = GateOne<uint32_t>(w[q], __uint_as_float(w[q]), limit, f, v * 4 + q, row_len, counts);
      reinterpret_cast<uint4*>(y)[v] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (int64_t i = nvec * 4 + tid; i < n; i += stride) {
      uint32_t w = static_cast<const uint32_t*>(x)[i];
      static_cast<uint32_t*>(y)[i] =
          GateOne<uint32_t>(w, __uint_as_float(w), limit, f, i, row_len, counts);
    }
  } else {
    const bool bf = kind == FloatKind::kBF16;
    const uint16_t f = bf ? F32ToBf16(fill) : F32ToF16(fill);
    for (int64_t v = tid; v < nvec; v += stride) {
      uint4 in = reinterpret_cast<const uint4*>(x)[v];
      uint16_t h[8];
      memcpy(h, &in, 16);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        float val = bf ? Bf16ToF32(h[q]) : F16ToF32(h[q]);
        h[q] = GateOne<uint16_t>(h[q], val, limit, f, v * 8 + q, row_len, counts);
      }
      uint4 out;
      memcpy(&out, h, 16);
      reinterpret_cast<uint4*>(y)[v] = out;
    }
    for (int64_t i = nvec * 8 + tid; i < n; i += stride) {
      uint16_t h = static_cast<const uint16_t*>(x)[i];
      float val = bf ? Bf16ToF32(h) : F16ToF32(h);
      static_cast<uint16_t*>(y)[i] = GateOne<uint16_t>(h, val, limit, f, i, row_len, counts);
    }
  }
}

ffi::Error GateCuda(cudaStream_t stream, ffi::AnyBuffer x, float fill, float limit,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> counts) {
  FloatKind kind;
  int64_t rows, row_len;
  if (auto err = CheckGate(x, *y, *counts, &kind, &rows, &row_len); err.failure()) return err;
  if (counts->element_type() != ffi::DataType::S32) return BadArg("gate", "counts must be int32");
  int32_t* cnt = static_cast<int32_t*>(counts->untyped_data());
  if (rows > 0) cudaMemsetAsync(cnt, 0, rows * sizeof(int32_t), stream);
  int64_t n = static_cast<int64_t>(x.element_count());
  if (n > 0) {
    // XLA's buffers are 16-byte aligned in practice; the scalar path covers any that is not.
    bool aligned = ((reinterpret_cast<uintptr_t>(x.untyped_data()) |
                     reinterpret_cast<uintptr_t>(y->untyped_data())) %
                    16) == 0;
    GateKernel<<<GridFor(n / 8 + 1, 256), 256, 0, stream>>>(
        x.untyped_data(), y->untyped_data(), n, row_len, kind, fill, limit, cnt, aligned);
  }
  return CudaStatus("gate");
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlGateCuda, pimlayers::GateCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: (..., n) f32|bf16|f16
                                  .Attr<float>("fill")           // replacement value
                                  .Attr<float>("limit")          // |x| > limit is replaced too
                                  .Ret<xla::ffi::AnyBuffer>()    // y: like x
                                  .Ret<xla::ffi::AnyBuffer>());  // counts: (...) int32
