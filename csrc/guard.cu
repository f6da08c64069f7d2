// CUDA handler of bank_guard: bank checksums, group parity and parity-row checksums in one read.
//
// Work units: (parity group, chunk of up to 4 KiB of its banks, pass of up to 8 member banks).
// Persistent CTAs copy each unit into shared memory with cp.async, the next unit's copies in
// flight while the current one is reduced (two stages, so loads never wait on arithmetic). Warp w
// holds member w: it sums its own vectors' checksum terms as bank_checksums' kernel does (one warp
// reduction per bank); thread t XORs column t of the staged members into the parity, writes it and
// adds the parity row's terms. Banks of several chunks add their chunks' sums (associative) into
// 64-bit scratch counters with fire-and-forget atomics, reduced mod p by a second small kernel.
#include "cuda_util.h"
#include "guard.h"

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
