// CPU handlers of bank_guard, bank_guard_many, bank_verify_many and adamw_guard_many. bank_guard:
// per parity group, each member bank is read once, in blocks that stay in L1, for its XOR into the
// group's parity row and its checksum; then the parity row's checksum.
#include <cmath>
#include <cstring>

#include "adam_guard.h"
#include "guard_many.h"

namespace pimlayers {
namespace {

constexpr int64_t kBlock = 4096;  // bytes per pass; even, so a block starts on a word

// Adds to (a, b) the checksum terms (common.h) of bytes p[0, n) of a bank, whose first word is word
// w0 of the bank; a and b stay reduced mod p. n is even except for the last bytes of a bank.
void ChecksumBlock(const uint8_t* p, int64_t n, int64_t w0, uint64_t* a, uint64_t* b) {
  uint64_t sa = 0, sb = 0;  // sb weights words by block position k + 1: below 2048^2 * 2^16 = 2^38
  const int64_t whole = n / 2;
  for (int64_t k = 0; k < whole; ++k) {
    uint64_t h = p[2 * k] | (static_cast<uint32_t>(p[2 * k + 1]) << 8);
    sa += h;
    sb += static_cast<uint64_t>(k + 1) * h;
  }
  if (n % 2) {  // a missing high byte reads as 0
    sa += p[n - 1];
    sb += static_cast<uint64_t>(whole + 1) * p[n - 1];
  }
  // Word k's weight in the bank is w0 + k + 1: the block adds sb + w0 * sa (< 2^30 * 2^27 + 2^38).
  *a = ModM31(*a + sa);
  *b = ModM31(*b + sb + static_cast<uint64_t>(w0) * sa);
}

// Checksum of bytes p[0, n) of one bank (or parity row) into out[0..1].
void ChecksumRow(const uint8_t* p, int64_t n, uint32_t* out) {
  uint64_t s1 = 0, s2 = 0;
  for (int64_t j = 0; j < n; j += kBlock)
    ChecksumBlock(p + j, n - j < kBlock ? n - j : kBlock, j / 2, &s1, &s2);
  out[0] = static_cast<uint32_t>(s1);
  out[1] = static_cast<uint32_t>(s2);
}

// Checksums (so), parity (po) and parity checksums (pso) of one example's `bytes` bytes.
void GuardOne(const uint8_t* ex, int64_t bytes, int64_t nbanks, int64_t ngroups, int64_t bank_bytes,
              int64_t group, uint32_t* so, uint8_t* po, uint32_t* pso) {
  for (int64_t g = 0; g < ngroups; ++g) {
    uint8_t* row = po + g * bank_bytes;
    std::memset(row, 0, bank_bytes);
    for (int64_t b = g * group; b < (g + 1) * group && b < nbanks; ++b) {
      const int64_t off = b * bank_bytes;
      const int64_t n = bytes - off < bank_bytes ? bytes - off : bank_bytes;
      const uint8_t* src = ex + off;
      uint64_t s1 = 0, s2 = 0;
      for (int64_t j = 0; j < n; j += kBlock) {
        const int64_t len = n - j < kBlock ? n - j : kBlock;
        for (int64_t k = 0; k < len; ++k) row[j + k] ^= src[j + k];
        ChecksumBlock(src + j, len, j / 2, &s1, &s2);
      }
      so[2 * b] = static_cast<uint32_t>(s1);
      so[2 * b + 1] = static_cast<uint32_t>(s2);
    }
    ChecksumRow(row, bank_bytes, pso + 2 * g);
  }
}

ffi::Error GuardCpu(ffi::AnyBuffer x, int64_t bank_bytes, int64_t group,
                    ffi::Result<ffi::AnyBuffer> sums, ffi::Result<ffi::AnyBuffer> parity,
                    ffi::Result<ffi::AnyBuffer> psums) {
  ParityLayout P;
  if (auto e = MakeGuardLayout(x, *sums, *parity, *psums, bank_bytes, group, &P); e.failure())
    return e;
  const BankLayout& L = P.banks;
  const uint8_t* in = static_cast<const uint8_t*>(x.untyped_data());
  uint32_t* so = static_cast<uint32_t*>(sums->untyped_data());
  uint8_t* po = static_cast<uint8_t*>(parity->untyped_data());
  uint32_t* pso = static_cast<uint32_t*>(psums->untyped_data());
  for (int64_t e = 0; e < L.batch; ++e) {
    GuardOne(in + e * L.bytes, L.bytes, L.nbanks, P.ngroups, bank_bytes, group,
             so + 2 * e * L.nbanks, po + e * P.ngroups * bank_bytes, pso + 2 * e * P.ngroups);
  }
  return ffi::Error::Success();
}

ffi::Error GuardManyCpu(ffi::RemainingArgs args, int64_t bank_bytes, int64_t group,
                        ffi::RemainingRets rets) {
  std::vector<ManyLeaf> leaves;
  if (auto e = CollectGuardMany(args, rets, bank_bytes, group, &leaves); e.failure()) return e;
  for (const ManyLeaf& L : leaves) {
    GuardOne(L.x, L.bytes, L.nbanks, L.ngroups, bank_bytes, group, L.sums, L.parity, L.psums);
  }
  return ffi::Error::Success();
}

// float32 bits rounded to bfloat16 bits as XLA's convert rounds: to nearest, ties to even (the
// carry out of the low half adds one to the kept half); a NaN stays a NaN, quieted.
uint16_t Bf16Bits(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

ffi::Error VerifyManyCpu(ffi::RemainingArgs args, int64_t bank_bytes, int64_t group,
                         ffi::Span<const int64_t> casts, ffi::RemainingRets rets) {
  std::vector<ManyLeaf> leaves;
  int32_t* count = nullptr;
  if (auto e = CollectVerifyMany(args, rets, bank_bytes, group, casts, &leaves, &count);
      e.failure())
    return e;
  int64_t faulty = 0;
  for (const ManyLeaf& L : leaves) {
    for (int64_t b = 0; b < L.nbanks; ++b) {
      const int64_t off = b * bank_bytes;
      ChecksumRow(L.x + off, L.bytes - off < bank_bytes ? L.bytes - off : bank_bytes,
                  L.sums + 2 * b);
      const bool bad =
          L.sums[2 * b] != L.sums_in[2 * b] || L.sums[2 * b + 1] != L.sums_in[2 * b + 1];
      L.bad[b] = bad;
      faulty += bad;
    }
    for (int64_t g = 0; g < L.ngroups; ++g) {
      uint32_t now[2];
      ChecksumRow(L.par_in + g * bank_bytes, bank_bytes, now);
      const bool bad = now[0] != L.psums_in[2 * g] || now[1] != L.psums_in[2 * g + 1];
      L.bad_par[g] = bad;
      faulty += bad;
    }
    for (int64_t i = 0; L.cast != nullptr && i < L.bytes / 4; ++i) {
      uint32_t u;
      std::memcpy(&u, L.x + 4 * i, 4);
      L.cast[i] = Bf16Bits(u);
    }
  }
  *count = static_cast<int32_t>(faulty);
  return ffi::Error::Success();
}

// The kernel's twin on the CPU (the training step's default there is XLA's update, then
// bank_guard_many: optax's arithmetic; this one is reached with impl="native"): each leaf updated
// value by value, then guarded from the values written.
ffi::Error AdamGuardManyCpu(ffi::RemainingArgs args, int64_t bank_bytes, int64_t group,
                            ffi::RemainingRets rets) {
  AdamCall C;
  if (auto e = CollectAdamGuardMany(args, rets, bank_bytes, group, &C); e.failure()) return e;
  const std::vector<ManyLeaf>& leaves = C.leaves;
  const std::vector<AdamLeaf>& adam = C.adam;
  AdamHyper H;
  std::memcpy(&H, C.hyper, sizeof(H));
  const AdamDerived D = Derive(H);
  for (size_t i = 0; i < leaves.size(); ++i) {
    const ManyLeaf& L = leaves[i];
    const AdamLeaf& A = adam[i];
    const int64_t n = L.bytes / 4;
    for (int64_t e = 0; e < n; ++e) {
      float g;
      if (A.g_bf16) {
        const uint32_t bits = uint32_t{static_cast<const uint16_t*>(A.g)[e]} << 16;
        std::memcpy(&g, &bits, 4);
      } else {
        g = static_cast<const float*>(A.g)[e];
      }
      float m = A.m[e], v = A.v[e];
      A.p_out[e] = AdamOne(H, D, A.p[e], g, m, v);
      A.m_out[e] = m, A.v_out[e] = v;
    }
    GuardOne(reinterpret_cast<const uint8_t*>(A.p_out), L.bytes, L.nbanks, L.ngroups, bank_bytes,
             group, L.sums, L.parity, L.psums);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankGuardCpu, pimlayers::GuardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()    // x: any byte-addressable array
                                  .Attr<int64_t>("bank_bytes")   // bank size, multiple of 16
                                  .Attr<int64_t>("group")        // banks per parity group
                                  .Ret<xla::ffi::AnyBuffer>()    // sums: (..., nbanks, 2) u32
                                  .Ret<xla::ffi::AnyBuffer>()    // parity: (..., ngroups, bank) u8
                                  .Ret<xla::ffi::AnyBuffer>());  // parity sums: (..., ngroups, 2)

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankGuardManyCpu, pimlayers::GuardManyCpu,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()              // x_i: byte-addressable arrays
                                  .Attr<int64_t>("bank_bytes")  // bank size, multiple of 16
                                  .Attr<int64_t>("group")       // banks per parity group
                                  .RemainingRets());            // sums_i, parity_i, psums_i

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlBankVerifyManyCpu, pimlayers::VerifyManyCpu,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()  // x_i, parity_i, sums_i, psums_i
                                  .Attr<int64_t>("bank_bytes")
                                  .Attr<int64_t>("group")
                                  .Attr<xla::ffi::Span<const int64_t>>("casts")  // 0/1 per array
                                  .RemainingRets());  // now_i, bad_i, bad_par_i; count; casts

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAdamwGuardManyCpu, pimlayers::AdamGuardManyCpu,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()  // p_i, g_i, m_i, v_i; the scalars
                                  .Attr<int64_t>("bank_bytes")
                                  .Attr<int64_t>("group")
                                  .RemainingRets());  // p_i, m_i, v_i, sums_i, parity_i, psums_i
