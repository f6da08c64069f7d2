// Launch helpers for the CUDA handlers: errors come back as ffi::Error, never abort.
#pragma once

#include <cuda_runtime.h>

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
