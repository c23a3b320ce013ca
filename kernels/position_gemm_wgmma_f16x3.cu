// wgmma_f16x3 — position_gemm at "highest" on fp16 parts: out[M, N] = rows[M, K] W[N, K]^T + bias in fp32, as
// three fp16 products on wgmma (twice tf32's rate, half its bytes of W and of shared-memory reads) with power-of-two
// scales that keep the parts inside fp16's range.
// Why fp32-accurate: a row's values over a 64-k tile are scaled by s (a power of two putting the largest |x s| in
// [2^14, 2^15)), x s = hi + lo with hi = fp16(x s), lo = fp16(x s - hi): 22 significant bits, as tf32x3's parts;
// W likewise with one scale per output column over all of K. hi.hi + hi.lo + lo.hi drops lo.lo (~2^-22). Each
// 64-k tile's products start from zero and are added into fp32 registers times 1 / s (exact: a power of two), so
// the tensor cores' truncating sums run over 64 k; the column scales come out in the epilogue.
// Layout: wgmma_tf32x3's (two consumer warpgroups of 64 rows, a producer warpgroup that hands its registers over,
// persistent over 128 x 128 output tiles), with 64 k per stage: the rows as two 128-row x 32-k fp32 boxes, W's hi
// and lo parts as 128 n x 64 k fp16 (BackwardPass::split_weight lays W out once per call, k permuted within each
// 64-k tile so that a thread's four 16-byte chunks of a row hold its A fragments of all four k16 steps). The weight
// gradients (rows_grad, below) likewise, with 64 positions a tile.
#include "position_gemm.cuh"

namespace trimul {
namespace position_gemm_f16x3 {

using namespace ::trimul::tma;
using namespace ::trimul::position_gemm;

constexpr int kBK = 64;  // k per stage
constexpr int kStages = 3;
constexpr int kRowsBoxBytes = kBM * 32 * 4;                       // 16 KiB: 128 rows x 32 k of fp32
constexpr int kPartBytes = kBN * kBK * 2;                         // 16 KiB: 128 n x 64 k of fp16
constexpr int kStageBytes = 2 * kRowsBoxBytes + 2 * kPartBytes;  // rows k 0-31, k 32-63, W hi, W lo
constexpr int kSmemBytes = 1023 + kStages * kStageBytes + 2 * kStages * 8;
static_assert(kBN == 128 && kBM == 128, "position_gemm_split_floats (api.cuh) pads N to 128 and K to 64");

// The power-of-two scale s that puts `largest` (>= 0) in [2^14, 2^15), and 1 / s, both exact: from the exponent
// field e of largest, s = 2^(141 - e); e is taken as at least 15 (largest below 2^-112, zero included: s = 2^126,
// whose reciprocal is still a normal float). An infinite or NaN largest gives a finite s: the non-finite values
// stay so through the products.
__device__ __forceinline__ void scale_for(float largest, float& s, float& inv) {
  const int e = max(static_cast<int>((__float_as_uint(largest) >> 23) & 0xff), 15);
  s = __uint_as_float(static_cast<uint32_t>(268 - e) << 23);
  inv = __uint_as_float(static_cast<uint32_t>(e - 14) << 23);
}

// x (already scaled) -> its fp16 parts as two packed pairs (x0 in the low half: the lower k).
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const __half2 l = __floats2half2_rn(x0 - __low2float(h), x1 - __high2float(h));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}


// The k a split weight's slot q (0..63) of a 64-k tile holds. Step j = q / 16 reads slots 16j .. 16j + 15 as its k
// 0..15; the thread with lane % 4 = t holds k 2t, 2t + 1 and 2t + 8, 2t + 9 of every step, from its row's values
// i = 0..15: elements 8t .. 8t + 7 (i < 8) and 32 + 8t .. 32 + 8t + 7 (its 16-byte chunks 2t and 2t + 1 of both
// 32-k boxes); step j takes i = 4j, 4j + 1 as k 2t, 2t + 1 and i = 4j + 2, 4j + 3 as k 2t + 8, 2t + 9.
__device__ __forceinline__ int slot_k(int q) {
  const int j = q >> 4, l = q & 15, t = (l & 7) >> 1, i = 4 * j + (l & 1) + (l >= 8 ? 2 : 0);
  return i < 8 ? 8 * t + i : 32 + 8 * t + (i - 8);
}

// W [N, K] (strides sn, sk) -> the split buffer: fp16 [2][n_pad][k_pad] (hi parts, then lo parts, zeros past N
// and K), then the columns' 1 / scale as fp32 [n_pad]. One warp per row of W (an output column).
__global__ void split_weight_kernel(const float* __restrict__ w, int64_t sn, int64_t sk, int64_t n, int64_t k,
                                    int64_t n_pad, int64_t k_pad, float* __restrict__ out) {
  __half* parts = reinterpret_cast<__half*>(out);
  float* inv_scales = out + n_pad * k_pad;  // (2 n_pad k_pad halves before them)
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t row = blockIdx.x * int64_t(blockDim.x >> 5) + (threadIdx.x >> 5); row < n_pad; row += warps) {
    float largest = 0.0f;
    if (row < n)
      for (int64_t col = lane; col < k; col += 32) largest = fmaxf(largest, fabsf(w[row * sn + col * sk]));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    float s, inv;
    scale_for(largest, s, inv);
    for (int64_t q = lane; q < k_pad; q += 32) {
      const int64_t col = (q & ~int64_t(63)) + slot_k(static_cast<int>(q & 63));
      const float x = row < n && col < k ? w[row * sn + col * sk] * s : 0.0f;
      const __half hi = __float2half_rn(x);
      parts[row * k_pad + q] = hi;
      parts[(n_pad + row) * k_pad + q] = __float2half_rn(x - __half2float(hi));
    }
    if (lane == 0) inv_scales[row] = inv;
  }
}

// One A row's 16 values of this thread (step j's k 2t, 2t + 1, 2t + 8, 2t + 9 at v[4j .. 4j + 3]) scaled by the
// row's scale (the largest |value| over the row's four threads, lanes 4g .. 4g + 3) and split into fp16 parts:
// hi[j][r8], hi[j][2 + r8] (r8: 0 for the warp's row g, 1 for g + 8), lo likewise; `inv` its 1 / scale.
__device__ __forceinline__ void split_row(const float (&v)[16], int r8, uint32_t (&hi)[4][4], uint32_t (&lo)[4][4],
                                          float& inv) {
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) largest = fmaxf(largest, fabsf(v[i]));
  largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
  largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
  float s;
  scale_for(largest, s, inv);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    split_pair(v[4 * j] * s, v[4 * j + 1] * s, hi[j][r8], lo[j][r8]);
    split_pair(v[4 * j + 2] * s, v[4 * j + 3] * s, hi[j][2 + r8], lo[j][2 + r8]);
  }
}

// This thread's A fragments of one row (`row`: its 128-byte line in box 0 of the stage; box 1 is kRowsBoxBytes
// further; 16-byte chunk c of row r at chunk c ^ (r % 8), and a warp's rows 16 w4 + g and + 8 both sit at g mod 8):
// its values i = 0..15 (slot_k's order) scaled and split by split_row.
__device__ __forceinline__ void load_row(uint32_t (&hi)[4][4], uint32_t (&lo)[4][4], float& inv, const uint8_t* row,
                                         int r8, int g, int t) {
  float v[16];
  const float4 x0 = *reinterpret_cast<const float4*>(row + (((2 * t) ^ g) << 4));
  const float4 x1 = *reinterpret_cast<const float4*>(row + (((2 * t + 1) ^ g) << 4));
  const float4 y0 = *reinterpret_cast<const float4*>(row + kRowsBoxBytes + (((2 * t) ^ g) << 4));
  const float4 y1 = *reinterpret_cast<const float4*>(row + kRowsBoxBytes + (((2 * t + 1) ^ g) << 4));
  v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
  v[8] = y0.x, v[9] = y0.y, v[10] = y0.z, v[11] = y0.w, v[12] = y1.x, v[13] = y1.y, v[14] = y1.z, v[15] = y1.w;
  split_row(v, r8, hi, lo, inv);
}

// A stage's fragments and row scales for this thread (rows 16 w4 + g and + 8 of its warpgroup's 64).
struct Fragments {
  uint32_t hi[4][4], lo[4][4];
  float inv[2];  // 1 / scale of the rows g and g + 8
};

__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_rows, const __grid_constant__ CUtensorMap map_w, int64_t m,
                int64_t n, int k_tiles, int n_pad, int n_tiles, int tiles, const float* __restrict__ inv_scales,
                const float* __restrict__ bias, float* __restrict__ out, int64_t ld_out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  // Persistent as wgmma_tf32x3 (fill_tiles).
  const int my_tiles = (tiles - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1;
  const auto fill = [&](FillRing& ring) {  // every stage's four boxes
    fill_tiles(ring, smem, full, kStageBytes, tiles, n_tiles, k_tiles,
               [&](uint8_t* stage, uint64_t* barrier, int m0, int n0, int kt) {
                 tma_load_2d(stage, &map_rows, kt * kBK, m0, barrier);
                 tma_load_2d(stage + kRowsBoxBytes, &map_rows, kt * kBK + 32, m0, barrier);
                 tma_load_2d(stage + 2 * kRowsBoxBytes, &map_w, kt * kBK, n0, barrier);
                 tma_load_2d(stage + 2 * kRowsBoxBytes + kPartBytes, &map_w, kt * kBK, n_pad + n0, barrier);
               });
  };
  const auto consume = [&] {
    const int wg = threadIdx.x >> 7, w4 = warp_index() & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // One fragment set: a stage's fragments are loaded and split, its group issued and waited for, its sums added;
    // the other warpgroup's group runs meanwhile (a second set beside the row's 16 values in flight took more than
    // 240 registers). The steps run over the block's k-tiles of all its tiles (`it`), each finding its tile.
    float acc[64], total[64];
    Fragments f;
    const int iterations = my_tiles * k_tiles;
    for (int it = 0, kt = 0, tile = blockIdx.x; it < iterations; ++it) {
      const int s = it % kStages;
      uint8_t* stage = smem + s * kStageBytes;
      mbar_wait(&full[s], (it / kStages) & 1);
      const uint8_t* rows = stage + (64 * wg + 16 * w4 + g) * 128;
      load_row(f.hi, f.lo, f.inv[0], rows, 0, g, t);
      load_row(f.hi, f.lo, f.inv[1], rows + 8 * 128, 1, g, t);
      const uint64_t desc_hi = smem_descriptor(stage + 2 * kRowsBoxBytes),
                     desc_lo = smem_descriptor(stage + 2 * kRowsBoxBytes + kPartBytes);
      products<__half>(acc, f.hi, f.lo, desc_hi, desc_lo);
      wgmma_wait<0>();
      fence_accumulators(acc);
      fence_proxy_async();  // (this thread's ld.shared of the stage before TMA refills it)
      mbar_arrive(&empty[s]);
      // The accumulators' layout: per n8 block j, acc[4j], [4j + 1] row g of this warp's 16, columns 8j + 2t, + 1;
      // acc[4j + 2], [4j + 3] the row 8 further.
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const float scaled = acc[i] * f.inv[(i >> 1) & 1];
        total[i] = kt > 0 ? total[i] + scaled : scaled;
      }
      if (++kt < k_tiles) continue;
      store_tile<true>(total, int64_t(tile / n_tiles) * kBM + 64 * wg + 16 * w4 + g, (tile % n_tiles) * kBN, t, m, n,
                       inv_scales, bias, out, ld_out);
      kt = 0;
      tile += gridDim.x;
    }
  };
  run_block(full, empty, kStages, fill, consume);
}

// ---- rows_grad: out[N, K] = d[P, N]^T x[P, K], the weight gradients, on fp16 parts ------------------------------
// wgmma_tf32x3's weight-gradient kernel with fp16 parts and 64 positions a tile: A (d's columns) from scalar loads
// of the stage, scaled per d column and tile like a row of rows_gemm; B (x's columns) split by the consumer threads
// into the K-major fp16 tiles for the next tile while this tile's products run, scaled per x column and tile (two
// threads of a warp share a column: positions 8c + {0..3} and 8c + {4..7}), the column's 1 / scale beside the tile
// in shared memory; the promotion multiplies by both. Fixed chunks of kGradChunk positions into [chunk][N][K]
// partials summed in chunk order.
constexpr int kGradStages = 2;
constexpr int kGradBoxBytes = kBK * 32 * 4;               // 8 KiB: 64 positions x 32 columns of fp32
constexpr int kGradStageBytes = 8 * kGradBoxBytes;        // d's four boxes, then x's four
constexpr int kGradPartBytes = kBN * kBK * 2;             // 16 KiB: one fp16 part of a B tile
constexpr int kGradSmemBytes = 1023 + kGradStages * kGradStageBytes + 4 * kGradPartBytes + 2 * kBN * 4 +
                               2 * kGradStages * 8;

// x's 64 positions x 128 columns of a stage -> B buffer `hi`, `lo` ([128 n][64 positions] fp16, K-major, 128-byte
// swizzle) and the columns' 1 / scale `inv`. Warp w of the consumers takes columns 16w .. 16w + 15, two lanes a
// column (lane / 2), lane % 2 = u its positions 8c + 4u + {0..3}: a load's 32 lanes read 16 columns at positions 4
// apart, whose swizzled chunks differ (conflict-free); the 8-byte stores of a half-warp fill 128 distinct bytes.
__device__ __forceinline__ void split_b_f16(const uint8_t* x, uint8_t* hi, uint8_t* lo, float* inv) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, n = 16 * w + (lane >> 1), u = lane & 1;
  const float* box = reinterpret_cast<const float*>(x + (n >> 5) * kGradBoxBytes);
  const int nn = n & 31;
  float v[32];  // (positions 8c + 4u + e at v[4c + e])
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int p = 8 * c + 4 * u + e;
      v[4 * c + e] = box[p * 32 + (((nn >> 2) ^ (p & 7)) << 2) + (nn & 3)];
    }
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) largest = fmaxf(largest, fabsf(v[i]));
  largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
  float s, inv_s;
  scale_for(largest, s, inv_s);
  if (u == 0) inv[n] = inv_s;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    uint2 h, l;
    split_pair(v[4 * c] * s, v[4 * c + 1] * s, h.x, l.x);
    split_pair(v[4 * c + 2] * s, v[4 * c + 3] * s, h.y, l.y);
    const int offset = n * 128 + ((c ^ (n & 7)) << 4) + 8 * u;
    *reinterpret_cast<uint2*>(hi + offset) = h;
    *reinterpret_cast<uint2*>(lo + offset) = l;
  }
}

// This thread's A fragments of a stage's 64 positions: A[m][k] = d[position k][column m] for its warpgroup's 64
// columns (boxes 2 wg and 2 wg + 1 of the stage's d), scaled per column and split by split_row; f.inv its columns'
// 1 / scale.
__device__ __forceinline__ void load_grad_fragments(Fragments& f, const uint8_t* d, int wg, int w4, int g, int t) {
  const float* box = reinterpret_cast<const float*>(d + (2 * wg + (w4 >> 1)) * kGradBoxBytes);
  const auto at = [&](int p, int m) { return box[p * 32 + (((m >> 2) ^ (p & 7)) << 2) + (m & 3)]; };
#pragma unroll
  for (int r8 = 0; r8 < 2; ++r8) {
    const int m = 16 * (w4 & 1) + g + 8 * r8;
    float v[16];  // (step j: positions 16j + 2t, + 1 at v[4j], v[4j + 1]; 16j + 2t + 8, + 9 at v[4j + 2], v[4j + 3])
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[4 * j] = at(16 * j + 2 * t, m);
      v[4 * j + 1] = at(16 * j + 2 * t + 1, m);
      v[4 * j + 2] = at(16 * j + 2 * t + 8, m);
      v[4 * j + 3] = at(16 * j + 2 * t + 9, m);
    }
    split_row(v, r8, f.hi, f.lo, f.inv[r8]);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    grad_kernel(const __grid_constant__ CUtensorMap map_d, const __grid_constant__ CUtensorMap map_x, int64_t positions,
                int64_t n, int64_t k, int m_tiles, int n_tiles, float* __restrict__ partials) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint8_t* b_tiles = smem + kGradStages * kGradStageBytes;  // [buffer][hi | lo], kGradPartBytes each
  float* inv_b = reinterpret_cast<float*>(b_tiles + 4 * kGradPartBytes);  // [buffer][128]
  uint64_t* full = reinterpret_cast<uint64_t*>(inv_b + 2 * kBN);
  uint64_t* empty = full + kGradStages;
  const GradBlock block = grad_block(positions, m_tiles, n_tiles, kBK);
  const int m0 = block.m0, n0 = block.n0, k_tiles = block.k_tiles;  // (m: d's columns, n: x's)
  const auto fill = [&](FillRing& ring) {
    fill_grad_stages(ring, smem, full, kGradStageBytes, kBK, block, &map_d, &map_x);
  };
  const auto consume = [&] {
    const int wg = threadIdx.x >> 7, w4 = warp_index() & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const auto b_part = [&](int buffer, int part) { return b_tiles + (2 * buffer + part) * kGradPartBytes; };
    float acc[64], total[64];
    Fragments f;  // (one set: tile kt's, replaced by tile kt + 1's after tile kt's products)
    // Tile kt: its products (A set, B buffer kt % 2) while tile kt + 1's B tile is split into the other buffer; then
    // its sums added, tile kt + 1's A fragments loaded and its stage released; the barrier: tile kt + 1's B tile
    // written by every thread and tile kt's products done in both groups (its buffer is tile kt + 2's).
    mbar_wait(&full[0], 0);
    split_b_f16(smem + 4 * kGradBoxBytes, b_part(0, 0), b_part(0, 1), inv_b);
    load_grad_fragments(f, smem, wg, w4, g, t);
    fence_proxy_async();
    mbar_arrive(&empty[0]);
    named_barrier(1, kConsumerThreads);
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int buffer = kt & 1;
      const uint64_t desc_hi = smem_descriptor(b_part(buffer, 0)), desc_lo = smem_descriptor(b_part(buffer, 1));
      products<__half>(acc, f.hi, f.lo, desc_hi, desc_lo);
      const int s_next = (kt + 1) % kGradStages;
      uint8_t* next = smem + s_next * kGradStageBytes;
      if (kt + 1 < k_tiles) {
        mbar_wait(&full[s_next], ((kt + 1) / kGradStages) & 1);
        split_b_f16(next + 4 * kGradBoxBytes, b_part(buffer ^ 1, 0), b_part(buffer ^ 1, 1), inv_b + kBN * (buffer ^ 1));
        fence_proxy_async();  // (the B tile's stores before wgmma reads them)
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      // The accumulators' layout: per n8 block j, acc[4j], [4j + 1] row g (d column) of this warp's 16, columns (x
      // columns) 8j + 2t, + 1; acc[4j + 2], [4j + 3] the row 8 further.
      // (the two 1 / scales one after the other: their product alone could fall below fp32's range where the
      // scaled sum times both does not)
      const float* inv_cols = inv_b + kBN * buffer;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 c = *reinterpret_cast<const float2*>(inv_cols + 8 * j + 2 * t);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float scaled = acc[4 * j + r] * f.inv[r >> 1] * ((r & 1) ? c.y : c.x);
          total[4 * j + r] = kt > 0 ? total[4 * j + r] + scaled : scaled;
        }
      }
      if (kt + 1 < k_tiles) {
        load_grad_fragments(f, next, wg, w4, g, t);
        fence_proxy_async();  // (every read of the stage done: x's split above, d's now)
        mbar_arrive(&empty[s_next]);
      }
      named_barrier(1, kConsumerThreads);
    }
    store_partials(total, partials + int64_t(block.chunk) * n * k, m0 + 64 * wg + 16 * w4 + g, n0, t, n, k);
  };
  run_block(full, empty, kGradStages, fill, consume);
}

// fp32 rows at "highest" that TMA reads, K >= 1, TMA's 32-bit coordinates and int counts of tiles and of a
// block's k-tiles, and Hopper's shared memory; rows_grad: d likewise.
bool applies(const BackwardArgs& args) {
  const bool sizes = args.operand == Dtype::f32 && args.precision == Precision::highest &&
                     tensor_map_encoder() != nullptr && args.gemm_k >= 1 && args.gemm_n >= 1 &&
                     args.gemm_m < (int64_t(1) << 31) && padded(args.gemm_k, kBK) < (int64_t(1) << 31) &&
                     2 * padded(args.gemm_n, kBN) < (int64_t(1) << 31) &&
                     rows_take(args.gemm_rows, args.gemm_ld, args.gemm_k);
  if (args.pass == BackwardPass::rows_grad)
    return sizes && rows_take(args.gemm_d, args.gemm_ld_d, args.gemm_n) && kGradSmemBytes <= max_smem_optin();
  return sizes &&
         ceil_div(args.gemm_m, kBM) * (padded(args.gemm_n, kBN) / kBN) * (padded(args.gemm_k, kBK) / kBK) <
             (int64_t(1) << 31) &&
         kSmemBytes <= max_smem_optin();
}

cudaError_t launch(const BackwardArgs& args) {
  if (!applies(args)) return cudaErrorInvalidValue;
  if (args.pass == BackwardPass::rows_grad) return launch_grad<grad_kernel>(args, kBK, kGradSmemBytes);
  const int64_t n_pad = padded(args.gemm_n, kBN), k_pad = padded(args.gemm_k, kBK);
  // (the split buffer: 2 n_pad k_pad halves and n_pad floats, within position_gemm_split_floats' 2 n_pad k_pad)
  static_assert(kBK == 64, "position_gemm_split_floats pads K to 64");
  if (args.gemm_w_split == nullptr || args.gemm_w_split_floats < n_pad * k_pad + n_pad ||
      args.gemm_w_split_floats < position_gemm_split_floats(args.gemm_n, args.gemm_k))
    return cudaErrorInvalidValue;
  if (args.pass == BackwardPass::split_weight) {
    if (args.gemm_w == nullptr) return cudaErrorInvalidValue;
    const int64_t blocks = std::min<int64_t>(ceil_div(n_pad, 8), 4096);  // (8 warps a block, a warp per row)
    split_weight_kernel<<<static_cast<unsigned>(blocks), 256, 0, args.stream>>>(
        args.gemm_w, args.gemm_w_sn, args.gemm_w_sk, args.gemm_n, args.gemm_k, n_pad, k_pad, args.gemm_w_split);
    return cudaGetLastError();
  }
  return launch_rows<gemm_kernel, __half>(args, n_pad, k_pad, kBK, kSmemBytes, static_cast<const float*>(args.gemm_w_split + n_pad * k_pad));
}

}  // namespace position_gemm_f16x3
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(position_gemm, wgmma_f16x3, ::trimul::position_gemm_f16x3::applies,
                         ::trimul::position_gemm_f16x3::launch);
