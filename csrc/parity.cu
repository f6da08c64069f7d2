// CUDA handlers of parity and reconstruct: one thread per 16 bytes of a parity bank; each data byte
// is read once (parity) or once per rebuilt bank (reconstruct).
#include "cuda_util.h"
#include "parity.h"

namespace pimlayers {
namespace {

// XOR of 16 bytes at byte `j` of every bank of group g except `skip`, starting from `acc`.
__device__ __forceinline__ uint4 XorGroup(const uint8_t* ex, int64_t bytes, int64_t bank_bytes,
                                          int64_t nbanks, int64_t g, int64_t group, int64_t j,
                                          int64_t skip, uint4 acc) {
  for (int64_t m = g * group; m < (g + 1) * group && m < nbanks; ++m) {
    if (m == skip) continue;
    const int64_t off = m * bank_bytes + j;
    if (off + 16 <= bytes && reinterpret_cast<uintptr_t>(ex + off) % 16 == 0) {
      uint4 q = *reinterpret_cast<const uint4*>(ex + off);
      acc.x ^= q.x, acc.y ^= q.y, acc.z ^= q.z, acc.w ^= q.w;
    } else {
      uint8_t t[16];
      memcpy(t, &acc, 16);
      for (int k = 0; k < 16; ++k) t[k] ^= BankByte(ex, bytes, bank_bytes, m, j + k);
      memcpy(&acc, t, 16);
    }
  }
  return acc;
}

__global__ void ParityKernel(const uint8_t* __restrict__ x, int64_t bytes, int64_t bank_bytes,
                             int64_t nbanks, int64_t group, int64_t ngroups, int64_t total,
                             uint8_t* __restrict__ parity) {
  const int64_t vecs = bank_bytes / 16;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = t % vecs, eg = t / vecs, g = eg % ngroups, e = eg / ngroups;
    uint4 acc = XorGroup(x + e * bytes, bytes, bank_bytes, nbanks, g, group, v * 16, -1,
                         make_uint4(0, 0, 0, 0));
    reinterpret_cast<uint4*>(parity)[t] = acc;  // parity rows are bank_bytes (16k) long
  }
}

__global__ void ReconstructKernel(uint8_t* __restrict__ x, int64_t bytes, int64_t bank_bytes,
                                  int64_t nbanks, int64_t group, int64_t ngroups, int64_t total,
                                  const uint8_t* __restrict__ parity,
                                  const int32_t* __restrict__ lost) {
  const int64_t vecs = bank_bytes / 16;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = t % vecs, eg = t / vecs, g = eg % ngroups, e = eg / ngroups;
    const int64_t l = lost[eg], b = g * group + l;
    if (l < 0 || l >= group || b >= nbanks) continue;  // nothing lost in this group
    uint8_t* ex = x + e * bytes;
    uint4 acc = XorGroup(ex, bytes, bank_bytes, nbanks, g, group, v * 16, b,
                         reinterpret_cast<const uint4*>(parity)[t]);
    const int64_t off = b * bank_bytes + v * 16;
    if (off + 16 <= bytes && reinterpret_cast<uintptr_t>(ex + off) % 16 == 0) {
      *reinterpret_cast<uint4*>(ex + off) = acc;
    } else {
      uint8_t tb[16];
      memcpy(tb, &acc, 16);
      for (int k = 0; k < 16 && off + k < bytes; ++k) ex[off + k] = tb[k];
    }
  }
}

ffi::Error ParityCuda(cudaStream_t stream, ffi::AnyBuffer x, int64_t bank_bytes, int64_t group,
                      ffi::Result<ffi::AnyBuffer> parity) {
  ParityLayout P;
  if (auto e = MakeParityLayout("parity", x, *parity, bank_bytes, group, &P); e.failure()) return e;
  const BankLayout& L = P.banks;
  int64_t total = L.batch * P.ngroups * (bank_bytes / 16);
  if (total > 0) {
    ParityKernel<<<GridFor(total, 256), 256, 0, stream>>>(
        static_cast<const uint8_t*>(x.untyped_data()), L.bytes, bank_bytes, L.nbanks, group,
        P.ngroups, total, static_cast<uint8_t*>(parity->untyped_data()));
  }
  return CudaStatus("parity");
}

ffi::Error ReconstructCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer parity,
                           ffi::AnyBuffer lost, int64_t bank_bytes, int64_t group,
                           ffi::Result<ffi::AnyBuffer> out) {
  ParityLayout P;
  if (auto e = MakeParityLayout("reconstruct", x, parity, bank_bytes, group, &P); e.failure())
    return e;
  const BankLayout& L = P.banks;
  if (out->element_type() != x.element_type() || out->size_bytes() != x.size_bytes()) {
    return BadArg("reconstruct", "output must have x's dtype and shape");
  }
  if (lost.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(lost.element_count()) != L.batch * P.ngroups) {
    return BadArg("reconstruct", "lost must be int32 of shape (..., " + std::to_string(P.ngroups) +
                                     "), got " + DtypeName(lost.element_type()) +
                                     ShapeString(lost.dimensions()));
  }
  uint8_t* o = static_cast<uint8_t*>(out->untyped_data());
  if (o != x.untyped_data() && x.size_bytes() > 0) {
    cudaMemcpyAsync(o, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  }
  int64_t total = L.batch * P.ngroups * (bank_bytes / 16);
  if (total > 0) {
    ReconstructKernel<<<GridFor(total, 256), 256, 0, stream>>>(
        o, L.bytes, bank_bytes, L.nbanks, group, P.ngroups, total,
        static_cast<const uint8_t*>(parity.untyped_data()),
        static_cast<const int32_t*>(lost.untyped_data()));
  }
  return CudaStatus("reconstruct");
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlParityCuda, pimlayers::ParityCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: any byte-addressable array
                                  .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
                                  .Attr<int64_t>("group")        // banks per parity group
                                  .Ret<xla::ffi::AnyBuffer>());  // (..., ngroups, bank_bytes) u8

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PlReconstructCuda, pimlayers::ReconstructCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()    // x: the damaged array
        .Arg<xla::ffi::AnyBuffer>()    // parity: (..., ngroups, bank_bytes)
        .Arg<xla::ffi::AnyBuffer>()    // lost: (..., ngroups) int32, -1 none
        .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
        .Attr<int64_t>("group")        // banks per parity group
        .Ret<xla::ffi::AnyBuffer>());  // x repaired (aliases x)
