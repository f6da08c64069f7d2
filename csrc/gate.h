// The insulation gate: y = x where x is finite and |x| <= limit, else fill; counts per row.
#pragma once

#include "common.h"

namespace pimlayers {

PL_HD bool GateKeeps(float v, float limit) { return IsFiniteF(v) && fabsf(v) <= limit; }

// Shape checks shared by the CPU and CUDA bindings. x: (..., n) -> y: same, counts: (...).
inline ffi::Error CheckGate(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                            const ffi::AnyBuffer& counts, FloatKind* kind, int64_t* rows,
                            int64_t* row_len) {
  if (!ToFloatKind(x.element_type(), kind)) {
    return BadArg("gate", std::string("x has dtype ") + DtypeName(x.element_type()) +
                              "; expected float32, bfloat16 or float16");
  }
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count()) {
    return BadArg("gate", "output y must have x's dtype and shape");
  }
  *rows = static_cast<int64_t>(counts.element_count());
  int64_t n = static_cast<int64_t>(x.element_count());
  if (*rows == 0) {
    *row_len = 0;
    if (n != 0)
      return BadArg("gate", "counts is empty but x " + ShapeString(x.dimensions()) + " is not");
    return ffi::Error::Success();
  }
  if (n % *rows != 0) {
    return BadArg("gate", "x of shape " + ShapeString(x.dimensions()) +
                              " does not split into rows of counts' shape " +
                              ShapeString(counts.dimensions()));
  }
  *row_len = n / *rows;
  return ffi::Error::Success();
}

}  // namespace pimlayers
