// CUDA handlers of abft_check and abft_finish (the math and its bound are in abft.h).
//
// Two kernels. The row kernel is the fast one, for float32 y whose rows and column blocks are
// multiples of 128 columns (every Llama-3 GEMM): one CTA per row, each warp reads 512 contiguous
// columns at a time with 16-byte loads, groups of 8 lanes own 128 columns, their sums are reduced
// across the group (3 shuffles, not a whole warp's 5) and added into per-block sums in shared
// memory; the gated, cast output is written in the same pass, so y is read once. The warp kernel
// covers every other shape and dtype: one warp per (row, column block), as simple as the CPU loop.
#include "abft.h"
#include "cuda_util.h"

namespace pimlayers {
namespace {

__device__ __forceinline__ void StoreCast4(void* out, int64_t i, float4 v, FloatKind k) {
  if (k == FloatKind::kF32) {
    reinterpret_cast<float4*>(out)[i / 4] = v;
    return;
  }
  const bool bf = k == FloatKind::kBF16;
  uint16_t h[4] = {bf ? F32ToBf16(v.x) : F32ToF16(v.x), bf ? F32ToBf16(v.y) : F32ToF16(v.y),
                   bf ? F32ToBf16(v.z) : F32ToF16(v.z), bf ? F32ToBf16(v.w) : F32ToF16(v.w)};
  uint2 packed;
  memcpy(&packed, h, 8);
  reinterpret_cast<uint2*>(out)[i / 4] = packed;
}

// The rare correction of one located value, by one thread (AbftRebuild: rebuilt from the others,
// then the block checked again). Returns the change to the row's gate count; a block whose rebuilt
// version fails the check is left as it was and its flag becomes "detected".
__device__ int CorrectOne(const AbftIo& io, int64_t j0, int64_t n, int64_t loc, float c1, float c2,
                          float mag, const AbftParams& p, const GateSpec& g, bool write_all,
                          int32_t* flag) {
  auto load = [&](int64_t j) { return static_cast<double>(LoadF(io.y, j0 + j, io.in_kind)); };
  const AbftFix fix = AbftRebuild(load, n, loc, c1, c2, mag, p);
  if (!fix.ok) {
    *flag = kAbftDetected;
    return 0;
  }
  int before = 0, after = 0;
  GateCast(LoadF(io.y, j0 + loc, io.in_kind), io.out_kind, g, &before);
  StoreF(io.out, j0 + loc, GateCast(fix.value, io.out_kind, g, &after), io.out_kind);
  return after - (write_all ? before : 0);
}

__global__ void AbftWarpKernel(AbftIo io, AbftParams p, GateSpec g, bool write_all) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       w < io.rows * io.nb; w += warps) {
    const int64_t r = w / io.nb, b = w % io.nb;
    const int64_t j0 = r * io.n_all + b * io.block_n;
    const int64_t n =
        io.n_all - b * io.block_n < io.block_n ? io.n_all - b * io.block_n : io.block_n;
    double s1 = 0, s2 = 0, sa = 0;
    int64_t nonfinite = 0, nf_loc = -1;
    int dropped = 0;
    for (int64_t j = lane; j < n; j += 32) {
      float v = LoadF(io.y, j0 + j, io.in_kind);
      if (write_all) StoreF(io.out, j0 + j, GateCast(v, io.out_kind, g, &dropped), io.out_kind);
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
    dropped = static_cast<int>(WarpSum(static_cast<int64_t>(dropped)));
    if (lane == 0) {
      const float c1 = io.checks[2 * w];
      AbftDecision d =
          AbftDecide(s1, s2, sa, nonfinite, nf_loc, c1, io.checks[2 * w + 1], io.mag[w], n, p);
      if (d.flag == kAbftCorrected) {
        dropped += CorrectOne(io, j0, n, d.loc, c1, io.checks[2 * w + 1], io.mag[w], p, g,
                              write_all, &d.flag);
      }
      io.flags[w] = d.flag;
      if (io.counts != nullptr && dropped != 0) atomicAdd(&io.counts[r], dropped);
    }
  }
}

constexpr int kRowThreads = 256;
constexpr int kGroup = 8;  // lanes per 128 columns

__device__ __forceinline__ double GroupSum(double v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int GroupSum(int v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int GroupMax(int v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Shared memory per CTA: s1, s2, sa (f64) and the non-finite count and location (int) per block,
// then the row's gate count.
__host__ __device__ inline size_t RowSmem(int64_t nb) {
  return static_cast<size_t>(nb) * (3 * sizeof(double) + 2 * sizeof(int)) + sizeof(int);
}

__global__ void __launch_bounds__(kRowThreads)
    AbftRowKernel(AbftIo io, AbftParams p, GateSpec g, bool write_all) {
  extern __shared__ double smem[];
  const int64_t nb = io.nb;
  double* s1s = smem;
  double* s2s = smem + nb;
  double* sas = smem + 2 * nb;
  int* nfs = reinterpret_cast<int*>(smem + 3 * nb);
  int* locs = nfs + nb;
  int* dropped_row = locs + nb;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int glane = lane % kGroup;
  const int64_t chunks = io.n_all / 512, tail_vecs = (io.n_all % 512) / 4;
  constexpr int kWarps = kRowThreads / 32;
  for (int64_t r = blockIdx.x; r < io.rows; r += gridDim.x) {
    for (int64_t b = threadIdx.x; b < nb; b += kRowThreads) {
      s1s[b] = s2s[b] = sas[b] = 0;
      nfs[b] = 0;
      locs[b] = -1;
    }
    if (threadIdx.x == 0) *dropped_row = 0;
    __syncthreads();
    const float4* row =
        reinterpret_cast<const float4*>(static_cast<const float*>(io.y) + r * io.n_all);
    int dropped = 0;
    // A warp's chunk is 128 float4 (512 columns); lane l reads float4 l*4 .. l*4+3 of it, so its
    // 8-lane group covers 128 contiguous columns, inside one column block (block_n % 128 == 0).
    const int64_t total = chunks + (tail_vecs > 0 ? 1 : 0);
    // Each lane keeps running sums while its group stays in one column block (whole rows, wide
    // blocks) and the group adds them into shared memory only when the block changes: with one
    // block per row, 8 shared atomics per row instead of one per chunk (their contention was
    // measured to cost a third of the kernel's time on an H200).
    double a1 = 0, a2 = 0, aa = 0;
    int anf = 0, aloc = -1;
    int64_t cur = -1;
    for (int64_t c = warp;; c += kWarps) {
      const bool more = c < total;                                     // warp-uniform
      const bool live = more && (c < chunks || lane * 4 < tail_vecs);  // tail: whole groups
      const int64_t v0 = c * 128 + lane * 4;
      const int64_t col0 = v0 * 4;  // first column of this lane's 16
      const int64_t b = live ? col0 / io.block_n : cur;
      const bool flush = cur >= 0 && (b != cur || !more);
      if (__any_sync(0xffffffffu, flush)) {
        const double r1 = GroupSum(a1), r2 = GroupSum(a2), ra = GroupSum(aa);
        const int rnf = GroupSum(anf), rloc = GroupMax(aloc);
        if (flush) {
          if (glane == 0) {
            atomicAdd(&s1s[cur], r1);
            atomicAdd(&s2s[cur], r2);
            atomicAdd(&sas[cur], ra);
            if (rnf) {
              atomicAdd(&nfs[cur], rnf);
              atomicMax(&locs[cur], rloc);
            }
          }
          a1 = a2 = aa = 0;
          anf = 0;
          aloc = -1;
        }
      }
      if (!more) break;
      cur = b;
      if (!live) continue;
      float4 v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = __ldcs(row + v0 + q);
      const int64_t jb = col0 - b * io.block_n;  // index of the first column within the block
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float e[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
        float o[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int64_t j = jb + 4 * q + t;
          o[t] = GateCast(e[t], io.out_kind, g, &dropped);
          if (!IsFiniteF(e[t])) {
            ++anf;
            aloc = max(aloc, static_cast<int>(j));
            continue;
          }
          a1 += e[t];
          a2 += static_cast<double>(j + 1) * e[t];
          aa += fabsf(e[t]);
        }
        if (write_all) {
          StoreCast4(io.out, r * io.n_all + col0 + 4 * q, make_float4(o[0], o[1], o[2], o[3]),
                     io.out_kind);
        }
      }
    }
    if (dropped) atomicAdd(dropped_row, dropped);
    __syncthreads();
    for (int64_t b = threadIdx.x; b < nb; b += kRowThreads) {
      const int64_t j0 = r * io.n_all + b * io.block_n;
      const int64_t n =
          io.n_all - b * io.block_n < io.block_n ? io.n_all - b * io.block_n : io.block_n;
      const int64_t cb = r * nb + b;
      const float c1 = io.checks[2 * cb];
      AbftDecision d = AbftDecide(s1s[b], s2s[b], sas[b], nfs[b], locs[b], c1,
                                  io.checks[2 * cb + 1], io.mag[cb], n, p);
      if (d.flag == kAbftCorrected) {
        int delta = CorrectOne(io, j0, n, d.loc, c1, io.checks[2 * cb + 1], io.mag[cb], p, g,
                               write_all, &d.flag);
        if (delta) atomicAdd(dropped_row, delta);
      }
      io.flags[cb] = d.flag;
    }
    __syncthreads();
    if (threadIdx.x == 0 && io.counts != nullptr) io.counts[r] = *dropped_row;
    __syncthreads();
  }
}

ffi::Error RunAbftCuda(cudaStream_t stream, const AbftIo& io, const AbftParams& p,
                       const GateSpec& g) {
  const bool write_all = io.out != io.y || g.on || io.out_kind != io.in_kind;
  if (io.rows * io.nb == 0) return CudaStatus("abft_check");
  const size_t smem = RowSmem(io.nb);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(io.y) | reinterpret_cast<uintptr_t>(io.out)) % 16) == 0;
  const bool row_kernel = io.in_kind == FloatKind::kF32 && io.block_n % 128 == 0 &&
                          io.n_all % 128 == 0 && aligned && smem <= 48 * 1024;
  if (row_kernel) {
    AbftRowKernel<<<GridFor(io.rows, 1), kRowThreads, smem, stream>>>(io, p, g, write_all);
  } else {
    if (io.counts != nullptr) cudaMemsetAsync(io.counts, 0, io.rows * sizeof(int32_t), stream);
    AbftWarpKernel<<<GridFor(io.rows * io.nb, 8), 256, 0, stream>>>(io, p, g, write_all);
  }
  return CudaStatus("abft_check");
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
  AbftIo io{out,
            kind,
            out,
            kind,
            static_cast<const float*>(checks.untyped_data()),
            static_cast<const float*>(mag.untyped_data()),
            static_cast<int32_t*>(flags->untyped_data()),
            nullptr,
            rows,
            n_all,
            block_n,
            nb};
  return RunAbftCuda(stream, io, AbftParams{k, u, lam, StorageRoundoff(kind), correct},
                     GateSpec{false, 0, 0});
}

ffi::Error AbftFinishCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                          ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                          bool correct, bool gate, float fill, float limit,
                          ffi::Result<ffi::AnyBuffer> y_out, ffi::Result<ffi::AnyBuffer> flags,
                          ffi::Result<ffi::AnyBuffer> counts) {
  FloatKind kind, out_kind;
  int64_t rows, n_all, nb;
  if (auto e = CheckAbftShapes(y, checks, mag, block_n, k, std::nullopt, *flags, &kind, &rows,
                               &n_all, &nb);
      e.failure())
    return e;
  if (auto e = CheckFinishOutputs(y, *y_out, *counts, rows, &out_kind); e.failure()) return e;
  int32_t* cnt = static_cast<int32_t*>(counts->untyped_data());
  if (rows > 0 && nb == 0) cudaMemsetAsync(cnt, 0, rows * sizeof(int32_t), stream);
  AbftIo io{y.untyped_data(),
            kind,
            y_out->untyped_data(),
            out_kind,
            static_cast<const float*>(checks.untyped_data()),
            static_cast<const float*>(mag.untyped_data()),
            static_cast<int32_t*>(flags->untyped_data()),
            cnt,
            rows,
            n_all,
            block_n,
            nb};
  return RunAbftCuda(stream, io, AbftParams{k, u, lam, StorageRoundoff(kind), correct},
                     GateSpec{gate, fill, limit});
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftFinishCuda, pimlayers::AbftFinishCuda,
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
                                  .Attr<bool>("gate")            // insulation gate on the output
                                  .Attr<float>("fill")           // what the gate writes
                                  .Attr<float>("limit")          // |y| > limit is gated too
                                  .Ret<xla::ffi::AnyBuffer>()    // y_out: (..., M, N) out dtype
                                  .Ret<xla::ffi::AnyBuffer>()    // flags: (..., M, nb) int32
                                  .Ret<xla::ffi::AnyBuffer>());  // counts: (..., M) int32
