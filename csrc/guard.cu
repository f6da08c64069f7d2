// CUDA handler of bank_guard: bank checksums, group parity and parity-row checksums in one read.
//
// Work units: (parity group, chunk of up to 4 KiB of its banks, pass of up to 8 member banks).
// Persistent CTAs copy each unit into shared memory with cp.async, the next unit's copies in
// flight while the current one is reduced (two stages, so loads never wait on arithmetic). Warp w
// holds member w: it sums its own vectors' checksum terms as bank_checksums' kernel does (one warp
// reduction per bank); thread t XORs column t of the staged members into the parity, writes it and
// adds the parity row's terms. Banks of several chunks add their chunks' sums (associative) into
// 64-bit scratch counters with fire-and-forget atomics, reduced mod p by a second small kernel.
#include <cuda_bf16.h>

#include <cstring>
#include <utility>

#include "cuda_util.h"

#include "adam_guard.h"
#include "guard_many.h"

namespace pimlayers {
namespace {

constexpr int kWarps = 8;    // member banks staged per pass (the default group)
constexpr int kPerLane = 8;  // 16-byte vectors per lane per chunk: chunks of up to 4 KiB

// Where a checksum goes: straight to the output, or (banks of several chunks) added to a 64-bit
// counter (each chunk adds < 2^31, at most 2^19 chunks: no overflow) that Finish reduces.
struct Sink {
  uint32_t* out;
  unsigned long long* acc;  // null: one chunk per bank
  __device__ __forceinline__ void Put(int64_t i, uint32_t v) const {
    if (acc) {
      atomicAdd(acc + i, static_cast<unsigned long long>(v));  // result unused: a RED, no wait
    } else {
      out[i] = v;
    }
  }
};

__global__ void FinishKernel(const unsigned long long* __restrict__ acc, int64_t n,
                             uint32_t* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = ModM31(acc[i]);
  }
}

// 16 bytes at byte `off` of one example, zero past its end, by bytes (unaligned examples only).
__device__ __noinline__ uint4 Load16Bytes(const uint8_t* ex, int64_t bytes, int64_t off) {
  uint64_t lo = 0, hi = 0;
  const int n = bytes - off < 16 ? static_cast<int>(bytes - off) : 16;
  for (int k = 0; k < n; ++k) {
    const uint64_t b = ex[off + k];
    if (k < 8) {
      lo |= b << (8 * k);
    } else {
      hi |= b << (8 * (k - 8));
    }
  }
  return make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                    static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
}

// Stage 16 bytes at byte `off` of one example into shared memory (zero past the example's end):
// an asynchronous copy where the source is 16-byte aligned, else byte loads.
__device__ __forceinline__ void Stage16(uint4* dst, const uint8_t* ex, int64_t bytes, int64_t off,
                                        bool aligned) {
  if (!aligned) {
    *dst = Load16Bytes(ex, bytes, off);
    return;
  }
  const int n = bytes - off < 16 ? (bytes > off ? static_cast<int>(bytes - off) : 0) : 16;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
               "l"(n > 0 ? ex + off : ex), "r"(n));
#else
  *dst = n == 16 ? *reinterpret_cast<const uint4*>(ex + off) : Load16Bytes(ex, bytes, off);
#endif
}

// Stage 16 aligned bytes that are all in the data.
__device__ __forceinline__ void Stage16Whole(uint4* dst, const uint8_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
#else
  *dst = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void StageCommit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait for all but the most recent committed group of copies.
__device__ __forceinline__ void StageWaitPrevious() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::);
#endif
}

// Sum mod p over the warp of per-lane values below 2^31.
__device__ __forceinline__ uint32_t WarpSumSmall(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // Two 16-bit halves: each warp sum fits 32 bits, and one instruction each.
  const uint32_t lo = __reduce_add_sync(0xffffffffu, v & 0xffffu);
  const uint32_t hi = __reduce_add_sync(0xffffffffu, v >> 16);
  return ModM31((static_cast<uint64_t>(hi) << 16) + lo);
#else
  return WarpSumM31(v);
#endif
}

// Half-word sums of a 16-byte vector (its words are bank words 8v .. 8v+7), two dot-product
// instructions per 32-bit word: hs = sum h_q (< 2^19), hq = sum q * h_q (< 2^21).
__device__ __forceinline__ void HalfSums(uint4 q, uint32_t* hs, uint32_t* hq) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  uint32_t s = 0, t = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    s = __dp2a_lo(w[k], 0x0101u, s);                         // lo + hi
    t = __dp2a_lo(w[k], (2u * k) | ((2u * k + 1) << 8), t);  // 2k lo + (2k + 1) hi
  }
  *hs = s;
  *hq = t;
}

struct Geometry {
  const uint8_t* x;
  int64_t bytes, bank_bytes, vecs, nbanks, group;
  uint32_t ngroups, nchunks, total;  // (group, chunk) items: fewer than 2^31 (checked)
  int per_lane;
};

// One pass of one item: member banks mb .. mb + 7 of chunk c of group g of example e.
struct Unit {
  uint32_t item;
  int64_t mb;
  int64_t c, eg, g, e, first, members;
  __device__ void Locate(const Geometry& G) {  // 32-bit divisions: a few instructions each
    const uint32_t eg32 = item / G.nchunks;
    c = item - eg32 * G.nchunks, eg = eg32, g = eg32 % G.ngroups, e = eg32 / G.ngroups;
    first = g * G.group;
    members = G.group < G.nbanks - first ? G.group : G.nbanks - first;
  }
  __device__ void Next(const Geometry& G) {
    mb += kWarps;
    if (mb >= members) {
      item += gridDim.x, mb = 0;
      if (item < G.total) Locate(G);
    }
  }
};

__global__ void __launch_bounds__(kWarps * 32)
    GuardKernel(Geometry G, Sink sums, uint8_t* __restrict__ parity, Sink psums) {
  extern __shared__ uint4 stage[];  // [2][min(group, 8)][cols]: two units' member vectors
  __shared__ uint32_t red[kWarps][2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int cols = G.per_lane * 32;  // vectors of each bank in one chunk (<= blockDim when G > 8)
  const int64_t unit_vecs = static_cast<int64_t>(nwarps) * cols;

  auto issue = [&](const Unit& u, uint4* buf) {  // warp w copies member u.mb + w
    const int64_t m = u.mb + warp;
    if (m >= u.members) return;
    const uint8_t* ex = G.x + u.e * G.bytes;
    const bool aligned = reinterpret_cast<uintptr_t>(ex) % 16 == 0;
    const int64_t base = (u.first + m) * G.bank_bytes, v0 = u.c * cols;
    // The common case: the warp's whole chunk is in the bank and in the data, aligned.
    const bool whole = aligned && v0 + cols <= G.vecs && base + (v0 + cols) * 16 <= G.bytes;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t v = v0 + k * 32 + lane;
      if (whole && k < G.per_lane) {
        Stage16Whole(buf + warp * cols + k * 32 + lane, ex + base + v * 16);
      } else if (!whole && k < G.per_lane && v < G.vecs) {
        Stage16(buf + warp * cols + k * 32 + lane, ex, G.bytes, base + v * 16, aligned);
      }
    }
  };

  Unit u{blockIdx.x, 0};
  if (u.item < G.total) {
    u.Locate(G);
    issue(u, stage);
  }
  StageCommit();
  uint4 acc = make_uint4(0, 0, 0, 0);  // column threadIdx.x's parity when G > 8 (one per thread)
  uint64_t p1 = 0, p2 = 0;             // this thread's terms of the parity row's checksum
  for (int buf = 0; u.item < G.total; buf ^= 1) {
    uint4* cur = stage + buf * unit_vecs;
    Unit nx = u;
    nx.Next(G);
    if (nx.item < G.total) issue(nx, stage + (buf ^ 1) * unit_vecs);
    StageCommit();
    StageWaitPrevious();  // this thread's copies of u have landed

    const int64_t v0 = u.c * cols, m = u.mb + warp;
    if (m < u.members) {  // member m's checksum terms, from the vectors this thread copied
      // Vector k of this lane is bank vector v0 + lane + 32k, its word q has weight
      // 8 (v0 + lane) + 1 + 256k + q: the lane adds (8 (v0 + lane) + 1) A + 256 B + Q with
      // A = sum hs_k (< 2^22), B = sum k hs_k (< 2^25), Q = sum hq_k (< 2^24), all in 32 bits.
      uint32_t a = 0, b = 0, qs = 0;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t v = v0 + k * 32 + lane;
        if (k < G.per_lane && v < G.vecs) {
          uint32_t hs, hq;
          HalfSums(cur[warp * cols + k * 32 + lane], &hs, &hq);
          a += hs, b += k * hs, qs += hq;
        }
      }
      const uint64_t w0 = 8 * static_cast<uint64_t>(v0 + lane) + 1;  // < 2^30
      const uint32_t s1 = WarpSumSmall(a), s2 = WarpSumSmall(ModM31(w0 * a + 256ull * b + qs));
      if (lane < 2) sums.Put(2 * (u.e * G.nbanks + u.first + m) + lane, lane ? s2 : s1);
    }
    __syncthreads();  // every warp's copies of u are visible

    auto finish = [&](int col, uint4 p) {  // column col of the parity is complete
      const int64_t v = v0 + col;
      if (v >= G.vecs) return;
      *reinterpret_cast<uint4*>(parity + u.eg * G.bank_bytes + v * 16) = p;  // rows: 16k bytes
      uint32_t hs, hq;
      HalfSums(p, &hs, &hq);
      p1 += hs;  // at most 8 columns a thread: p2 < 2^3 * (2^30 * 2^19 + 2^21)
      p2 += (8 * static_cast<uint64_t>(v) + 1) * hs + hq;
    };
    const int nm = u.members - u.mb < kWarps ? static_cast<int>(u.members - u.mb) : kWarps;
    const bool last = u.mb + kWarps >= u.members;
    if (u.members <= kWarps) {  // one pass: each column is finished here
      for (int col = threadIdx.x; col < cols; col += blockDim.x) {
        uint4 p = cur[col];
        for (int w = 1; w < nm; ++w) {
          const uint4 t = cur[w * cols + col];
          p.x ^= t.x, p.y ^= t.y, p.z ^= t.z, p.w ^= t.w;
        }
        finish(col, p);
      }
    } else if (static_cast<int>(threadIdx.x) < cols) {  // blockDim is 256 >= cols
      for (int w = 0; w < nm; ++w) {
        const uint4 t = cur[w * cols + threadIdx.x];
        acc.x ^= t.x, acc.y ^= t.y, acc.z ^= t.z, acc.w ^= t.w;
      }
      if (last) finish(threadIdx.x, acc);
    }
    if (last) {  // the parity row's checksum: warp sums now, the CTA's after the barrier
      const uint32_t r1 = WarpSumSmall(ModM31(p1)), r2 = WarpSumSmall(ModM31(p2));
      if (lane == 0) red[warp][0] = r1, red[warp][1] = r2;
    }
    __syncthreads();  // stage[buf] is free for the copies issued next; red is complete
    if (last) {
      if (threadIdx.x < 2) {
        uint64_t r = 0;  // at most 8 terms below 2^31: one reduction at the end
        for (int w = 0; w < nwarps; ++w) r += red[w][threadIdx.x];
        psums.Put(2 * u.eg + threadIdx.x, ModM31(r));
      }
      acc = make_uint4(0, 0, 0, 0), p1 = p2 = 0;
    }
    u = nx;
  }
}

ffi::Error GuardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                     int64_t bank_bytes, int64_t group, ffi::Result<ffi::AnyBuffer> sums,
                     ffi::Result<ffi::AnyBuffer> parity, ffi::Result<ffi::AnyBuffer> psums) {
  ParityLayout P;
  if (auto e = MakeGuardLayout(x, *sums, *parity, *psums, bank_bytes, group, &P); e.failure())
    return e;
  const BankLayout& L = P.banks;
  Geometry G;
  G.x = static_cast<const uint8_t*>(x.untyped_data());
  G.bytes = L.bytes, G.bank_bytes = bank_bytes, G.vecs = bank_bytes / 16, G.nbanks = L.nbanks;
  G.group = group;
  // Chunks of equal size (4112-byte banks: two of 129 vectors, not 256 + 1).
  const int64_t nchunks = CeilDiv(G.vecs, kPerLane * 32);
  G.per_lane = static_cast<int>(CeilDiv(CeilDiv(G.vecs, nchunks), 32));
  const int64_t total = L.batch * P.ngroups * nchunks;
  if (total == 0) return CudaStatus("bank_guard");
  if (total >= (int64_t{1} << 31)) {
    return BadArg("bank_guard",
                  std::to_string(total) + " (group, 4 KiB chunk) items; at most 2^31 - 1: split x");
  }
  G.ngroups = static_cast<uint32_t>(P.ngroups), G.nchunks = static_cast<uint32_t>(nchunks);
  G.total = static_cast<uint32_t>(total);
  Sink s{static_cast<uint32_t*>(sums->untyped_data()), nullptr};
  Sink ps{static_cast<uint32_t*>(psums->untyped_data()), nullptr};
  const int64_t ns = static_cast<int64_t>(sums->element_count());
  const int64_t nps = static_cast<int64_t>(psums->element_count());
  if (nchunks > 1) {  // 64-bit counters for sums then parity sums, zeroed
    auto buf = scratch.Allocate(static_cast<size_t>(ns + nps) * 8, 16);
    if (!buf.has_value()) {
      return ffi::Error::Internal("pimlayers.bank_guard: no scratch memory for the checksums");
    }
    s.acc = static_cast<unsigned long long*>(*buf);
    ps.acc = s.acc + ns;
    if (cudaMemsetAsync(s.acc, 0, static_cast<size_t>(ns + nps) * 8, stream) != cudaSuccess) {
      return CudaStatus("bank_guard");
    }
  }
  const int warps = group < kWarps ? static_cast<int>(group) : kWarps;
  const int smem = 2 * warps * G.per_lane * 32 * 16;  // two stages: <= 64 KiB
  // Persistent CTAs: as many as fit on the GPU at once, each looping over units.
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaFuncSetAttribute(GuardKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, GuardKernel, warps * 32, smem) !=
          cudaSuccess) {
    return CudaStatus("bank_guard");
  }
  const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  const int64_t grid = total < resident ? total : resident;
  GuardKernel<<<static_cast<unsigned>(grid), warps * 32, smem, stream>>>(
      G, s, static_cast<uint8_t*>(parity->untyped_data()), ps);
  if (nchunks > 1) {
    FinishKernel<<<GridFor(ns, 256), 256, 0, stream>>>(s.acc, ns, s.out);
    if (auto e = CudaStatus("bank_guard"); e.failure()) return e;
    FinishKernel<<<GridFor(nps, 256), 256, 0, stream>>>(ps.acc, nps, ps.out);
  }
  return CudaStatus("bank_guard");
}

// ---- bank_guard_many / bank_verify_many: every leaf of a pytree in one launch -------------------
//
// One CTA per parity group (a unit), in chunks of 4 KiB of its banks: thread t holds vector t of
// the chunk of each of up to 8 member banks in registers (eight independent 16-byte loads in flight
// per thread, no shared-memory staging), XORs them into the parity vector and forms each bank's
// checksum terms; one warp reduction per term (__reduce_add_sync), lane k of each warp keeps term k
// across chunks, and the eight warps' terms are summed through shared memory. The leaves' addresses
// are a table in device memory, copied there with the launch.

constexpr int kManyThreads = 256;  // vectors of a bank per chunk: 4 KiB
constexpr int kBatch = 8;          // member banks in registers at once

// The call's geometry; the leaf table lives in device memory (one small copy per call), so the
// kernel's parameters stay a few words whatever the number of leaves.
struct ManyTable {
  const ManyLeaf* leaf;   // n leaves
  const uint32_t* unit0;  // first unit (parity group) of each leaf; unit0[n]: all units
  int n;
  int64_t bank_bytes, vecs, nchunks, group;
  int32_t* count;        // verify: faulty banks and parity rows, all leaves
  const AdamLeaf* adam;  // adamw_guard_many: each leaf's update operands, n of them
  const float* hyper;    // adamw_guard_many: the step's scalars (AdamHyper)
};

__device__ __forceinline__ uint4 Xor4(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

// 16 bytes at byte `off` of a leaf, zero past its end (byte loads for a partial or unaligned one).
__device__ __forceinline__ uint4 LoadVec(const uint8_t* x, int64_t bytes, int64_t off,
                                         bool aligned) {
  if (aligned && off + 16 <= bytes) return __ldg(reinterpret_cast<const uint4*>(x + off));
  return off < bytes ? Load16Bytes(x, bytes, off) : make_uint4(0, 0, 0, 0);
}

// Where a unit (one parity group of one leaf) lies.
struct ManyUnit {
  const ManyLeaf* leaf;
  int64_t g, first, members;
};

__device__ __forceinline__ ManyUnit Locate(const ManyTable& T, uint32_t unit) {
  int l = 0, hi = T.n - 1;  // the last leaf whose first unit is <= unit
  while (l < hi) {
    const int mid = (l + hi + 1) / 2;
    if (__ldg(T.unit0 + mid) <= unit) {
      l = mid;
    } else {
      hi = mid - 1;
    }
  }
  ManyUnit u;
  u.leaf = &T.leaf[l];
  u.g = unit - __ldg(T.unit0 + l), u.first = u.g * T.group;
  u.members = T.group < u.leaf->nbanks - u.first ? T.group : u.leaf->nbanks - u.first;
  return u;
}

// The loads of one pass (members mb .. mb + 7) over chunk c: thread t's vector of each member and,
// when verifying on the last pass, of the stored parity row.
template <bool kVerify>
__device__ __forceinline__ void LoadPass(const ManyTable& T, const ManyUnit& u, int64_t mb,
                                         int64_t c, uint4 (&q)[kBatch], uint4& stored) {
  const ManyLeaf& L = *u.leaf;
  const int64_t v = c * kManyThreads + threadIdx.x;
  const bool in = v < T.vecs, aligned = reinterpret_cast<uintptr_t>(L.x) % 16 == 0;
  const int64_t nm = u.members - mb;
#pragma unroll
  for (int m = 0; m < kBatch; ++m) {
    q[m] = m < nm && in ? LoadVec(L.x, L.bytes, (u.first + mb + m) * T.bank_bytes + v * 16, aligned)
                        : make_uint4(0, 0, 0, 0);
  }
  stored = make_uint4(0, 0, 0, 0);
  if (kVerify && in && mb + kBatch >= u.members) {
    stored = __ldg(reinterpret_cast<const uint4*>(L.par_in + u.g * T.bank_bytes + v * 16));
  }
}

// Two float32 words rounded to bfloat16 (to nearest, ties to even: XLA's convert), packed low
// first.
__device__ __forceinline__ uint32_t Bf16Pair(uint32_t lo, uint32_t hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(__uint_as_float(lo), __uint_as_float(hi));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Verify with a cast: thread t's vectors of the pass (four float32 each) written, rounded, to the
// leaf's bfloat16 copy: the scrub's read of the weights also gives the forward pass its compute
// copy. 8-byte stores (the copy is 8-byte aligned: checked on the host) but at a leaf's end.
__device__ __forceinline__ void CastPass(const ManyTable& T, const ManyUnit& u, int64_t mb,
                                         int64_t c, const uint4 (&q)[kBatch]) {
  const ManyLeaf& L = *u.leaf;
  const int64_t v = c * kManyThreads + threadIdx.x;
  if (L.cast == nullptr || v >= T.vecs) return;
  const int64_t nm = u.members - mb;
#pragma unroll
  for (int m = 0; m < kBatch; ++m) {
    const int64_t off = (u.first + mb + m) * T.bank_bytes + v * 16;
    if (m >= nm || off >= L.bytes) continue;
    const uint2 r = make_uint2(Bf16Pair(q[m].x, q[m].y), Bf16Pair(q[m].z, q[m].w));
    uint16_t* dst = L.cast + off / 4;
    if (off + 16 <= L.bytes) {
      *reinterpret_cast<uint2*>(dst) = r;
    } else {  // a float32 leaf's bytes are a multiple of 4: 1 to 3 values left
      const uint16_t h[4] = {static_cast<uint16_t>(r.x), static_cast<uint16_t>(r.x >> 16),
                             static_cast<uint16_t>(r.y), static_cast<uint16_t>(r.y >> 16)};
      for (int k = 0; k < (L.bytes - off) / 4; ++k) dst[k] = h[k];
    }
  }
}

// The parity of one pass (guard: XORed into the row, written), then every checksum term of the
// pass reduced over the warp; lane k adds term k into `mine` (reduced mod p by the caller).
template <bool kVerify>
__device__ __forceinline__ void ReducePass(const ManyTable& T, const ManyUnit& u, int64_t mb,
                                           int64_t c, const uint4 (&q)[kBatch], uint4 stored,
                                           uint64_t& mine) {
  const ManyLeaf& L = *u.leaf;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t v = c * kManyThreads + threadIdx.x;
  const int nm = u.members - mb < kBatch ? static_cast<int>(u.members - mb) : kBatch;
  const bool last = mb + kBatch >= u.members;
  uint4 p = stored;  // the parity vector whose terms are taken (last pass only)
  if (!kVerify && v < T.vecs) {
    uint4* row = reinterpret_cast<uint4*>(L.parity + u.g * T.bank_bytes + v * 16);
    uint4 acc = mb > 0 ? *row : make_uint4(0, 0, 0, 0);  // this thread's own earlier write
#pragma unroll
    for (int m = 0; m < kBatch; ++m) acc = Xor4(acc, q[m]);
    *row = acc;
    if (last) p = acc;
  }
  // Vector v's word j has weight 8 v + 1 + j. Per lane: a = sum h (< 2^19) and
  // b = (8 lane + 1) a + sum j h_j (< 2^27 + 2^21): the warp sums fit 32 bits
  // (sum (8 lane + 1) = 4000 < 2^12; 2^12 * 2^19 + 32 * 2^21 < 2^32). Lane k keeps only the sums of
  // term k / 2 (selects, no arithmetic per term) and adds its term once: the warp's base
  // 8 (256 c + 32 warp) times the sum of a, plus the sum of b (< 2^30 * 2^24 + 2^32), in 64 bits.
  const uint32_t w8 = 8u * lane + 1u;
  uint32_t sel_a = 0, sel_b = 0;
#pragma unroll
  for (int k = 0; k <= kBatch; ++k) {
    if (k < kBatch ? k >= nm : !last) continue;  // uniform over the CTA
    uint32_t hs, hq;
    HalfSums(k < kBatch ? q[k] : p, &hs, &hq);
    const uint32_t a = __reduce_add_sync(0xffffffffu, hs);
    const uint32_t b = __reduce_add_sync(0xffffffffu, w8 * hs + hq);
    sel_a = (lane >> 1) == k ? a : sel_a;
    sel_b = (lane >> 1) == k ? b : sel_b;
  }
  const uint64_t base = 8 * static_cast<uint64_t>(c * kManyThreads + 32 * warp);
  mine += lane & 1 ? base * sel_a + sel_b : sel_a;  // < 2^55 a chunk
}

// The stored checksum pair thread t of a pass compares with (thread m < 8: member m's, thread 8:
// the parity row's), or zeros for a thread that finishes nothing.
__device__ __forceinline__ uint2 WantPair(const ManyUnit& u, int64_t mb) {
  const ManyLeaf& L = *u.leaf;
  const int t = threadIdx.x;
  const int nm = u.members - mb < kBatch ? static_cast<int>(u.members - mb) : kBatch;
  const bool last = mb + kBatch >= u.members;
  if (!(t < nm || (t == kBatch && last))) return make_uint2(0, 0);
  const uint32_t* want = t < kBatch ? L.sums_in : L.psums_in;
  const int64_t i = t < kBatch ? u.first + mb + t : u.g;
  return make_uint2(__ldg(want + 2 * i), __ldg(want + 2 * i + 1));
}

// The eight warps' terms of a pass summed: thread m < 8 finishes member m, thread 8 the parity row.
// `want`: WantPair(u, mb) when verifying, loaded by the caller (the fast kernel loads it with the
// data, so its latency is not paid again after the reduction).
template <bool kVerify>
__device__ __forceinline__ void FinishPass(const ManyTable& T, const ManyUnit& u, int64_t mb,
                                           uint64_t mine, uint32_t (*red)[2 * kBatch + 2],
                                           uint2 want) {
  const ManyLeaf& L = *u.leaf;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = threadIdx.x;
  const int nm = u.members - mb < kBatch ? static_cast<int>(u.members - mb) : kBatch;
  const bool last = mb + kBatch >= u.members;
  if (lane < 2 * kBatch + 2) red[warp][lane] = ModM31(mine);
  __syncthreads();
  if (t < nm || (t == kBatch && last)) {
    uint64_t s1 = 0, s2 = 0;  // eight terms below 2^31 each
    for (int w = 0; w < kManyThreads / 32; ++w) s1 += red[w][2 * t], s2 += red[w][2 * t + 1];
    const uint32_t r1 = ModM31(s1), r2 = ModM31(s2);
    const int64_t i = t < kBatch ? u.first + mb + t : u.g;  // bank, or group for the parity row
    if (!kVerify) {
      uint32_t* out = t < kBatch ? L.sums : L.psums;
      out[2 * i] = r1, out[2 * i + 1] = r2;
    } else {
      const bool bad = r1 != want.x || r2 != want.y;
      if (t < kBatch) {
        L.sums[2 * i] = r1, L.sums[2 * i + 1] = r2;
        L.bad[i] = bad;
      } else {
        L.bad_par[i] = bad;
      }
      if (bad) atomicAdd(T.count, 1);
    }
  }
  __syncthreads();  // red is free for the next pass
}

// Any geometry: units in a grid-stride loop, passes of 8 members, chunks of 4 KiB.
template <bool kVerify>
__global__ void __launch_bounds__(kManyThreads) ManyKernel(const ManyTable T) {
  __shared__ uint32_t red[kManyThreads / 32][2 * kBatch + 2];
  const uint32_t total = __ldg(T.unit0 + T.n);
  for (uint32_t unit = blockIdx.x; unit < total; unit += gridDim.x) {
    const ManyUnit u = Locate(T, unit);
    for (int64_t mb = 0; mb < u.members; mb += kBatch) {
      uint64_t mine = 0;
      for (int64_t c = 0; c < T.nchunks; ++c) {
        uint4 q[kBatch], stored;
        LoadPass<kVerify>(T, u, mb, c, q, stored);
        if (kVerify) CastPass(T, u, mb, c, q);
        ReducePass<kVerify>(T, u, mb, c, q, stored, mine);
        if (c % 256 == 255) mine = ModM31(mine);  // 256 chunks: below 2^63
      }
      FinishPass<kVerify>(T, u, mb, mine, red, kVerify ? WantPair(u, mb) : make_uint2(0, 0));
    }
  }
}

// One chunk per bank and one pass per group (banks up to 4 KiB, groups up to 8: the default
// geometry). A whole group inside an aligned leaf (every group but a leaf's last) is loaded
// without per-member bounds checks, from one base address.
template <bool kVerify>
__global__ void __launch_bounds__(kManyThreads, 4) ManyKernelFast(const ManyTable T) {
  __shared__ uint32_t red[kManyThreads / 32][2 * kBatch + 2];
  const uint32_t unit = blockIdx.x;
  const ManyUnit u = Locate(T, unit);
  const ManyLeaf& L = *u.leaf;
  uint4 q[kBatch], stored;
  // The stored checksums are loaded first: their latency overlaps the data's rather than
  // following the reduction at the end of every CTA's short life.
  const uint2 want = kVerify ? WantPair(u, 0) : make_uint2(0, 0);
  const bool whole = u.members == kBatch && reinterpret_cast<uintptr_t>(L.x) % 16 == 0 &&
                     (u.first + kBatch) * T.bank_bytes <= L.bytes;
  if (whole && T.vecs == kManyThreads) {
    const uint8_t* p = L.x + u.first * T.bank_bytes + threadIdx.x * 16;
#pragma unroll
    for (int m = 0; m < kBatch; ++m)
      q[m] = __ldg(reinterpret_cast<const uint4*>(p + m * T.bank_bytes));
    stored = make_uint4(0, 0, 0, 0);
    if (kVerify) {
      stored =
          __ldg(reinterpret_cast<const uint4*>(L.par_in + u.g * T.bank_bytes + threadIdx.x * 16));
    }
  } else {
    LoadPass<kVerify>(T, u, 0, 0, q, stored);
  }
  if (kVerify) CastPass(T, u, 0, 0, q);
  uint64_t mine = 0;
  ReducePass<kVerify>(T, u, 0, 0, q, stored, mine);
  FinishPass<kVerify>(T, u, 0, mine, red, want);
}

// The fast kernel where the geometry allows it. On the H200 (4 layers of Llama-3-8B weights, 36
// leaves, 1.74 GB; device time of 10 calls in one jit) it encoded in 0.485 ms against the general
// kernel's 0.537 and 0.513 with evict-first (ld.global.cs) loads: plain loads here.
template <bool kVerify>
ffi::Error LaunchMany(const ManyTable& T, int64_t units, cudaStream_t stream) {
  if (T.nchunks == 1 && T.group <= kBatch) {
    ManyKernelFast<kVerify><<<static_cast<unsigned>(units), kManyThreads, 0, stream>>>(T);
  } else {
    ManyKernel<kVerify><<<static_cast<unsigned>(units), kManyThreads, 0, stream>>>(T);
  }
  return CudaStatus(kVerify ? "bank_verify_many" : "bank_guard_many");
}

// ---- adamw_guard_many: AdamW's update, and the guard of what it writes -----------------------
//
// The guard after an optimizer step reads every parameter the update has just written (3.5 GB of
// float32 for 4 Llama-3-8B layers: ~1.3 ms of an H100's step). Here the update itself is the
// guard's load: ManyKernelFast's CTA per parity group, thread t's vector t of each member bank,
// but the vector is computed (p, g, m, v read; p', m', v' written) rather than read, then XORed
// into the parity and summed as the guard does. The update moves the bytes XLA's update moves (26
// a parameter with a bfloat16 gradient, 28 with a float32 one); the guard's read of 4 is saved.
// The arithmetic (AdamOne) is adam_guard.h's, shared with the CPU handler.

// The updated float32 vector at byte `off` of leaf i (written to p', m', v'), as the bytes the
// guard takes; zeros past the leaf's end, as the guard reads there.
__device__ __forceinline__ uint4 AdamVec(const ManyLeaf& L, const AdamLeaf& A, const AdamHyper& H,
                                         const AdamDerived& D, int64_t off) {
  if (off >= L.bytes) return make_uint4(0, 0, 0, 0);
  const int64_t e = off / 4;
  const int k = off + 16 <= L.bytes ? 4 : static_cast<int>((L.bytes - off) / 4);
  float p[4] = {0.f, 0.f, 0.f, 0.f}, g[4] = {0.f, 0.f, 0.f, 0.f}, m[4], v[4];
  if (k == 4) {
    const float4 pv = __ldg(reinterpret_cast<const float4*>(A.p + e));
    const float4 mv = __ldg(reinterpret_cast<const float4*>(A.m + e));
    const float4 vv = __ldg(reinterpret_cast<const float4*>(A.v + e));
    if (A.g_bf16) {  // bfloat16 -> float32 is exact: the bits moved up
      const uint2 gb = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(A.g) + e));
      g[0] = __uint_as_float(gb.x << 16), g[1] = __uint_as_float(gb.x & 0xffff0000u);
      g[2] = __uint_as_float(gb.y << 16), g[3] = __uint_as_float(gb.y & 0xffff0000u);
    } else {
      const float4 gv = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(A.g) + e));
      g[0] = gv.x, g[1] = gv.y, g[2] = gv.z, g[3] = gv.w;
    }
    p[0] = pv.x, p[1] = pv.y, p[2] = pv.z, p[3] = pv.w;
    m[0] = mv.x, m[1] = mv.y, m[2] = mv.z, m[3] = mv.w;
    v[0] = vv.x, v[1] = vv.y, v[2] = vv.z, v[3] = vv.w;
  } else {  // a leaf's last 1 to 3 values (unrolled: the arrays stay in registers)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= k) continue;
      p[j] = A.p[e + j], m[j] = A.m[e + j], v[j] = A.v[e + j];
      g[j] = A.g_bf16 ? __uint_as_float(uint32_t{static_cast<const uint16_t*>(A.g)[e + j]} << 16)
                      : static_cast<const float*>(A.g)[e + j];
    }
  }
  uint32_t bits[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < k) p[j] = AdamOne(H, D, p[j], g[j], m[j], v[j]), bits[j] = __float_as_uint(p[j]);
  }
  if (k == 4) {
    *reinterpret_cast<float4*>(A.p_out + e) = make_float4(p[0], p[1], p[2], p[3]);
    *reinterpret_cast<float4*>(A.m_out + e) = make_float4(m[0], m[1], m[2], m[3]);
    *reinterpret_cast<float4*>(A.v_out + e) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < k) A.p_out[e + j] = p[j], A.m_out[e + j] = m[j], A.v_out[e + j] = v[j];
    }
  }
  return make_uint4(bits[0], bits[1], bits[2], bits[3]);
}

// One CTA per parity group; banks of at most 4 KiB and groups of at most 8 (the default geometry:
// one chunk, one pass, as ManyKernelFast). Three CTAs an SM (at most 80 registers a thread): 8.80
// ms against 9.37 with two (H100, as above).
__global__ void __launch_bounds__(kManyThreads, 3) AdamGuardKernel(const ManyTable T) {
  __shared__ uint32_t red[kManyThreads / 32][2 * kBatch + 2];
  const uint32_t unit = blockIdx.x;
  const ManyUnit u = Locate(T, unit);
  const AdamLeaf& A = T.adam[u.leaf - T.leaf];
  const float* h = T.hyper;  // the fields in AdamHyper's order, straight into registers
  const AdamHyper H{__ldg(h),      __ldg(h + 1),  __ldg(h + 2),  __ldg(h + 3), __ldg(h + 4),
                    __ldg(h + 5),  __ldg(h + 6),  __ldg(h + 7),  __ldg(h + 8), __ldg(h + 9),
                    __ldg(h + 10), __ldg(h + 11), __ldg(h + 12), __ldg(h + 13)};
  static_assert(kAdamHyper == 14, "AdamHyper's fields are loaded one by one");
  const AdamDerived D = Derive(H);
  const int64_t v = threadIdx.x;
  uint4 q[kBatch];
#pragma unroll
  for (int m = 0; m < kBatch; ++m) {
    q[m] = m < u.members && v < T.vecs
               ? AdamVec(*u.leaf, A, H, D, (u.first + m) * T.bank_bytes + v * 16)
               : make_uint4(0, 0, 0, 0);
  }
  uint64_t mine = 0;
  ReducePass<false>(T, u, 0, 0, q, make_uint4(0, 0, 0, 0), mine);
  FinishPass<false>(T, u, 0, mine, red, make_uint2(0, 0));
}

// The leaf table in device memory, in one scratch buffer and one copy: the leaves, each leaf's
// first unit (and the total) and, for adamw_guard_many, the update's arrays. A copy from pageable
// host memory is staged before cudaMemcpyAsync returns, so the vectors may go when the handler
// does.
ffi::Error UploadTable(const char* op, const std::vector<ManyLeaf>& leaves,
                       const std::vector<AdamLeaf>* adam, ffi::ScratchAllocator& scratch,
                       cudaStream_t stream, ManyTable* T, int64_t* units) {
  const size_t n = leaves.size();
  std::vector<uint32_t> unit0(n + 1);
  *units = 0;
  for (size_t i = 0; i < n; ++i) {
    unit0[i] = static_cast<uint32_t>(*units);
    *units += leaves[i].ngroups;
    if (*units >= (int64_t{1} << 31)) {
      return BadArg(op, std::to_string(*units) + "+ parity groups in one call; at most 2^31 - 1");
    }
  }
  unit0[n] = static_cast<uint32_t>(*units);
  *T = ManyTable{};
  T->n = static_cast<int>(n);
  if (*units == 0) return ffi::Error::Success();
  const size_t leaf_bytes = n * sizeof(ManyLeaf), unit_bytes = (n + 1) * sizeof(uint32_t);
  const size_t adam_at = CeilDiv(static_cast<int64_t>(leaf_bytes + unit_bytes), 16) * 16;
  const size_t bytes = adam ? adam_at + n * sizeof(AdamLeaf) : leaf_bytes + unit_bytes;
  std::vector<uint8_t> host(bytes);
  std::memcpy(host.data(), leaves.data(), leaf_bytes);
  std::memcpy(host.data() + leaf_bytes, unit0.data(), unit_bytes);
  if (adam) std::memcpy(host.data() + adam_at, adam->data(), n * sizeof(AdamLeaf));
  auto buf = scratch.Allocate(bytes, 16);
  if (!buf.has_value())
    return ffi::Error::Internal(std::string("pimlayers.") + op + ": no scratch memory");
  uint8_t* dev = static_cast<uint8_t*>(*buf);
  if (cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
    return CudaStatus(op);
  }
  T->leaf = reinterpret_cast<const ManyLeaf*>(dev);
  T->unit0 = reinterpret_cast<const uint32_t*>(dev + leaf_bytes);
  T->adam = adam ? reinterpret_cast<const AdamLeaf*>(dev + adam_at) : nullptr;
  return ffi::Error::Success();
}

// casts: verify only (the guard's handler passes an empty span).
template <bool kVerify>
ffi::Error ManyCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
                    int64_t bank_bytes, int64_t group, ffi::Span<const int64_t> casts,
                    ffi::RemainingRets rets) {
  const char* op = kVerify ? "bank_verify_many" : "bank_guard_many";
  std::vector<ManyLeaf> leaves;
  int32_t* count = nullptr;
  if (auto e = kVerify ? CollectVerifyMany(args, rets, bank_bytes, group, casts, &leaves, &count)
                       : CollectGuardMany(args, rets, bank_bytes, group, &leaves);
      e.failure()) {
    return e;
  }
  for (const ManyLeaf& L : leaves) {  // XLA's buffers are aligned; the 16-byte stores need it
    const void* ptrs[] = {L.par_in, L.parity};
    for (const void* q : ptrs) {
      if (reinterpret_cast<uintptr_t>(q) % 16 != 0) {
        return BadArg(op, "a parity buffer is not 16-byte aligned");
      }
    }
  }
  if (kVerify && cudaMemsetAsync(count, 0, sizeof(int32_t), stream) != cudaSuccess) {
    return CudaStatus(op);
  }
  ManyTable T;
  int64_t units = 0;
  if (auto e = UploadTable(op, leaves, nullptr, scratch, stream, &T, &units); e.failure()) return e;
  if (units == 0) return CudaStatus(op);
  T.bank_bytes = bank_bytes, T.vecs = bank_bytes / 16, T.group = group, T.count = count;
  T.nchunks = CeilDiv(T.vecs, kManyThreads);
  return LaunchMany<kVerify>(T, units, stream);
}

ffi::Error GuardManyCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                         ffi::RemainingArgs args, int64_t bank_bytes, int64_t group,
                         ffi::RemainingRets rets) {
  return ManyCuda<false>(stream, std::move(scratch), args, bank_bytes, group, {}, rets);
}

// Operands: p, g, m, v per leaf, then the scalars; results: p', m', v', sums, parity, psums per
// leaf (p', m', v' aliased to p, m, v by the caller, or not: each element is read before its
// thread writes it).
ffi::Error AdamGuardManyCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                             ffi::RemainingArgs args, int64_t bank_bytes, int64_t group,
                             ffi::RemainingRets rets) {
  const char* op = "adamw_guard_many";
  AdamCall C;
  if (auto e = CollectAdamGuardMany(args, rets, bank_bytes, group, &C); e.failure()) return e;
  if (bank_bytes > 16 * kManyThreads || group > kBatch) {
    return BadArg(
        op, "bank_bytes=" + std::to_string(bank_bytes) + ", group=" + std::to_string(group) +
                "; the fused kernel takes banks of at most " + std::to_string(16 * kManyThreads) +
                " bytes in groups of at most " + std::to_string(kBatch));
  }
  ManyTable T;
  int64_t units = 0;
  if (auto e = UploadTable(op, C.leaves, &C.adam, scratch, stream, &T, &units); e.failure()) {
    return e;
  }
  if (units == 0) return CudaStatus(op);
  T.bank_bytes = bank_bytes, T.vecs = bank_bytes / 16, T.group = group, T.count = nullptr;
  T.nchunks = 1, T.hyper = C.hyper;
  AdamGuardKernel<<<static_cast<unsigned>(units), kManyThreads, 0, stream>>>(T);
  return CudaStatus(op);
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankGuardCuda, pimlayers::GuardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()  // multi-chunk counters
                                  .Arg<xla::ffi::AnyBuffer>()    // x: any byte-addressable array
                                  .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
                                  .Attr<int64_t>("group")        // banks per parity group
                                  .Ret<xla::ffi::AnyBuffer>()    // sums: (..., nbanks, 2) u32
                                  .Ret<xla::ffi::AnyBuffer>()    // parity: (..., ngroups, bank) u8
                                  .Ret<xla::ffi::AnyBuffer>());  // parity sums: (..., ngroups, 2)

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankGuardManyCuda, pimlayers::GuardManyCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()  // the leaf table
                                  .RemainingArgs()              // x_i: byte-addressable arrays
                                  .Attr<int64_t>("bank_bytes")  // bank size, multiple of 16
                                  .Attr<int64_t>("group")       // banks per parity group
                                  .RemainingRets());            // sums_i, parity_i, psums_i

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankVerifyManyCuda, pimlayers::ManyCuda<true>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()  // the leaf table
                                  .RemainingArgs()  // x_i, parity_i, sums_i, psums_i
                                  .Attr<int64_t>("bank_bytes")
                                  .Attr<int64_t>("group")
                                  .Attr<xla::ffi::Span<const int64_t>>("casts")  // 0/1 per array
                                  .RemainingRets());  // now_i, bad_i, bad_par_i; count; casts

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAdamwGuardManyCuda, pimlayers::AdamGuardManyCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()  // the leaf table
                                  .RemainingArgs()  // p_i, g_i, m_i, v_i; the scalars
                                  .Attr<int64_t>("bank_bytes")
                                  .Attr<int64_t>("group")
                                  .RemainingRets());  // p_i, m_i, v_i, sums_i, parity_i, psums_i
