// Banked GEMV of the "pim" execution backend: the shapes, checks and the per-row dot product shared
// by the CPU and CUDA handlers.
//
// Weights are stored bank-major, as an HBM-PIM part holds them: bank b of `nb` data banks keeps
// output rows b*R .. b*R + R - 1 (each a full row of K weights), and one checksum bank keeps
// C = sum_b W_b (f32, R x K). For every token t the handler computes, in f32,
//     y[t, b, r] = W_b[r, :] . x[t, :]   for banks with bank_ok[b] != 0 (0 for a failed bank: it is
//                                        never read), and
//     c[t, r]    = C[r, :] . x[t, :],
// so a failed bank's slice is c - sum of the others (the wrapper does that sum).
#pragma once

#include "common.h"

namespace pimlayers {

struct PimShape {
  int64_t tokens = 0, nb = 0, rows = 0, k = 0;
  FloatKind kind = FloatKind::kF32;
};

inline ffi::Error CheckPimShapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                 const ffi::AnyBuffer& wsum, const ffi::AnyBuffer& ok,
                                 const ffi::AnyBuffer& y, const ffi::AnyBuffer& c, PimShape* s) {
  const std::string op = "pim_gemv";
  auto xd = x.dimensions(), wd = w.dimensions(), sd = wsum.dimensions();
  if (!ToFloatKind(x.element_type(), &s->kind)) {
    return BadArg(op, std::string("x has dtype ") + DtypeName(x.element_type()) +
                          "; expected float32, bfloat16 or float16");
  }
  if (w.element_type() != x.element_type()) {
    return BadArg(op, std::string("weights have dtype ") + DtypeName(w.element_type()) +
                          "; expected x's dtype " + DtypeName(x.element_type()));
  }
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 2) {
    return BadArg(op, "expected x (T, K), w (banks, R, K), wsum (R, K); got x" + ShapeString(xd) +
                          ", w" + ShapeString(wd) + ", wsum" + ShapeString(sd));
  }
  s->tokens = xd[0];
  s->k = xd[1];
  s->nb = wd[0];
  s->rows = wd[1];
  if (wd[2] != s->k || sd[0] != s->rows || sd[1] != s->k ||
      wsum.element_type() != ffi::DataType::F32) {
    return BadArg(op, "w" + ShapeString(wd) + " and wsum" + ShapeString(sd) + " do not match x" +
                          ShapeString(xd) + " (wsum must be float32)");
  }
  if (ok.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(ok.element_count()) != s->nb) {
    return BadArg(
        op, "bank_ok must be int32 with one entry per data bank (" + std::to_string(s->nb) + ")");
  }
  if (y.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(y.element_count()) != s->tokens * s->nb * s->rows ||
      c.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(c.element_count()) != s->tokens * s->rows) {
    return BadArg(op, "outputs must be float32 (T, banks, R) and (T, R)");
  }
  return ffi::Error::Success();
}

}  // namespace pimlayers
