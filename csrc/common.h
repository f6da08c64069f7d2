// Shared helpers for pimlayers' XLA FFI handlers (CPU and CUDA).
//
// Everything here is header-only and marked PL_HD so that the same numerics run in the C++ CPU
// handlers and in the CUDA kernels: one definition of each rounding and checksum rule.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define PL_HD __host__ __device__ __forceinline__
#else
#define PL_HD inline
#endif

namespace pimlayers {

namespace ffi = xla::ffi;

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    default:
      return "an unsupported dtype";
  }
}

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  if (dims.size() == 1) s += ",";
  return s + ")";
}

inline ffi::Error BadArg(const std::string& op, const std::string& what) {
  return ffi::Error::InvalidArgument("pimlayers." + op + ": " + what);
}

// Product of all dimensions but the last `drop` ones.
inline int64_t LeadingCount(ffi::AnyBuffer::Dimensions dims, size_t drop) {
  int64_t n = 1;
  for (size_t i = 0; i + drop < dims.size(); ++i) n *= dims[i];
  return n;
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- 16-bit float formats, done by hand so host and device round identically -------------------

PL_HD float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
PL_HD uint16_t F32ToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

PL_HD float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: value = man * 2^-24, exact in f32
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    memcpy(&u, &v, 4);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, overflow to inf, NaN to a quiet NaN.
PL_HD uint16_t F32ToF16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // man = round_half_even(|f| * 2^24); exact in f32 arithmetic because |f| < 2^-14.
    float af;
    memcpy(&af, &a, 4);
    float scaled = af * 16777216.0f;
    float fl = floorf(scaled);
    float rem = scaled - fl;
    uint32_t m = static_cast<uint32_t>(fl);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t e = (a >> 23) - 112u;
  uint32_t m = a & 0x7fffffu;
  uint32_t r = (e << 10) | (m >> 13);
  uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// Loads and stores of the three float formats the float ops accept, as f32.
enum class FloatKind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

PL_HD float LoadF(const void* p, int64_t i, FloatKind k) {
  if (k == FloatKind::kF32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return k == FloatKind::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
}

PL_HD void StoreF(void* p, int64_t i, float v, FloatKind k) {
  if (k == FloatKind::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = k == FloatKind::kBF16 ? F32ToBf16(v) : F32ToF16(v);
  }
}

inline bool ToFloatKind(ffi::DataType t, FloatKind* k) {
  switch (t) {
    case ffi::DataType::F32:
      *k = FloatKind::kF32;
      return true;
    case ffi::DataType::BF16:
      *k = FloatKind::kBF16;
      return true;
    case ffi::DataType::F16:
      *k = FloatKind::kF16;
      return true;
    default:
      return false;
  }
}

// Unit roundoff of the storage format (0 for f32: the checks then count f32 rounding elsewhere).
PL_HD float StorageRoundoff(FloatKind k) {
  return k == FloatKind::kBF16 ? 0.00390625f : (k == FloatKind::kF16 ? 0.00048828125f : 0.0f);
}

PL_HD bool IsFiniteF(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return (u & 0x7f800000u) != 0x7f800000u;
}

// ---- Bank checksum: two position-weighted sums modulo the Mersenne prime p = 2^31 - 1 ---------
//
// A bank's bytes are read as little-endian 16-bit words h_0 .. h_{n-1} (a missing last byte reads
// as 0) and the checksum is the pair
//     S1 = sum_i h_i          mod p,      S2 = sum_i (i + 1) h_i   mod p.
// Why this and not CRC32C: both sums are associative, so a GPU reads the bank with wide coalesced
// loads and reduces in any order at memory bandwidth, where a CRC is a serial chain of table
// look-ups. What it guarantees: an error confined to any two 16-bit words changes (S1, S2) — the
// differences d_a, d_b satisfy |d| < 2^16 < p, and d_a + d_b = 0, (a+1) d_a + (b+1) d_b = 0 (mod p)
// force (b - a) d_b = 0, so d_b = 0 since p is prime. That covers every single-bit and every
// double-bit error in a bank and every burst of up to 17 bits; other corruption escapes with
// probability about p^-2 = 2^-62.
constexpr uint32_t kM31 = 0x7fffffffu;

PL_HD uint32_t ModM31(uint64_t x) {
  x = (x & kM31) + (x >> 31);
  x = (x & kM31) + (x >> 31);
  x = (x & kM31) + (x >> 31);
  return x >= kM31 ? static_cast<uint32_t>(x - kM31) : static_cast<uint32_t>(x);
}

PL_HD uint32_t AddM31(uint32_t a, uint32_t b) { return ModM31(static_cast<uint64_t>(a) + b); }

PL_HD uint32_t MulM31(uint32_t a, uint32_t b) {
  return ModM31(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

}  // namespace pimlayers
