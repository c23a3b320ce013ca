// wgmma_tf32x3 — position_gemm at "highest": out[M, N] = rows[M, K] W[N, K]^T + bias in fp32, as 3xTF32 on wgmma
// with the rows split in registers: fp32-accurate, and faster than cuBLAS's fp32 GEMMs on the CUDA cores.
// Why fp32-accurate: x = hi + lo with hi = tf32(x), lo = tf32(x - hi) (22 of fp32's 24 significant bits), for
// the rows and W alike; hi.hi + hi.lo + lo.hi drops lo.lo (~2^-22 relative). The tensor cores' fp32 sums truncate,
// and over all of K their error grows linearly with K (bench/NOTES.md): each 32-k tile's
// products start from zero and are added into fp32 registers (rounded), so the truncating sums run over 32 k.
// Layout: a block is two consumer warpgroups (64 rows each) and a producer warpgroup over a 128 x 128 output tile
// (one of its threads issues the TMA loads; the group hands its registers to the consumers: setmaxnreg). Each
// of 4 stages holds the block's 128 rows x 32 k (TMA, 128-byte swizzle, zeros past M and K) and 128 n x 32 k of W's
// hi and lo parts (BackwardPass::split_weight lays W out once per call as [2][N_pad][K_pad], k permuted within
// each 32-k tile so that a thread's two 16-byte chunks of a row hold its A fragments of all four k8 steps). A
// thread reads its rows' chunks from shared memory, splits them and issues each k8 step's three products with A
// from registers (lo.hi, hi.lo, hi.hi).
#include "position_gemm.cuh"

namespace trimul {
namespace position_gemm_tf32x3 {

using namespace ::trimul::tma;
using namespace ::trimul::position_gemm;

constexpr int kBK = 32;  // k per stage: one 128-byte row of fp32
constexpr int kStages = 4;
constexpr int kPartBytes = kBM * kBK * 4;  // 16 KiB: the rows' box, W hi's, W lo's
constexpr int kStageBytes = 3 * kPartBytes;
constexpr int kSmemBytes = 1023 + kStages * kStageBytes + 2 * kStages * 8;
static_assert(kBN == 128 && kBM == 128, "position_gemm_split_floats (api.cuh) pads N to 128 and K to 64");

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = mma::to_tf32(x);
  lo = mma::to_tf32(x - __uint_as_float(hi));
}


// The k a split weight's slot q (0..31) of a 32-k tile holds: step j = q / 8 reads slots 8j .. 8j + 7 as its k
// 0..7; the thread with lane % 4 = t holds k t and t + 4 of every step, from its 16-byte chunks 2t and 2t + 1 of a
// row (elements 8t .. 8t + 7): element 8t + 2j as k t, 8t + 2j + 1 as k t + 4.
__device__ __forceinline__ int slot_k(int q) {
  const int j = q >> 3, l = q & 7;
  return l < 4 ? 8 * l + 2 * j : 8 * (l - 4) + 2 * j + 1;
}

// W [N, K] (strides sn, sk) -> [2][n_pad][k_pad]: the hi parts, then the lo parts, zeros past N and K.
__global__ void split_weight_kernel(const float* __restrict__ w, int64_t sn, int64_t sk, int64_t n, int64_t k,
                                    int64_t n_pad, int64_t k_pad, float* __restrict__ out) {
  const int64_t total = n_pad * k_pad;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / k_pad, q = i % k_pad;
    const int64_t col = (q & ~int64_t(31)) + slot_k(static_cast<int>(q & 31));
    uint32_t hi, lo;
    split(row < n && col < k ? w[row * sn + col * sk] : 0.0f, hi, lo);
    out[i] = __uint_as_float(hi);
    out[total + i] = __uint_as_float(lo);
  }
}

// This thread's A fragments of a stage's 32 k, from its warpgroup's 64 swizzled rows `rows` (row r's 16-byte chunk
// c at chunk c ^ (r % 8); a warp's rows 16 w4 + g and + 8 both sit at g mod 8), split into tf32 parts
// (hi[j], lo[j]: k8 step j).
__device__ __forceinline__ void load_fragments(uint32_t (&hi)[4][4], uint32_t (&lo)[4][4], const uint8_t* rows, int w4,
                                               int g, int t) {
  const uint8_t* r0 = rows + (16 * w4 + g) * 128;
  const uint8_t* r8 = r0 + 8 * 128;
  const float4 x0 = *reinterpret_cast<const float4*>(r0 + (((2 * t) ^ g) << 4));
  const float4 x1 = *reinterpret_cast<const float4*>(r0 + (((2 * t + 1) ^ g) << 4));
  const float4 y0 = *reinterpret_cast<const float4*>(r8 + (((2 * t) ^ g) << 4));
  const float4 y1 = *reinterpret_cast<const float4*>(r8 + (((2 * t + 1) ^ g) << 4));
  const float row0[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  const float row8[8] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    split(row0[2 * j], hi[j][0], lo[j][0]);
    split(row8[2 * j], hi[j][1], lo[j][1]);
    split(row0[2 * j + 1], hi[j][2], lo[j][2]);
    split(row8[2 * j + 1], hi[j][3], lo[j][3]);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_rows, const __grid_constant__ CUtensorMap map_w, int64_t m,
                int64_t n, int k_tiles, int n_pad, int n_tiles, int tiles, const float* __restrict__ bias,
                float* __restrict__ out, int64_t ld_out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  // Persistent (fill_tiles: one block per SM), so that the producer fills the next tile's stages while the
  // consumers finish this one (with K = 128 a tile is four stages: its fill and epilogue would otherwise be a third
  // of its time).
  const int my_tiles = (tiles - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1;
  const auto fill = [&](FillRing& ring) {  // every stage's three boxes
    fill_tiles(ring, smem, full, kStageBytes, tiles, n_tiles, k_tiles,
               [&](uint8_t* stage, uint64_t* barrier, int m0, int n0, int kt) {
                 tma_load_2d(stage, &map_rows, kt * kBK, m0, barrier);
                 tma_load_2d(stage + kPartBytes, &map_w, kt * kBK, n0, barrier);
                 tma_load_2d(stage + 2 * kPartBytes, &map_w, kt * kBK, n_pad + n0, barrier);
               });
  };
  const auto consume = [&] {  // (two fragment sets, the accumulators and their fp32 sums: more than 168 registers)
    const int wg = threadIdx.x >> 7, w4 = warp_index() & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // While a k-tile's products run, the next k-tile's fragments (the next output tile's first, after a tile's last)
    // are loaded and split into the other fragment set; the k-tile's group is waited for within its step (a group
    // in flight across the loop's back edge, its accumulators live across it, made ptxas serialize every wgmma).
    // Stages and their phases count the block's k-tiles over all its tiles (`it`), as the producer fills them.
    float acc[64], total[64];
    uint32_t hi[2][4][4], lo[2][4][4];
    const int iterations = my_tiles * k_tiles;
    const auto fragments = [&](uint32_t(&h)[4][4], uint32_t(&l)[4][4], int it) {
      mbar_wait(&full[it % kStages], (it / kStages) & 1);
      load_fragments(h, l, smem + (it % kStages) * kStageBytes + wg * 64 * 128, w4, g, t);
    };
    const auto step = [&](int it, int kt, const uint32_t(&h)[4][4], const uint32_t(&l)[4][4],
                          uint32_t(&h_next)[4][4], uint32_t(&l_next)[4][4]) {
      uint8_t* stage = smem + (it % kStages) * kStageBytes;
      const uint64_t desc_hi = smem_descriptor(stage + kPartBytes), desc_lo = smem_descriptor(stage + 2 * kPartBytes);
      products<float>(acc, h, l, desc_hi, desc_lo);
      if (it + 1 < iterations) fragments(h_next, l_next, it + 1);
      wgmma_wait<0>();
      fence_accumulators(acc);
      fence_proxy_async();  // (this thread's ld.shared of the stage before TMA refills it)
      mbar_arrive(&empty[it % kStages]);
#pragma unroll
      for (int i = 0; i < 64; ++i) total[i] = kt > 0 ? total[i] + acc[i] : acc[i];
    };
    fragments(hi[0], lo[0], 0);
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int64_t m0 = int64_t(tile / n_tiles) * kBM;
      const int n0 = (tile % n_tiles) * kBN;
      for (int kt = 0; kt < k_tiles; kt += 2, it += 2) {  // (k_tiles even: K is padded to 64)
        step(it, kt, hi[0], lo[0], hi[1], lo[1]);
        step(it + 1, kt + 1, hi[1], lo[1], hi[0], lo[0]);
      }
      store_tile<false>(total, m0 + 64 * wg + 16 * w4 + g, n0, t, m, n, nullptr, bias, out, ld_out);
    }
  };
  run_block(full, empty, kStages, fill, consume);
}

// ---- rows_grad: out[N, K] = d[P, N]^T x[P, K], the weight gradients (K = positions in GEMM terms) -------------
// Both operands are position-major and tf32 wgmma reads B K-major only, so the block's consumer threads lay B out
// themselves: each stage holds 32 positions of d (128 of its columns: A) and of x (128 of its columns: B) by TMA;
// the threads split x's into tf32 hi/lo B tiles [128 n][32 positions] (K-major, 128-byte swizzle) for the next
// tile while this tile's products run, and build their A fragments (d's values at a fragment's (position, column))
// from the stage with scalar loads. Each 32-position tile's 12 products are added into fp32 registers, as in
// rows_gemm: the tensor cores' truncating sums then run over 32 positions, not over ~10^6. Blocks take fixed
// chunks of kGradChunk positions and write [chunk][N][K] partials that grad_sum adds in chunk order: the same bits
// on any GPU.
constexpr int kGradBoxBytes = 32 * 32 * 4;               // 32 positions x 32 columns
constexpr int kGradStageBytes = 8 * kGradBoxBytes;       // d's four boxes, then x's four
constexpr int kGradPartBytes = kBN * kBK * 4;            // one split part of a B tile
constexpr int kGradSmemBytes = 1023 + kStages * kGradStageBytes + 2 * 2 * kGradPartBytes + 2 * kStages * 8;

// x's 32 positions x 128 columns of a stage (four boxes of 32 columns, 128-byte swizzle) -> the B tiles `hi` and `lo`
// [128 n][32 positions]: each of the 256 consumer threads takes four (column, 4-position chunk) units, a warp 32
// consecutive columns of one chunk (conflict-free reads and 16-byte stores).
__device__ __forceinline__ void split_b_tile(const uint8_t* x, uint8_t* hi, uint8_t* lo) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int unit = tid + kConsumerThreads * i, n = unit & 127, c = unit >> 7;  // (c: positions 4c .. 4c + 3)
    const uint8_t* box = x + (n >> 5) * kGradBoxBytes;
    const int nn = n & 31;
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int p = 4 * c + e;
      v[e] = *reinterpret_cast<const float*>(box + p * 128 + ((((nn >> 2) ^ (p & 7))) << 4) + (nn & 3) * 4);
    }
    uint4 h, l;
    split(v[0], h.x, l.x);
    split(v[1], h.y, l.y);
    split(v[2], h.z, l.z);
    split(v[3], h.w, l.w);
    const int offset = n * 128 + ((c ^ (n & 7)) << 4);
    *reinterpret_cast<uint4*>(hi + offset) = h;
    *reinterpret_cast<uint4*>(lo + offset) = l;
  }
}

// This thread's A fragments of a stage's 32 positions: A[m][k] = d[position k][column m] for its warpgroup's 64
// columns (boxes 2 wg and 2 wg + 1 of the stage's d), split into tf32 parts (hi[j], lo[j]: k8 step j).
__device__ __forceinline__ void load_grad_fragments(uint32_t (&hi)[4][4], uint32_t (&lo)[4][4], const uint8_t* d,
                                                    int wg, int w4, int g, int t) {
  const uint8_t* box = d + (2 * wg + (w4 >> 1)) * kGradBoxBytes;
  const int m0 = 16 * (w4 & 1) + g;  // (this thread's two columns: m0 and m0 + 8 of the box)
  const auto at = [&](int p, int m) {
    return *reinterpret_cast<const float*>(box + p * 128 + (((m >> 2) ^ (p & 7)) << 4) + (m & 3) * 4);
  };
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    split(at(8 * j + t, m0), hi[j][0], lo[j][0]);
    split(at(8 * j + t, m0 + 8), hi[j][1], lo[j][1]);
    split(at(8 * j + t + 4, m0), hi[j][2], lo[j][2]);
    split(at(8 * j + t + 4, m0 + 8), hi[j][3], lo[j][3]);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    grad_kernel(const __grid_constant__ CUtensorMap map_d, const __grid_constant__ CUtensorMap map_x, int64_t positions,
                int64_t n, int64_t k, int m_tiles, int n_tiles, float* __restrict__ partials) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint8_t* b_tiles = smem + kStages * kGradStageBytes;  // [buffer][hi | lo], kGradPartBytes each
  uint64_t* full = reinterpret_cast<uint64_t*>(b_tiles + 4 * kGradPartBytes);
  uint64_t* empty = full + kStages;
  const GradBlock block = grad_block(positions, m_tiles, n_tiles, kBK);
  const int m0 = block.m0, n0 = block.n0, k_tiles = block.k_tiles;  // (m: d's columns, n: x's)
  const auto fill = [&](FillRing& ring) {
    fill_grad_stages(ring, smem, full, kGradStageBytes, kBK, block, &map_d, &map_x);
  };
  const auto consume = [&] {
    const int wg = threadIdx.x >> 7, w4 = warp_index() & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float acc[64], total[64];
    uint32_t hi[2][4][4], lo[2][4][4];
    const auto b_part = [&](int buffer, int part) { return b_tiles + (2 * buffer + part) * kGradPartBytes; };
    // Tile kt's operands: x split into B buffer kt % 2, d's fragments into fragment set kt % 2; then the stage is
    // released (every read of it done).
    const auto operands = [&](int kt, uint32_t(&h)[4][4], uint32_t(&l)[4][4]) {
      const int s = kt % kStages;
      uint8_t* stage = smem + s * kGradStageBytes;
      mbar_wait(&full[s], (kt / kStages) & 1);
      split_b_tile(stage + 4 * kGradBoxBytes, b_part(kt & 1, 0), b_part(kt & 1, 1));
      load_grad_fragments(h, l, stage, wg, w4, g, t);
      fence_proxy_async();  // (the B tile's stores before wgmma reads them; the stage's reads before TMA refills it)
      mbar_arrive(&empty[s]);
    };
    // Tile kt's products while tile kt + 1's operands are laid out; the barrier after it: tile kt + 1's B tile
    // written by every thread, and tile kt's products done in both groups (its B buffer is tile kt + 2's).
    const auto step = [&](int kt, const uint32_t(&h)[4][4], const uint32_t(&l)[4][4], uint32_t(&h_next)[4][4],
                          uint32_t(&l_next)[4][4]) {
      const uint64_t desc_hi = smem_descriptor(b_part(kt & 1, 0)), desc_lo = smem_descriptor(b_part(kt & 1, 1));
      products<float>(acc, h, l, desc_hi, desc_lo);
      if (kt + 1 < k_tiles) operands(kt + 1, h_next, l_next);
      wgmma_wait<0>();
      fence_accumulators(acc);
#pragma unroll
      for (int i = 0; i < 64; ++i) total[i] = kt > 0 ? total[i] + acc[i] : acc[i];
      named_barrier(1, kConsumerThreads);
    };
    operands(0, hi[0], lo[0]);
    named_barrier(1, kConsumerThreads);
    for (int kt = 0; kt < k_tiles; kt += 2) {
      step(kt, hi[0], lo[0], hi[1], lo[1]);
      if (kt + 1 < k_tiles) step(kt + 1, hi[1], lo[1], hi[0], lo[0]);
    }
    store_partials(total, partials + int64_t(block.chunk) * n * k, m0 + 64 * wg + 16 * w4 + g, n0, t, n, k);
  };
  run_block(full, empty, kStages, fill, consume);
}

// fp32 rows at "highest" (at "high" cuBLAS's one-pass TF32 is the mode's own rounding) that TMA reads, K >= 1,
// TMA's 32-bit coordinates, and Hopper's shared memory; rows_grad: d likewise.
bool applies(const BackwardArgs& args) {
  const bool sizes = args.operand == Dtype::f32 && args.precision == Precision::highest &&
                     tensor_map_encoder() != nullptr && args.gemm_k >= 1 && args.gemm_n >= 1 &&
                     args.gemm_m < (int64_t(1) << 31) && padded(args.gemm_k, 64) < (int64_t(1) << 31) &&
                     2 * padded(args.gemm_n, kBN) < (int64_t(1) << 31);
  if (args.pass == BackwardPass::rows_grad)
    return sizes && rows_take(args.gemm_rows, args.gemm_ld, args.gemm_k) &&
           rows_take(args.gemm_d, args.gemm_ld_d, args.gemm_n) && kGradSmemBytes <= max_smem_optin();
  // (rows_gemm: a block's k-tiles over all its tiles, and the tiles, counted in int)
  const bool counts = ceil_div(args.gemm_m, kBM) * (padded(args.gemm_n, kBN) / kBN) * (padded(args.gemm_k, 64) / kBK) <
                      (int64_t(1) << 31);
  return sizes && counts && rows_take(args.gemm_rows, args.gemm_ld, args.gemm_k) && kSmemBytes <= max_smem_optin();
}

cudaError_t launch(const BackwardArgs& args) {
  if (!applies(args)) return cudaErrorInvalidValue;
  if (args.pass == BackwardPass::rows_grad) return launch_grad<grad_kernel>(args, 32, kGradSmemBytes);
  const int64_t n_pad = padded(args.gemm_n, kBN), k_pad = padded(args.gemm_k, 64);
  if (args.gemm_w_split == nullptr || args.gemm_w_split_floats < position_gemm_split_floats(args.gemm_n, args.gemm_k))
    return cudaErrorInvalidValue;
  if (args.pass == BackwardPass::split_weight) {
    if (args.gemm_w == nullptr) return cudaErrorInvalidValue;
    const int64_t blocks = std::min<int64_t>(ceil_div(n_pad * k_pad, 256), 4096);
    split_weight_kernel<<<static_cast<unsigned>(blocks), 256, 0, args.stream>>>(
        args.gemm_w, args.gemm_w_sn, args.gemm_w_sk, args.gemm_n, args.gemm_k, n_pad, k_pad, args.gemm_w_split);
    return cudaGetLastError();
  }
  return launch_rows<gemm_kernel, float>(args, n_pad, k_pad, kBK, kSmemBytes);
}

}  // namespace position_gemm_tf32x3
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(position_gemm, wgmma_tf32x3, ::trimul::position_gemm_tf32x3::applies,
                         ::trimul::position_gemm_tf32x3::launch);
