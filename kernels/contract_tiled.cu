// tiled — 64x64 output tiles staged through shared memory (k-slabs of 16), 4x4 outputs per
// thread, fp32 FMA accumulate: fp32-accurate at every precision setting.
#include "common.cuh"

namespace trimul {
namespace tiled {

constexpr int kTile = 64;     // output tile is kTile x kTile
constexpr int kSlab = 16;     // k-depth staged per step
constexpr int kThreads = 256; // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPad = 4;       // keeps float4 alignment and spreads the transposed stores over banks

// Loads rows [row0, row0+64) x k-columns [k0, k0+16) of a row-major [rows, k] matrix, transposed
// into tile[k][row], with zeros outside the matrix so tails need no special casing below.
template <typename T>
__device__ __forceinline__ void load_slab(float (&tile)[kSlab][kTile + kPad], const T* __restrict__ src,
                                          int64_t row0, int64_t rows, int64_t k0, int64_t k,
                                          int64_t ld) {
  const int row = threadIdx.x / 4;        // 0..63
  const int kq = (threadIdx.x % 4) * 4;   // 0, 4, 8, 12
  const int64_t grow = row0 + row;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t gk = k0 + kq + e;
    tile[kq + e][row] = (grow < rows && gk < k) ? to_float(src[grow * ld + gk]) : 0.f;
  }
}

template <typename T, typename TOut>
__global__ void __launch_bounds__(kThreads)
contract_kernel(const T* __restrict__ a, const T* __restrict__ b, TOut* __restrict__ z, int64_t batch,
                int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldz) {
  __shared__ __align__(16) float a_tile[kSlab][kTile + kPad];
  __shared__ __align__(16) float b_tile[kSlab][kTile + kPad];
  const int64_t tiles_n = ceil_div(n, kTile);
  const int64_t row0 = (blockIdx.x / tiles_n) * kTile;
  const int64_t col0 = (blockIdx.x % tiles_n) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;

  for (int64_t bz = blockIdx.y; bz < batch; bz += gridDim.y) {
    const T* a_mat = a + bz * m * lda;
    const T* b_mat = b + bz * n * lda;
    float acc[4][4] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kSlab) {
      load_slab(a_tile, a_mat, row0, m, k0, k, lda);
      load_slab(b_tile, b_mat, col0, n, k0, k, lda);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kSlab; ++kk) {
        const float4 av = *reinterpret_cast<const float4*>(&a_tile[kk][ty * 4]);
        const float4 bv = *reinterpret_cast<const float4*>(&b_tile[kk][tx * 4]);
        const float ar[4] = {av.x, av.y, av.z, av.w};
        const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(ar[r], br[c], acc[r][c]);
      }
      __syncthreads();
    }
    TOut* z_mat = z + bz * m * ldz;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t i = row0 + ty * 4 + r;
      if (i >= m) continue;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t j = col0 + tx * 4 + c;
        if (j < n) z_mat[i * ldz + j] = from_float<TOut>(acc[r][c]);
      }
    }
  }
}

// Any operands stored whole (no split or scaled fp16 ones, which only wgmma_tma takes).
bool applies(const ContractArgs& args) { return !args.split && args.z_scale == nullptr; }

cudaError_t launch(const ContractArgs& args) {
  return dispatch_dtypes(args.operand, args.out, [&](auto op_tag, auto out_tag) {
    using T = typename decltype(op_tag)::type;
    using TOut = typename decltype(out_tag)::type;
    if (args.batch == 0 || args.m == 0 || args.n == 0) return cudaSuccess;
    const dim3 grid(static_cast<unsigned>(ceil_div(args.m, kTile) * ceil_div(args.n, kTile)),
                    batch_grid(args.batch));
    contract_kernel<T, TOut><<<grid, kThreads, 0, args.stream>>>(
        static_cast<const T*>(args.a), static_cast<const T*>(args.b), static_cast<TOut*>(args.z),
        args.batch, args.m, args.n, args.k, args.lda, args.ldz);
    return cudaGetLastError();
  });
}

}  // namespace tiled
}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(tiled, trimul::tiled::applies, trimul::tiled::launch);
