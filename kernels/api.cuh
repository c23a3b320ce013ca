// api.cuh — the plain C++ contract between the kernels (compiled by nvcc) and bindings.cpp
// (compiled by the host compiler). No device code and no torch headers here, so both sides can
// include it and the kernel translation unit stays free of heavy torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace trimul {

enum class Dtype : int { f32 = 0, bf16 = 1, f16 = 2 };

// How fp32 operands may be rounded inside a contraction (PyTorch's matmul precision names).
// bf16/fp16 operands are used as they are, whatever this says.
enum class Precision : int { highest = 0, high = 1, medium = 2 };

// z[batch, i, j] = sum_k a[batch, i, k] * b[batch, j, k]; all three row-major and contiguous.
// The module lays a and b out as [B*H, N, N] so both directions of the triangle update are this
// one "A times B-transposed" product.
struct ContractArgs {
  const void* a;
  const void* b;
  void* z;
  int64_t batch, m, n, k;
  Dtype operand;  // dtype of a and b
  Dtype out;      // dtype of z
  Precision precision;
  cudaStream_t stream;
};

using ContractFn = cudaError_t (*)(const ContractArgs&);

// Each contraction kernel file registers its launcher under its variant name with
// TRIMUL_REGISTER_CONTRACTION; bindings.cpp finds it by that name.
bool register_contraction(const char* name, ContractFn fn);
ContractFn find_contraction(const char* name);
// Writes up to `capacity` registered names into `names`; returns how many are registered.
int list_contractions(const char** names, int capacity);

}  // namespace trimul

#define TRIMUL_REGISTER_CONTRACTION(NAME, FN) \
  static const bool trimul_registered_contraction_##NAME = ::trimul::register_contraction(#NAME, FN)
