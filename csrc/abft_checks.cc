// CPU handler of abft_checks: a GEMM's checks c = x @ sums and mag = |x| @ abs_sums (abft.h) in
// one pass over x. XLA runs them as two GEMMs only 2nb and nb columns wide, with |x| materialised
// in between: on a 2-core CPU at 256 x 256-1024 (f32) that took 0.14-0.63 ms next to a 0.65-1.0 ms
// GEMM, for 2-3% of its flops.
//
// Two kernels. Where the CPU has AVX-512 or AVX2 (and the compiler can target them per function),
// the vector kernel of abft_checks_simd.h: x's values broadcast against a panel whose lanes are the
// check columns, so no horizontal sums per k. A jitted call on a 2-core AMD EPYC (f32, 256 rows,
// 128-column blocks; 2026-12-05, `python -m benchmarks.run --suite cpu-kernels`, its checks rows):
// 27 us with AVX-512 and 37 with AVX2 against 67 for the portable kernel at K = 256, N = 1024
// (nb = 8); 34, 45 and 52 us at K = 1024, N = 256 (nb = 2).
// Elsewhere, and with PIMLAYERS_CPU_ISA=generic (cpu_isa.h), the portable kernel
// below: the 3nb checksum columns as rows of a panel (3nb, K), each pair of x's rows dotted with
// them eight k at a time: a vector of x is loaded once for up to four columns, |x| is a bit mask
// on it, and a narrow check (nb = 1: three columns) costs about one pass over x.
//
// Sums are f32, in lanes added up at the end, where XLA's f32 dot adds in an order of its own;
// the bound (abft.h) covers the rounding of any order.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "cpu_isa.h"
#include "parallel.h"

// The vector kernels (abft_checks_simd.h), built for AVX-512 and AVX2 where the compiler can target
// them per function (GCC on x86-64); elsewhere the portable kernel below runs alone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define PL_CHECKS_SIMD 1
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace pimlayers::avx512 {
struct I {
  using Vec = __m512;
  // 8 rows x 3 vectors: 24 accumulators, 3 panel vectors and x's broadcast in 32 registers.
  static constexpr int L = 16, R = 8, kMaxV = 3;
  static Vec Zero() { return _mm512_setzero_ps(); }
  static Vec Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec Abs(Vec a) { return _mm512_abs_ps(a); }
  // x[0 .. P) repeated L / P times: one broadcast load.
  template <int P>
  static Vec Bcast(const float* p) {
    if constexpr (P == 1) {
      return _mm512_set1_ps(*p);
    } else if constexpr (P == 2) {
      double d;
      std::memcpy(&d, p, sizeof d);
      return _mm512_castpd_ps(_mm512_set1_pd(d));
    } else if constexpr (P == 4) {
      return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
    } else if constexpr (P == 8) {
      return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
    } else {
      return _mm512_loadu_ps(p);
    }
  }
};
#include "abft_checks_simd.h"
}  // namespace pimlayers::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
namespace pimlayers::avx2 {
struct I {
  using Vec = __m256;
  // 4 rows x 3 vectors: 12 accumulators, 3 panel vectors and x's broadcast in 16 registers.
  static constexpr int L = 8, R = 4, kMaxV = 3;
  static Vec Zero() { return _mm256_setzero_ps(); }
  static Vec Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec Abs(Vec a) {
    return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  }
  template <int P>
  static Vec Bcast(const float* p) {
    if constexpr (P == 1) {
      return _mm256_set1_ps(*p);
    } else if constexpr (P == 2) {
      double d;
      std::memcpy(&d, p, sizeof d);
      return _mm256_castpd_ps(_mm256_set1_pd(d));
    } else if constexpr (P == 4) {
      const __m128 q = _mm_loadu_ps(p);
      return _mm256_set_m128(q, q);
    } else {
      return _mm256_loadu_ps(p);
    }
  }
};
#include "abft_checks_simd.h"
}  // namespace pimlayers::avx2
#pragma GCC pop_options
#endif

namespace pimlayers {
namespace {

constexpr int kLanes = 8;
constexpr int kRows = 2;  // rows of x per dot tile
constexpr int kCols = 4;  // panel rows (check columns) per pass over them
// Rows per unit of work (a bf16/f16 or transposed tile is converted to f32 rows at once).
constexpr int kTileRows = 16;
// Eight lanes, any alignment: loads and stores go through these types, never memcpy (GCC 12 kept
// an accumulator whose address memcpy took on the stack, reloading and storing it every step).
typedef float V8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t I8 __attribute__((vector_size(32), aligned(4)));

inline V8 Load8(const float* p) { return *reinterpret_cast<const V8*>(p); }

// out[i][c] = sum_k f(x_i[k]) * t[c][k] for R rows and C panel rows, f = |.| when kAbs.
template <int R, int C, bool kAbs>
__attribute__((always_inline)) inline void Dots(const float* const* x, int64_t k, const float* t,
                                                int64_t ldt, float* const* out) {
  V8 acc[R][C] = {};
  int64_t kk = 0;
  for (; kk + kLanes <= k; kk += kLanes) {
    V8 xv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      xv[i] = Load8(x[i] + kk);
      if (kAbs) xv[i] = reinterpret_cast<V8>(reinterpret_cast<I8>(xv[i]) & 0x7fffffff);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const V8 p = Load8(t + c * ldt + kk);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i][c] += xv[i] * p;
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < C; ++c) {
      float s = ((acc[i][c][0] + acc[i][c][1]) + (acc[i][c][2] + acc[i][c][3])) +
                ((acc[i][c][4] + acc[i][c][5]) + (acc[i][c][6] + acc[i][c][7]));
      for (int64_t j = kk; j < k; ++j) {
        s += (kAbs ? std::fabs(x[i][j]) : x[i][j]) * t[c * ldt + j];
      }
      out[i][c] = s;
    }
  }
}

// Columns [0, n) of one panel in passes of up to kCols.
template <int R, bool kAbs>
__attribute__((always_inline)) inline void Columns(const float* const* x, int64_t k, const float* t,
                                                   int64_t n, float* const* out) {
  for (int64_t j0 = 0; j0 < n; j0 += kCols) {
    const float* tj = t + j0 * k;
    float* o[R];
    for (int i = 0; i < R; ++i) o[i] = out[i] + j0;
    switch (std::min<int64_t>(kCols, n - j0)) {
      case 4:
        Dots<R, 4, kAbs>(x, k, tj, k, o);
        break;
      case 3:
        Dots<R, 3, kAbs>(x, k, tj, k, o);
        break;
      case 2:
        Dots<R, 2, kAbs>(x, k, tj, k, o);
        break;
      default:
        Dots<R, 1, kAbs>(x, k, tj, k, o);
        break;
    }
  }
}

// c and mag of `rows` (1 or 2) f32 rows x[i] (K values each) against the panel t: rows [0, 2nb)
// are c's columns, [2nb, 3nb) mag's.
PL_CLONES void DotTile(const float* const* x, int rows, int64_t k, const float* t, int64_t nb,
                       float* const* c, float* const* mag) {
  if (rows == 2) {
    Columns<2, false>(x, k, t, 2 * nb, c);
    Columns<2, true>(x, k, t + 2 * nb * k, nb, mag);
  } else {
    Columns<1, false>(x, k, t, 2 * nb, c);
    Columns<1, true>(x, k, t + 2 * nb * k, nb, mag);
  }
}

struct Job {
  const void* x;
  FloatKind kind;
  bool transposed;      // x is (G, K, R) rather than (G, R, K)
  int64_t rows, k, nb;  // per group
  CpuIsa isa;
  const float* panel;     // kGeneric: (G, 3nb, K)
  const void* panels;     // kAvx2 / kAvx512: that ISA's Panels
  const float* sums;      // (G, K, nb, 2)
  const float* abs_sums;  // (G, K, nb)
  float* c;               // (G, R, nb, 2)
  float* mag;             // (G, R, nb)
};

// Rows [r0, r0 + rows) of x (one group, from `base`) as f32 rows of xf, `ld` apart.
template <FloatKind KI>
void ToRows(const void* x, int64_t base, bool transposed, int64_t r_all, int64_t k, int64_t r0,
            int64_t rows, float* xf, int64_t ld) {
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = transposed ? kk * r_all + r0 + i : (r0 + i) * k + kk;
      xf[i * ld + kk] = LoadF(x, base + at, KI);
    }
  }
}

// Tiles [t0, t1) of the flattened (group, tile of kTileRows rows) index. f32 rows are read where
// they lie; a bf16/f16 or transposed tile is first written out as f32 rows.
void RunTiles(const Job& j, int64_t t0, int64_t t1) {
  const int64_t tiles = CeilDiv(j.rows, kTileRows);
  const bool direct = j.kind == FloatKind::kF32 && !j.transposed;
  // Rows of the converted tile 64 bytes longer than K: at K = 1024, rows exactly 4 KiB apart fall
  // in one L1 set, and writing a column of 16 of them per k ran 5x slower.
  const int64_t ld = j.k + 16;
  std::vector<float> xf(direct ? 0 : static_cast<size_t>(kTileRows * ld));
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t g = t / tiles, r0 = (t % tiles) * kTileRows;
    const int64_t rows = std::min<int64_t>(kTileRows, j.rows - r0);
    const int64_t base = g * j.rows * j.k;  // x's group offset, either layout
    switch (direct ? -1 : static_cast<int>(j.kind)) {
      case static_cast<int>(FloatKind::kF32):
        ToRows<FloatKind::kF32>(j.x, base, j.transposed, j.rows, j.k, r0, rows, xf.data(), ld);
        break;
      case static_cast<int>(FloatKind::kBF16):
        ToRows<FloatKind::kBF16>(j.x, base, j.transposed, j.rows, j.k, r0, rows, xf.data(), ld);
        break;
      case static_cast<int>(FloatKind::kF16):
        ToRows<FloatKind::kF16>(j.x, base, j.transposed, j.rows, j.k, r0, rows, xf.data(), ld);
        break;
      default:
        break;
    }
#if defined(PL_CHECKS_SIMD)
    if (j.isa != CpuIsa::kGeneric) {
      const float* x[kTileRows];
      float* c[kTileRows];
      float* m[kTileRows];
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = r0 + i;
        x[i] = direct ? static_cast<const float*>(j.x) + base + r * j.k : &xf[i * ld];
        c[i] = j.c + (g * j.rows + r) * 2 * j.nb;
        m[i] = j.mag + (g * j.rows + r) * j.nb;
      }
      if (j.isa == CpuIsa::kAvx512) {
        avx512::Rows(x, rows, j.k, j.nb, j.sums, j.abs_sums,
                     *static_cast<const avx512::Panels*>(j.panels), g, c, m);
      } else {
        avx2::Rows(x, rows, j.k, j.nb, j.sums, j.abs_sums,
                   *static_cast<const avx2::Panels*>(j.panels), g, c, m);
      }
      continue;
    }
#endif
    const float* panel = j.panel + g * 3 * j.nb * j.k;
    for (int64_t i = 0; i < rows; i += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, rows - i));
      const float* x[kRows];
      float* c[kRows];
      float* m[kRows];
      for (int q = 0; q < n; ++q) {
        const int64_t r = r0 + i + q;
        x[q] = direct ? static_cast<const float*>(j.x) + base + r * j.k : &xf[(i + q) * ld];
        c[q] = j.c + (g * j.rows + r) * 2 * j.nb;
        m[q] = j.mag + (g * j.rows + r) * j.nb;
      }
      DotTile(x, n, j.k, panel, j.nb, c, m);
    }
  }
}

ffi::Error AbftChecksCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer sums,
                         ffi::AnyBuffer abs_sums, bool transposed, ffi::Result<ffi::AnyBuffer> c,
                         ffi::Result<ffi::AnyBuffer> mag) {
  FloatKind kind;
  if (!ToFloatKind(x.element_type(), &kind)) {
    return BadArg("abft_checks", std::string("x has dtype ") + DtypeName(x.element_type()) +
                                     "; expected float32, bfloat16 or float16");
  }
  auto xd = x.dimensions(), sd = sums.dimensions(), ad = abs_sums.dimensions();
  // sums (*g, K, nb, 2), abs_sums (*g, K, nb); x (*g, R, K), or (*g, K, R) transposed.
  if (sd.size() < 3 || ad.size() != sd.size() - 1 || xd.size() != sd.size() - 1 ||
      sd[sd.size() - 1] != 2 || sums.element_type() != ffi::DataType::F32 ||
      abs_sums.element_type() != ffi::DataType::F32) {
    return BadArg("abft_checks", "x " + ShapeString(xd) + ", sums " + ShapeString(sd) +
                                     ", abs_sums " + ShapeString(ad) +
                                     "; expected x (..., R, K), float32 sums (..., K, nb, 2) and "
                                     "abs_sums (..., K, nb) with the same leading axes");
  }
  const size_t lead = sd.size() - 3;
  int64_t groups = 1;
  for (size_t i = 0; i < lead; ++i) {
    if (xd[i] != sd[i] || ad[i] != sd[i]) {
      return BadArg("abft_checks", "x " + ShapeString(xd) + " and sums " + ShapeString(sd) +
                                       " differ in their leading axes");
    }
    groups *= sd[i];
  }
  const int64_t k = sd[lead], nb = sd[lead + 1];
  const int64_t xk = transposed ? xd[lead] : xd[lead + 1];
  const int64_t rows = transposed ? xd[lead + 1] : xd[lead];
  if (xk != k || ad[lead] != k || ad[lead + 1] != nb) {
    return BadArg("abft_checks", "x " + ShapeString(xd) + (transposed ? " (transposed)" : "") +
                                     " contracts over " + std::to_string(xk) + "; the checksums " +
                                     ShapeString(sd) + " / " + ShapeString(ad) +
                                     " over K = " + std::to_string(k));
  }
  if (c->element_type() != ffi::DataType::F32 || mag->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(c->element_count()) != groups * rows * nb * 2 ||
      static_cast<int64_t>(mag->element_count()) != groups * rows * nb) {
    return BadArg("abft_checks", "outputs " + ShapeString(c->dimensions()) + " / " +
                                     ShapeString(mag->dimensions()) +
                                     "; expected float32 (..., R, nb, 2) and (..., R, nb)");
  }
  if (groups * rows * nb == 0) return ffi::Error::Success();
  float* c_out = static_cast<float*>(c->untyped_data());
  float* m_out = static_cast<float*>(mag->untyped_data());
  if (k == 0) {
    std::memset(c_out, 0, c->size_bytes());
    std::memset(m_out, 0, mag->size_bytes());
    return ffi::Error::Success();
  }
  const float* s = static_cast<const float*>(sums.untyped_data());
  const float* a = static_cast<const float*>(abs_sums.untyped_data());
  CpuIsa isa;
  if (auto e = CpuIsaFor("abft_checks", &isa); e.failure()) return e;
#if !defined(PL_CHECKS_SIMD)
  isa = CpuIsa::kGeneric;  // this build has no vector kernels
#endif
  std::vector<float> panel;
#if defined(PL_CHECKS_SIMD)
  avx512::Panels panels512;
  avx2::Panels panels2;
  if (isa == CpuIsa::kAvx512) avx512::MakePanels(s, a, groups, k, nb, &panels512);
  if (isa == CpuIsa::kAvx2) avx2::MakePanels(s, a, groups, k, nb, &panels2);
  const void* panels = isa == CpuIsa::kAvx512 ? static_cast<const void*>(&panels512) : &panels2;
#else
  const void* panels = nullptr;
#endif
  if (isa == CpuIsa::kGeneric) {
    // The panel: per group, c's 2nb columns then mag's nb, each as a row of K values.
    panel.resize(static_cast<size_t>(groups * 3 * nb * k));
    for (int64_t g = 0; g < groups; ++g) {
      float* t = &panel[g * 3 * nb * k];
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t j = 0; j < 2 * nb; ++j) t[j * k + kk] = s[(g * k + kk) * 2 * nb + j];
        for (int64_t b = 0; b < nb; ++b) t[(2 * nb + b) * k + kk] = a[(g * k + kk) * nb + b];
      }
    }
  }
  Job job{x.untyped_data(), kind,   transposed, rows, k,     nb,   isa,
          panel.data(),     panels, s,          a,    c_out, m_out};
  // The GEMM these checks belong to does not depend on them, so XLA runs both at once on the same
  // pool: on a 2-core CPU the checks taking the pool's threads made the protected GEMM slower than
  // this thread alone (docs/benchmarks.md). A quarter of the pool, so a many-core CPU still
  // splits a large check.
  ParallelUnits(
      &pool, groups * CeilDiv(rows, kTileRows), groups * rows * k * 3 * nb / kCols,
      [job](int64_t t0, int64_t t1) { RunTiles(job, t0, t1); }, 0.25);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftChecksCpu, pimlayers::AbftChecksCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()   // XLA's intra-op threads
                                  .Arg<xla::ffi::AnyBuffer>()    // x: (..., R, K) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()    // sums: (..., K, nb, 2) f32
                                  .Arg<xla::ffi::AnyBuffer>()    // abs_sums: (..., K, nb) f32
                                  .Attr<bool>("transposed")      // x stored as (..., K, R)
                                  .Ret<xla::ffi::AnyBuffer>()    // c: (..., R, nb, 2) f32
                                  .Ret<xla::ffi::AnyBuffer>());  // mag: (..., R, nb) f32
