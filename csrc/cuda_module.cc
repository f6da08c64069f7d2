// Python module `pimlayers._pimlayers_cuda`: hands XLA the CUDA FFI handlers as capsules.
#include <pybind11/pybind11.h>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(PlGateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankChecksumsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlParityCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankGuardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankGuardManyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlBankVerifyManyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAdamwGuardManyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlReconstructCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftCheckCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftFinishCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftEncodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlAbftEncodePairCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PlPimGemvCuda);

namespace {
template <typename T>
pybind11::capsule Capsule(T* fn) {
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

PYBIND11_MODULE(_pimlayers_cuda, m) {
  m.doc() = "pimlayers CUDA handlers for XLA's FFI";
  m.def("registrations", []() {
    pybind11::dict d;
    d["pimlayers_gate"] = Capsule(PlGateCuda);
    d["pimlayers_bank_checksums"] = Capsule(PlBankChecksumsCuda);
    d["pimlayers_parity"] = Capsule(PlParityCuda);
    d["pimlayers_reconstruct"] = Capsule(PlReconstructCuda);
    d["pimlayers_bank_guard"] = Capsule(PlBankGuardCuda);
    d["pimlayers_bank_guard_many"] = Capsule(PlBankGuardManyCuda);
    d["pimlayers_bank_verify_many"] = Capsule(PlBankVerifyManyCuda);
    d["pimlayers_adamw_guard_many"] = Capsule(PlAdamwGuardManyCuda);
    d["pimlayers_abft_check"] = Capsule(PlAbftCheckCuda);
    d["pimlayers_abft_finish"] = Capsule(PlAbftFinishCuda);
    d["pimlayers_abft_encode"] = Capsule(PlAbftEncodeCuda);
    d["pimlayers_abft_encode_pair"] = Capsule(PlAbftEncodePairCuda);
    d["pimlayers_pim_gemv"] = Capsule(PlPimGemvCuda);
    return d;
  });
}
