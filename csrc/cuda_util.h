// Launch helpers for the CUDA handlers: errors come back as ffi::Error, never abort.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "common.h"

namespace pimlayers {

inline ffi::Error CudaStatus(const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("pimlayers.") + op +
                                ": CUDA error: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// A grid that covers `work` items of `per_block` each, capped so a grid-stride loop does the rest.
inline unsigned GridFor(int64_t work, int64_t per_block) {
  int64_t g = CeilDiv(work, per_block);
  const int64_t cap = 65535LL * 16;
  if (g > cap) g = cap;
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

// The element types of the float kernels' templates: float, and tags for the two 16-bit formats.
struct Bf16 {};
struct F16 {};

template <typename T>
constexpr int kValueBytes = std::is_same<T, float>::value ? 4 : 2;

// A value's f32 from its bits (the low 16 bits for bf16/f16; higher bits are ignored): exact.
template <typename T>
__device__ __forceinline__ float ToF32(uint32_t bits);
template <>
__device__ __forceinline__ float ToF32<float>(uint32_t bits) {
  return __uint_as_float(bits);
}
template <>
__device__ __forceinline__ float ToF32<Bf16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
template <>
__device__ __forceinline__ float ToF32<F16>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// Warp sums.
__device__ __forceinline__ double WarpSum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int64_t WarpSum(int64_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int64_t WarpMax(int64_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    int64_t w = __shfl_down_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}
__device__ __forceinline__ uint32_t WarpSumM31(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = AddM31(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace pimlayers
