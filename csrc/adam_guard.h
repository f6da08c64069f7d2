// adamw_guard_many: AdamW's update of many float32 leaves and bank_guard_many of the updated
// parameters, in one read of each leaf (encode on write, fused into the write). The CUDA handler
// (guard.cu) and the CPU one (guard.cc) share these checks and this arithmetic.
//
//   adamw_guard_many(p_i, g_i, m_i, v_i for each i; hyper) -> (p'_i, m'_i, v'_i, sums_i, parity_i,
//     psums_i) for each i. p, m, v float32; g float32 or bfloat16, of p's shape; p', m', v' in
//     place of p, m, v (aliased by the caller). hyper: float32 (kAdamHyper,), the step's scalars in
//     the order of AdamHyper below; per element, in float32 with every operation rounded on its own
//     (no contraction), as optax's clip_by_global_norm -> adamw -> apply_updates under
//     pimlayers.optim.fault_aware, but for its divisions by a scalar, taken as products by the
//     scalar's reciprocal (as XLA's GPU programs take them):
//       g~ = trigger ? g : g * (max_norm / norm)
//       m' = (1 - b1) g~ + b1 m;   v' = (1 - b2) g~^2 + b2 v
//       u = step * ((m' * (1 / bc1)) / (sqrt(v' * (1 / bc2) + eps_root) + eps) + wd p)
//       skip: u = 0, m' = m, v' = v;   p' = p + u
//     and (sums, parity, psums) = bank_guard(p', parity_sums=True) of the bytes written.
#pragma once

#include <string>
#include <vector>

#include "guard_many.h"

namespace pimlayers {

// The step's scalars, read by every thread (the kernel copies them to registers).
struct AdamHyper {
  float trigger;  // 1: the global norm is under max_norm, g is used as it is
  float norm, max_norm;
  float b1, one_minus_b1, b2, one_minus_b2;
  float bc1, bc2;  // 1 - b1^t, 1 - b2^t
  float eps, eps_root, wd;
  float step;  // -learning_rate(count)
  float skip;  // 1: the step is skipped (updates zero, moments kept)
};
constexpr int64_t kAdamHyper = sizeof(AdamHyper) / sizeof(float);

// Float operations rounded one by one, for the update below: on the device the CUDA intrinsics,
// which are never contracted into FMAs; on the host plain operators (the CPU module is built for
// baseline x86-64, which has no FMA instruction to contract into, and GCC is told not to for the
// update should it be built for a newer ISA).
PL_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PL_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PL_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
PL_HD float SqrtRn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// Scalars derived once per call (per thread on the device): the clip factor and the bias
// corrections' reciprocals.
struct AdamDerived {
  float clip, rbc1, rbc2;
};

PL_HD AdamDerived Derive(const AdamHyper& H) {
  return {DivRn(H.max_norm, H.norm), DivRn(1.f, H.bc1), DivRn(1.f, H.bc2)};
}

// AdamW on one float32 parameter, in the order of optax's clip_by_global_norm -> adamw ->
// apply_updates, every operation rounded on its own, but for the divisions by a scalar (the
// clip's, the bias corrections'), taken as products by its reciprocal as XLA's GPU programs take
// them: one division per value instead of four. A measuring build with both forms (2026-12-06,
// H100, 4 Llama-3-8B layers; its switch is not in the repo: docs/gpu-tests.md, fifty-second
// session) ran the four divisions at 9.99 ms (2 CTAs an SM) and 9.10 (3), the reciprocals at 9.37
// and 8.80; the kept kernel: `python -m benchmarks.run --suite update`. The kernel (guard.cu) and
// the CPU handler (guard.cc) both run this text; ops._adam_guard._update_numpy is its NumPy twin.
#if !defined(__CUDA_ARCH__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
PL_HD float AdamOne(const AdamHyper& H, const AdamDerived& D, float p, float g, float& m,
                    float& v) {
#if !defined(__CUDA_ARCH__) && defined(__clang__)
#pragma clang fp contract(off)
#endif
  const float gg = H.trigger != 0.f ? g : MulRn(g, D.clip);
  const float m1 = AddRn(MulRn(H.one_minus_b1, gg), MulRn(H.b1, m));
  const float v1 = AddRn(MulRn(H.one_minus_b2, MulRn(gg, gg)), MulRn(H.b2, v));
  const float mh = MulRn(m1, D.rbc1), vh = MulRn(v1, D.rbc2);
  float u = DivRn(mh, AddRn(SqrtRn(AddRn(vh, H.eps_root)), H.eps));
  u = MulRn(H.step, AddRn(u, MulRn(H.wd, p)));
  const bool skip = H.skip != 0.f;
  m = skip ? m : m1, v = skip ? v : v1;
  return AddRn(p, skip ? 0.f : u);  // p + 0, as apply_updates adds a skipped step's zeros
}

// Leaf i's AdamW operands and results (its guard's outputs are in the ManyLeaf).
struct AdamLeaf {
  const float* p = nullptr;
  const void* g = nullptr;
  bool g_bf16 = false;
  const float* m = nullptr;
  const float* v = nullptr;
  float* p_out = nullptr;
  float* m_out = nullptr;
  float* v_out = nullptr;
};

// One call's operands and results: `leaves` carry the guard's geometry and outputs, `adam` the
// update's arrays, `hyper` the scalars' address (device memory on a GPU).
struct AdamCall {
  std::vector<ManyLeaf> leaves;
  std::vector<AdamLeaf> adam;
  const float* hyper = nullptr;
};

// The operands, results and attributes of one call, checked.
inline ffi::Error CollectAdamGuardMany(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                       int64_t bank_bytes, int64_t group, AdamCall* call) {
  std::vector<ManyLeaf>* leaves = &call->leaves;
  std::vector<AdamLeaf>* adam = &call->adam;
  const float** hyper = &call->hyper;
  static const std::string op = "adamw_guard_many";
  if (auto e = CheckManyAttrs(op, bank_bytes, group); e.failure()) return e;
  if (args.size() % 4 != 1) {
    return BadArg(op, std::to_string(args.size()) +
                          " operands; expected 4 per leaf (p, g, m, v) and the scalars");
  }
  const size_t n = args.size() / 4;
  if (rets.size() != 6 * n) {
    return BadArg(op, std::to_string(n) + " leaves and " + std::to_string(rets.size()) +
                          " results; expected 6 per leaf (p, m, v, sums, parity, parity sums)");
  }
  auto h = args.get<ffi::AnyBuffer>(4 * n);
  if (!h.has_value()) return BadArg(op, "the scalars are not a buffer");
  if (auto e = CheckManyBuffer(op, *h, ffi::DataType::F32, {kAdamHyper}, "the scalars", n);
      e.failure()) {
    return e;
  }
  *hyper = static_cast<const float*>(h->untyped_data());
  leaves->assign(n, ManyLeaf{});
  adam->assign(n, AdamLeaf{});
  const char* names[] = {"p", "g", "m", "v"};
  for (size_t i = 0; i < n; ++i) {
    std::vector<ffi::AnyBuffer> in;
    for (int k = 0; k < 4; ++k) {
      auto a = args.get<ffi::AnyBuffer>(4 * i + k);
      if (!a.has_value()) {
        return BadArg(op,
                      std::string(names[k]) + " of leaf " + std::to_string(i) + " is not a buffer");
      }
      in.push_back(*a);
    }
    std::vector<ffi::Result<ffi::AnyBuffer>> out;
    for (int k = 0; k < 6; ++k) {
      auto r = rets.get<ffi::AnyBuffer>(6 * i + k);
      if (!r.has_value()) {
        return BadArg(op, "a result of leaf " + std::to_string(i) + " is not a buffer");
      }
      out.push_back(*r);
    }
    for (int k : {0, 2, 3}) {
      if (in[k].element_type() != ffi::DataType::F32 || !SameDims(in[k], in[0])) {
        return BadArg(op, std::string(names[k]) + " of leaf " + std::to_string(i) + " is " +
                              DtypeName(in[k].element_type()) + ShapeString(in[k].dimensions()) +
                              "; expected float32" + ShapeString(in[0].dimensions()));
      }
    }
    const auto gt = in[1].element_type();
    if ((gt != ffi::DataType::F32 && gt != ffi::DataType::BF16) || !SameDims(in[1], in[0])) {
      return BadArg(op, "g of leaf " + std::to_string(i) + " is " + DtypeName(gt) +
                            ShapeString(in[1].dimensions()) + "; expected float32 or bfloat16" +
                            ShapeString(in[0].dimensions()));
    }
    for (int k = 0; k < 3; ++k) {
      if ((*out[k]).element_type() != ffi::DataType::F32 || !SameDims(*out[k], in[0])) {
        return BadArg(op, std::string("the new ") + names[k == 0 ? 0 : k + 1] + " of leaf " +
                              std::to_string(i) + " is " + DtypeName((*out[k]).element_type()) +
                              ShapeString((*out[k]).dimensions()) + "; expected float32" +
                              ShapeString(in[0].dimensions()));
      }
    }
    ManyLeaf& L = (*leaves)[i];
    // The guard reads the parameters as written: its layout is p's.
    if (auto e = ManyLayout(op, in[0], bank_bytes, group, i, &L); e.failure()) return e;
    if (auto e = CheckManyBuffer(op, *out[3], ffi::DataType::U32, {L.nbanks, 2}, "sums", i);
        e.failure()) {
      return e;
    }
    if (auto e =
            CheckManyBuffer(op, *out[4], ffi::DataType::U8, {L.ngroups, bank_bytes}, "parity", i);
        e.failure()) {
      return e;
    }
    if (auto e = CheckManyBuffer(op, *out[5], ffi::DataType::U32, {L.ngroups, 2}, "parity sums", i);
        e.failure()) {
      return e;
    }
    L.sums = Data<uint32_t>(out[3]), L.parity = Data<uint8_t>(out[4]);
    L.psums = Data<uint32_t>(out[5]);
    AdamLeaf& A = (*adam)[i];
    A.p = static_cast<const float*>(in[0].untyped_data());
    A.g = in[1].untyped_data(), A.g_bf16 = gt == ffi::DataType::BF16;
    A.m = static_cast<const float*>(in[2].untyped_data());
    A.v = static_cast<const float*>(in[3].untyped_data());
    A.p_out = Data<float>(out[0]), A.m_out = Data<float>(out[1]), A.v_out = Data<float>(out[2]);
    // 16-byte vectors of p, m, v and their results, 8- or 16-byte ones of g (XLA's buffers are
    // aligned; a view into another buffer need not be).
    const void* vec[] = {A.p, A.m, A.v, A.p_out, A.m_out, A.v_out, L.parity};
    for (const void* q : vec) {
      if (reinterpret_cast<uintptr_t>(q) % 16 != 0) {
        return BadArg(op, "a buffer of leaf " + std::to_string(i) + " is not 16-byte aligned");
      }
    }
    if (reinterpret_cast<uintptr_t>(A.g) % (A.g_bf16 ? 8 : 16) != 0) {
      return BadArg(op, "g of leaf " + std::to_string(i) + " is not aligned to its 4 values");
    }
  }
  return ffi::Error::Success();
}

}  // namespace pimlayers
