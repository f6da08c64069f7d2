// CUDA handler of pim_gemv (see pim.h): one warp per output row of a bank (the checksum bank's rows
// included), 16-byte loads of the row and of x, tokens in register blocks of 4.
#include "cuda_util.h"
#include "pim.h"

namespace pimlayers {
namespace {

constexpr int kTok = 4;  // tokens accumulated per pass over a row

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int kVec = 4, kBytes = 4;
  __device__ static float At(const uint4& q, int i) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    return __uint_as_float(w[i]);
  }
  __device__ static float Scalar(const void* p, int64_t i) {
    return static_cast<const float*>(p)[i];
  }
};
struct Half {};  // (Bf16: cuda_util.h)
template <>
struct Elem<Bf16> {
  static constexpr int kVec = 8, kBytes = 2;
  __device__ static float At(const uint4& q, int i) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    return Bf16ToF32(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
  }
  __device__ static float Scalar(const void* p, int64_t i) {
    return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
  }
};
template <>
struct Elem<Half> {
  static constexpr int kVec = 8, kBytes = 2;
  __device__ static float At(const uint4& q, int i) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    return F16ToF32(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
  }
  __device__ static float Scalar(const void* p, int64_t i) {
    return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  }
};

// acc[t] += row . x[t0 + t] over one row of K elements (row type R, x type X).
template <typename R, typename X>
__device__ void RowDot(const void* row, const void* x, int64_t t0, int64_t nt, int64_t k, bool vec,
                       int lane, float* acc) {
  if (vec) {  // R and X may differ in width (the checksum bank is f32 against 16-bit x): step by
    // the smaller vector; a 16-byte load of the narrower type is then used in halves.
    constexpr int V = Elem<R>::kVec < Elem<X>::kVec ? Elem<R>::kVec : Elem<X>::kVec;
    for (int64_t j = static_cast<int64_t>(lane) * V; j < k; j += 32 * V) {
      uint4 rq =
          *reinterpret_cast<const uint4*>(static_cast<const char*>(row) + (j / Elem<R>::kVec) * 16);
      const int ro = static_cast<int>(j % Elem<R>::kVec);
      float rv[V];
#pragma unroll
      for (int i = 0; i < V; ++i) rv[i] = Elem<R>::At(rq, ro + i);
#pragma unroll
      for (int t = 0; t < kTok; ++t) {
        if (t < nt) {
          const char* xt = static_cast<const char*>(x) + (t0 + t) * k * Elem<X>::kBytes;
          uint4 xq = *reinterpret_cast<const uint4*>(xt + (j / Elem<X>::kVec) * 16);
          const int xo = static_cast<int>(j % Elem<X>::kVec);
          float s = 0.0f;
#pragma unroll
          for (int i = 0; i < V; ++i) s += rv[i] * Elem<X>::At(xq, xo + i);
          acc[t] += s;
        }
      }
    }
  } else {
    for (int64_t j = lane; j < k; j += 32) {
      float rv = Elem<R>::Scalar(row, j);
#pragma unroll
      for (int t = 0; t < kTok; ++t) {
        if (t < nt) acc[t] += rv * Elem<X>::Scalar(x, (t0 + t) * k + j);
      }
    }
  }
}

template <typename X>
__global__ void PimGemvKernel(const void* __restrict__ x, const void* __restrict__ w,
                              const float* __restrict__ wsum, const int32_t* __restrict__ ok,
                              int64_t tokens, int64_t nb, int64_t rows, int64_t k, bool vec,
                              float* __restrict__ y, float* __restrict__ c) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t total = (nb + 1) * rows;
  for (int64_t v = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; v < total;
       v += warps) {
    const int64_t b = v / rows, r = v % rows;
    const bool checksum = b == nb;
    const bool live = checksum || ok[b] != 0;
    for (int64_t t0 = 0; t0 < tokens; t0 += kTok) {
      const int64_t nt = tokens - t0 < kTok ? tokens - t0 : kTok;
      float acc[kTok] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (live && checksum) {
        RowDot<float, X>(wsum + r * k, x, t0, nt, k, vec, lane, acc);
      } else if (live) {
        RowDot<X, X>(static_cast<const char*>(w) + (b * rows + r) * k * Elem<X>::kBytes, x, t0, nt,
                     k, vec, lane, acc);
      }
#pragma unroll
      for (int t = 0; t < kTok; ++t) {
        float s = acc[t];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0 && t < nt) {
          if (checksum) {
            c[(t0 + t) * rows + r] = s;
          } else {
            y[((t0 + t) * nb + b) * rows + r] = s;
          }
        }
      }
    }
  }
}

ffi::Error PimGemvCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer wsum,
                       ffi::AnyBuffer ok, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> c) {
  PimShape s;
  if (auto e = CheckPimShapes(x, w, wsum, ok, *y, *c, &s); e.failure()) return e;
  const int64_t total = (s.nb + 1) * s.rows;
  if (total == 0 || s.tokens == 0) return ffi::Error::Success();
  // 16-byte loads need every row to start on a 16-byte boundary: K * 4 bytes (the f32 checksum
  // bank) and K * itemsize must both be multiples of 16, i.e. K % 4 == 0 (f32) or K % 8 == 0.
  const bool vec = s.kind == FloatKind::kF32 ? s.k % 4 == 0 : s.k % 8 == 0;
  const unsigned grid = GridFor(total, 8);  // 8 warps (rows) per block of 256 threads
  auto* yo = static_cast<float*>(y->untyped_data());
  auto* co = static_cast<float*>(c->untyped_data());
  auto* okp = static_cast<const int32_t*>(ok.untyped_data());
  auto* cs = static_cast<const float*>(wsum.untyped_data());
  if (s.kind == FloatKind::kF32) {
    PimGemvKernel<float><<<grid, 256, 0, stream>>>(x.untyped_data(), w.untyped_data(), cs, okp,
                                                   s.tokens, s.nb, s.rows, s.k, vec, yo, co);
  } else if (s.kind == FloatKind::kBF16) {
    PimGemvKernel<Bf16><<<grid, 256, 0, stream>>>(x.untyped_data(), w.untyped_data(), cs, okp,
                                                  s.tokens, s.nb, s.rows, s.k, vec, yo, co);
  } else {
    PimGemvKernel<Half><<<grid, 256, 0, stream>>>(x.untyped_data(), w.untyped_data(), cs, okp,
                                                  s.tokens, s.nb, s.rows, s.k, vec, yo, co);
  }
  return CudaStatus("pim_gemv");
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlPimGemvCuda, pimlayers::PimGemvCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: (T, K) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()    // w: (banks, R, K), x's dtype
                                  .Arg<xla::ffi::AnyBuffer>()    // wsum: (R, K) f32
                                  .Arg<xla::ffi::AnyBuffer>()    // bank_ok: (banks,) int32
                                  .Ret<xla::ffi::AnyBuffer>()    // y: (T, banks, R) f32
                                  .Ret<xla::ffi::AnyBuffer>());  // c: (T, R) f32
