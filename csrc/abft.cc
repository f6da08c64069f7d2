// CPU handlers of abft_check, abft_finish and abft_encode (the math and its bound are in abft.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "abft.h"
#include "cpu_isa.h"
#include "parallel.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define PL_SUMS_AVX512 1
#include <immintrin.h>
#endif

namespace pimlayers {
namespace {

// amax: the largest |value| of the block, +inf where not known (a non-finite value was seen): a
// finish in place then skips its gate pass when nothing can be gated.
struct BlockSums {
  double s1, s2, sa;
  int64_t nonfinite, nf_loc;
  float amax;
};

template <FloatKind KI>
BlockSums CarefulSums(const void* y, int64_t j0, int64_t n);

// The three sums of one (row, block) of f16 (f32 and bf16 take the vector pass below). The fast
// pass keeps four independent f64 accumulators (no reassociation needed) and does not look at each
// value: a non-finite value makes a sum non-finite (finite f32 values cannot overflow f64, even
// times j+1), and only then does CarefulSums run.
template <FloatKind KI>
BlockSums SumBlock(const void* y, int64_t j0, int64_t n) {
  double a1[4] = {0, 0, 0, 0}, a2[4] = {0, 0, 0, 0}, aa[4] = {0, 0, 0, 0};
  float amax = 0;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int q = 0; q < 4; ++q) {
      double v = LoadF(y, j0 + j + q, KI);
      a1[q] += v;
      a2[q] += static_cast<double>(j + q + 1) * v;
      aa[q] += std::fabs(v);
      amax = std::max(amax, static_cast<float>(std::fabs(v)));
    }
  }
  for (; j < n; ++j) {
    double v = LoadF(y, j0 + j, KI);
    a1[0] += v;
    a2[0] += static_cast<double>(j + 1) * v;
    aa[0] += std::fabs(v);
    amax = std::max(amax, static_cast<float>(std::fabs(v)));
  }
  BlockSums s{(a1[0] + a1[1]) + (a1[2] + a1[3]),
              (a2[0] + a2[1]) + (a2[2] + a2[3]),
              (aa[0] + aa[1]) + (aa[2] + aa[3]),
              0,
              -1,
              amax};
  if (std::isfinite(s.s1) && std::isfinite(s.s2) && std::isfinite(s.sa)) return s;
  return CarefulSums<KI>(y, j0, n);
}

// One f64 pass that leaves non-finite values out and notes where they are.
template <FloatKind KI>
BlockSums CarefulSums(const void* y, int64_t j0, int64_t n) {
  BlockSums s{0, 0, 0, 0, -1, std::numeric_limits<float>::infinity()};
  for (int64_t j = 0; j < n; ++j) {
    float v = LoadF(y, j0 + j, KI);
    if (!IsFiniteF(v)) {
      ++s.nonfinite;
      s.nf_loc = j;
      continue;
    }
    s.s1 += v;
    s.s2 += static_cast<double>(j + 1) * v;
    s.sa += std::fabs(v);
  }
  return s;
}

// float32 and bfloat16 y: sixteen f32 lanes in two 8-wide vectors (GCC/Clang vector
// extensions: one AVX2 register each in the x86-64-v3 clone, two SSE2 registers in the baseline,
// NEON on ARM; the plain loop was not vectorised and ran 6x slower), the two added and flushed
// into four f64 lanes every 256 values, so no f32 partial sum has more than 32 rounded terms
// (error <= 32 u sum|y|, far inside the check's bound, which already allows for f32 check sums:
// its sqrt(n) term). bf16 values widen to f32 exactly (a 16-bit shift). The positions j + 1 are
// carried as floats, exact below 2^24 (wider blocks take the careful pass). A non-finite sum (a
// non-finite value, or finite values overflowing f32) also sends the block to CarefulSums. The
// largest |v| is kept as bits: non-negative floats order as their bit patterns.
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint16_t H8 __attribute__((vector_size(16)));

inline F4 LoadF4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline F4 AbsF4(F4 v) { return reinterpret_cast<F4>(reinterpret_cast<I4>(v) & 0x7fffffff); }

typedef double D4 __attribute__((vector_size(32)));

// The sum of an 8-lane f32 vector's halves, as four f64 lanes.
inline D4 Widen(F8 v) {
  const D4 lo = {v[0], v[1], v[2], v[3]}, hi = {v[4], v[5], v[6], v[7]};
  return lo + hi;
}

// Eight values as f32 lanes, and one as a float.
__attribute__((always_inline)) inline F8 Load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline F8 Load8(const uint16_t* p) {  // bf16
  H8 h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<F8>(__builtin_convertvector(h, I8) << 16);
}
inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t v) { return Bf16ToF32(v); }

template <typename T>
__attribute__((always_inline)) inline BlockSums SumBlockVec(const T* y, int64_t n) {
  D4 v1 = {0, 0, 0, 0}, v2 = v1, va = v1;
  I8 mx = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  while (j + 16 <= n) {
    F8 a1 = {0, 0, 0, 0, 0, 0, 0, 0}, b1 = a1, a2 = a1, b2 = a1, aa = a1, ba = a1;
    const float p0 = static_cast<float>(j + 1);
    F8 pa = {p0, p0 + 1, p0 + 2, p0 + 3, p0 + 4, p0 + 5, p0 + 6, p0 + 7}, pb = pa + 8;
    const int64_t end = j + std::min<int64_t>(256, (n - j) / 16 * 16);
    for (; j < end; j += 16) {
      const F8 va = Load8(y + j), vb = Load8(y + j + 8);
      const I8 ia = reinterpret_cast<I8>(va) & 0x7fffffff,
               ib = reinterpret_cast<I8>(vb) & 0x7fffffff;
      a1 += va;
      b1 += vb;
      a2 += pa * va;
      b2 += pb * vb;
      aa += reinterpret_cast<F8>(ia);
      ba += reinterpret_cast<F8>(ib);
      mx = mx > ia ? mx : ia;
      mx = mx > ib ? mx : ib;
      pa += 16;
      pb += 16;
    }
    v1 += Widen(a1 + b1);
    v2 += Widen(a2 + b2);
    va += Widen(aa + ba);
  }
  double d1 = (v1[0] + v1[1]) + (v1[2] + v1[3]), d2 = (v2[0] + v2[1]) + (v2[2] + v2[3]);
  double da = (va[0] + va[1]) + (va[2] + va[3]);
  int32_t mbits = 0;
  for (int q = 0; q < 8; ++q) mbits = std::max(mbits, mx[q]);
  float amax;
  std::memcpy(&amax, &mbits, sizeof(amax));
  for (; j < n; ++j) {
    const float f = ToF32(y[j]);
    const double v = f;
    d1 += v;
    d2 += static_cast<double>(j + 1) * v;
    da += std::fabs(v);
    amax = std::max(amax, std::fabs(f));
  }
  return {d1, d2, da, 0, -1, amax};
}

PL_CLONES BlockSums SumBlockF32(const float* y, int64_t n) { return SumBlockVec(y, n); }
// bf16 through the scalar loop ran at ~1.7 GB/s on a 2-core CPU, 0.07x of XLA's read of the same
// bytes (`python -m benchmarks.run --suite finish --m 64`), where f32 ran at ~0.37x.
PL_CLONES BlockSums SumBlockBf16(const uint16_t* y, int64_t n) { return SumBlockVec(y, n); }

template <FloatKind KI>
BlockSums CheckedVecSums(const BlockSums& s, const void* yv, int64_t j0, int64_t n) {
  if (std::isfinite(s.s1) && std::isfinite(s.s2) && std::isfinite(s.sa) && n < (int64_t{1} << 24)) {
    return s;
  }
  return CarefulSums<KI>(yv, j0, n);
}

template <>
BlockSums SumBlock<FloatKind::kF32>(const void* yv, int64_t j0, int64_t n) {
  return CheckedVecSums<FloatKind::kF32>(SumBlockF32(static_cast<const float*>(yv) + j0, n), yv, j0,
                                         n);
}

template <>
BlockSums SumBlock<FloatKind::kBF16>(const void* yv, int64_t j0, int64_t n) {
  return CheckedVecSums<FloatKind::kBF16>(SumBlockBf16(static_cast<const uint16_t*>(yv) + j0, n),
                                          yv, j0, n);
}

#if defined(PL_SUMS_AVX512)
// Every block of a row at once, with AVX-512 (f32 and bf16 y). Per block the sums of SumBlockVec,
// in one 16-lane vector per sum (masked loads for a block's last values: no scalar tail), flushed
// into f64 every 256 values as there. A 128-column block is only 8 steps, so a call per block, its
// returned struct and the checks on it cost as much as the sums: in a loop of finishes of one y in
// cache (f32, 256 x 1024, 128-column blocks, 2-core AMD EPYC, 2026-12-05) 37 us a finish a block
// at a time and 24 us a row at a time (`python -m benchmarks.run --suite cpu-kernels`: its finish
// rows, the first under PIMLAYERS_CPU_ISA=generic).
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace avx512 {

inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load16(const uint16_t* p, __mmask16 m) {  // bf16: widened exactly
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// The 16 lanes' halves added in f32 (as SumBlockVec adds its two 8-wide vectors), then as f64.
inline __m512d Widen(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm512_cvtps_pd(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

template <typename T>
BlockSums Block(const T* y, int64_t n) {
  __m512d d1 = _mm512_setzero_pd(), d2 = d1, da = d1;
  __m512i mx = _mm512_setzero_si512();
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int64_t j = 0; j < n;) {
    __m512 a1 = _mm512_setzero_ps(), a2 = a1, aa = a1;
    __m512 pos = _mm512_add_ps(iota, _mm512_set1_ps(static_cast<float>(j + 1)));
    const int64_t end = std::min<int64_t>(n, j + 256);
    for (; j < end; j += 16) {
      const __mmask16 m = end - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (end - j)) - 1);
      const __m512 v = Load16(y + j, m);
      const __m512i iv = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
      a1 = _mm512_add_ps(a1, v);
      a2 = _mm512_fmadd_ps(pos, v, a2);
      aa = _mm512_add_ps(aa, _mm512_castsi512_ps(iv));
      mx = _mm512_max_epi32(mx, iv);
      pos = _mm512_add_ps(pos, _mm512_set1_ps(16.0f));
    }
    d1 = _mm512_add_pd(d1, Widen(a1));
    d2 = _mm512_add_pd(d2, Widen(a2));
    da = _mm512_add_pd(da, Widen(aa));
  }
  const int32_t mbits = _mm512_reduce_max_epi32(mx);
  float amax;
  std::memcpy(&amax, &mbits, sizeof(amax));
  return {
      _mm512_reduce_add_pd(d1), _mm512_reduce_add_pd(d2), _mm512_reduce_add_pd(da), 0, -1, amax};
}

// Blocks [0, nb) of the row at y (n_all values; the last block may be short).
template <typename T>
void Row(const T* y, int64_t n_all, int64_t block_n, int64_t nb, BlockSums* out) {
  for (int64_t b = 0; b < nb; ++b) {
    out[b] = Block(y + b * block_n, std::min(block_n, n_all - b * block_n));
  }
}

// w stored transposed (abft_encode's transposed=True): the column sums of a block of n rows (row j
// at w + j * ld, k values each), a1[kk] = sum_j v, a2[kk] = sum_j (j + 1) v, aa[kk] = sum_j |v|, in
// f64 and in row order, as EncodeBlocksOfRows' scalar loop adds them (a product, then a sum: the
// same doubles). 32 columns a pass, in registers across the rows: 12 independent chains of adds,
// where the scalar loop kept its sums in memory and ran at two doubles a vector.
inline __m512d Load8d(const float* p, __mmask8 m) {
  return _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, p));
}
inline __m512d Load8d(const uint16_t* p, __mmask8 m) {  // bf16: widened exactly
  return _mm512_cvtps_pd(_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, p)), 16)));
}

template <typename T>
void ColumnSums(const T* w, int64_t ld, int64_t n, int64_t k, double* a1, double* a2, double* aa) {
  constexpr int kV = 4;
  for (int64_t kk = 0; kk < k; kk += 8 * kV) {
    __mmask8 m[kV];
    __m512d s1[kV], s2[kV], sa[kV];
    for (int v = 0; v < kV; ++v) {
      const int64_t left = k - kk - 8 * v;
      m[v] = left >= 8 ? __mmask8(0xff) : left <= 0 ? __mmask8(0) : __mmask8((1u << left) - 1);
      s1[v] = s2[v] = sa[v] = _mm512_setzero_pd();
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m512d pos = _mm512_set1_pd(static_cast<double>(j + 1));
      const T* row = w + j * ld + kk;
#pragma GCC unroll 4
      for (int v = 0; v < kV; ++v) {
        const __m512d x = Load8d(row + 8 * v, m[v]);
        s1[v] = _mm512_add_pd(s1[v], x);
        s2[v] = _mm512_add_pd(s2[v], _mm512_mul_pd(pos, x));
        sa[v] = _mm512_add_pd(sa[v], _mm512_abs_pd(x));
      }
    }
    for (int v = 0; v < kV; ++v) {
      _mm512_mask_storeu_pd(a1 + kk + 8 * v, m[v], s1[v]);
      _mm512_mask_storeu_pd(a2 + kk + 8 * v, m[v], s2[v]);
      _mm512_mask_storeu_pd(aa + kk + 8 * v, m[v], sa[v]);
    }
  }
}

}  // namespace avx512
#pragma GCC pop_options
#endif

// Every block sum of row r of y (f32 or bf16), for CheckedVecSums: the AVX-512 kernel. False
// where there is none (other dtypes, CPUs and compilers): then a SumBlock per block.
template <FloatKind KI>
bool RowSums(const void* y, int64_t r, int64_t n_all, int64_t block_n, int64_t nb, BlockSums* out) {
#if defined(PL_SUMS_AVX512)
  if constexpr (KI == FloatKind::kF32) {
    avx512::Row(static_cast<const float*>(y) + r * n_all, n_all, block_n, nb, out);
    return true;
  } else if constexpr (KI == FloatKind::kBF16) {
    avx512::Row(static_cast<const uint16_t*>(y) + r * n_all, n_all, block_n, nb, out);
    return true;
  }
#endif
  return false;
}

// The column sums of ColumnSums for f32 and bf16 w, with AVX-512. False where there is none.
template <FloatKind KI>
bool BlockColumnSums(const void* w, int64_t row0, int64_t n, int64_t k, double* a1, double* a2,
                     double* aa) {
#if defined(PL_SUMS_AVX512)
  if constexpr (KI == FloatKind::kF32) {
    avx512::ColumnSums(static_cast<const float*>(w) + row0 * k, k, n, k, a1, a2, aa);
    return true;
  } else if constexpr (KI == FloatKind::kBF16) {
    avx512::ColumnSums(static_cast<const uint16_t*>(w) + row0 * k, k, n, k, a1, a2, aa);
    return true;
  }
#endif
  return false;
}

// The gated f32 -> f32 copy of a block: |v| <= min(limit, FLT_MAX) is false exactly for NaN,
// +-Inf and values past the limit; a select per lane, the count from the masks.
inline int GateCopyF32(const float* in, float* out, int64_t n, const GateSpec& g) {
  if (!g.on) {
    std::memcpy(out, in, n * sizeof(float));
    return 0;
  }
  const float lim = std::min(g.limit, std::numeric_limits<float>::max());
  const F4 limv = {lim, lim, lim, lim}, fillv = {g.fill, g.fill, g.fill, g.fill};
  I4 kept = {0, 0, 0, 0};  // -1 per kept lane
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const F4 v = LoadF4(in + j);
    const I4 keep = AbsF4(v) <= limv;
    const F4 o = reinterpret_cast<F4>((reinterpret_cast<I4>(v) & keep) |
                                      (reinterpret_cast<I4>(fillv) & ~keep));
    std::memcpy(out + j, &o, sizeof(o));
    kept += keep;
  }
  int dropped = static_cast<int>(j) + kept[0] + kept[1] + kept[2] + kept[3];
  for (; j < n; ++j) {
    const bool keep = std::fabs(in[j]) <= lim;
    out[j] = keep ? in[j] : g.fill;
    dropped += !keep;
  }
  return dropped;
}

// In place (io.out == io.y, one dtype) the block is only read; a located error is rebuilt and then
// the gate, if on, replaces what must go in the final block, so the count is of stored values. Out
// of place, the gated cast is written as the block is summed and the rebuild corrects the count.
template <FloatKind KI, FloatKind KO>
void RunCpu(const AbftIo& io, const AbftParams& p, const GateSpec& g, bool wide, int64_t r0,
            int64_t r1) {
  const bool write_all = io.out != io.y || KI != KO;
  const GateSpec no_gate{false, 0, 0};
  std::vector<BlockSums> row(wide ? io.nb : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const bool have_row = wide && RowSums<KI>(io.y, r, io.n_all, io.block_n, io.nb, row.data());
    for (int64_t b = 0; b < io.nb; ++b) {
      int dropped = 0;
      const int64_t j0 = r * io.n_all + b * io.block_n;
      const int64_t n =
          io.n_all - b * io.block_n < io.block_n ? io.n_all - b * io.block_n : io.block_n;
      BlockSums s = have_row ? CheckedVecSums<KI>(row[b], io.y, j0, n) : SumBlock<KI>(io.y, j0, n);
      if (write_all && KI == FloatKind::kF32 && KO == FloatKind::kF32) {
        dropped += GateCopyF32(static_cast<const float*>(io.y) + j0,
                               static_cast<float*>(io.out) + j0, n, g);
      } else if (write_all) {
        for (int64_t j = 0; j < n; ++j) {
          StoreF(io.out, j0 + j, GateCast(LoadF(io.y, j0 + j, KI), KO, g, &dropped), KO);
        }
      }
      const int64_t cb = r * io.nb + b, ci = CheckIndex(io, cb);
      const float c1 = io.checks[2 * ci], c2 = io.checks[2 * ci + 1], m = io.mag[ci];
      auto load = [&](int64_t j) { return static_cast<double>(LoadF(io.y, j0 + j, KI)); };
      AbftDecision d = AbftDecide(s.s1, s.s2, s.sa, s.nonfinite, s.nf_loc, c1, c2, m, n, p, load);
      if (d.flag == kAbftCorrected) {
        const AbftFix fix = AbftRebuild(load, n, d.loc, c1, c2, m, p);
        if (fix.ok) {
          const GateSpec& gs = write_all ? g : no_gate;  // in place: gated below
          int before = 0;
          GateCast(LoadF(io.y, j0 + d.loc, KI), KO, gs, &before);  // was it gated in the pass?
          dropped -= before;
          StoreF(io.out, j0 + d.loc, GateCast(fix.value, KO, gs, &dropped), KO);
        } else {
          d.flag = kAbftDetected;
        }
      }
      // In place, a block whose values are all finite and within the limit (its largest |v|, from
      // the sums' pass) has nothing to gate: no second pass. A corrected value is checked again.
      const bool clean = s.amax <= std::min(g.limit, std::numeric_limits<float>::max()) &&
                         d.flag != kAbftCorrected;
      if (!write_all && g.on && clean) {
        // nothing to gate
      } else if (!write_all && g.on && KO == FloatKind::kF32) {
        float* row = static_cast<float*>(io.out) + j0;
        dropped += GateCopyF32(row, row, n, g);
      } else if (!write_all && g.on) {
        for (int64_t j = 0; j < n; ++j) {
          const float v = LoadF(io.out, j0 + j, KO);
          int gone = 0;
          GateCast(v, KO, g, &gone);
          if (gone) StoreF(io.out, j0 + j, g.fill, KO);
          dropped += gone;
        }
      }
      io.flags[cb] = d.flag;
      if (io.counts != nullptr) io.counts[cb] = dropped;
    }
  }
}

template <FloatKind KI>
void RunCpuOut(const AbftIo& io, const AbftParams& p, const GateSpec& g, bool wide, int64_t r0,
               int64_t r1) {
  switch (io.out_kind) {
    case FloatKind::kF32:
      return RunCpu<KI, FloatKind::kF32>(io, p, g, wide, r0, r1);
    case FloatKind::kBF16:
      return RunCpu<KI, FloatKind::kBF16>(io, p, g, wide, r0, r1);
    case FloatKind::kF16:
      return RunCpu<KI, FloatKind::kF16>(io, p, g, wide, r0, r1);
  }
}

void RunRows(const AbftIo& io, const AbftParams& p, const GateSpec& g, bool wide, int64_t r0,
             int64_t r1) {
  switch (io.in_kind) {
    case FloatKind::kF32:
      return RunCpuOut<FloatKind::kF32>(io, p, g, wide, r0, r1);
    case FloatKind::kBF16:
      return RunCpuOut<FloatKind::kBF16>(io, p, g, wide, r0, r1);
    case FloatKind::kF16:
      return RunCpuOut<FloatKind::kF16>(io, p, g, wide, r0, r1);
  }
}

// `wide`: the row sums of AVX-512 (RowSums), where the CPU has it and PIMLAYERS_CPU_ISA allows it.
void RunAbftCpu(const AbftIo& io, const AbftParams& p, const GateSpec& g, bool wide,
                ffi::ThreadPool* pool) {
  ParallelUnits(pool, io.rows, io.rows * io.n_all,
                [io, p, g, wide](int64_t r0, int64_t r1) { RunRows(io, p, g, wide, r0, r1); });
}

// abft_encode: a weight's checksum columns in one pass over it (EncodeIo in abft.h; the reference
// is the pure-JAX abft_encode; f64 sums here, so the two agree to f32 rounding, not bit for bit).

// Rows of w (G, K, N): each (row, block) summed as y's blocks are in the check (with AVX-512 a
// row's blocks in one RowSums call). A non-finite weight makes its sums non-finite (the check then
// reports the GEMM, never trusts it).
template <FloatKind KI>
void EncodeRows(const EncodeIo& io, bool wide, int64_t r0, int64_t r1) {
  std::vector<BlockSums> row(wide ? io.nb : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const bool have_row = wide && RowSums<KI>(io.w, r, io.n, io.block_n, io.nb, row.data());
    for (int64_t b = 0; b < io.nb; ++b) {
      const int64_t j0 = r * io.n + b * io.block_n;
      const int64_t n = std::min(io.block_n, io.n - b * io.block_n);
      BlockSums s = have_row ? CheckedVecSums<KI>(row[b], io.w, j0, n) : SumBlock<KI>(io.w, j0, n);
      if (s.nonfinite > 0) {
        s.s1 = s.s2 = s.sa = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double v = LoadF(io.w, j0 + j, KI);
          s.s1 += v;
          s.s2 += static_cast<double>(j + 1) * v;
          s.sa += std::fabs(v);
        }
      }
      const int64_t o = r * io.nb + b;
      io.sums[2 * o] = static_cast<float>(s.s1);
      io.sums[2 * o + 1] = static_cast<float>(s.s2);
      io.abs_sums[o] = static_cast<float>(s.sa);
    }
  }
}

// w stored transposed, (G, N, K): block b of the operand's columns is a block of w's rows, summed
// row by row into per-k accumulators (contiguous, vectorisable; with AVX-512 in registers,
// ColumnSums), then written out (G, K, nb).
template <FloatKind KI>
void EncodeBlocksOfRows(const EncodeIo& io, bool wide, int64_t u0, int64_t u1) {
  std::vector<double> a1(io.k), a2(io.k), aa(io.k);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t g = u / io.nb, b = u % io.nb;
    const int64_t n = std::min(io.block_n, io.n - b * io.block_n);
    const int64_t row0 = g * io.n + b * io.block_n;
    if (!(wide && BlockColumnSums<KI>(io.w, row0, n, io.k, a1.data(), a2.data(), aa.data()))) {
      std::fill(a1.begin(), a1.end(), 0.0);
      std::fill(a2.begin(), a2.end(), 0.0);
      std::fill(aa.begin(), aa.end(), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t row = (row0 + j) * io.k;
        const double pos = static_cast<double>(j + 1);
        for (int64_t kk = 0; kk < io.k; ++kk) {
          const double v = LoadF(io.w, row + kk, KI);
          a1[kk] += v;
          a2[kk] += pos * v;
          aa[kk] += std::fabs(v);
        }
      }
    }
    for (int64_t kk = 0; kk < io.k; ++kk) {
      const int64_t o = (g * io.k + kk) * io.nb + b;
      io.sums[2 * o] = static_cast<float>(a1[kk]);
      io.sums[2 * o + 1] = static_cast<float>(a2[kk]);
      io.abs_sums[o] = static_cast<float>(aa[kk]);
    }
  }
}

template <FloatKind KI>
void RunEncode(const EncodeIo& io, bool transposed, bool wide, ffi::ThreadPool* pool) {
  const int64_t values = io.groups * io.k * io.n;
  if (transposed) {
    ParallelUnits(pool, io.groups * io.nb, values,
                  [io, wide](int64_t u0, int64_t u1) { EncodeBlocksOfRows<KI>(io, wide, u0, u1); });
  } else {
    ParallelUnits(pool, io.groups * io.k, values,
                  [io, wide](int64_t r0, int64_t r1) { EncodeRows<KI>(io, wide, r0, r1); });
  }
}

ffi::Error AbftEncodeCpu(ffi::ThreadPool pool, ffi::AnyBuffer w, int64_t block_n, bool transposed,
                         ffi::Result<ffi::AnyBuffer> sums, ffi::Result<ffi::AnyBuffer> abs_sums) {
  EncodeIo io;
  if (auto e = CheckEncodeShapes(w, block_n, transposed, *sums, *abs_sums, &io); e.failure()) {
    return e;
  }
  CpuIsa isa;
  if (auto e = CpuIsaFor("abft_encode", &isa); e.failure()) return e;
  const bool wide = isa == CpuIsa::kAvx512;
  if (io.groups * io.k * io.nb == 0) return ffi::Error::Success();
  switch (io.kind) {
    case FloatKind::kF32:
      RunEncode<FloatKind::kF32>(io, transposed, wide, &pool);
      break;
    case FloatKind::kBF16:
      RunEncode<FloatKind::kBF16>(io, transposed, wide, &pool);
      break;
    case FloatKind::kF16:
      RunEncode<FloatKind::kF16>(io, transposed, wide, &pool);
      break;
  }
  return ffi::Error::Success();
}

ffi::Error AbftCheckCpu(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                        ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                        bool correct, bool weighted, ffi::Result<ffi::AnyBuffer> y_out,
                        ffi::Result<ffi::AnyBuffer> flags) {
  FloatKind kind;
  int64_t rows, n_all, nb;
  if (auto e =
          CheckAbftShapes(y, checks, mag, block_n, k, *y_out, *flags, &kind, &rows, &n_all, &nb);
      e.failure())
    return e;
  CpuIsa isa;
  if (auto e = CpuIsaFor("abft_check", &isa); e.failure()) return e;
  void* out = y_out->untyped_data();
  if (out != y.untyped_data()) std::memcpy(out, y.untyped_data(), y.size_bytes());
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
  RunAbftCpu(io, AbftParams{k, u, lam, StorageRoundoff(kind), correct, weighted},
             GateSpec{false, 0, 0}, isa == CpuIsa::kAvx512, &pool);
  return ffi::Error::Success();
}

ffi::Error AbftFinishCpu(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer checks,
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
  CpuIsa isa;
  if (auto e = CpuIsaFor("abft_finish", &isa); e.failure()) return e;
  AbftIo io{y.untyped_data(),
            kind,
            y_out->untyped_data(),
            out_kind,
            static_cast<const float*>(checks.untyped_data()),
            static_cast<const float*>(mag.untyped_data()),
            static_cast<int32_t*>(flags->untyped_data()),
            static_cast<int32_t*>(counts->untyped_data()),
            rows,
            n_all,
            block_n,
            nb,
            ld,
            block_offset};
  RunAbftCpu(io, AbftParams{k, u, lam, StorageRoundoff(kind), correct, weighted},
             GateSpec{gate, fill, limit}, isa == CpuIsa::kAvx512, &pool);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftCheckCpu, pimlayers::AbftCheckCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()   // XLA's intra-op threads
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftFinishCpu, pimlayers::AbftFinishCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()    // XLA's intra-op threads
                                  .Arg<xla::ffi::AnyBuffer>()     // y: (..., M, N) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()     // checks: (..., M, nb, 2) f32
                                  .Arg<xla::ffi::AnyBuffer>()     // mag: (..., M, nb) f32
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftEncodeCpu, pimlayers::AbftEncodeCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()   // XLA's intra-op threads
                                  .Arg<xla::ffi::AnyBuffer>()    // w: (..., K, N) f32|bf16|f16
                                  .Attr<int64_t>("block_n")      // column block width
                                  .Attr<bool>("transposed")      // w stored as (..., N, K)
                                  .Ret<xla::ffi::AnyBuffer>()    // sums: (..., K, nb, 2) f32
                                  .Ret<xla::ffi::AnyBuffer>());  // abs_sums: (..., K, nb) f32
