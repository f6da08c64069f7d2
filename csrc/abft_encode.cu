// CUDA handler of abft_encode: a weight's checksum columns (EncodeIo in abft.h) in one pass over w,
// written once, in their final layout: sums (G, K, nb, 2) as (s1, s2) pairs, abs_sums (G, K, nb).
//
// Two kernels, one launch each:
//   AbftEncodeRowsKernel (w is (G, K, N)): a group of 2^p lanes per (row, column block). The
//     blocks of all rows tile w's memory in order, so a warp's groups take consecutive blocks (and
//     write consecutive outputs); each lane takes every 2^p-th pack of its block, kLoads packs in
//     flight, and the group adds its lanes' sums with shuffles. The group is sized so that a lane
//     has about kLoads packs of a full block (128-column bf16 blocks: 4 lanes of 4 x 16 bytes).
//   AbftEncodeBlocksKernel (transposed, w is (G, N, K)): a CTA per (group, column chunk, bpc
//     blocks of rows). Each lane owns one pack of columns and walks down rows of its block (a
//     warp's lanes with the same row read one contiguous run of a row), kLoads rows in flight, so
//     the sums over rows stay in the lane's registers; the row slots of a block (lanes of a warp,
//     then warps) are added through shuffles and shared memory, and the CTA writes its columns'
//     sums.
//   AbftEncodePairKernel (w is (G, K, N), 128-column blocks, K and N multiples of 128): both at
//     once, the sums of w and those of its transpose, from one read of w (the forward's checks and
//     the backward's dx checks). A CTA per 128 x 128 tile: each thread loads one column pack of
//     128 / kSlots rows; a row's packs are adjacent lanes (shuffles give the row's block sums), and
//     a column's sums over the tile's rows gather across row slots (a shuffle, then the warps
//     through shared memory).
// A pack is one 16-byte load (8 bf16/f16 values or 4 f32) where every pack is 16-byte aligned
// (rows: N and block_n multiples of 8 or 4 values; transposed: K a multiple of 8 or 4), else one
// value (the general path: odd widths, misaligned rows; the same kernels, scalar loads).
//
// Numerics: f32 sums, as the pure-JAX reference's (the CPU handler sums in f64). Values widen to
// f32 exactly. Each weighted term (j+1)*w enters its sum through one fmaf, so the product itself is
// never rounded (it would be exact anyway for bf16/f16 w and j < 256: j+1 has at most 8 significant
// bits and w 8 or 11, within f32's 24); the positions j+1 are floats, exact below 2^24. Only the
// order of the f32 additions differs from the reference's: a lane's terms in sequence, then a tree
// over lanes (rows), or over a warp's row slots and then its block's warps in order (transposed),
// an error of at most (terms per lane + additions after them) u sum|term| to first order, which the
// check's bound already allows for f32 check sums (its sqrt(n) term). A non-finite weight makes its
// sums non-finite (the weights start at 1: no 0 * inf), as in the reference; the check then reports
// the GEMM, it never trusts it.
#include "abft.h"
#include "cuda_util.h"

namespace pimlayers {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 4;  // packs a lane has in flight before it sums any (4 x 16 = 64 bytes)
// The transposed kernel's 24 f32 accumulators (8 columns x 3 sums) and 16 registers of loads held
// 72 registers unbounded: 3 CTAs per SM. Bounded to 64, 4 CTAs (1024 threads, 64 KB of loads in
// flight per SM).
constexpr int kBlocksPerSm = 4;
static_assert(kWarps == 8, "the transposed kernel's tiling takes 8 warps (bpc = 8 >> wpb_log2)");

// kVec consecutive values of w as loaded: one 16-byte load (kVec = 16 / bytes per value) or one
// value (kVec = 1). Streamed (`__ldcs`): w is read once.
template <typename T, int kVec>
struct Pack {
  static constexpr int kWords = kVec * kValueBytes<T> >= 4 ? kVec * kValueBytes<T> / 4 : 1;
  uint32_t q[kWords];

  // i: the element index of the pack's first value (a multiple of kVec).
  __device__ __forceinline__ void Load(const void* w, int64_t i) {
    if constexpr (kVec == 1 && kValueBytes<T> == 2) {
      q[0] = __ldcs(static_cast<const unsigned short*>(w) + i);
    } else if constexpr (kVec == 1) {
      q[0] = __ldcs(static_cast<const unsigned int*>(w) + i);
    } else {
      static_assert(kVec * kValueBytes<T> == 16, "a pack is one 16-byte load");
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(w) + i / kVec);
      q[0] = v.x;
      q[1] = v.y;
      q[2] = v.z;
      q[3] = v.w;
    }
  }
  __device__ __forceinline__ float At(int j) const {
    if constexpr (kValueBytes<T> == 4) {
      return ToF32<T>(q[j]);
    } else {
      return ToF32<T>(q[j / 2] >> (16 * (j % 2)));
    }
  }
};

// One value's terms of a block's three sums: s1 += x, s2 += pos * x (one fmaf: the product is never
// rounded on its own), sa += |x|.
__device__ __forceinline__ void AddTerms(float x, float pos, float& s1, float& s2, float& sa) {
  s1 += x;
  s2 = fmaf(pos, x, s2);
  sa += fabsf(x);
}

struct EncodeArgs {
  const void* w;
  float* sums;      // (G, K, nb, 2): (s1, s2) pairs
  float* abs_sums;  // (G, K, nb)
  int64_t groups, k, n, block_n, nb;
};

// The non-transposed encode. lanes_log2: lanes per (row, block), 0..5; small: G*K*nb < 2^32 (a
// block's row and index by 32-bit division, where a 64-bit one is a long emulated sequence).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    AbftEncodeRowsKernel(EncodeArgs a, int lanes_log2, bool small) {
  const int lanes = 1 << lanes_log2, lane = threadIdx.x & 31, gl = lane & (lanes - 1);
  const int per_warp = 32 >> lanes_log2;  // (row, block) pairs a warp takes at once
  const int64_t segs = a.groups * a.k * a.nb;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * per_warp;
  // Warp-uniform loop (the shuffles need every lane); s: this lane's (row, block), row-major.
  for (int64_t s0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * per_warp;
       s0 < segs; s0 += stride) {
    const int64_t s = s0 + (lane >> lanes_log2);
    float a1 = 0, a2 = 0, aa = 0;
    if (s < segs) {
      int64_t row, b;
      if (small) {
        const uint32_t r32 = static_cast<uint32_t>(s) / static_cast<uint32_t>(a.nb);
        row = r32;
        b = static_cast<uint32_t>(s) - r32 * static_cast<uint32_t>(a.nb);
      } else {
        row = s / a.nb;
        b = s - row * a.nb;
      }
      const int64_t first = row * a.n + b * a.block_n;  // element index of the block's value 0
      const int64_t width = a.n - b * a.block_n < a.block_n ? a.n - b * a.block_n : a.block_n;
      const int64_t packs = width / kVec;  // whole packs: the vector path needs kVec | width
      for (int64_t v0 = gl; v0 < packs; v0 += kLoads * lanes) {
        Pack<T, kVec> p[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          if (v0 + u * lanes < packs) p[u].Load(a.w, first + (v0 + u * lanes) * kVec);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t v = v0 + u * lanes;
          if (v < packs) {
            const float pos = static_cast<float>(v * kVec + 1);  // j + 1 of the pack's value 0
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              AddTerms(p[u].At(j), pos + static_cast<float>(j), a1, a2, aa);
            }
          }
        }
      }
    }
    for (int o = lanes / 2; o > 0; o >>= 1) {
      a1 += __shfl_xor_sync(0xffffffffu, a1, o);
      a2 += __shfl_xor_sync(0xffffffffu, a2, o);
      aa += __shfl_xor_sync(0xffffffffu, aa, o);
    }
    if (s < segs && gl == 0) {
      a.sums[2 * s] = a1;  // two f32 stores: nothing promises sums 8-byte alignment
      a.sums[2 * s + 1] = a2;
      a.abs_sums[s] = aa;
    }
  }
}

// The transposed encode's layout within a CTA of kWarps warps: a warp's 32 lanes are 2^cols_log2
// column packs (cols_log2 1..5) by 32 >> cols_log2 row slots; the warps are bpc = kWarps >>
// wpb_log2 blocks of rows by 2^wpb_log2 warps each. chunks: column chunks of 2^cols_log2 packs per
// group; bgroups: groups of bpc blocks per group.
struct BlocksTiling {
  int cols_log2, wpb_log2;
  int64_t chunks, bgroups;
};

// Partial sums of each warp's column packs (a row-slot-0 lane's), padded to 33 columns so that
// lanes writing consecutive columns, and threads reading them, fall in different banks.
template <int kVec>
struct Partials {
  float v[kWarps][3][kVec][33];
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    AbftEncodeBlocksKernel(EncodeArgs a, BlocksTiling t) {
  __shared__ Partials<kVec> part;
  const int cols = 1 << t.cols_log2, wpb = 1 << t.wpb_log2, bpc = kWarps >> t.wpb_log2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int c = lane & (cols - 1);             // column pack in the chunk
  const int bl = warp >> t.wpb_log2;           // block in the CTA
  const int slots = wpb << (5 - t.cols_log2);  // row slots per block
  const int slot = ((warp & (wpb - 1)) << (5 - t.cols_log2)) + (lane >> t.cols_log2);
  const int64_t kpacks = a.k / kVec;  // whole packs: the vector path needs kVec | K
  const int64_t units = a.groups * t.bgroups * t.chunks;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {  // CTA-uniform: barriers inside
    // Column chunks fastest: neighbouring CTAs read neighbouring columns of the same rows.
    const int64_t chunk = u % t.chunks, rest = u / t.chunks;
    const int64_t bg = rest % t.bgroups, g = rest / t.bgroups;
    const int64_t kp = chunk * cols + c, b = bg * bpc + bl;
    float s1[kVec], s2[kVec], sa[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) s1[j] = s2[j] = sa[j] = 0;
    if (kp < kpacks && b < a.nb) {
      const int64_t rows = a.n - b * a.block_n < a.block_n ? a.n - b * a.block_n : a.block_n;
      const int64_t first = (g * a.n + b * a.block_n) * a.k + kp * kVec;  // row 0 of the block
      const int64_t step = a.k * slots;  // elements from one of this thread's rows to the next
      for (int64_t r0 = slot, i0 = first + slot * a.k; r0 < rows;
           r0 += kLoads * slots, i0 += kLoads * step) {
        Pack<T, kVec> p[kLoads];
#pragma unroll
        for (int q = 0; q < kLoads; ++q) {
          if (r0 + q * slots < rows) p[q].Load(a.w, i0 + q * step);
        }
        const float pos0 = static_cast<float>(r0 + 1);  // t + 1 for row t of the block
#pragma unroll
        for (int q = 0; q < kLoads; ++q) {
          if (r0 + q * slots < rows) {
            const float pos = pos0 + static_cast<float>(q * slots);
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              AddTerms(p[q].At(j), pos, s1[j], s2[j], sa[j]);
            }
          }
        }
      }
    }
    // The warp's row slots: lanes `cols` apart hold the same columns.
    for (int o = 16; o >= cols; o >>= 1) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        s1[j] += __shfl_xor_sync(0xffffffffu, s1[j], o);
        s2[j] += __shfl_xor_sync(0xffffffffu, s2[j], o);
        sa[j] += __shfl_xor_sync(0xffffffffu, sa[j], o);
      }
    }
    if (lane < cols) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        part.v[warp][0][j][c] = s1[j];
        part.v[warp][1][j][c] = s2[j];
        part.v[warp][2][j][c] = sa[j];
      }
    }
    __syncthreads();
    // The block's warps added in order; e runs over (value j, column pack, block), the block
    // fastest, so a column's adjacent blocks are adjacent writes.
    const int bpc_log2 = 3 - t.wpb_log2;  // kWarps = 8
    for (int e = threadIdx.x; e < (kVec * cols) * bpc; e += kThreads) {
      const int eb = e & (bpc - 1), ec = (e >> bpc_log2) & (cols - 1);
      const int ej = e >> (bpc_log2 + t.cols_log2);
      const int64_t k = (chunk * cols + ec) * kVec + ej, bb = bg * bpc + eb;
      if (chunk * cols + ec >= kpacks || bb >= a.nb) continue;
      float t1 = 0, t2 = 0, ta = 0;
      for (int wp = 0; wp < wpb; ++wp) {
        const int w = eb * wpb + wp;
        t1 += part.v[w][0][ej][ec];
        t2 += part.v[w][1][ej][ec];
        ta += part.v[w][2][ej][ec];
      }
      const int64_t o = (g * a.k + k) * a.nb + bb;
      a.sums[2 * o] = t1;
      a.sums[2 * o + 1] = t2;
      a.abs_sums[o] = ta;
    }
    __syncthreads();  // part is free for the next unit
  }
}

// The pair's tile: 128 rows by 128 columns (= block_n, both ways).
constexpr int kPairTile = 128;

struct PairArgs {
  const void* w;
  float *sums, *abs_sums;      // (G, K, N / 128, 2), (G, K, N / 128): w's blocks of columns
  float *sums_t, *abs_sums_t;  // (G, N, K / 128, 2), (G, N, K / 128): its blocks of rows
  int64_t groups, k, n;
  bool pairs8;  // sums and sums_t 8-byte aligned: each (s1, s2) pair one store
};

// One (s1, s2) pair of a sums array: one 8-byte store where the array is 8-byte aligned (a pair's
// offset is a multiple of 8 bytes), else two.
//
// The pair kernel's outputs are few bytes (6 floats per 128 values of w) but many scattered stores
// (a row's sums per column tile, a column's per row tile: one float each, nbn or nbk floats apart),
// and on an H100 they, not the reads, bound it: at 4096 x 14336 bf16 ncu found L2 72% busy and
// DRAM 55% (1.8 TB/s). The 28 weights of 4 Llama-3-8B-dimension layers took 0.972 ms with the
// pairs' stores fused against 1.043 with two (two runs each, alternating processes, 2026-12-06).
// Three restructurings measured slower and were not kept (1.06-1.22 ms): the next 4 packs in
// registers while a thread summed 4; a persistent grid streaming tiles through a cp.async ring in
// shared memory; that ring with 128 x 1024 regions and the row sums staged to whole sectors. Each
// cost occupancy (2 CTAs per SM against 3) and kept the column sums' scattered stores.
__device__ __forceinline__ void StorePair(float* sums, int64_t o, float s1, float s2, bool pairs8) {
  if (pairs8) {
    *reinterpret_cast<float2*>(sums + 2 * o) = make_float2(s1, s2);
  } else {
    sums[2 * o] = s1;
    sums[2 * o + 1] = s2;
  }
}

// Up to 3 CTAs per SM (<= 85 registers): a thread holds 8 packs in flight (32 registers for
// 2-byte values) and 3 f32 sums per column of its pack.
template <typename T>
__global__ void __launch_bounds__(kThreads, 3) AbftEncodePairKernel(PairArgs a) {
  constexpr int kVec = 16 / kValueBytes<T>;
  constexpr int kPacks = kPairTile / kVec;   // packs per tile row: 16 (2-byte values) or 32 (f32)
  constexpr int kSlots = kThreads / kPacks;  // row slots: 16 or 8
  constexpr int kRows = kPairTile / kSlots;  // rows per thread: 8 or 16
  constexpr int kBatch = 8;                  // packs in flight
  static_assert(kRows % kBatch == 0 && (kPacks == 16 || kPacks == 32), "the pair's tiling");
  __shared__ float part[kWarps][3][kPairTile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int p = threadIdx.x % kPacks, slot = threadIdx.x / kPacks;
  const int64_t nbn = a.n / kPairTile, nbk = a.k / kPairTile;
  // Column tiles fastest: neighbouring CTAs read neighbouring columns of the same rows.
  const int64_t ct = blockIdx.x % nbn, rest = blockIdx.x / nbn;
  const int64_t rt = rest % nbk, g = rest / nbk;
  const int64_t col0 = ct * kPairTile + p * kVec;
  float s1[kVec], s2[kVec], sa[kVec];  // this thread's columns, summed over its rows
#pragma unroll
  for (int j = 0; j < kVec; ++j) s1[j] = s2[j] = sa[j] = 0;
#pragma unroll
  for (int b0 = 0; b0 < kRows; b0 += kBatch) {
    Pack<T, kVec> q[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t row = rt * kPairTile + slot + (b0 + i) * kSlots;
      q[i].Load(a.w, (g * a.k + row) * a.n + col0);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = slot + (b0 + i) * kSlots;               // row in the tile
      const float rpos = static_cast<float>(r + 1);         // its position in its block of rows
      const float cpos = static_cast<float>(p * kVec + 1);  // the pack's first column's, + 1
      float a1 = 0, a2 = 0, aa = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float x = q[i].At(j);
        AddTerms(x, cpos + static_cast<float>(j), a1, a2, aa);  // its row's
        AddTerms(x, rpos, s1[j], s2[j], sa[j]);                 // its column's
      }
      // The row's packs are kPacks adjacent lanes (an aligned group): a tree over them.
#pragma unroll
      for (int o = kPacks / 2; o > 0; o >>= 1) {
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
        a2 += __shfl_xor_sync(0xffffffffu, a2, o);
        aa += __shfl_xor_sync(0xffffffffu, aa, o);
      }
      if (p == 0) {
        const int64_t o = (g * a.k + rt * kPairTile + r) * nbn + ct;
        StorePair(a.sums, o, a1, a2, a.pairs8);
        a.abs_sums[o] = aa;
      }
    }
  }
  // A warp's two row slots (2-byte values) hold the same columns 16 lanes apart.
  if constexpr (kPacks == 16) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      s1[j] += __shfl_xor_sync(0xffffffffu, s1[j], 16);
      s2[j] += __shfl_xor_sync(0xffffffffu, s2[j], 16);
      sa[j] += __shfl_xor_sync(0xffffffffu, sa[j], 16);
    }
  }
  if (lane < kPacks) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      part[warp][0][p * kVec + j] = s1[j];
      part[warp][1][p * kVec + j] = s2[j];
      part[warp][2][p * kVec + j] = sa[j];
    }
  }
  __syncthreads();
  // The warps added in order, a thread per column of the tile.
  if (threadIdx.x < kPairTile) {
    const int c = threadIdx.x;
    float t1 = 0, t2 = 0, ta = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      t1 += part[w][0][c];
      t2 += part[w][1][c];
      ta += part[w][2][c];
    }
    const int64_t o = (g * a.n + ct * kPairTile + c) * nbk + rt;
    StorePair(a.sums_t, o, t1, t2, a.pairs8);
    a.abs_sums_t[o] = ta;
  }
}

int FloorLog2(int64_t v) {
  int l = 0;
  while (v > 1) {
    v >>= 1;
    ++l;
  }
  return l;
}

// Rows: lanes per (row, block) so that a lane has about kLoads packs of a full block.
template <typename T, int kVec>
void LaunchRows(cudaStream_t stream, const EncodeArgs& a) {
  const int64_t packs = (a.block_n < a.n ? a.block_n : a.n) / kVec;  // of a full block
  const int lanes_log2 = std::min(5, FloorLog2(std::max<int64_t>(1, packs / kLoads)));
  const int64_t segs = a.groups * a.k * a.nb;
  AbftEncodeRowsKernel<T, kVec><<<GridFor(segs << lanes_log2, kThreads), kThreads, 0, stream>>>(
      a, lanes_log2, segs < (int64_t{1} << 32));
}

// Transposed: warps per block so that a thread has about 16 rows of a block (fewer rows leave the
// loads' latency exposed, more leave few CTAs), then narrower column chunks (more CTAs, more row
// slots per block) while there are fewer CTAs than 4 per SM and a thread keeps 8 rows or more
// (whole-row blocks of a narrow w: few columns, many rows). A warp of 2 packs still reads whole
// 32-byte sectors of a row (the general path's scalar loads: 4 or 8 bytes, the rest of the sector
// read by the next chunk's CTA, from L2 if it is still there).
template <typename T, int kVec>
void LaunchBlocks(cudaStream_t stream, const EncodeArgs& a, int sms) {
  const int64_t bn = a.block_n < a.n ? a.block_n : a.n, kpacks = a.k / kVec;
  BlocksTiling t{5, 0, 0, 0};
  while (t.wpb_log2 < 3 && (bn >> (t.wpb_log2 + 1)) >= 16) ++t.wpb_log2;
  while (t.cols_log2 > 1 && (int64_t{1} << (t.cols_log2 - 1)) >= kpacks) --t.cols_log2;
  auto ctas = [&](int cols_log2) {
    return a.groups * CeilDiv(kpacks, int64_t{1} << cols_log2) *
           CeilDiv(a.nb, int64_t{kWarps >> t.wpb_log2});
  };
  auto rows_per_thread = [&](int cols_log2) {
    return CeilDiv(bn, int64_t{1} << (t.wpb_log2 + 5 - cols_log2));
  };
  while (t.cols_log2 > 1 && ctas(t.cols_log2) < 4 * int64_t{sms} &&
         rows_per_thread(t.cols_log2 - 1) >= 8) {
    --t.cols_log2;
  }
  t.chunks = CeilDiv(kpacks, int64_t{1} << t.cols_log2);
  t.bgroups = CeilDiv(a.nb, int64_t{kWarps >> t.wpb_log2});
  AbftEncodeBlocksKernel<T, kVec><<<GridFor(ctas(t.cols_log2), 1), kThreads, 0, stream>>>(a, t);
}

template <typename T>
ffi::Error RunEncode(cudaStream_t stream, const EncodeArgs& a, bool transposed) {
  constexpr int kVec = 16 / kValueBytes<T>;
  const bool aligned = reinterpret_cast<uintptr_t>(a.w) % 16 == 0;
  if (transposed) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return CudaStatus("abft_encode");
    }
    // Every row of w starts 16-byte aligned, and a pack never leaves its row.
    if (aligned && a.k % kVec == 0) {
      LaunchBlocks<T, kVec>(stream, a, sms);
    } else {
      LaunchBlocks<T, 1>(stream, a, sms);
    }
  } else if (aligned && a.n % kVec == 0 && (a.nb == 1 || a.block_n % kVec == 0)) {
    // Every block starts 16-byte aligned and holds whole packs.
    LaunchRows<T, kVec>(stream, a);
  } else {
    LaunchRows<T, 1>(stream, a);
  }
  return CudaStatus("abft_encode");
}

ffi::Error AbftEncodeCuda(cudaStream_t stream, ffi::AnyBuffer w, int64_t block_n, bool transposed,
                          ffi::Result<ffi::AnyBuffer> sums, ffi::Result<ffi::AnyBuffer> abs_sums) {
  EncodeIo io;
  if (auto e = CheckEncodeShapes(w, block_n, transposed, *sums, *abs_sums, &io); e.failure()) {
    return e;
  }
  if (io.groups * io.k * io.nb == 0) return ffi::Error::Success();  // nothing to launch
  const EncodeArgs a{io.w, io.sums, io.abs_sums, io.groups, io.k, io.n, io.block_n, io.nb};
  switch (io.kind) {
    case FloatKind::kF32:
      return RunEncode<float>(stream, a, transposed);
    case FloatKind::kBF16:
      return RunEncode<Bf16>(stream, a, transposed);
    case FloatKind::kF16:
      return RunEncode<F16>(stream, a, transposed);
    default:
      return BadArg("abft_encode", "w has an unsupported dtype");
  }
}

// w's checksum columns and its transpose's (abft_encode's two layouts) from one read of w, where
// the pair's tiling applies: 128-column blocks, K and N multiples of 128, w 16-byte aligned. Other
// shapes are abft_encode's (two calls); given one here, the handler refuses it.
ffi::Error AbftEncodePairCuda(cudaStream_t stream, ffi::AnyBuffer w, int64_t block_n,
                              ffi::Result<ffi::AnyBuffer> sums,
                              ffi::Result<ffi::AnyBuffer> abs_sums,
                              ffi::Result<ffi::AnyBuffer> sums_t,
                              ffi::Result<ffi::AnyBuffer> abs_sums_t) {
  EncodeIo io, io_t;
  if (auto e = CheckEncodeShapes(w, block_n, false, *sums, *abs_sums, &io); e.failure()) return e;
  if (auto e = CheckEncodeShapes(w, block_n, true, *sums_t, *abs_sums_t, &io_t); e.failure()) {
    return e;
  }
  if (block_n != kPairTile || io.k % kPairTile != 0 || io.n % kPairTile != 0 ||
      reinterpret_cast<uintptr_t>(io.w) % 16 != 0) {
    return BadArg("abft_encode_pair",
                  "w " + ShapeString(w.dimensions()) + " with block_n=" + std::to_string(block_n) +
                      "; expected block_n = 128 and (..., K, N) with K and N multiples of 128 "
                      "(abft_encode takes the rest)");
  }
  const int64_t tiles = io.groups * (io.k / kPairTile) * (io.n / kPairTile);
  if (tiles == 0) return ffi::Error::Success();  // nothing to launch
  if (tiles > INT32_MAX)
    return BadArg("abft_encode_pair", "w has more than 2^31 tiles of 128 x 128");
  const bool pairs8 = reinterpret_cast<uintptr_t>(io.sums) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(io_t.sums) % 8 == 0;
  const PairArgs a{io.w,      io.sums, io.abs_sums, io_t.sums, io_t.abs_sums,
                   io.groups, io.k,    io.n,        pairs8};
  const auto grid = static_cast<unsigned>(tiles);
  switch (io.kind) {
    case FloatKind::kF32:
      AbftEncodePairKernel<float><<<grid, kThreads, 0, stream>>>(a);
      break;
    case FloatKind::kBF16:
      AbftEncodePairKernel<Bf16><<<grid, kThreads, 0, stream>>>(a);
      break;
    case FloatKind::kF16:
      AbftEncodePairKernel<F16><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      return BadArg("abft_encode_pair", "w has an unsupported dtype");
  }
  return CudaStatus("abft_encode_pair");
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftEncodePairCuda, pimlayers::AbftEncodePairCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // w: (..., K, N) f32|bf16|f16
                                  .Attr<int64_t>("block_n")      // 128: both block widths
                                  .Ret<xla::ffi::AnyBuffer>()    // sums: (..., K, N/128, 2) f32
                                  .Ret<xla::ffi::AnyBuffer>()    // abs_sums: (..., K, N/128) f32
                                  .Ret<xla::ffi::AnyBuffer>()    // sums_t: (..., N, K/128, 2) f32
                                  .Ret<xla::ffi::AnyBuffer>());  // abs_sums_t: (..., N, K/128) f32

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftEncodeCuda, pimlayers::AbftEncodeCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // w: (..., K, N) f32|bf16|f16
                                  .Attr<int64_t>("block_n")      // column block width
                                  .Attr<bool>("transposed")      // w stored as (..., N, K)
                                  .Ret<xla::ffi::AnyBuffer>()    // sums: (..., K, nb, 2) f32
                                  .Ret<xla::ffi::AnyBuffer>());  // abs_sums: (..., K, nb) f32
