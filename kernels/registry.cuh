// registry.cuh — how a kernel file registers the kernel it implements under its registry.def name:
// TRIMUL_REGISTER_CONTRACTION and TRIMUL_REGISTER_BACKWARD here, TRIMUL_REGISTER_PASS (input and output
// kernels) in fused.cuh.
// The registrations run as the library loads; dispatch.cu matches them to registry.def.
#pragma once
#include "api.cuh"

namespace trimul {

// A kernel's two entry points. applies() says whether it takes a call: it reads sizes, strides,
// dtypes, the inputs' alignment, which optional weights and buffers exist (a buffer pointer may be a
// placeholder while the forward is planned) and the device; never the memory behind a pointer.
// launch() runs it on the current args (cudaErrorNotSupported: it declines after all, e.g. where the
// driver refuses a tensor map, and the next kernel of the default order takes the call).
struct Implementation {
  Role role;
  const char* name;
  bool (*pass_applies)(const ForwardArgs&);
  cudaError_t (*pass_launch)(const ForwardArgs&);
  bool (*contract_applies)(const ContractArgs&);
  cudaError_t (*contract_launch)(const ContractArgs&);
  bool contracts_in_output_pass;  // no launch of its own: the output pass computes z (ForwardArgs::z null)
  bool (*backward_applies)(const BackwardArgs&);  // a backward role's kernel: every pass of its role
  cudaError_t (*backward_launch)(const BackwardArgs&);
};

bool register_implementation(const Implementation& implementation);

}  // namespace trimul

// Registers contraction kernel NAME: applies(const ContractArgs&) -> bool, launch(const ContractArgs&).
#define TRIMUL_REGISTER_CONTRACTION(NAME, APPLIES, LAUNCH)                                     \
  static const bool trimul_registered_contract_##NAME = ::trimul::register_implementation( \
      {::trimul::Role::contract, #NAME, nullptr, nullptr, APPLIES, LAUNCH, false, nullptr, nullptr})

// Registers contraction NAME that the output pass does itself (z never stored; see
// Implementation::contracts_in_output_pass): applies(const ContractArgs&) -> bool.
#define TRIMUL_REGISTER_CONTRACTION_IN_OUTPUT_PASS(NAME, APPLIES)                               \
  static const bool trimul_registered_contract_##NAME = ::trimul::register_implementation( \
      {::trimul::Role::contract, #NAME, nullptr, nullptr, APPLIES, nullptr, true, nullptr, nullptr})

// Registers backward kernel NAME of ROLE (output_backward, input_backward): applies(const BackwardArgs&) ->
// bool, launch(const BackwardArgs&) for each BackwardPass of its role.
#define TRIMUL_REGISTER_BACKWARD(ROLE, NAME, APPLIES, LAUNCH)                                            \
  static const bool trimul_registered_##ROLE##_##NAME = ::trimul::register_implementation(             \
      {::trimul::Role::ROLE, #NAME, nullptr, nullptr, nullptr, nullptr, false, APPLIES, LAUNCH})
