// CUDA handler of abft_check: one warp per (row, column block), sums in f64 across the warp.
#include "abft.h"
#include "cuda_util.h"

namespace pimlayers {
namespace {

__global__ void AbftKernel(void* __restrict__ y, const float* __restrict__ checks,
                           const float* __restrict__ mag, int64_t rows, int64_t n_all,
                           int64_t block_n, int64_t nb, FloatKind kind, AbftParams p,
                           int32_t* __restrict__ flags) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       w < rows * nb; w += warps) {
    const int64_t r = w / nb, b = w % nb;
    const int64_t j0 = r * n_all + b * block_n;
    const int64_t n = n_all - b * block_n < block_n ? n_all - b * block_n : block_n;
    double s1 = 0, s2 = 0, sa = 0;
    int64_t nonfinite = 0, nf_loc = -1;
    for (int64_t j = lane; j < n; j += 32) {
      float v = LoadF(y, j0 + j, kind);
      if (!IsFiniteF(v)) {
        ++nonfinite;
        nf_loc = j;
        continue;
      }
      s1 += v;
      s2 += static_cast<double>(j + 1) * v;
      sa += fabs(v);
    }
    s1 = WarpSum(s1);
    s2 = WarpSum(s2);
    sa = WarpSum(sa);
    nonfinite = WarpSum(nonfinite);
    nf_loc = WarpMax(nf_loc);
    AbftDecision d{kAbftClean, -1};
    if (lane == 0) {
      d = AbftDecide(s1, s2, sa, nonfinite, nf_loc, checks[2 * w], checks[2 * w + 1], mag[w], n, p);
    }
    d.flag = __shfl_sync(0xffffffffu, d.flag, 0);
    d.loc = __shfl_sync(0xffffffffu, d.loc, 0);
    if (d.flag == kAbftCorrected) {  // rare: rebuild the located value from the checksum
      double others = 0;
      for (int64_t j = lane; j < n; j += 32) {
        if (j != d.loc) others += LoadF(y, j0 + j, kind);
      }
      others = WarpSum(others);
      if (lane == 0) StoreF(y, j0 + d.loc, static_cast<float>(checks[2 * w] - others), kind);
    }
    if (lane == 0) flags[w] = d.flag;
  }
}

ffi::Error AbftCheckCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                         ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                         bool correct, ffi::Result<ffi::AnyBuffer> y_out,
                         ffi::Result<ffi::AnyBuffer> flags) {
  FloatKind kind;
  int64_t rows, n_all, nb;
  if (auto e =
          CheckAbftShapes(y, checks, mag, block_n, k, *y_out, *flags, &kind, &rows, &n_all, &nb);
      e.failure())
    return e;
  void* out = y_out->untyped_data();
  if (out != y.untyped_data() && y.size_bytes() > 0) {
    cudaMemcpyAsync(out, y.untyped_data(), y.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  }
  AbftParams p{k, u, lam, StorageRoundoff(kind), correct};
  if (rows * nb > 0) {
    AbftKernel<<<GridFor(rows * nb, 8), 256, 0, stream>>>(
        out, static_cast<const float*>(checks.untyped_data()),
        static_cast<const float*>(mag.untyped_data()), rows, n_all, block_n, nb, kind, p,
        static_cast<int32_t*>(flags->untyped_data()));
  }
  return CudaStatus("abft_check");
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftCheckCuda, pimlayers::AbftCheckCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
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
