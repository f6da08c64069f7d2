// ABFT check of a GEMM output y = x @ w against its weighted checksums (Huang & Abraham 1984).
//
// For output row i and column block b (columns j = 0 .. n-1 of that block, n <= block_n), the
// caller computed, from the weight's encoded checksum columns,
//     c1 = x_i . (sum_j w_:j),   c2 = x_i . (sum_j (j+1) w_:j),   mag = |x_i| . (sum_j |w_:j|).
// The check forms r1 = sum_j y_ij - c1 and r2 = sum_j (j+1) y_ij - c2.
//
// Bound. With f32 accumulation (unit roundoff u) every quantity above is a sum of at most
// K + n rounded terms bounded by mag. Higham & Mary's probabilistic analysis (SIAM J. Sci. Comput.
// 2019) bounds such an error by lam * sqrt(terms) * u * (sum of magnitudes) except with probability
// about 2 exp(-lam^2 / 2) per sum (lam = 8: 2.5e-14). So
//     B1 = lam * u * (sqrt(K) + sqrt(n) + 2) * mag  +  u_y * sum_j |y_ij|
// where the last term is the rounding of y to its storage dtype (0 for f32, 2^-8 for bf16).
// Weights are at most n, so r2 is held to B2 = n * B1. A block is "detected" when |r1| > B1,
// |r2| > B2, or it holds a non-finite value. Without c2 (AbftParams::weighted false) r1 alone
// decides, and nothing is located.
//
// Location. One wrong value e at column j gives r1 = e + n1, r2 = (j+1) e + n2 with |n1| <= B1,
// |n2| <= B2, so |r2/r1 - (j+1)| <= (B2 + n B1) / |r1| = 2 n B1 / |r1|: the rounded ratio names j
// for certain once |r1| > 4 n B1. Smaller detected errors, and ratios that name no column, are
// "detected, not corrected" (the caller recomputes). A single non-finite value is located by
// itself. The corrected value is rebuilt from the checksum, c1 - sum_{k != j} y_ik, never by
// subtracting a (possibly huge or non-finite) residual, and the rebuilt block is checked again
// (AbftRebuild): a block that fails is "detected" after all.
#pragma once

#include <optional>

#include "common.h"

namespace pimlayers {

enum AbftFlag : int32_t { kAbftClean = 0, kAbftCorrected = 1, kAbftDetected = 2 };

struct AbftDecision {
  int32_t flag;
  int64_t loc;  // column within the block to rebuild when flag == kAbftCorrected
};

struct AbftParams {
  int64_t k;
  float u;
  float lam;
  float u_y;
  bool correct;
  // Whether c2 (the position-weighted checks) was formed. Without it (FaultPolicy(weighted_checks=
  // False)) a block is judged on r1 alone and nothing is located: every detected block goes to the
  // caller's recompute. c2 is not read (its slot may hold anything).
  bool weighted;
};

// The bound's floor for subnormal values. A GEMM may flush subnormal operands or products to zero
// (XLA's CPU kernels run with flush-to-zero; GPU tensor cores too) where the checks keep them, or
// the other way round: each of the K products and n sums can then differ by up to the smallest
// normal f32, FLT_MIN, while a block of subnormal values has a mag (and so a relative bound) that
// underflows to 0. Seen in the CPU training step (llama3_small, f32): after ~160 steps attention's
// dQ = dS·K checks failed on blocks of subnormal dS (a pure-JAX check of the same blocks, in XLA's
// arithmetic, passed them), and about a third of the steps were skipped as uncorrectable; with the
// floor, none. (K + n + 2)·FLT_MIN is ~1e-35 at these sizes: no error that matters hides under it.
PL_HD float AbftFloor(int64_t k, int64_t n) {
  return static_cast<float>(k + n + 2) * 1.17549435e-38f;
}

PL_HD float AbftBound(float mag, double sum_abs, int64_t n, const AbftParams& p) {
  return p.lam * p.u * (sqrtf(static_cast<float>(p.k)) + sqrtf(static_cast<float>(n)) + 2.0f) *
             mag +
         p.u_y * static_cast<float>(sum_abs) + AbftFloor(p.k, n);
}

// `load(j)` reads the block's value j (as stored): needed only to locate an error in a rounded
// (bf16/f16) y, where the candidate's own magnitude leaves the bound (see below).
template <typename LoadFn>
PL_HD AbftDecision AbftDecide(double s1, double s2, double sum_abs, int64_t nonfinite,
                              int64_t nonfinite_loc, float c1, float c2, float mag, int64_t n,
                              const AbftParams& p, LoadFn load) {
  AbftDecision d{kAbftClean, -1};
  float b1 = AbftBound(mag, sum_abs, n, p);
  double nd = static_cast<double>(n);
  if (nonfinite > 0) {
    // The sums leave the non-finite element out, so r1 = -y_loc and r2 = -(loc + 1) y_loc when it
    // is the only error; anything else in the block breaks that proportion (see below).
    double r1 = s1 - static_cast<double>(c1), r2 = s2 - static_cast<double>(c2);
    double tol = 2.0 * nd * b1 + 4.0 * nd * nd * fabs(r1) * 2.220446049250313e-16;
    bool single = fabs(r2 - static_cast<double>(nonfinite_loc + 1) * r1) <= tol;
    if (nonfinite == 1 && p.correct && p.weighted && IsFiniteF(c1) && IsFiniteF(c2) && single) {
      return {kAbftCorrected, nonfinite_loc};
    }
    return {kAbftDetected, -1};
  }
  double r1 = s1 - static_cast<double>(c1);
  double r2 = s2 - static_cast<double>(c2);
  bool bad_inputs = !IsFiniteF(c1) || (p.weighted && !IsFiniteF(c2)) || !IsFiniteF(mag);
  bool within2 = !p.weighted || fabs(r2) <= static_cast<double>(n) * b1;
  if (!bad_inputs && fabs(r1) <= b1 && within2) return d;
  if (!p.correct || !p.weighted || bad_inputs) return {kAbftDetected, -1};
  double j = rint(r2 / r1) - 1.0;
  if (!(j >= 0.0 && j < static_cast<double>(n))) return {kAbftDetected, -1};
  // A rounded y's term u_y * sum |y| holds the wrong value's own magnitude, which would keep any
  // error from being located (4 n u_y |e| > |e| for n = 128 in bf16). But everything at column j
  // (the error and its rounding) is the one error the location test assumes; only the other
  // values' rounding is noise. So the candidate's magnitude leaves the bound; a wrong candidate
  // is caught by the rebuilt block's check (AbftRebuild), whose bound counts every value.
  if (p.u_y > 0) {
    const double rest = sum_abs - fabs(load(static_cast<int64_t>(j)));
    b1 = AbftBound(mag, rest > 0 ? rest : 0.0, n, p);
  }
  if (!(fabs(r1) > 4.0 * static_cast<double>(n) * b1)) return {kAbftDetected, -1};
  // One error e at column j leaves r2 = (j + 1) r1 up to rounding: the checksums' (|r1| <= b1,
  // |r2| <= n b1) and the f64 sums' (n terms of at most n |e|). Two errors of very different size
  // also point at a column; their remainder (b - a) e_b exceeds this, and the block goes to
  // recompute instead of being "corrected" wrongly.
  double tol = 2.0 * nd * b1 + 4.0 * nd * nd * fabs(r1) * 2.220446049250313e-16;
  if (!(fabs(r2 - (j + 1.0) * r1) <= tol)) return {kAbftDetected, -1};
  return {kAbftCorrected, static_cast<int64_t>(j)};
}

// The rare correction of the located value at `loc`: c1 - (sum of the others), re-summed from y
// without it (subtracting a possibly huge wrong value from s1 would cancel catastrophically), and
// then the block must pass the check a clean block passes. The location test's tolerance grows
// with |r1| (the f64 sums' rounding next to a huge error), so a second, smaller error in the block
// can hide behind a huge one: e.g. an exponent flip to 1e37 at one column and a value of 1.5
// flushed to 0 at another pointed at the first, and "correcting" it left the second wrong,
// silently. With the huge value rebuilt, r2 = (m - loc) e2 for a second error e2 at column m:
// the block then goes back to "detected" (recompute) instead. `value` is valid when ok.
struct AbftFix {
  bool ok;
  float value;
};

template <typename LoadFn>
PL_HD AbftFix AbftRebuild(LoadFn load, int64_t n, int64_t loc, float c1, float c2, float mag,
                          const AbftParams& p) {
  double o1 = 0, o2 = 0, oa = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (j == loc) continue;
    const double v = load(j);
    o1 += v;
    o2 += static_cast<double>(j + 1) * v;
    oa += fabs(v);
  }
  const float value = static_cast<float>(static_cast<double>(c1) - o1);
  const double b1 = AbftBound(mag, oa + fabsf(value), n, p);
  const double r2 = o2 + static_cast<double>(loc + 1) * value - static_cast<double>(c2);
  // Plus the rounding of the rebuilt value to f32, weighted by loc + 1 <= n.
  const double tol = static_cast<double>(n) * (b1 + fabsf(value) * 1.1920928955078125e-07);
  return {IsFiniteF(value) && IsFiniteF(o1) && IsFiniteF(o2) && fabs(r2) <= tol, value};
}

// abft_finish: after the check, the insulation gate and the cast to the output dtype, in the same
// pass over y. The gate judges the value as stored (after the cast: an f32 value that overflows
// bf16 is caught as the Inf it becomes). `dropped` counts replaced values.
struct GateSpec {
  bool on;
  float fill;
  float limit;
};

PL_HD float CastF(float v, FloatKind k) {
  if (k == FloatKind::kBF16) return Bf16ToF32(F32ToBf16(v));
  if (k == FloatKind::kF16) return F16ToF32(F32ToF16(v));
  return v;
}

PL_HD float GateCast(float v, FloatKind out, const GateSpec& g, int* dropped) {
  float c = CastF(v, out);
  if (!g.on || (IsFiniteF(c) && fabsf(c) <= g.limit)) return c;
  ++*dropped;
  return g.fill;
}

// Where y comes from and goes to. out may alias y when both have one dtype (abft_check; abft_finish
// in place): then y is only read, and only corrected and gated values are written. counts (gated
// values per row block) may be null (abft_check has no gate).
struct AbftIo {
  const void* y;
  FloatKind in_kind;
  void* out;
  FloatKind out_kind;
  const float* checks;
  const float* mag;
  int32_t* flags;
  int32_t* counts;
  int64_t rows, n_all, block_n, nb;
  // checks and mag hold check_ld blocks per row, this product's from block check_off on (a check
  // GEMM shared by several weights: their checks side by side, each product reading its own).
  int64_t check_ld, check_off;
};

// Where block w (row w / nb, column block w % nb; flags' and counts' own index) of io's product
// has its checks: index into mag, and half the index into checks.
PL_HD int64_t CheckIndex(const AbftIo& io, int64_t w) {
  if (io.check_ld == io.nb) return w + io.check_off;
  return (w / io.nb) * io.check_ld + io.check_off + w % io.nb;
}

// Shape and dtype validation shared by the CPU and CUDA bindings. checks and mag hold *ld blocks
// per row (at least block_offset + nb; abft_check: exactly nb, block_offset 0).
inline ffi::Error CheckAbftShapes(const ffi::AnyBuffer& y, const ffi::AnyBuffer& checks,
                                  const ffi::AnyBuffer& mag, int64_t block_n, int64_t k,
                                  std::optional<ffi::AnyBuffer> y_out, const ffi::AnyBuffer& flags,
                                  FloatKind* kind, int64_t* rows, int64_t* n, int64_t* nb,
                                  int64_t block_offset = 0, int64_t* ld = nullptr) {
  const std::string op = y_out ? "abft_check" : "abft_finish";  // abft_finish passes no y_out
  if (!ToFloatKind(y.element_type(), kind)) {
    return BadArg(op, std::string("y has dtype ") + DtypeName(y.element_type()) +
                          "; expected float32, bfloat16 or float16");
  }
  auto yd = y.dimensions();
  if (yd.size() < 2) return BadArg(op, "y has shape " + ShapeString(yd) + "; expected (..., M, N)");
  if (block_n <= 0 || k < 0) {
    return BadArg(op, "block_n=" + std::to_string(block_n) + ", k=" + std::to_string(k) +
                          "; expected block_n >= 1 and k >= 0");
  }
  *n = yd[yd.size() - 1];
  *nb = *n == 0 ? 0 : CeilDiv(*n, block_n);
  *rows = LeadingCount(yd, 1);
  // B, the checks' blocks per row, from their shape (-1 if they have too few axes: refused below).
  auto cd = checks.dimensions();
  const int64_t blocks = cd.size() >= 2 ? cd[cd.size() - 2] : -1;
  if (checks.element_type() != ffi::DataType::F32 || mag.element_type() != ffi::DataType::F32 ||
      cd.size() < 2 || cd[cd.size() - 1] != 2 || block_offset < 0 || blocks < *nb + block_offset ||
      (ld == nullptr && blocks != *nb) ||
      static_cast<int64_t>(checks.element_count()) != *rows * blocks * 2 ||
      static_cast<int64_t>(mag.element_count()) != *rows * blocks) {
    return BadArg(op, "checks " + ShapeString(cd) + " / mag " + ShapeString(mag.dimensions()) +
                          " do not match y " + ShapeString(yd) +
                          " with block_n=" + std::to_string(block_n) +
                          " and block_offset=" + std::to_string(block_offset) +
                          "; expected float32 (..., M, B, 2) and (..., M, B) with B >= " +
                          std::to_string(*nb + block_offset) + " (nb = " + std::to_string(*nb) +
                          (ld == nullptr ? "; B = nb)" : ")"));
  }
  if (ld != nullptr) *ld = blocks;
  // y_out is checked here for abft_check (in place); abft_finish checks its own
  // (CheckFinishOutputs).
  if (y_out &&
      (y_out->element_type() != y.element_type() || y_out->element_count() != y.element_count())) {
    return BadArg(op, "y_out must have y's dtype and shape");
  }
  if (flags.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(flags.element_count()) != *rows * *nb) {
    return BadArg(op, "flags must be int32 (..., M, nb)");
  }
  return ffi::Error::Success();
}

// abft_finish's extra outputs: y_out in a float dtype of y's shape, counts (..., M, nb) int32.
inline ffi::Error CheckFinishOutputs(const ffi::AnyBuffer& y, const ffi::AnyBuffer& y_out,
                                     const ffi::AnyBuffer& counts, int64_t blocks,
                                     FloatKind* out_kind) {
  if (!ToFloatKind(y_out.element_type(), out_kind) || y_out.element_count() != y.element_count()) {
    return BadArg("abft_finish", "y_out " + ShapeString(y_out.dimensions()) + " " +
                                     DtypeName(y_out.element_type()) + "; expected y's shape " +
                                     ShapeString(y.dimensions()) + " in float32|bfloat16|float16");
  }
  if (counts.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(counts.element_count()) != blocks) {
    return BadArg("abft_finish", "counts " + ShapeString(counts.dimensions()) +
                                     "; expected int32 with one count per row block of y (" +
                                     std::to_string(blocks) + ")");
  }
  return ffi::Error::Success();
}

// abft_encode: a weight's checksum columns. w is (G, K, N), or (G, N, K) when transposed (the
// GEMM's operand stored transposed); the reference is the pure-JAX abft_encode_reference.
struct EncodeIo {
  const void* w;
  FloatKind kind;
  float* sums;      // (G, K, nb, 2)
  float* abs_sums;  // (G, K, nb)
  int64_t groups, k, n, block_n, nb;
};

// Shape and dtype validation shared by the CPU and CUDA bindings of abft_encode; fills io.
inline ffi::Error CheckEncodeShapes(const ffi::AnyBuffer& w, int64_t block_n, bool transposed,
                                    const ffi::AnyBuffer& sums, const ffi::AnyBuffer& abs_sums,
                                    EncodeIo* io) {
  if (!ToFloatKind(w.element_type(), &io->kind)) {
    return BadArg("abft_encode", std::string("w has dtype ") + DtypeName(w.element_type()) +
                                     "; expected float32, bfloat16 or float16");
  }
  auto d = w.dimensions();
  if (d.size() < 2 || block_n < 1) {
    return BadArg("abft_encode", "w " + ShapeString(d) + ", block_n=" + std::to_string(block_n) +
                                     "; expected (..., K, N) (or (..., N, K) transposed) and "
                                     "block_n >= 1");
  }
  const int64_t rows = d[d.size() - 2], cols = d[d.size() - 1];
  io->w = w.untyped_data();
  io->groups = LeadingCount(d, 2);
  io->k = transposed ? cols : rows;
  io->n = transposed ? rows : cols;
  io->block_n = block_n;
  io->nb = io->n == 0 ? 0 : CeilDiv(io->n, block_n);
  const int64_t blocks = io->groups * io->k * io->nb;
  if (sums.element_type() != ffi::DataType::F32 || abs_sums.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(sums.element_count()) != blocks * 2 ||
      static_cast<int64_t>(abs_sums.element_count()) != blocks) {
    return BadArg("abft_encode", "outputs " + ShapeString(sums.dimensions()) + " / " +
                                     ShapeString(abs_sums.dimensions()) + " do not match w " +
                                     ShapeString(d) +
                                     "; expected float32 (..., K, nb, 2) and (..., K, nb)");
  }
  io->sums = static_cast<float*>(sums.untyped_data());
  io->abs_sums = static_cast<float*>(abs_sums.untyped_data());
  return ffi::Error::Success();
}

}  // namespace pimlayers
