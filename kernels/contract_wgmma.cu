// wgmma — Hopper warpgroup MMA (sm_90a): 128x128 tiles, two warpgroups of 64 rows each issuing
// m64n128k16 (k8 for TF32) from 128-byte-swizzled shared memory, a 4-buffer cp.async pipeline two
// k-tiles ahead; bf16/fp16 operands, and TF32 ones that are already TF32 values; fp32 accumulation.
#include "tma.cuh"

namespace trimul {
namespace contract_wgmma {

using namespace ::trimul::tma;

constexpr int BM = 128, BN = 128;
constexpr int kRowBytes = 128;          // bytes of k per tile row: one 128-byte swizzle row
constexpr int kBuffers = 4, kAhead = 2;  // a buffer is refilled two iterations after its MMAs
constexpr int kThreads = 256;
constexpr int kTileBytes = BM * kRowBytes;  // A or B tile of one buffer (16 KB)
constexpr int kSmemBytes = kBuffers * 2 * kTileBytes + 1024;  // + slack for 1024-byte alignment

// rows x 128 bytes of k of a K-major matrix into a swizzled tile: 16-byte chunk c of row r goes to
// chunk c ^ (r % 8) of that row, which is where the 128-byte swizzle mode reads it. Rows past
// `rows` and chunks past the row's padded length `ld` are zero-filled.
template <int ROWS>
__device__ __forceinline__ void load_tile(uint8_t* tile, const char* mat, int64_t ld_bytes, int64_t row0,
                                          int64_t rows, int64_t k_byte) {
#pragma unroll
  for (int it = 0; it < ROWS * 8 / kThreads; ++it) {
    const int chunk = threadIdx.x + it * kThreads;
    const int r = chunk >> 3, c = chunk & 7;
    const int64_t byte = k_byte + c * 16;
    const bool ok = row0 + r < rows && byte < ld_bytes;
    const char* src = ok ? mat + (row0 + r) * ld_bytes + byte : mat;
    mma::cp_async16(tile + r * 128 + ((c ^ (r & 7)) << 4), src, ok);
  }
}


template <typename Op, typename TOut>
__global__ void __launch_bounds__(kThreads, 1)
contract_kernel(const Op* __restrict__ a, const Op* __restrict__ b, TOut* __restrict__ z, int64_t batch,
                int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldz) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int64_t tiles_n = ceil_div(n, BN);
  const int64_t row0 = (blockIdx.x / tiles_n) * BM, col0 = (blockIdx.x % tiles_n) * BN;
  const int warpgroup = threadIdx.x / 128;
  const int64_t ld_bytes = lda * static_cast<int64_t>(sizeof(Op));
  const int k_tiles = static_cast<int>(ceil_div(k * static_cast<int64_t>(sizeof(Op)), kRowBytes));
  const bool paired_store = (ldz % 2) == 0;

  for (int64_t bz = blockIdx.y; bz < batch; bz += gridDim.y) {
    const char* a_mat = reinterpret_cast<const char*>(a + bz * m * lda);
    const char* b_mat = reinterpret_cast<const char*>(b + bz * n * lda);
    auto fetch = [&](int kt) {
      if (kt < k_tiles) {
        uint8_t* buf = smem + (kt % kBuffers) * 2 * kTileBytes;
        load_tile<BM>(buf, a_mat, ld_bytes, row0, m, int64_t(kt) * kRowBytes);
        load_tile<BN>(buf + kTileBytes, b_mat, ld_bytes, col0, n, int64_t(kt) * kRowBytes);
      }
      mma::cp_async_commit();
    };
    float acc[64];
#pragma unroll
    for (int r = 0; r < 64; ++r) acc[r] = 0.f;
#pragma unroll
    for (int s = 0; s < kAhead; ++s) fetch(s);
    for (int kt = 0; kt < k_tiles; ++kt) {
      mma::cp_async_wait<kAhead - 1>();
      fence_proxy_async();
      __syncthreads();  // tile kt is in; every warpgroup finished the MMAs of tile kt - 2
      fetch(kt + kAhead);
      const uint8_t* buf = smem + (kt % kBuffers) * 2 * kTileBytes;
      const uint64_t desc_a = smem_descriptor(buf + warpgroup * 64 * 128);
      const uint64_t desc_b = smem_descriptor(buf + kTileBytes);
      wgmma_k_tile<Op>(acc, desc_a, desc_b);
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
    mma::cp_async_wait<0>();
    __syncthreads();  // the next batch's prologue reuses the buffers

    store_accumulators<BN>(z + bz * m * ldz, acc, row0 + warpgroup * 64, col0, m, n, ldz, paired_store);
  }
}

template <typename Op, typename TOut>
cudaError_t launch_types(const ContractArgs& args) {
  return fused::launch_contraction<contract_kernel<Op, TOut>, Op, TOut, BM, BN>(args, kThreads, kSmemBytes);
}

// sm_90a on Hopper; fp32 operands only as TF32 values already (the fused input pass rounds them; the
// tensor cores would truncate raw fp32) and only where TF32 is allowed; no split or scaled operands;
// rows are read up to their padded length.
bool applies(const ContractArgs& args) {
  const bool tf32 = args.operand == Dtype::f32;
  return sm90a_ready() && !(tf32 && (!args.tf32_rounded || args.precision == Precision::highest)) && !args.split &&
         args.z_scale == nullptr && args.lda >= args.k;
}

cudaError_t launch(const ContractArgs& args) {
  if (!applies(args)) return cudaErrorNotSupported;
  if (args.batch == 0 || args.m == 0 || args.n == 0) return cudaSuccess;
  return dispatch_dtypes(args.operand, args.out, [&](auto op_tag, auto out_tag) {
    return launch_types<typename decltype(op_tag)::type, typename decltype(out_tag)::type>(args);
  });
}

}  // namespace contract_wgmma
}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(wgmma, trimul::contract_wgmma::applies, trimul::contract_wgmma::launch);
