// common.cuh — device helpers shared by every kernel file, and the variant table behind
// TRIMUL_REGISTER_CONTRACTION. All kernels/*.cu files are compiled as one translation unit, so
// each kernel file keeps its own helpers in its own namespace.
#pragma once
#include "api.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <utility>

namespace trimul {

// ---- the variant table ----------------------------------------------------------------------
struct ContractEntry {
  const char* name;
  ContractFn fn;
};
constexpr int kMaxContractions = 64;

// Construct-on-first-use: registrations run from static initialisers in file order.
inline ContractEntry* contraction_table(int** count) {
  static ContractEntry table[kMaxContractions];
  static int registered = 0;
  *count = &registered;
  return table;
}

bool register_contraction(const char* name, ContractFn fn) {
  int* count;
  ContractEntry* table = contraction_table(&count);
  if (*count >= kMaxContractions) return false;
  table[(*count)++] = ContractEntry{name, fn};
  return true;
}

ContractFn find_contraction(const char* name) {
  int* count;
  ContractEntry* table = contraction_table(&count);
  for (int i = 0; i < *count; ++i)
    if (std::strcmp(table[i].name, name) == 0) return table[i].fn;
  return nullptr;
}

int list_contractions(const char** names, int capacity) {
  int* count;
  ContractEntry* table = contraction_table(&count);
  for (int i = 0; i < *count && i < capacity; ++i) names[i] = table[i].name;
  return *count;
}

// ---- dtype plumbing ---------------------------------------------------------------------------
template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<Operand>{}, TypeTag<Out>{}) for the run-time dtypes; unknown codes are an error
// rather than a silent default.
template <typename F>
cudaError_t dispatch_out(Dtype out, F&& f) {
  switch (out) {
    case Dtype::f32: return f(TypeTag<float>{});
    case Dtype::bf16: return f(TypeTag<__nv_bfloat16>{});
    case Dtype::f16: return f(TypeTag<__half>{});
  }
  return cudaErrorInvalidValue;
}

template <typename F>
cudaError_t dispatch_dtypes(Dtype operand, Dtype out, F&& f) {
  switch (operand) {
    case Dtype::f32:
      return dispatch_out(out, [&](auto out_tag) { return f(TypeTag<float>{}, out_tag); });
    case Dtype::bf16:
      return dispatch_out(out, [&](auto out_tag) { return f(TypeTag<__nv_bfloat16>{}, out_tag); });
    case Dtype::f16:
      return dispatch_out(out, [&](auto out_tag) { return f(TypeTag<__half>{}, out_tag); });
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// gridDim.y is capped at 65535; kernels loop over the batch with this stride.
inline unsigned batch_grid(int64_t batch) { return static_cast<unsigned>(batch < 65535 ? batch : 65535); }

}  // namespace trimul
