// The vector kernel of abft_checks' CPU handler (abft_checks.cc), written once against an ISA's
// traits `I` and built once per ISA: the handler includes this header inside a `#pragma GCC target`
// region for AVX-512 and again for AVX2, each in a namespace of its own that defines `I` first.
//
// The checks are a skinny GEMM: R x K rows of x against a panel of W = 2nb (c, from x) or nb (mag,
// from |x|) columns. XLA's dot ran it at a few percent of the GEMM's rate, and a dot per check
// column (eight k per vector, a horizontal sum per row and column) at a quarter of one core's FMA
// rate. Here every lane of a vector accumulator holds a column, so a row's sums need no horizontal
// step per k:
//   - W >= L (L lanes): one phase. Per k, x[k] is broadcast and multiplied by the panel's row k,
//     W padded up to whole vectors.
//   - W < L: P = L / Wp phases, Wp the power of two >= W. Lane l holds column l / P and phase
//     q = l % P: per step of P k, the vector of x[k .. k+P) repeated Wp times (one broadcast load)
//     is multiplied by the panel's [x's column j, k + q] block. The phases are added at the end, so
//     a row-wise check (nb = 1: W = 2 and 1) costs one FMA per row per L/2 and L values of k.
// `R` rows share each panel load (register blocking); at most `kMaxV` vectors per pass.
//
// Summation order: each lane adds its k in sequence (and the P phases at the end); the bound
// (abft.h) is for any order of f32 sums.

// How one check part (c or mag) lies in this ISA's vectors.
struct PartLayout {
  int64_t w;        // columns
  int p;            // phases (1: one k per step)
  int64_t vectors;  // vectors per step (> 1 only with p == 1)
};

inline PartLayout Layout(int64_t w) {
  if (w >= I::L) return {w, 1, CeilDiv(w, I::L)};
  int64_t wp = 1;
  while (wp < w) wp *= 2;
  return {w, static_cast<int>(I::L / wp), 1};
}

// The panel of a part, `s` its (K, W) row-major sums: per step of p k (K / p steps; the k past the
// last whole step are left to the scalar tail), `vectors` vectors of L lanes, zero past column W.
inline void BuildPanel(const float* s, int64_t k, const PartLayout& lay, float* out) {
  const int64_t steps = k / lay.p, ld = lay.vectors * I::L, wp = ld / lay.p;
  for (int64_t st = 0; st < steps; ++st) {
    float* o = out + st * ld;
    if (lay.p == 1) {
      std::memcpy(o, s + st * lay.w, static_cast<size_t>(lay.w) * sizeof(float));
      std::fill(o + lay.w, o + ld, 0.0f);
      continue;
    }
    for (int q = 0; q < lay.p; ++q) {
      const float* row = s + (st * lay.p + q) * lay.w;
      for (int64_t j = 0; j < wp; ++j) o[j * lay.p + q] = j < lay.w ? row[j] : 0.0f;
    }
  }
}

inline int64_t PanelFloats(int64_t k, const PartLayout& lay) {
  return (k / lay.p) * lay.vectors * I::L;
}

// acc[i][v] over all whole steps for R rows, V vectors from `panel` (`ld` floats per step). With
// fewer than 8 accumulators, even and odd steps go to two sets: an FMA's latency (4 cycles) over 4
// chains capped an AVX2 pass (R = 4, one vector) at half the FMA units' rate (52 -> 36 us at
// 256 x 1024, nb = 2, on one core: a probe of the kernel alone, not kept).
template <int P, int V, bool kAbs>
__attribute__((always_inline)) inline void Steps(const float* const* x, int64_t steps,
                                                 const float* panel, int64_t ld,
                                                 float (*out)[I::kMaxV * I::L]) {
  constexpr int U = V * I::R < 8 ? 2 : 1;
  typename I::Vec acc[I::R][U * V];
#pragma GCC unroll 8
  for (int i = 0; i < I::R; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < U * V; ++v) acc[i][v] = I::Zero();
  }
  auto step = [&](int64_t st, int u) __attribute__((always_inline)) {
    typename I::Vec pv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) pv[v] = I::Load(panel + st * ld + v * I::L);
#pragma GCC unroll 8
    for (int i = 0; i < I::R; ++i) {
      typename I::Vec xv = I::template Bcast<P>(x[i] + st * P);
      if (kAbs) xv = I::Abs(xv);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[i][u * V + v] = I::Fma(xv, pv[v], acc[i][u * V + v]);
    }
  };
  int64_t st = 0;
  for (; st + U <= steps; st += U) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) step(st + u, u);
  }
  if (st < steps) step(st, 0);
  for (int i = 0; i < I::R; ++i) {
    for (int v = 0; v < V; ++v) {
      typename I::Vec sum = acc[i][v];
      for (int u = 1; u < U; ++u) sum = I::Add(sum, acc[i][u * V + v]);
      I::Store(out[i] + v * I::L, sum);
    }
  }
}

template <bool kAbs>
void Pass(const float* const* x, int64_t steps, int p, int v, const float* panel, int64_t ld,
          float (*out)[I::kMaxV * I::L]) {
  switch (p) {
    case 1:
      if (v == 1) return Steps<1, 1, kAbs>(x, steps, panel, ld, out);
      if (v == 2) return Steps<1, 2, kAbs>(x, steps, panel, ld, out);
      return Steps<1, I::kMaxV, kAbs>(x, steps, panel, ld, out);
    case 2:
      return Steps<2, 1, kAbs>(x, steps, panel, ld, out);
    case 4:
      return Steps<4, 1, kAbs>(x, steps, panel, ld, out);
    case 8:
      return Steps<8, 1, kAbs>(x, steps, panel, ld, out);
    default:
      return Steps<I::L, 1, kAbs>(x, steps, panel, ld, out);
  }
}

// One part's columns for `rows` (<= R) rows x[i] of K values: out_rows[i][j], j < W. `s` is the
// part's (K, W) sums (for the k past the last whole step), `panel` its BuildPanel.
template <bool kAbs>
void Part(const float* const* x, int rows, int64_t k, const float* s, const PartLayout& lay,
          const float* panel, float* const* out_rows) {
  alignas(64) float out[I::R][I::kMaxV * I::L];
  const float* xr[I::R];
  for (int i = 0; i < I::R; ++i) xr[i] = x[i < rows ? i : rows - 1];  // spare rows: a repeat
  const int64_t steps = k / lay.p, ld = lay.vectors * I::L, k0 = steps * lay.p;
  for (int64_t v0 = 0; v0 < lay.vectors; v0 += I::kMaxV) {
    const int v = static_cast<int>(std::min<int64_t>(I::kMaxV, lay.vectors - v0));
    Pass<kAbs>(xr, steps, lay.p, v, panel + v0 * I::L, ld, out);
    const int64_t j0 = v0 * I::L, j1 = std::min<int64_t>(lay.w, j0 + v * I::L);
    for (int i = 0; i < rows; ++i) {
      float* o = out_rows[i];
      if (lay.p == 1) {
        std::memcpy(o + j0, out[i], static_cast<size_t>(j1 - j0) * sizeof(float));
      } else {
        for (int64_t j = j0; j < j1; ++j) {
          float sum = 0.0f;
          for (int q = 0; q < lay.p; ++q) sum += out[i][j * lay.p + q];
          o[j] = sum;
        }
      }
      for (int64_t kk = k0; kk < k; ++kk) {  // the k past the last whole step
        const float xv = kAbs ? std::fabs(x[i][kk]) : x[i][kk];
        for (int64_t j = j0; j < j1; ++j) o[j] += xv * s[kk * lay.w + j];
      }
    }
  }
}

// Both parts' panels for every group of checksums: per group c's panel, then mag's.
struct Panels {
  PartLayout c, mag;
  int64_t c_floats, mag_floats;   // per group
  std::unique_ptr<float[]> data;  // every float written by BuildPanel
};

inline void MakePanels(const float* sums, const float* abs_sums, int64_t groups, int64_t k,
                       int64_t nb, Panels* pn) {
  pn->c = Layout(2 * nb);
  pn->mag = Layout(nb);
  pn->c_floats = PanelFloats(k, pn->c);
  pn->mag_floats = PanelFloats(k, pn->mag);
  pn->data.reset(new float[static_cast<size_t>(groups * (pn->c_floats + pn->mag_floats))]);
  for (int64_t g = 0; g < groups; ++g) {
    float* out = pn->data.get() + g * (pn->c_floats + pn->mag_floats);
    BuildPanel(sums + g * k * 2 * nb, k, pn->c, out);
    BuildPanel(abs_sums + g * k * nb, k, pn->mag, out + pn->c_floats);
  }
}

// c (2nb values per row) and mag (nb) of `rows` f32 rows x[i] (K values each) of group g.
inline void Rows(const float* const* x, int64_t rows, int64_t k, int64_t nb, const float* sums,
                 const float* abs_sums, const Panels& pn, int64_t g, float* const* c,
                 float* const* mag) {
  const float* panel = pn.data.get() + g * (pn.c_floats + pn.mag_floats);
  for (int64_t i = 0; i < rows; i += I::R) {
    const int n = static_cast<int>(std::min<int64_t>(I::R, rows - i));
    Part<false>(x + i, n, k, sums + g * k * 2 * nb, pn.c, panel, c + i);
    Part<true>(x + i, n, k, abs_sums + g * k * nb, pn.mag, panel + pn.c_floats, mag + i);
  }
}
