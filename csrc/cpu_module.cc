// Python module `pimlayers._pimlayers_cpu`: hands XLA the CPU FFI handlers as capsules.
#include <pybind11/pybind11.h>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(PlGateCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankChecksumsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlParityCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankGuardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankGuardManyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankVerifyManyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAdamwGuardManyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlReconstructCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftCheckCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftFinishCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftEncodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftChecksCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlPimGemvCpu);

namespace {
template <typename T>
pybind11::capsule Capsule(T* fn) {
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

PYBIND11_MODULE(_pimlayers_cpu, m) {
  m.doc() = "pimlayers CPU handlers for XLA's FFI";
  m.def("registrations", []() {
    pybind11::dict d;
    d["pimlayers_gate"] = Capsule(PlGateCpu);
    d["pimlayers_bank_checksums"] = Capsule(PlBankChecksumsCpu);
    d["pimlayers_parity"] = Capsule(PlParityCpu);
    d["pimlayers_reconstruct"] = Capsule(PlReconstructCpu);
    d["pimlayers_bank_guard"] = Capsule(PlBankGuardCpu);
    d["pimlayers_bank_guard_many"] = Capsule(PlBankGuardManyCpu);
    d["pimlayers_bank_verify_many"] = Capsule(PlBankVerifyManyCpu);
    d["pimlayers_adamw_guard_many"] = Capsule(PlAdamwGuardManyCpu);
    d["pimlayers_abft_check"] = Capsule(PlAbftCheckCpu);
    d["pimlayers_abft_finish"] = Capsule(PlAbftFinishCpu);
    d["pimlayers_abft_encode"] = Capsule(PlAbftEncodeCpu);
    d["pimlayers_abft_checks"] = Capsule(PlAbftChecksCpu);
    d["pimlayers_pim_gemv"] = Capsule(PlPimGemvCpu);
    return d;
  });
}
