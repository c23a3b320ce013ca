// wgmma_f16x3 — contract_backward at "highest": z = a b^T again, da = dz b, db = dz^T a as fp16x3 products
// The products are the forward's own split-operand contraction (wgmma_tma with fp16 parts and z_scale, run by
// the extension through the contraction registry); this file is the pass that makes its operands
// (BackwardPass::split_f16x3): fp32 planes, each scaled by the forward's power of two for rows of no known range
// (fused::exponent_to_4096 of the plane's largest element) and split as the forward's input pass splits its
// operands (input_pass::store_contraction_pair: fp16 hi + lo, 22 significant bits; the products' lo.lo term,
// 2^-22 of the product, is dropped), laid out as they are or transposed, whichever the product reads k-major.
// One read of the planes and one write of the parts; the scales come from device-side bounds (no host
// synchronisation). Per plane, since channels differ in scale: an element r times below its plane's largest
// keeps ~2^-36 / r of relative precision from the parts (2^-22 down to r ~ 2^-14).
#include "input_pass.cuh"

namespace trimul {
namespace contract_backward_f16x3 {

constexpr int kSide = 64;  // a block's tile of a plane: kSide x kSide elements through shared memory
constexpr int kThreads = 256;

// Block (x, y) takes source columns x*kSide.. and rows y*kSide.. of planes z, z + gridDim.z, ...: a tile
// read along the source rows into shared memory (zero past N; kVector: 16-byte loads, the four a thread makes
// issued before any is used), then written scaled and split along the output rows of each layout as half2
// pairs (a warp: 128 contiguous bytes per part).
template <bool kVector>
__global__ void __launch_bounds__(kThreads) split_kernel(const BackwardArgs args) {
  constexpr int kQuads = kSide * kSide / 4 / kThreads;  // 4-element groups per thread
  __shared__ float tile[kSide][kSide + 1];
  const int64_t n = args.n, ld = args.ld, plane_elems = n * ld, remainder = args.batch * plane_elems;
  const int64_t row0 = int64_t(blockIdx.y) * kSide, col0 = int64_t(blockIdx.x) * kSide;
  const float* planes = static_cast<const float*>(args.a_planes);
  for (int64_t plane = blockIdx.z; plane < args.batch; plane += gridDim.z) {
    const float* source = planes + plane * args.plane_stride;
    const int e = fused::exponent_to_4096(args.bound[plane]);
    if (args.unscale != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
      args.unscale[plane] = fused::pow2(-e) * fused::pow2(-fused::exponent_to_4096(args.bound_other[plane]));
    const float scale = fused::pow2(e);
    float x[kQuads][4];
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {  // (loads first, then the shared-memory stores: kQuads loads in flight)
      const int i = threadIdx.x + q * kThreads, r = i / (kSide / 4), c = 4 * (i % (kSide / 4));
      const int64_t row = row0 + r, col = col0 + c;
      const float* at = source + row * args.row_stride + col;
      if constexpr (kVector) {  // (N and the row stride multiples of 4: a group is wholly inside or outside)
        const float4 v = row < n && col < n ? *reinterpret_cast<const float4*>(at) : make_float4(0.f, 0.f, 0.f, 0.f);
        x[q][0] = v.x, x[q][1] = v.y, x[q][2] = v.z, x[q][3] = v.w;
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) x[q][k] = row < n && col + k < n ? at[k] : 0.f;
      }
    }
    __syncthreads();  // (the previous plane's reads of the tile are done)
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {
      const int i = threadIdx.x + q * kThreads, r = i / (kSide / 4), c = 4 * (i % (kSide / 4));
#pragma unroll
      for (int k = 0; k < 4; ++k) tile[r][c + k] = x[q][k];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kSide * kSide / 2; i += kThreads) {
      const int r = i / (kSide / 2), c = 2 * (i % (kSide / 2));
      // (ld is a multiple of 32 and c even: a pair starting before ld ends before it)
      if (args.parts != nullptr && row0 + r < n && col0 + c < ld)
        input_pass::store_contraction_pair<Mode::highest>(args.parts, plane * plane_elems + (row0 + r) * ld + col0 + c,
                                                          tile[r][c], tile[r][c + 1], remainder, scale);
      if (args.parts_t != nullptr && col0 + r < n && row0 + c < ld)
        input_pass::store_contraction_pair<Mode::highest>(args.parts_t, plane * plane_elems + (col0 + r) * ld + row0 + c,
                                                          tile[c][r], tile[c + 1][r], remainder, scale);
    }
  }
}

// The products run on wgmma_tma's split-operand path (Hopper, its tensor-map encoder); only fp32 planes at
// "highest" (at "high" cuBLAS's TF32 products are as fast as the split pass alone). batch * h planes (the
// split pass: batch planes, h = 1).
bool applies(const BackwardArgs& args) {
  return args.operand == Dtype::f32 && args.precision == Precision::highest && tma::tensor_map_encoder() != nullptr &&
         ceil_div(args.n, kSide) + 1 < 65535 && 2 * args.batch * args.h < (int64_t(1) << 31);
}

cudaError_t launch(const BackwardArgs& args) {
  if (args.pass != BackwardPass::split_f16x3) return cudaErrorInvalidValue;  // (its only pass)
  if (args.a_planes == nullptr || args.bound == nullptr || (args.parts == nullptr && args.parts_t == nullptr) ||
      (args.unscale != nullptr && args.bound_other == nullptr) || args.ld < args.n || args.ld % 32 != 0 ||
      !applies(args))
    return cudaErrorInvalidValue;
  if (args.batch == 0 || args.n == 0) return cudaSuccess;
  const unsigned tiles = static_cast<unsigned>(ceil_div(args.ld, kSide));
  const dim3 grid(tiles, tiles, static_cast<unsigned>(args.batch < 65535 ? args.batch : 65535));
  const bool vector = args.n % 4 == 0 && args.row_stride % 4 == 0 && args.plane_stride % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(args.a_planes) % 16 == 0;
  if (vector) {
    split_kernel<true><<<grid, kThreads, 0, args.stream>>>(args);
  } else {
    split_kernel<false><<<grid, kThreads, 0, args.stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace contract_backward_f16x3
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(contract_backward, wgmma_f16x3, ::trimul::contract_backward_f16x3::applies,
                         ::trimul::contract_backward_f16x3::launch);
