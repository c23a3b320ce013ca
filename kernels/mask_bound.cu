// mask_bound — the fp32 modes' F16x3Scale factors for a mask that is not bool (bindings.cpp scales_for_mask):
// max|mask| by a grid of blocks, each block's maximum folded in by an integer atomicMax on the bits of a
// non-negative float (a maximum does not depend on the order of arrival: deterministic), and the last block to
// finish folding the bound into the factors. One launch in place of a dozen tensor ops on the host.
#include "common.cuh"

#include <algorithm>

namespace trimul {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) mask_scales_kernel(const void* __restrict__ mask, MaskKind kind,
                                                               int64_t count, const float* __restrict__ scales,
                                                               float* __restrict__ out, unsigned int* work) {
  float local = 0.f;  // (fmaxf drops NaN: a NaN mask makes the outputs NaN through a and b anyway)
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < count; i += int64_t(gridDim.x) * kThreads)
    local = fmaxf(local, fabsf(load_mask(mask, kind, i)));
  for (int offset = 16; offset > 0; offset >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float block = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) block = fmaxf(block, warp_max[w]);
  atomicMax(&work[0], __float_as_uint(block));
  __threadfence();
  if (atomicAdd(&work[1], 1u) != gridDim.x - 1) return;
  __threadfence();
  // The last block: every other block's maximum is in work[0]. shift = the power of two at or above the bound,
  // exactly (frexpf: bound = m 2^e, m in [0.5, 1); m = 0.5 is a power of two itself).
  const float bound = fmaxf(1.f, __uint_as_float(atomicAdd(&work[0], 0u)));
  int exponent;
  const float mantissa = frexpf(bound, &exponent);
  const float shift = ldexpf(1.f, mantissa == 0.5f ? exponent - 1 : exponent);
  for (int s = 0; s < kF16x3Scales; ++s) out[s] = scales[s];
  out[kAbUp] = scales[kAbUp] / shift;
  out[kZDown] = scales[kZDown] * shift * shift;
}

}  // namespace

cudaError_t launch_mask_scales(const void* mask, MaskKind kind, int64_t count, const float* scales, float* out,
                               unsigned int* work, cudaStream_t stream) {
  const cudaError_t cleared = cudaMemsetAsync(work, 0, 2 * sizeof(unsigned int), stream);
  if (cleared != cudaSuccess) return cleared;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(count, 8 * kThreads), 4 * sm_count()));
  mask_scales_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(mask, kind, count, scales, out,
                                                                                 work);
  return cudaGetLastError();
}

}  // namespace trimul
