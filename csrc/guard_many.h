// bank_guard_many and bank_verify_many: encode-on-write and the scrub's check of many arrays (the
// leaves of a parameter pytree) in one call, so one kernel launch covers them all.
//
//   bank_guard_many(x_0 .. x_{n-1}) -> (sums_i, parity_i, psums_i) for each i, as bank_guard with
//     parity_sums=True on each x_i alone (one example: no batch axes).
//   bank_verify_many(x_i, parity_i, sums_i, psums_i for each i; casts) -> (now_i, bad_i, bad_par_i)
//     for each i, then count, then cast_i for each i with casts[i] = 1: now_i =
//     bank_checksums(x_i); bad_i[b] = now_i[b] != sums_i[b] (either sum); bad_par_i[g] =
//     bank_checksums(parity_i)[g] != psums_i[g]; count = int32 number of true entries of every
//     bad_i and bad_par_i; cast_i = x_i (float32) rounded to bfloat16 (to nearest, ties to even, as
//     XLA's convert), written from the same read of x_i.
#pragma once

#include <initializer_list>
#include <vector>

#include "guard.h"

namespace pimlayers {

// One array of a multi-array call: where its bytes are and where its results go.
struct ManyLeaf {
  const uint8_t* x = nullptr;
  int64_t bytes = 0, nbanks = 0, ngroups = 0;
  const uint8_t* par_in = nullptr;     // verify: the stored parity
  const uint32_t* sums_in = nullptr;   // verify: the stored checksums
  const uint32_t* psums_in = nullptr;  // verify: the stored parity checksums
  uint32_t* sums = nullptr;            // guard: checksums; verify: checksums now
  uint8_t* parity = nullptr;           // guard
  uint32_t* psums = nullptr;           // guard
  uint8_t* bad = nullptr;              // verify: bool per bank
  uint8_t* bad_par = nullptr;          // verify: bool per group
  uint16_t* cast = nullptr;            // verify: x (float32) as bfloat16 bits, or null
};

// buf must be `dtype` of exactly `dims` (no batch axes). Strings are built only for an error: the
// handlers check every leaf on every call.
inline ffi::Error CheckManyBuffer(const std::string& op, const ffi::AnyBuffer& buf,
                                  ffi::DataType dtype, std::initializer_list<int64_t> dims,
                                  const char* what, size_t i) {
  auto d = buf.dimensions();
  bool ok = buf.element_type() == dtype && d.size() == dims.size();
  size_t k = 0;
  for (int64_t n : dims) ok = ok && d[k++] == n;
  if (ok) return ffi::Error::Success();
  std::string want = "(";
  k = 0;
  for (int64_t n : dims) want += (k++ ? ", " : "") + std::to_string(n);
  want += dims.size() == 1 ? ",)" : ")";
  return BadArg(op, std::string(what) + " of array " + std::to_string(i) + " is " +
                        DtypeName(buf.element_type()) + ShapeString(d) + "; expected " +
                        DtypeName(dtype) + want);
}

// Whether two buffers have the same dimensions (dtypes aside).
inline bool SameDims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto x = a.dimensions(), y = b.dimensions();
  if (x.size() != y.size()) return false;
  for (size_t d = 0; d < x.size(); ++d) {
    if (x[d] != y[d]) return false;
  }
  return true;
}

// Leaf i's bank and group counts from its array (bank_bytes and group checked by the caller).
inline ffi::Error ManyLayout(const std::string& op, const ffi::AnyBuffer& x, int64_t bank_bytes,
                             int64_t group, size_t i, ManyLeaf* L) {
  if (!ByteAddressable(x.element_type())) {
    return BadArg(op, "array " + std::to_string(i) + " has dtype " + DtypeName(x.element_type()) +
                          "; expected a byte-addressable dtype");
  }
  L->x = static_cast<const uint8_t*>(x.untyped_data());
  L->bytes = static_cast<int64_t>(x.size_bytes());
  L->nbanks = CeilDiv(L->bytes, bank_bytes), L->ngroups = CeilDiv(L->nbanks, group);
  return ffi::Error::Success();
}

// The attributes, checked once per call.
inline ffi::Error CheckManyAttrs(const std::string& op, int64_t bank_bytes, int64_t group) {
  if (bank_bytes <= 0 || bank_bytes % 16 != 0 || bank_bytes > (int64_t{1} << 31)) {
    return BadArg(op, "bank_bytes=" + std::to_string(bank_bytes) +
                          "; expected a positive multiple of 16 of at most 2^31");
  }
  if (group <= 0) return BadArg(op, "group=" + std::to_string(group) + "; expected >= 1");
  return ffi::Error::Success();
}

template <typename T>
T* Data(ffi::Result<ffi::AnyBuffer>& r) {
  return static_cast<T*>(r->untyped_data());
}

inline ffi::Error CollectGuardMany(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                   int64_t bank_bytes, int64_t group, std::vector<ManyLeaf>* out) {
  static const std::string op = "bank_guard_many";
  if (auto e = CheckManyAttrs(op, bank_bytes, group); e.failure()) return e;
  const size_t n = args.size();
  if (rets.size() != 3 * n) {
    return BadArg(op, std::to_string(n) + " arrays and " + std::to_string(rets.size()) +
                          " results; expected 3 results per array");
  }
  out->assign(n, ManyLeaf{});
  for (size_t i = 0; i < n; ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto s = rets.get<ffi::AnyBuffer>(3 * i);
    auto p = rets.get<ffi::AnyBuffer>(3 * i + 1);
    auto ps = rets.get<ffi::AnyBuffer>(3 * i + 2);
    if (!x.has_value() || !s.has_value() || !p.has_value() || !ps.has_value()) {
      return BadArg(op, "array " + std::to_string(i) + " or its results are not buffers");
    }
    ManyLeaf& L = (*out)[i];
    if (auto e = ManyLayout(op, *x, bank_bytes, group, i, &L); e.failure()) return e;
    if (auto e = CheckManyBuffer(op, **s, ffi::DataType::U32, {L.nbanks, 2}, "sums", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, **p, ffi::DataType::U8, {L.ngroups, bank_bytes}, "parity", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, **ps, ffi::DataType::U32, {L.ngroups, 2}, "parity sums", i);
        e.failure()) {
      return e;
    }
    L.sums = Data<uint32_t>(*s), L.parity = Data<uint8_t>(*p), L.psums = Data<uint32_t>(*ps);
  }
  return ffi::Error::Success();
}

inline ffi::Error CollectVerifyMany(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    int64_t bank_bytes, int64_t group,
                                    ffi::Span<const int64_t> casts, std::vector<ManyLeaf>* out,
                                    int32_t** count) {
  static const std::string op = "bank_verify_many";
  if (auto e = CheckManyAttrs(op, bank_bytes, group); e.failure()) return e;
  const size_t n = args.size() / 4;
  if (args.size() % 4 != 0 || casts.size() != n) {
    return BadArg(op, std::to_string(args.size()) + " operands and " +
                          std::to_string(casts.size()) +
                          " cast flags; expected 4 operands and one flag per array");
  }
  size_t ncast = 0;
  for (size_t i = 0; i < n; ++i) {
    if (casts[i] != 0 && casts[i] != 1) {
      return BadArg(op, "cast flag " + std::to_string(i) + " is " + std::to_string(casts[i]) +
                            "; expected 0 or 1");
    }
    ncast += static_cast<size_t>(casts[i]);
  }
  if (rets.size() != 3 * n + 1 + ncast) {
    return BadArg(op, std::to_string(n) + " arrays, " + std::to_string(ncast) + " cast and " +
                          std::to_string(rets.size()) +
                          " results; expected 3 results per array, a count and one per cast");
  }
  auto c = rets.get<ffi::AnyBuffer>(3 * n);
  if (!c.has_value()) return BadArg(op, "the count is not a buffer");
  if (c.value()->element_type() != ffi::DataType::S32 || c.value()->dimensions().size() != 0) {
    return BadArg(op, std::string("the count is ") + DtypeName(c.value()->element_type()) +
                          ShapeString(c.value()->dimensions()) + "; expected an int32 scalar");
  }
  *count = Data<int32_t>(*c);
  out->assign(n, ManyLeaf{});
  for (size_t i = 0; i < n; ++i) {
    auto x = args.get<ffi::AnyBuffer>(4 * i);
    auto par = args.get<ffi::AnyBuffer>(4 * i + 1);
    auto sums = args.get<ffi::AnyBuffer>(4 * i + 2);
    auto psums = args.get<ffi::AnyBuffer>(4 * i + 3);
    auto now = rets.get<ffi::AnyBuffer>(3 * i);
    auto bad = rets.get<ffi::AnyBuffer>(3 * i + 1);
    auto bad_par = rets.get<ffi::AnyBuffer>(3 * i + 2);
    if (!x.has_value() || !par.has_value() || !sums.has_value() || !psums.has_value() ||
        !now.has_value() || !bad.has_value() || !bad_par.has_value()) {
      return BadArg(op, "array " + std::to_string(i) + "'s operands or results are not buffers");
    }
    ManyLeaf& L = (*out)[i];
    if (auto e = ManyLayout(op, *x, bank_bytes, group, i, &L); e.failure()) return e;
    if (auto e = CheckManyBuffer(op, *par, ffi::DataType::U8, {L.ngroups, bank_bytes}, "parity", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, *sums, ffi::DataType::U32, {L.nbanks, 2}, "sums", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, *psums, ffi::DataType::U32, {L.ngroups, 2}, "parity sums", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, **now, ffi::DataType::U32, {L.nbanks, 2}, "checksums now", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, **bad, ffi::DataType::PRED, {L.nbanks}, "bad", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, **bad_par, ffi::DataType::PRED, {L.ngroups}, "bad parity", i);
        e.failure()) {
      return e;
    }
    L.par_in = static_cast<const uint8_t*>(par->untyped_data());
    L.sums_in = static_cast<const uint32_t*>(sums->untyped_data());
    L.psums_in = static_cast<const uint32_t*>(psums->untyped_data());
    L.sums = Data<uint32_t>(*now), L.bad = Data<uint8_t>(*bad), L.bad_par = Data<uint8_t>(*bad_par);
  }
  size_t k = 3 * n + 1;  // the casts follow the count, in the order of their arrays
  for (size_t i = 0; i < n; ++i) {
    if (casts[i] == 0) continue;
    auto x = args.get<ffi::AnyBuffer>(4 * i);
    auto c = rets.get<ffi::AnyBuffer>(k++);
    if (!c.has_value())
      return BadArg(op, "the cast of array " + std::to_string(i) + " is not a buffer");
    if (x->element_type() != ffi::DataType::F32) {
      return BadArg(op, "array " + std::to_string(i) + " is " + DtypeName(x->element_type()) +
                            "; a cast reads float32");
    }
    if (c.value()->element_type() != ffi::DataType::BF16 || !SameDims(**c, *x)) {
      return BadArg(op, "the cast of array " + std::to_string(i) + " is " +
                            DtypeName(c.value()->element_type()) +
                            ShapeString(c.value()->dimensions()) + "; expected bfloat16" +
                            ShapeString(x->dimensions()));
    }
    if (reinterpret_cast<uintptr_t>(c.value()->untyped_data()) % 8 != 0) {
      return BadArg(op, "the cast of array " + std::to_string(i) + " is not 8-byte aligned");
    }
    (*out)[i].cast = Data<uint16_t>(*c);
  }
  return ffi::Error::Success();
}

}  // namespace pimlayers
