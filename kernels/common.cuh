// common.cuh — what every kernel file shares: the registration macros (registry.cuh), dtype
// dispatch, conversions and the device's limits. Each kernels/*.cu is its own translation unit:
// whatever a header defines is inline or a template.
#pragma once
#include "registry.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <utility>

namespace trimul {

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

// The sum over a warp by a butterfly: every lane gets the same bits (each step adds the same two values).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of every thread's v over a block of kThreads (a multiple of 32) in a fixed order (each warp's
// butterfly, then the warps' sums in warp order): the same bits on every run, in every thread. scratch:
// kThreads / 32 floats of shared memory, free again on return.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// A value of a run-time dtype as fp32 (parameters of mixed dtypes: per-tensor codes, small reads).
__device__ __forceinline__ float load_float(const void* p, Dtype dtype, int64_t i) {
  switch (dtype) {
    case Dtype::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Dtype::f16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
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

// A mask element's bits as loaded, apart from their conversion (mask_value), so that a prefetch does not
// wait for its load where it converts: 8-, 16- and 32-bit kinds as they are, i64 converted to its float's
// bits here (that kind waits). Zero bits are the value 0 in every kind (a position that does not exist).
__device__ __forceinline__ uint32_t load_mask_bits(const void* mask, MaskKind kind, int64_t off) {
  switch (kind) {
    case MaskKind::u8: return static_cast<const uint8_t*>(mask)[off];
    case MaskKind::i32:
    case MaskKind::f32: return static_cast<const uint32_t*>(mask)[off];
    case MaskKind::i64: return __float_as_uint(static_cast<float>(static_cast<const int64_t*>(mask)[off]));
    case MaskKind::bf16:
    case MaskKind::f16: return static_cast<const uint16_t*>(mask)[off];
  }
  return 0u;
}
__device__ __forceinline__ float mask_value(uint32_t bits, MaskKind kind) {
  switch (kind) {
    case MaskKind::u8: return static_cast<float>(bits);
    case MaskKind::i32: return static_cast<float>(static_cast<int32_t>(bits));
    case MaskKind::i64:
    case MaskKind::f32: return __uint_as_float(bits);
    case MaskKind::bf16: return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
    case MaskKind::f16: return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
  return 0.f;
}
// A mask element, in whatever dtype the mask came in, as a float.
__device__ __forceinline__ float load_mask(const void* mask, MaskKind kind, int64_t off) {
  return mask_value(load_mask_bits(mask, kind, off), kind);
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Device limits, read once per device (a small forward must not pay driver queries each call).
inline int64_t device_attribute(cudaDeviceAttr attr, int slot) {
  constexpr int kMaxDevices = 64;
  static int64_t cache[5][kMaxDevices] = {};
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  if (cache[slot][device] == 0 && cudaDeviceGetAttribute(&value, attr, device) == cudaSuccess)
    cache[slot][device] = int64_t(value) + 1;  // (+ 1: a cached 0 stays distinct from "not read yet")
  return cache[slot][device] > 0 ? cache[slot][device] - 1 : 0;
}
inline int64_t max_smem_optin() { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 0); }
inline int64_t max_smem_per_sm() { return device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, 1); }
inline int64_t sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount, 2); }
// (programmatic dependent launch: compute capability 9.0 and later)
inline int64_t compute_capability_major() { return device_attribute(cudaDevAttrComputeCapabilityMajor, 3); }
// major * 10 + minor, e.g. 90 on Hopper
inline int64_t compute_capability() {
  return 10 * compute_capability_major() + device_attribute(cudaDevAttrComputeCapabilityMinor, 4);
}

// gridDim.y is capped at 65535; kernels loop over the batch with this stride.
inline unsigned batch_grid(int64_t batch) { return static_cast<unsigned>(batch < 65535 ? batch : 65535); }

}  // namespace trimul
