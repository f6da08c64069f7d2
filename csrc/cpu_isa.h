// Which vector kernels a CPU handler runs: the widest the CPU has, capped by the environment
// variable PIMLAYERS_CPU_ISA ("generic", "avx2" or "avx512"), which is read on every call so that
// one process (a test, a benchmark alternating builds) can run each kernel on one machine.
// abft_checks has a kernel per level (abft_checks.cc); the block sums of abft_finish, abft_check
// and abft_encode take a row at a time with AVX-512 and a block at a time otherwise, and the
// transposed abft_encode sums a block's columns in AVX-512 registers (abft.cc).
#pragma once

#include <cstdlib>
#include <string>

#include "common.h"

namespace pimlayers {

enum class CpuIsa { kGeneric, kAvx2, kAvx512 };

// False, with `err` set, when PIMLAYERS_CPU_ISA names no ISA.
inline bool ChooseCpuIsa(CpuIsa* isa, std::string* err) {
  const char* env = std::getenv("PIMLAYERS_CPU_ISA");
  const std::string cap = env == nullptr || *env == '\0' ? "avx512" : env;
  if (cap != "generic" && cap != "avx2" && cap != "avx512") {
    *err = "PIMLAYERS_CPU_ISA is '" + cap + "'; expected generic, avx2 or avx512 (or unset)";
    return false;
  }
  *isa = CpuIsa::kGeneric;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (cap == "avx512" && avx512) {
    *isa = CpuIsa::kAvx512;
  } else if (cap != "generic" && avx2) {
    *isa = CpuIsa::kAvx2;
  }
#endif
  return true;
}

// ChooseCpuIsa for a handler: its error names the op.
inline ffi::Error CpuIsaFor(const std::string& op, CpuIsa* isa) {
  std::string err;
  return ChooseCpuIsa(isa, &err) ? ffi::Error::Success() : BadArg(op, err);
}

}  // namespace pimlayers
