// mma — tensor cores via mma.sync: 128x128 tiles, 4 warps of 64x64, 3-stage cp.async pipeline;
// bf16/f16 operands as they are, fp32 operands as split 3xTF32 ("highest") or TF32 otherwise.
#include "fused.cuh"

namespace trimul {
namespace contract_mma {

using namespace ::trimul::mma;
using Tile = Tiling<2, 2, 4, 8>;  // 128 x 128 block, 64 x 64 per warp

template <Mode M, typename TOut, bool PreRounded>
__global__ void __launch_bounds__(Tile::kThreads)
contract_kernel(const op_t<M>* __restrict__ a, const op_t<M>* __restrict__ b, TOut* __restrict__ z,
                int64_t batch, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldz) {
  extern __shared__ __align__(16) uint32_t smem[];
  constexpr int kStageWords = (Tile::BM + Tile::BN) * kSlabStride;
  const int64_t tiles_n = ceil_div(n, Tile::BN);
  const int64_t row0 = (blockIdx.x / tiles_n) * Tile::BM;
  const int64_t col0 = (blockIdx.x % tiles_n) * Tile::BN;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / Tile::WN, wn = warp % Tile::WN;
  const int g = lane >> 2, t = lane & 3;
  const int k_slabs = static_cast<int>(ceil_div(k * static_cast<int64_t>(sizeof(op_t<M>)), kSlabBytes));
  const int64_t ld_bytes = lda * static_cast<int64_t>(sizeof(op_t<M>));
  const bool paired_store = (ldz % 2) == 0;

  for (int64_t bz = blockIdx.y; bz < batch; bz += gridDim.y) {
    const char* a_mat = reinterpret_cast<const char*>(a + bz * m * lda);
    const char* b_mat = reinterpret_cast<const char*>(b + bz * n * lda);
    auto fetch = [&](int slab) {
      if (slab < k_slabs) {
        uint32_t* stage = smem + (slab % kStages) * kStageWords;
        const int64_t k_byte = static_cast<int64_t>(slab) * kSlabBytes;
        load_slab_async<Tile::BM, Tile::kThreads>(stage, a_mat, ld_bytes, row0, m, k_byte);
        load_slab_async<Tile::BN, Tile::kThreads>(stage + Tile::BM * kSlabStride, b_mat, ld_bytes,
                                                  col0, n, k_byte);
      }
      cp_async_commit();
    };
    float acc[Tile::MT][Tile::NT][4];
    zero<Tile>(acc);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) fetch(s);
    for (int slab = 0; slab < k_slabs; ++slab) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      fetch(slab + kStages - 1);
      const uint32_t* stage = smem + (slab % kStages) * kStageWords;
      warp_slab<M, Tile::MT, Tile::NT, PreRounded>(acc, stage + (wm * Tile::MT * 16) * kSlabStride, kSlabStride,
                                       stage + (Tile::BM + wn * Tile::NT * 8) * kSlabStride,
                                       kSlabStride, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // the next batch's prologue reuses the stages

    TOut* z_mat = z + bz * m * ldz;
#pragma unroll
    for (int mi = 0; mi < Tile::MT; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t i = row0 + wm * Tile::MT * 16 + mi * 16 + g + half * 8;
        if (i >= m) continue;
#pragma unroll
        for (int ni = 0; ni < Tile::NT; ++ni) {
          const int64_t j = col0 + wn * Tile::NT * 8 + ni * 8 + 2 * t;
          if (j >= n) continue;
          store_pair(z_mat + i * ldz + j, acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1], j + 1 < n,
                     paired_store);
        }
      }
  }
}

constexpr int kSmemBytes = kStages * (Tile::BM + Tile::BN) * kSlabStride * 4;

template <Mode M, typename TOut, bool PreRounded = false>
cudaError_t launch_mode(const ContractArgs& args) {
  return fused::launch_contraction<contract_kernel<M, TOut, PreRounded>, op_t<M>, TOut, Tile::BM, Tile::BN>(
      args, Tile::kThreads, kSmemBytes);
}

// mma.sync's bf16 and TF32 shapes: compute capability 8.0 and later; operands stored whole (no split or
// scaled fp16 ones); whole 64-byte slabs are read, so rows are padded (see ContractArgs).
bool applies(const ContractArgs& args) {
  const int64_t esize = args.operand == Dtype::f32 ? 4 : 2;
  return compute_capability() >= 80 && !args.split && args.z_scale == nullptr &&
         (args.lda * esize) % kSlabBytes == 0 && args.lda >= args.k;
}

cudaError_t launch(const ContractArgs& args) {
  if (!applies(args)) return cudaErrorNotSupported;
  if (args.batch == 0 || args.m == 0 || args.n == 0) return cudaSuccess;
  return dispatch_out(args.out, [&](auto out_tag) -> cudaError_t {
    using TOut = typename decltype(out_tag)::type;
    switch (args.operand) {
      case Dtype::bf16: return launch_mode<Mode::bf16, TOut>(args);
      case Dtype::f16: return launch_mode<Mode::f16, TOut>(args);
      case Dtype::f32:
        if (args.precision == Precision::highest) return launch_mode<Mode::highest, TOut>(args);
        return args.tf32_rounded ? launch_mode<Mode::high, TOut, true>(args) : launch_mode<Mode::high, TOut>(args);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace contract_mma
}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(mma, trimul::contract_mma::applies, trimul::contract_mma::launch);
