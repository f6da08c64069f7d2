// CUDA handlers of abft_check and abft_finish (the math and its bound are in abft.h).
//
// Two kernels. The row kernel is the fast one, for y (f32, bf16 or f16) whose rows and column
// blocks are multiples of 128 columns (every Llama-3 GEMM): a CTA takes a group of whole rows, each
// 8-lane group sums a 128-column tile with 16-byte loads (see AbftRowKernel). Out of place, the
// gated, cast output is written in the same pass, so y is read once; in place (a bf16 GEMM's own
// output), y is only read, and a block is written only where a value is corrected or gated. The
// warp kernel covers every other shape: one warp per (row, column block), as simple as the CPU
// loop.
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
// then the block checked again). Returns the change to the block's gate count; a block whose
// rebuilt version fails the check is left as it was and its flag becomes "detected". In place the
// value is stored ungated (GateBlock gates the final block).
__device__ __noinline__ int CorrectOne(const AbftIo& io, int64_t j0, int64_t n, int64_t loc,
                                       float c1, float c2, float mag, const AbftParams& p,
                                       const GateSpec& g, bool write_all, int32_t* flag) {
  auto load = [&](int64_t j) { return static_cast<double>(LoadF(io.y, j0 + j, io.in_kind)); };
  const AbftFix fix = AbftRebuild(load, n, loc, c1, c2, mag, p);
  if (!fix.ok) {
    *flag = kAbftDetected;
    return 0;
  }
  const GateSpec gs = write_all ? g : GateSpec{false, 0, 0};
  int before = 0, after = 0;
  GateCast(LoadF(io.y, j0 + loc, io.in_kind), io.out_kind, gs, &before);
  StoreF(io.out, j0 + loc, GateCast(fix.value, io.out_kind, gs, &after), io.out_kind);
  return after - before;
}

// In place: the gate over one final block (after any correction), by the threads given; returns
// this thread's count of replaced values. Runs only for blocks that hold a value to gate or were
// corrected, so the common clean block is read once and never written.
__device__ __noinline__ int GateBlock(const AbftIo& io, int64_t j0, int64_t n, const GateSpec& g,
                                      int first, int stride) {
  int dropped = 0;
  for (int64_t j = first; j < n; j += stride) {
    int gone = 0;
    GateCast(LoadF(io.out, j0 + j, io.out_kind), io.out_kind, g, &gone);
    if (gone) StoreF(io.out, j0 + j, g.fill, io.out_kind);
    dropped += gone;
  }
  return dropped;
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
    int dropped = 0;  // out of place: gated as written; in place: values the gate will replace
    for (int64_t j = lane; j < n; j += 32) {
      float v = LoadF(io.y, j0 + j, io.in_kind);
      const float o = GateCast(v, io.out_kind, g, &dropped);
      if (write_all) StoreF(io.out, j0 + j, o, io.out_kind);
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
    int32_t flag = kAbftClean;
    if (lane == 0) {
      const float c1 = io.checks[2 * w];
      AbftDecision d =
          AbftDecide(s1, s2, sa, nonfinite, nf_loc, c1, io.checks[2 * w + 1], io.mag[w], n, p,
                     [&](int64_t j) { return LoadF(io.y, j0 + j, io.in_kind); });
      flag = d.flag;
      if (d.flag == kAbftCorrected) {
        dropped += CorrectOne(io, j0, n, d.loc, c1, io.checks[2 * w + 1], io.mag[w], p, g,
                              write_all, &flag);
      }
    }
    flag = __shfl_sync(0xffffffffu, flag, 0);
    if (!write_all && g.on && (dropped > 0 || flag == kAbftCorrected)) {  // warp-uniform
      __syncwarp();  // lane 0's correction is visible to the warp
      dropped = static_cast<int>(WarpSum(static_cast<int64_t>(GateBlock(io, j0, n, g, lane, 32))));
    }
    if (lane == 0) {
      io.flags[w] = flag;
      if (io.counts != nullptr) io.counts[w] = dropped;
    }
  }
}

constexpr int kRowThreads = 256;
constexpr int kWarps = kRowThreads / 32;
constexpr int kGroup = 8;                     // lanes per 128-column tile
constexpr int64_t kRowGroupValues = 1 << 16;  // values a CTA takes at once (whole rows)

template <typename T>
__device__ __forceinline__ T GroupSum(T v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int GroupMax(int v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 16 consecutive values of y from element i0 (a multiple of 16), as f32: four 16-byte loads of
// f32 or two of bf16/f16 (a warp's 32 lanes read 2 KB or 1 KB contiguously).
__device__ __forceinline__ void Load16(const void* y, int64_t i0, FloatKind k, float e[16]) {
  if (k == FloatKind::kF32) {
    const float4* v = reinterpret_cast<const float4*>(static_cast<const float*>(y) + i0);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = __ldcs(v + q);
      e[4 * q] = x.x;
      e[4 * q + 1] = x.y;
      e[4 * q + 2] = x.z;
      e[4 * q + 3] = x.w;
    }
    return;
  }
  const uint4* v = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(y) + i0);
  const bool bf = k == FloatKind::kBF16;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint4 x = __ldcs(v + q);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint16_t lo = static_cast<uint16_t>(w[t] & 0xffffu);
      const uint16_t hi = static_cast<uint16_t>(w[t] >> 16);
      e[8 * q + 2 * t] = bf ? Bf16ToF32(lo) : F16ToF32(lo);
      e[8 * q + 2 * t + 1] = bf ? Bf16ToF32(hi) : F16ToF32(hi);
    }
  }
}

// One 128-column tile's sums, kept in shared memory until its block is decided. s2 weighs value t
// of the tile by t (0-based).
struct TileSums {
  double s1, s2, sa;
  int nonfinite, loc, dropped;  // loc: last non-finite column in the tile, -1 if none
};

// A lane's 16 values: sums with weights t0 .. t0 + 15. The fast path is 4 f32 operations per value
// (16 terms in f32 sit well inside the bound's sqrt(n) term); it returns false. A lane that holds
// a non-finite value, a value past the gate's limit, sums that overflow f32 (an exponent flip makes
// a value ~2^128), or writes a cast copy (`careful`) redoes its 16 in f64, non-finite values left
// out and located, and returns true.
__device__ __forceinline__ bool SumLane(const float e[16], int t0, bool careful, const AbftIo& io,
                                        const GateSpec& g, int64_t i0, double* s1, double* s2,
                                        double* sa, int* nf, int* loc, int* dropped) {
  float a1 = 0, a2 = 0, aa = 0, mx = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    a1 += e[i];
    a2 = fmaf(static_cast<float>(i), e[i], a2);
    aa += fabsf(e[i]);
    mx = fmaxf(mx, fabsf(e[i]));
  }
  const float limit = g.on ? g.limit : INFINITY;
  if (!careful && IsFiniteF(a1) && IsFiniteF(a2) && IsFiniteF(aa) && mx <= limit) {
    *s1 = a1;
    *s2 = static_cast<double>(fmaf(static_cast<float>(t0), a1, a2));
    *sa = aa;
    return false;
  }
  double d1 = 0, d2 = 0, da = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float o[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int i = 4 * q + t;
      o[t] = GateCast(e[i], io.out_kind, g, dropped);
      if (!IsFiniteF(e[i])) {
        ++*nf;
        *loc = max(*loc, t0 + i);
        continue;
      }
      d1 += e[i];
      d2 += static_cast<double>(t0 + i) * e[i];
      da += fabs(static_cast<double>(e[i]));
    }
    if (careful) StoreCast4(io.out, i0 + 4 * q, make_float4(o[0], o[1], o[2], o[3]), io.out_kind);
  }
  *s1 = d1;
  *s2 = d2;
  *sa = da;
  return true;
}

// The row kernel. A CTA takes a group of whole rows (~64K values: 4 rows of 14336, 64 of 1024),
// so its fixed costs (clearing, two barriers, the decisions) are paid once per group and each warp
// has ~16 loads of 512 values to keep in flight; a warp issues two chunks' loads before summing
// either. Each 8-lane group sums one 128-column tile (tiles never straddle a row or a column
// block: both are multiples of 128) into shared memory without atomics; then one thread per
// column block adds its tiles in f64, decides, corrects and (in place) gates.
__global__ void __launch_bounds__(kRowThreads)
    AbftRowKernel(AbftIo io, AbftParams p, GateSpec g, bool write_all, int64_t rows_per_cta) {
  extern __shared__ TileSums tiles[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, glane = lane % kGroup;
  const int64_t tiles_per_row = io.n_all / 128, nb = io.nb;
  const size_t in_size = io.in_kind == FloatKind::kF32 ? 4 : 2;
  for (int64_t r0 = blockIdx.x * rows_per_cta; r0 < io.rows;
       r0 += static_cast<int64_t>(gridDim.x) * rows_per_cta) {
    const int64_t nrows = io.rows - r0 < rows_per_cta ? io.rows - r0 : rows_per_cta;
    const int64_t values = nrows * io.n_all, base = r0 * io.n_all;
    const int64_t chunks = (values + 511) / 512;
    const void* y = static_cast<const char*>(io.y) + base * in_size;
    for (int64_t c = warp; c < chunks; c += 2 * kWarps) {
      float e[2][16];
      bool live[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int64_t i0 = (c + u * kWarps) * 512 + lane * 16;
        live[u] = c + u * kWarps < chunks && i0 < values;  // tail: whole tiles (values % 128 == 0)
        if (live[u]) Load16(y, i0, io.in_kind, e[u]);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (c + u * kWarps >= chunks) break;  // warp-uniform
        const int64_t i0 = (c + u * kWarps) * 512 + lane * 16;
        double s1 = 0, s2 = 0, sa = 0;
        int nf = 0, loc = -1, dropped = 0;
        bool slow = false;
        if (live[u]) {
          slow = SumLane(e[u], glane * 16, write_all, io, g, base + i0, &s1, &s2, &sa, &nf, &loc,
                         &dropped);
        }
        if (__any_sync(0xffffffffu, slow)) {  // rare (or a cast copy): f64 and the counts
          s1 = GroupSum(s1);
          s2 = GroupSum(s2);
          sa = GroupSum(sa);
          nf = GroupSum(nf);
          loc = GroupMax(loc);
          dropped = GroupSum(dropped);
        } else {  // 128 clean values: f32 shuffles (half a double's)
          s1 = GroupSum(static_cast<float>(s1));
          s2 = GroupSum(static_cast<float>(s2));
          sa = GroupSum(static_cast<float>(sa));
        }
        if (live[u] && glane == 0) tiles[i0 / 128] = TileSums{s1, s2, sa, nf, loc, dropped};
      }
    }
    __syncthreads();
    for (int64_t bb = threadIdx.x; bb < nrows * nb; bb += kRowThreads) {
      const int64_t rl = bb / nb, b = bb % nb, r = r0 + rl;
      const int64_t j0 = r * io.n_all + b * io.block_n;
      const int64_t n =
          io.n_all - b * io.block_n < io.block_n ? io.n_all - b * io.block_n : io.block_n;
      const TileSums* t = tiles + rl * tiles_per_row + b * io.block_n / 128;
      double s1 = 0, s2 = 0, sa = 0;
      int nf = 0, loc = -1, dropped = 0;
      for (int64_t q = 0; q < n / 128; ++q) {
        s1 += t[q].s1;
        s2 += t[q].s2 + static_cast<double>(128 * q + 1) * t[q].s1;  // weights j + 1 in the block
        sa += t[q].sa;
        nf += t[q].nonfinite;
        if (t[q].loc >= 0) loc = static_cast<int>(128 * q) + t[q].loc;
        dropped += t[q].dropped;
      }
      const int64_t cb = r * nb + b;
      const float c1 = io.checks[2 * cb];
      AbftDecision d = AbftDecide(s1, s2, sa, nf, loc, c1, io.checks[2 * cb + 1], io.mag[cb], n, p,
                                  [&](int64_t j) { return LoadF(io.y, j0 + j, io.in_kind); });
      if (d.flag == kAbftCorrected) {
        dropped += CorrectOne(io, j0, n, d.loc, c1, io.checks[2 * cb + 1], io.mag[cb], p, g,
                              write_all, &d.flag);
      }
      if (!write_all && g.on && (dropped > 0 || d.flag == kAbftCorrected)) {
        dropped = GateBlock(io, j0, n, g, 0, 1);  // rare: one thread, one block
      }
      io.flags[cb] = d.flag;
      if (io.counts != nullptr) io.counts[cb] = dropped;
    }
    __syncthreads();
  }
}

ffi::Error RunAbftCuda(cudaStream_t stream, const AbftIo& io, const AbftParams& p,
                       const GateSpec& g) {
  const bool write_all = io.out != io.y || io.out_kind != io.in_kind;
  if (io.rows * io.nb == 0) return CudaStatus("abft_check");
  const int64_t rows_per_cta = std::max<int64_t>(
      1, std::min<int64_t>(io.rows, kRowGroupValues / std::max<int64_t>(io.n_all, 1)));
  const size_t smem = static_cast<size_t>(rows_per_cta * (io.n_all / 128)) * sizeof(TileSums);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(io.y) | reinterpret_cast<uintptr_t>(io.out)) % 16) == 0;
  const bool row_kernel =
      io.block_n % 128 == 0 && io.n_all % 128 == 0 && aligned && smem <= 48 * 1024;
  if (row_kernel) {
    AbftRowKernel<<<GridFor(CeilDiv(io.rows, rows_per_cta), 1), kRowThreads, smem, stream>>>(
        io, p, g, write_all, rows_per_cta);
  } else {
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
  if (auto e = CheckFinishOutputs(y, *y_out, *counts, rows * nb, &out_kind); e.failure()) return e;
  int32_t* cnt = static_cast<int32_t*>(counts->untyped_data());
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
                                  .Ret<xla::ffi::AnyBuffer>());  // counts: (..., M, nb) int32
