// CUDA handler of bank_checksums: one warp per bank, 16-byte coalesced loads, sums mod 2^31-1.
#include "banks.h"
#include "cuda_util.h"

namespace pimlayers {
namespace {

// Fold a 64-bit accumulator towards 31 bits without a full reduction (keeps it below 2^35).
__device__ __forceinline__ uint64_t Fold(uint64_t x) { return (x & kM31) + (x >> 31); }

__global__ void ChecksumKernel(const uint8_t* __restrict__ x, int64_t bytes, int64_t bank_bytes,
                               int64_t nbanks, int64_t total_banks, uint32_t* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       w < total_banks; w += warps) {
    const int64_t e = w / nbanks, b = w % nbanks;
    const int64_t off = b * bank_bytes;
    const int64_t n = bytes - off < bank_bytes ? bytes - off : bank_bytes;
    const uint8_t* p = x + e * bytes + off;
    uint64_t a = 0, s = 0;
    int64_t nvec = (reinterpret_cast<uintptr_t>(p) % 16 == 0) ? n / 16 : 0;
    for (int64_t v = lane; v < nvec; v += 32) {
      uint4 q = reinterpret_cast<const uint4*>(p)[v];
      uint32_t wds[4] = {q.x, q.y, q.z, q.w};
      uint32_t hs = 0, hq = 0;  // sum h_q and sum q*h_q over the 8 half-words of this vector
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint32_t lo = wds[t] & 0xffffu, hi = wds[t] >> 16;
        hs += lo + hi;
        hq += (2 * t) * lo + (2 * t + 1) * hi;
      }
      // Words 8v+q carry weight 8v+q+1: sum = (8v+1)*hs + hq. (8v+1) < 2^29, hs < 2^19.
      a += hs;
      s = Fold(s + static_cast<uint64_t>(8 * v + 1) * hs + hq);
    }
    // Tail (or the whole bank when unaligned): one half-word per lane.
    for (int64_t i = nvec * 8 + lane; 2 * i < n; i += 32) {
      uint64_t h = HalfwordAt(p, n, i);
      a += h;
      s = Fold(s + static_cast<uint64_t>(i + 1) * h);
    }
    uint32_t s1 = WarpSumM31(ModM31(a));
    uint32_t s2 = WarpSumM31(ModM31(s));
    if (lane == 0) {
      out[2 * w] = s1;
      out[2 * w + 1] = s2;
    }
  }
}

ffi::Error ChecksumCuda(cudaStream_t stream, ffi::AnyBuffer x, int64_t bank_bytes,
                        ffi::Result<ffi::AnyBuffer> out) {
  auto od = out->dimensions();
  if (out->element_type() != ffi::DataType::U32 || od.size() < 2 || od[od.size() - 1] != 2) {
    return BadArg("bank_checksums", "output must be uint32 of shape (..., nbanks, 2)");
  }
  BankLayout L;
  if (auto e = MakeLayout("bank_checksums", x, bank_bytes, LeadingCount(od, 2), &L); e.failure())
    return e;
  if (od[od.size() - 2] != L.nbanks) {
    return BadArg("bank_checksums", "output has " + std::to_string(od[od.size() - 2]) +
                                        " banks; the layout has " + std::to_string(L.nbanks));
  }
  int64_t total = L.batch * L.nbanks;
  if (total > 0) {
    ChecksumKernel<<<GridFor(total, 8), 256, 0, stream>>>(
        static_cast<const uint8_t*>(x.untyped_data()), L.bytes, L.bank_bytes, L.nbanks, total,
        static_cast<uint32_t*>(out->untyped_data()));
  }
  return CudaStatus("bank_checksums");
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankChecksumsCuda, pimlayers::ChecksumCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: any byte-addressable array
                                  .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
                                  .Ret<xla::ffi::AnyBuffer>());  // (..., nbanks, 2) uint32
