// CUDA handlers of abft_check and abft_finish (the math and its bound are in abft.h).
//
// Three kernels. The tile kernel is the fast one, for blocks of exactly 128 columns checked in
// place (a bf16 GEMM's own output: every product of the training step): y is then a stream of
// 128-value tiles, one per check block, and only corrected or gated values are written (see
// AbftTileKernel). The row kernel covers the other widths that are multiples of 128 columns and
// the out-of-place finish (f32, bf16 or f16): a CTA takes a group of whole rows, each 8-lane group
// sums a 128-column tile with 16-byte loads, and out of place the gated, cast output is written in
// the same pass, so y is read once (see AbftRowKernel). The warp kernel covers every other shape:
// one warp per (row, column block), as simple as the CPU loop.
#include <cstdlib>

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
      const int64_t ci = CheckIndex(io, w);
      const float c1 = io.checks[2 * ci], c2 = io.checks[2 * ci + 1], m = io.mag[ci];
      AbftDecision d = AbftDecide(s1, s2, sa, nonfinite, nf_loc, c1, c2, m, n, p,
                                  [&](int64_t j) { return LoadF(io.y, j0 + j, io.in_kind); });
      flag = d.flag;
      if (d.flag == kAbftCorrected) {
        dropped += CorrectOne(io, j0, n, d.loc, c1, c2, m, p, g, write_all, &flag);
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
// The row kernel's occupancy and loads in flight. Its launch bound caps the registers at 64, so
// four CTAs (1024 threads) fit on an SM; each lane keeps kRowLaneBytes of y in flight before
// summing. Unbounded, the kernel held 128 registers, two CTAs fit, and on an H200 the in-place bf16
// finish read y at 0.49x the speed of an XLA reduction over the same bytes. Side by side in one run
// (`python -m benchmarks.run --suite finish --layers 4`, 2026-12-02; the 84 products of a 4-layer
// step): 8.45-8.80 ms unbounded, 6.43 at 4 CTAs x 64 bytes (0.62x XLA's read), 7.27 at 2 x 128,
// 7.76-7.85 at 3 x 128. The rare paths (f64 sums, decisions, corrections) run out of line and
// may spill; the streaming loop keeps its raw loads in registers.
constexpr int kRowMinBlocks = 4;
constexpr int kRowLaneBytes = 64;

template <typename T>
__device__ __forceinline__ T GroupSum(T v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int GroupMax(int v) {
  for (int o = kGroup / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 16 consecutive values of y as loaded: kBytes 16-byte words (f32: 4, bf16/f16: 2), streamed
// (`__ldcs`: read once). A warp's 32 lanes read 2 KB (f32) or 1 KB contiguously.
template <int kBytes>
struct Raw16 {
  uint4 q[kBytes];
};

template <int kBytes>
__device__ __forceinline__ Raw16<kBytes> LoadRaw16(const void* y, int64_t i0) {
  const uint4* v = reinterpret_cast<const uint4*>(static_cast<const char*>(y) + i0 * kBytes);
  Raw16<kBytes> r;
#pragma unroll
  for (int t = 0; t < kBytes; ++t) r.q[t] = __ldcs(v + t);
  return r;
}

// Value i (0..15, a compile-time index after unrolling) of a Raw16, as f32.
template <int kBytes>
__device__ __forceinline__ float RawValue(const Raw16<kBytes>& r, int i, bool bf) {
  auto word = [](const uint4& q, int c) {
    return c == 0 ? q.x : c == 1 ? q.y : c == 2 ? q.z : q.w;
  };
  if (kBytes == 4) return __uint_as_float(word(r.q[i / 4], i % 4));
  const uint32_t w = word(r.q[i / 8], (i / 2) % 4);
  const uint16_t h = static_cast<uint16_t>(i % 2 ? w >> 16 : w & 0xffffu);
  return bf ? Bf16ToF32(h) : F16ToF32(h);
}

// A lane's sums over its 16 values; once its 8-lane group adds them, one 128-column tile's, kept in
// shared memory until its block is decided. s2 weighs value t of the tile by t (0-based).
struct LaneSums {
  double s1, s2, sa;
  int nonfinite, loc, dropped;  // loc: last non-finite column, -1 if none
};

// A lane's 16 values `e` (weights t0 .. t0 + 15) the careful way: in f64, non-finite values left
// out and located, each value gated as stored; with `out`, the gated, cast values are written to it
// from element i0 (the out-of-place finish).
__device__ __forceinline__ LaneSums CarefulSums(const float e[16], int t0, void* out,
                                                FloatKind out_kind, GateSpec g, int64_t i0) {
  LaneSums r{0, 0, 0, 0, -1, 0};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float o[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int i = 4 * q + t;
      o[t] = GateCast(e[i], out_kind, g, &r.dropped);
      if (!IsFiniteF(e[i])) {
        ++r.nonfinite;
        r.loc = max(r.loc, t0 + i);
        continue;
      }
      r.s1 += e[i];
      r.s2 += static_cast<double>(t0 + i) * e[i];
      r.sa += fabs(static_cast<double>(e[i]));
    }
    if (out != nullptr) StoreCast4(out, i0 + 4 * q, make_float4(o[0], o[1], o[2], o[3]), out_kind);
  }
  return r;
}

// The in-place finish's rare lane (a non-finite value, one past the gate's limit, or f32 sums that
// overflowed: an exponent flip makes a value ~2^128): its 16 values read again, out of line and
// with everything passed by value, so the streaming loop's registers stay registers.
__device__ __noinline__ LaneSums CarefulReload(const void* y, FloatKind in_kind, FloatKind out_kind,
                                               GateSpec g, int64_t i0, int t0) {
  float e[16];
  for (int i = 0; i < 16; ++i) e[i] = LoadF(y, i0 + i, in_kind);
  return CarefulSums(e, t0, nullptr, out_kind, g, i0);
}

// A lane's 16 values: sums with weights t0 .. t0 + 15, and whether they took the careful path. The
// fast path is 4 f32 operations per value (16 terms in f32 sit well inside the bound's sqrt(n)
// term). A lane that holds a non-finite value, a value past the gate's limit or sums that overflow
// f32, or that writes a cast copy (kWriteAll), takes the careful f64 sums.
template <int kBytes, bool kWriteAll>
__device__ __forceinline__ LaneSums SumLane(const Raw16<kBytes>& r, int t0, const AbftIo& io,
                                            const GateSpec& g, int64_t i0, bool* slow) {
  const bool bf = io.in_kind == FloatKind::kBF16;
  *slow = true;
  if (kWriteAll) {
    float e[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) e[i] = RawValue(r, i, bf);
    return CarefulSums(e, t0, io.out, io.out_kind, g, i0);
  }
  float a1 = 0, a2 = 0, aa = 0, mx = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float v = RawValue(r, i, bf);
    a1 += v;
    a2 = fmaf(static_cast<float>(i), v, a2);
    aa += fabsf(v);
    mx = fmaxf(mx, fabsf(v));
  }
  const float limit = g.on ? g.limit : INFINITY;
  if (IsFiniteF(a1) && IsFiniteF(a2) && IsFiniteF(aa) && mx <= limit) {
    *slow = false;
    return LaneSums{a1, static_cast<double>(fmaf(static_cast<float>(t0), a1, a2)), aa, 0, -1, 0};
  }
  return CarefulReload(io.y, io.in_kind, io.out_kind, g, i0, t0);
}

// One column block of the row kernel, by one thread: its tiles added in f64, decided, corrected and
// (in place) gated; writes the block's flag and gate count. Out of line: f64 decisions hold many
// registers, once per 128 or more values.
__device__ __noinline__ void DecideBlock(const AbftIo& io, const AbftParams& p, const GateSpec& g,
                                         bool write_all, const LaneSums* t, int64_t r, int64_t b) {
  const int64_t j0 = r * io.n_all + b * io.block_n;
  const int64_t n = io.n_all - b * io.block_n < io.block_n ? io.n_all - b * io.block_n : io.block_n;
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
  const int64_t cb = r * io.nb + b, ci = CheckIndex(io, cb);
  const float c1 = io.checks[2 * ci], c2 = io.checks[2 * ci + 1], m = io.mag[ci];
  AbftDecision d = AbftDecide(s1, s2, sa, nf, loc, c1, c2, m, n, p,
                              [&](int64_t j) { return LoadF(io.y, j0 + j, io.in_kind); });
  if (d.flag == kAbftCorrected) {
    dropped += CorrectOne(io, j0, n, d.loc, c1, c2, m, p, g, write_all, &d.flag);
  }
  if (!write_all && g.on && (dropped > 0 || d.flag == kAbftCorrected)) {
    dropped = GateBlock(io, j0, n, g, 0, 1);  // rare: one thread, one block
  }
  io.flags[cb] = d.flag;
  if (io.counts != nullptr) io.counts[cb] = dropped;
}

// The row kernel. A CTA takes a group of whole rows (~64K values: 4 rows of 14336, 64 of 1024),
// so its fixed costs (clearing, two barriers, the decisions) are paid once per group and each warp
// has ~16 loads of 512 values to keep in flight; a warp issues kChunks chunks' loads (kRowLaneBytes
// per lane) before summing any. Each 8-lane group sums one 128-column tile (tiles never straddle a
// row or a column block: both are multiples of 128) into shared memory without atomics; then one
// thread per column block adds its tiles in f64, decides, corrects and (in place) gates.
// kBytes: bytes per value of y (4: f32, 2: bf16/f16); kWriteAll: the out-of-place finish.
template <int kBytes, bool kWriteAll>
__global__ void __launch_bounds__(kRowThreads, kRowMinBlocks)
    AbftRowKernel(AbftIo io, AbftParams p, GateSpec g, int64_t rows_per_cta) {
  constexpr int kChunks = kRowLaneBytes / (16 * kBytes);  // f32: 1, bf16/f16: 2
  static_assert(kChunks >= 1, "a lane loads at least one chunk of 16 values");
  extern __shared__ LaneSums tiles[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, glane = lane % kGroup;
  const int64_t tiles_per_row = io.n_all / 128, nb = io.nb;
  for (int64_t r0 = blockIdx.x * rows_per_cta; r0 < io.rows;
       r0 += static_cast<int64_t>(gridDim.x) * rows_per_cta) {
    const int64_t nrows = io.rows - r0 < rows_per_cta ? io.rows - r0 : rows_per_cta;
    const int64_t values = nrows * io.n_all, base = r0 * io.n_all;
    const int64_t chunks = (values + 511) / 512;
    const void* y = static_cast<const char*>(io.y) + base * kBytes;
    for (int64_t c = warp; c < chunks; c += kChunks * kWarps) {
      Raw16<kBytes> raw[kChunks];
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
        const int64_t i0 = (c + u * kWarps) * 512 + lane * 16;
        // tail: whole tiles (values % 128 == 0), so a lane's 16 values are all in or all out
        if (c + u * kWarps < chunks && i0 < values) raw[u] = LoadRaw16<kBytes>(y, i0);
      }
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
        if (c + u * kWarps >= chunks) break;  // warp-uniform
        const int64_t i0 = (c + u * kWarps) * 512 + lane * 16;
        const bool live = i0 < values;
        LaneSums t{0, 0, 0, 0, -1, 0};
        bool slow = false;
        if (live) t = SumLane<kBytes, kWriteAll>(raw[u], glane * 16, io, g, base + i0, &slow);
        if (__any_sync(0xffffffffu, slow)) {  // rare (or a cast copy): f64 and the counts
          t.s1 = GroupSum(t.s1);
          t.s2 = GroupSum(t.s2);
          t.sa = GroupSum(t.sa);
          t.nonfinite = GroupSum(t.nonfinite);
          t.loc = GroupMax(t.loc);
          t.dropped = GroupSum(t.dropped);
        } else {  // 128 clean values: f32 shuffles (half a double's)
          t.s1 = GroupSum(static_cast<float>(t.s1));
          t.s2 = GroupSum(static_cast<float>(t.s2));
          t.sa = GroupSum(static_cast<float>(t.sa));
        }
        if (live && glane == 0) tiles[i0 / 128] = t;
      }
    }
    __syncthreads();
    for (int64_t bb = threadIdx.x; bb < nrows * nb; bb += kRowThreads) {
      const int64_t rl = bb / nb, b = bb % nb;
      DecideBlock(io, p, g, kWriteAll, tiles + rl * tiles_per_row + b * io.block_n / 128, r0 + rl,
                  b);
    }
    __syncthreads();
  }
}

// The tile kernel: blocks of exactly 128 columns checked in place (every bf16 product of the
// training step). y is then a run of rows * nb tiles of 128 values, tile t being column block t of
// the checks: a plain stream, with nothing to gather per row. Each 8-lane group sums one tile, each
// warp kChunks chunks of 4 consecutive tiles per trip (1 KB of bf16 a chunk, 128 bytes in flight
// per lane), every load (y, and each tile's checks on its group's first lane) issued before any
// sum, and the first lane decides its tile at once: no shared sums and no barriers, so no CTA
// stops streaming to decide as the row kernel's do. Warps are persistent and loop over a
// grid-stride, so they drift apart and one's sums overlap another's loads.
//
// The loop holds no call: a call there made ptxas keep the loads in flight on the stack (nvcc 13.0,
// sm_90). A tile that is not clean at first sight, or holds a non-finite value or one past the
// gate's limit, is queued (its index, in shared memory) and decided after the loop, its sums taken
// again in f64 and then decided as the row kernel decides (DecideTile, DecideBlock). A warp that
// meets more than kTileQueue such tiles marks the rest kAbftPending in flags and finds them again
// after the loop by re-reading its tiles' flags (a product with many non-finite values to gate).
// kLimit: the gate has a finite limit, so each lane also keeps its largest |value|.
//
// On an H200 (`python -m benchmarks.run --suite finish --layers 4`, device time from profiler
// traces, 2026-12-03) the 84 bf16 products of a 4-layer step took 2.40 ms against the row kernel's
// 4.21 and XLA's reduction over the same bytes 1.95; a first version without the loop (one trip a
// warp, as many CTAs as chunks) 3.40.
constexpr int kTileThreads = 256;
constexpr int kTileMinBlocks = 3;  // <= 85 registers: 768 lanes x 128 bytes in flight per SM
constexpr int kTileQueue = 32;
constexpr int32_t kAbftPending = -1;

// Value i (0..15, a compile-time index after unrolling) of a lane's 16 values of type T.
template <typename T>
__device__ __forceinline__ float TileValue(const Raw16<kValueBytes<T>>& r, int i) {
  const uint4& q = r.q[i * kValueBytes<T> / 16];
  const int c = (i * kValueBytes<T> / 4) % 4;
  const uint32_t w = c == 0 ? q.x : c == 1 ? q.y : c == 2 ? q.z : q.w;
  return ToF32<T>(kValueBytes<T> == 2 && i % 2 ? w >> 16 : w);
}

// A queued tile, by one thread: its sums in f64 (non-finite values left out and located, values
// the gate will replace counted, as the warp kernel sums a block), then DecideBlock.
__device__ __noinline__ void DecideTile(const AbftIo& io, const AbftParams& p, const GateSpec& g,
                                        int64_t t) {
  LaneSums r{0, 0, 0, 0, -1, 0};
  for (int j = 0; j < 128; ++j) {
    const float v = LoadF(io.y, t * 128 + j, io.in_kind);
    GateCast(v, io.out_kind, g, &r.dropped);
    if (!IsFiniteF(v)) {
      ++r.nonfinite;
      r.loc = j;
      continue;
    }
    r.s1 += v;
    r.s2 += static_cast<double>(j) * v;  // 0-based weights, as LaneSums keeps them
    r.sa += fabs(static_cast<double>(v));
  }
  DecideBlock(io, p, g, false, &r, t / io.nb, t % io.nb);
}

template <typename T, int kChunks, bool kLimit>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocks)
    AbftTileKernel(AbftIo io, AbftParams p, GateSpec g, float coef) {
  __shared__ int64_t queue[kTileThreads / 32][kTileQueue];
  __shared__ int queued[kTileThreads / 32];
  const int lane = threadIdx.x & 31, glane = lane % kGroup, group = lane / kGroup;
  const int wib = threadIdx.x / 32;
  const float floor = AbftFloor(p.k, 128);  // AbftBound's, for the clean case below
  const int64_t tiles = io.rows * io.nb, per_warp = kChunks * 4;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kTileThreads / 32);
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * (kTileThreads / 32) + wib;
  if (lane == 0) queued[wib] = 0;
  __syncwarp();
  for (int64_t w = warp0; w * per_warp < tiles; w += warps) {
    const int64_t first = w * per_warp + group;  // this group's tile in chunk 0
    Raw16<kValueBytes<T>> raw[kChunks];
    float2 c[kChunks];
    float mag[kChunks];
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int64_t t = first + 4 * u;
      if (t < tiles) {
        raw[u] = LoadRaw16<kValueBytes<T>>(io.y, t * 128 + glane * 16);
        if (glane == 0) {
          const int64_t ci = CheckIndex(io, t);
          c[u] = __ldg(reinterpret_cast<const float2*>(io.checks) + ci);
          mag[u] = __ldg(io.mag + ci);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const int64_t t = first + 4 * u;
      if (t - group >= tiles) break;  // warp-uniform: no tile of this chunk exists
      const bool live = t < tiles;
      float a1 = 0, a2 = 0, aa = 0, mx = 0;
      if (live) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float v = TileValue<T>(raw[u], i);
          a1 += v;
          a2 = fmaf(static_cast<float>(i), v, a2);
          aa += fabsf(v);
          if (kLimit) mx = fmaxf(mx, fabsf(v));
        }
      }
      // 16 terms in f32 per lane, then 8 lanes: as the row kernel sums a clean tile (SumLane).
      const float s1 = GroupSum(a1), s2 = GroupSum(fmaf(static_cast<float>(glane * 16), a1, a2));
      const float sa = GroupSum(aa);
      // A non-finite value makes a1 non-finite; a2 and aa can overflow on their own.
      const bool lane_slow =
          !(IsFiniteF(a1) && IsFiniteF(a2) && IsFiniteF(aa)) || (kLimit && mx > g.limit);
      const unsigned slow = __ballot_sync(0xffffffffu, lane_slow) >> (group * kGroup) & 0xffu;
      if (!live || glane != 0) continue;
      bool rare = slow != 0 || !(IsFiniteF(s1) && IsFiniteF(s2) && IsFiniteF(sa));
      if (!rare) {
        // AbftDecide's clean case, free of calls (its square roots hoisted into coef): the
        // block's weights are j + 1, so its weighted sum is s2 + s1.
        const float b1 = coef * mag[u] + p.u_y * sa + floor;
        const double r1 = static_cast<double>(s1) - c[u].x;
        const double r2 = static_cast<double>(s2) + static_cast<double>(s1) - c[u].y;
        // Without c2 (p.weighted false) r1 alone decides; c[u].y is not read.
        rare = !(IsFiniteF(c[u].x) && IsFiniteF(mag[u]) && fabs(r1) <= b1 &&
                 (!p.weighted || (IsFiniteF(c[u].y) && fabs(r2) <= 128.0 * b1)));
      }
      if (!rare) {
        io.flags[t] = kAbftClean;
        if (io.counts != nullptr) io.counts[t] = 0;
      } else {
        const int slot = atomicAdd(&queued[wib], 1);
        if (slot < kTileQueue) {
          queue[wib][slot] = t;
        } else {
          io.flags[t] = kAbftPending;
        }
      }
    }
  }
  __syncwarp();
  const int n = queued[wib];
  for (int i = lane; i < min(n, kTileQueue); i += 32) DecideTile(io, p, g, queue[wib][i]);
  if (n > kTileQueue) {  // warp-uniform; rare: the tiles past the queue, found again by their flag
    __syncwarp();
    for (int64_t w = warp0; w * per_warp < tiles; w += warps) {
      const int64_t t = w * per_warp + lane;
      if (lane < per_warp && t < tiles && io.flags[t] == kAbftPending) DecideTile(io, p, g, t);
    }
  }
}

template <typename T, bool kLimit>
ffi::Error LaunchTileKernel(cudaStream_t stream, const AbftIo& io, const AbftParams& p,
                            const GateSpec& g) {
  constexpr int kChunks = 128 / (16 * kValueBytes<T>);  // 128 bytes of y in flight per lane
  auto kernel = AbftTileKernel<T, kChunks, kLimit>;
  // AbftBound's factor of mag, as it forms it (sqrtf is correctly rounded on host and device).
  const float coef = p.lam * p.u * (sqrtf(static_cast<float>(p.k)) + sqrtf(128.0f) + 2.0f);
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kTileThreads, 0) !=
          cudaSuccess) {
    return CudaStatus("abft_check");
  }
  // Persistent CTAs: as many as fit on the GPU at once, or fewer where y is small.
  const int64_t need = CeilDiv(io.rows * io.nb, int64_t{kTileThreads / 32} * kChunks * 4);
  const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  kernel<<<static_cast<unsigned>(need < resident ? need : resident), kTileThreads, 0, stream>>>(
      io, p, g, coef);
  return CudaStatus("abft_check");
}

template <typename T>
ffi::Error RunTileKernel(cudaStream_t stream, const AbftIo& io, const AbftParams& p,
                         const GateSpec& g) {
  if (g.on && IsFiniteF(g.limit)) return LaunchTileKernel<T, true>(stream, io, p, g);
  return LaunchTileKernel<T, false>(stream, io, p, g);
}

template <int kBytes, bool kWriteAll>
void LaunchRowKernel(cudaStream_t stream, const AbftIo& io, const AbftParams& p, const GateSpec& g,
                     int64_t rows_per_cta, size_t smem) {
  AbftRowKernel<kBytes, kWriteAll>
      <<<GridFor(CeilDiv(io.rows, rows_per_cta), 1), kRowThreads, smem, stream>>>(io, p, g,
                                                                                  rows_per_cta);
}

ffi::Error RunAbftCuda(cudaStream_t stream, const AbftIo& io, const AbftParams& p,
                       const GateSpec& g) {
  const bool write_all = io.out != io.y || io.out_kind != io.in_kind;
  if (io.rows * io.nb == 0) return CudaStatus("abft_check");
  const int64_t rows_per_cta = std::max<int64_t>(
      1, std::min<int64_t>(io.rows, kRowGroupValues / std::max<int64_t>(io.n_all, 1)));
  const size_t smem = static_cast<size_t>(rows_per_cta * (io.n_all / 128)) * sizeof(LaneSums);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(io.y) | reinterpret_cast<uintptr_t>(io.out)) % 16) == 0;
  // PIMLAYERS_ABFT_ROW_KERNEL (any value) keeps 128-column blocks on the row kernel: for timing
  // the two side by side (`python -m benchmarks.step_ab --env PIMLAYERS_ABFT_ROW_KERNEL=1`).
  static const bool row_only = std::getenv("PIMLAYERS_ABFT_ROW_KERNEL") != nullptr;
  if (io.block_n == 128 && io.n_all % 128 == 0 && aligned && !write_all && !row_only) {
    if (io.in_kind == FloatKind::kF32) return RunTileKernel<float>(stream, io, p, g);
    if (io.in_kind == FloatKind::kBF16) return RunTileKernel<Bf16>(stream, io, p, g);
    return RunTileKernel<F16>(stream, io, p, g);
  }
  const bool row_kernel =
      io.block_n % 128 == 0 && io.n_all % 128 == 0 && aligned && smem <= 48 * 1024;
  if (row_kernel) {
    const bool wide = io.in_kind == FloatKind::kF32;
    if (wide && write_all) LaunchRowKernel<4, true>(stream, io, p, g, rows_per_cta, smem);
    if (wide && !write_all) LaunchRowKernel<4, false>(stream, io, p, g, rows_per_cta, smem);
    if (!wide && write_all) LaunchRowKernel<2, true>(stream, io, p, g, rows_per_cta, smem);
    if (!wide && !write_all) LaunchRowKernel<2, false>(stream, io, p, g, rows_per_cta, smem);
  } else {
    AbftWarpKernel<<<GridFor(io.rows * io.nb, 8), 256, 0, stream>>>(io, p, g, write_all);
  }
  return CudaStatus("abft_check");
}

ffi::Error AbftCheckCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                         ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                         bool correct, bool weighted, ffi::Result<ffi::AnyBuffer> y_out,
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
            nb,
            nb,
            0};
  return RunAbftCuda(stream, io, AbftParams{k, u, lam, StorageRoundoff(kind), correct, weighted},
                     GateSpec{false, 0, 0});
}

ffi::Error AbftFinishCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                          ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                          bool correct, bool weighted, bool gate, float fill, float limit,
                          int64_t block_offset, ffi::Result<ffi::AnyBuffer> y_out,
                          ffi::Result<ffi::AnyBuffer> flags, ffi::Result<ffi::AnyBuffer> counts) {
  FloatKind kind, out_kind;
  int64_t rows, n_all, nb, ld;
  if (auto e = CheckAbftShapes(y, checks, mag, block_n, k, std::nullopt, *flags, &kind, &rows,
                               &n_all, &nb, block_offset, &ld);
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
            nb,
            ld,
            block_offset};
  return RunAbftCuda(stream, io, AbftParams{k, u, lam, StorageRoundoff(kind), correct, weighted},
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
                                  .Attr<bool>("weighted")        // c2 formed: r2 checked too
                                  .Ret<xla::ffi::AnyBuffer>()    // y_out: like y (aliases y)
                                  .Ret<xla::ffi::AnyBuffer>());  // flags: (..., M, nb) int32

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftFinishCuda, pimlayers::AbftFinishCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()     // y: (..., M, N) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()     // checks: (..., M, B, 2) f32
                                  .Arg<xla::ffi::AnyBuffer>()     // mag: (..., M, B) f32
                                  .Attr<int64_t>("block_n")       // column block width
                                  .Attr<int64_t>("k")             // GEMM inner dimension
                                  .Attr<float>("unit_roundoff")   // u of the accumulation
                                  .Attr<float>("lam")             // safety factor of the bound
                                  .Attr<bool>("correct")          // rebuild located errors
                                  .Attr<bool>("weighted")         // c2 formed: r2 checked too
                                  .Attr<bool>("gate")             // insulation gate on the output
                                  .Attr<float>("fill")            // what the gate writes
                                  .Attr<float>("limit")           // |y| > limit is gated too
                                  .Attr<int64_t>("block_offset")  // y's first block in checks
                                  .Ret<xla::ffi::AnyBuffer>()     // y_out: (..., M, N) out dtype
                                  .Ret<xla::ffi::AnyBuffer>()     // flags: (..., M, nb) int32
                                  .Ret<xla::ffi::AnyBuffer>());   // counts: (..., M, nb) int32
