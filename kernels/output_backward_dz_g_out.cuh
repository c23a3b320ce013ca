// output_backward_dz_g_out.cuh — output_backward wgmma's dz_planes_g_out pass: dz planes from d o (as dz_mma) and
// out_proj's weight gradient g_out = d o^T z_hat in the same pass, at pair_dim and hidden 128.
// dz_mma reads d o's tiles by TMA and z_hat's rows for LayerNorm_out's backward; g_out, a GEMM over every position,
// read both again (its K is the positions). Here a block's two warpgroups share each 64-position tile: d o's two
// 64-channel boxes and z_hat's two 64-h boxes land in one stage of a ring by TMA (one thread issues), and
// warpgroup w takes the tile's h half w twice over:
// - d z_hat[:, half] = d o W_out_f[:, half] (m64n64, K = C, both operands K-major), then LayerNorm_out's backward on
//   the accumulators, its row means over all 128 h from the two warpgroups' halves (exchanged in shared memory,
//   added in a fixed order), and dz's half out by box stores (dz_mma's store_part);
// - g_out[:, half] += d o^T z_hat[:, half] (two m64n64 over the channels, K = the tile's 64 positions, both
//   operands MN-major: the boxes as they landed), accumulated in registers over the block's tiles and written once
//   as the block's fp32 partial [C, H], which the caller sums over blocks in a fixed order (bitwise repeatable).
// A tile's rows past its batch's plane hold the next batch's rows (or TMA's zeros): the warpgroup zeroes them in its
// z_hat box before g_out's product, so that they add nothing. Hopper (sm_90a), bf16 operands.
#pragma once
#include "backward_wgmma_rows.cuh"
#include "wgmma_rs.cuh"

namespace trimul {
namespace backward {
namespace dz_g_out {

using namespace ::trimul::backward::wgmma_rows;  // (the block: two warpgroups; the boxes: 64 positions x 64 columns)
constexpr int kC = 128, kH = 128;                // the pair_dim and hidden it takes
constexpr int kHalf = kH / kGroups;              // h per warpgroup
constexpr int kKTiles = kC / kKCols;             // d o's boxes per tile: the main product's k-tiles, g_out's M blocks
constexpr int kTileStages = 4;                   // tiles in flight
constexpr int kDOBytes = kKTiles * kBoxBytes;
constexpr int kTileBytes = kDOBytes + kGroups * kBoxBytes;  // d o's boxes, then z_hat's (one per h half)
constexpr int kPartH = 32;                                  // h per dz box store
constexpr int kScratchBytes = kPartH * kPositions * 2;      // a box's scratch: 32 h x 64 positions, bf16
constexpr int kWeightBytes = kKTiles * ws::kStageBytes;     // W_out_f as K-major B: k-tile kt's 128 h rows
static_assert(kHalf == kKCols && kH == kN, "a warpgroup's h half is one box of z_hat and 64 rows of the weights");

// Dynamic shared memory (from a 1024-byte aligned base): the weights, the tile ring, per warpgroup two dz scratches,
// the row-sum exchange [tile parity][warpgroup][row] (sum of d z_hat, sum of d z_hat z_hat), the ring's barriers.
constexpr int64_t kRingOffset = kWeightBytes;
constexpr int64_t kScratchOffset = kRingOffset + kTileStages * kTileBytes;
constexpr int64_t kExchangeOffset = kScratchOffset + kGroups * 2 * kScratchBytes;
constexpr int64_t kBarrierOffset = kExchangeOffset + 2 * kGroups * kPositions * sizeof(float2);
constexpr int64_t kSmemBytes = 1023 + kBarrierOffset + 2 * kTileStages * 8;
constexpr int kExchangeBarrier = 3;  // (named barriers 1 and 2: store_part's, one per warpgroup)

__global__ void __launch_bounds__(kBlockThreads, 1)
    kernel(const BackwardArgs args, const __grid_constant__ CUtensorMap map_d_o,
           const __grid_constant__ CUtensorMap map_z_hat, const __grid_constant__ CUtensorMap map_dz) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* weights = smem;
  uint8_t* ring = smem + kRingOffset;
  float2* exchange = reinterpret_cast<float2*>(smem + kExchangeOffset);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);
  uint64_t* empty = full + kTileStages;
  const int warp = warp_index(), group = warp >> 2, warp4 = warp & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3, tid = threadIdx.x & 127;
  uint8_t* scratch = smem + kScratchOffset + group * 2 * kScratchBytes;
  if (threadIdx.x == 0) {
    init_barrier_pairs(full, 1, empty, kGroups, kTileStages);
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t plane = plane_positions(args), tiles_per_run = ceil_div(plane, int64_t(kPositions));
  const int64_t tiles = args.batch * tiles_per_run;
  // The block's i-th tile (blockIdx.x + i gridDim.x) into stage i % kTileStages, once both warpgroups released
  // the stage's previous tile. Thread 0 only.
  const auto issue = [&](int64_t i) {
    const int64_t tile = blockIdx.x + i * gridDim.x;
    if (tile >= tiles) return;
    const int stage = static_cast<int>(i % kTileStages);
    if (i >= kTileStages) mbar_wait(&empty[stage], static_cast<int>((i / kTileStages - 1) & 1));
    const int64_t batch = tile / tiles_per_run;
    const int row = static_cast<int>(batch * plane + (tile - batch * tiles_per_run) * kPositions);
    uint8_t* dst = ring + stage * kTileBytes;
    mbar_expect_tx(&full[stage], kTileBytes);
    for (int kt = 0; kt < kKTiles; ++kt) tma_load_2d(dst + kt * kBoxBytes, &map_d_o, kt * kKCols, row, &full[stage]);
    for (int half = 0; half < kGroups; ++half)
      tma_load_2d(dst + kDOBytes + half * kBoxBytes, &map_z_hat, half * kHalf, row, &full[stage]);
  };
  if (threadIdx.x == 0)
    for (int64_t i = 0; i < kTileStages - 1; ++i) issue(i);
  lay_out_weights(Sources{kKTiles, kKTiles, args.w_out_f, nullptr}, weights);  // (the first tiles load meanwhile)
  __syncthreads();

  float g_out[kKTiles][32];  // [channel block][4 j + 2 hf + e]: channel 64 block + 16 warp4 + g + 8 hf, h of the half
#pragma unroll               // 8 j + 2 t + e
  for (int mb = 0; mb < kKTiles; ++mb)
#pragma unroll
    for (int i = 0; i < 32; ++i) g_out[mb][i] = 0.f;
  const uint64_t w_desc = smem_descriptor(weights + group * kHalf * ws::kKBytes);  // (this half's 64 weight rows)

  int64_t i = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
    if (threadIdx.x == 0) issue(i + kTileStages - 1);
    const int stage = static_cast<int>(i % kTileStages);
    const uint8_t* d_o = ring + stage * kTileBytes;
    uint8_t* z_box = ring + stage * kTileBytes + kDOBytes + group * kBoxBytes;
    const int64_t batch = tile / tiles_per_run, p0 = (tile - batch * tiles_per_run) * kPositions;
    const int count = static_cast<int>(std::min<int64_t>(kPositions, plane - p0));
    float rstd[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * warp4 + g + 8 * hf;
      rstd[hf] = r < count ? args.rstd[batch * plane + p0 + r] : 0.f;
    }
    mbar_wait(&full[stage], static_cast<int>((i / kTileStages) & 1));
    if (count < kPositions) {  // (uniform over the block: the tile's rows past the plane out of g_out's sum)
      for (int index = tid; index < (kPositions - count) * 8; index += 128)
        *reinterpret_cast<uint4*>(z_box + (count + index / 8) * ws::kKBytes + (index % 8) * 16) = make_uint4(0, 0, 0, 0);
      fence_proxy_async();  // (wgmma reads the box through the async proxy)
      named_barrier(1 + group, 128);
    }

    // d z_hat of the half: A = d o's boxes (rows: positions; k: channels), B = the half's weight rows.
    float acc[32];
    wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < kKTiles; ++kt)
#pragma unroll
      for (int s = 0; s < 4; ++s)
        wgmma_64x64<Op>(acc, desc_add(smem_descriptor(d_o + kt * kBoxBytes), 2 * s),
                        desc_add(w_desc, kt * (ws::kStageBytes >> 4) + 2 * s), kt > 0 || s > 0);
    wgmma_commit();
    // g_out of the half: A = d o's box mb read transposed (m: its 64 channels), B = the z_hat box (n: the half's
    // 64 h), k = the tile's positions, 16 a step.
    const uint64_t z_desc = smem_descriptor(z_box);
#pragma unroll
    for (int mb = 0; mb < kKTiles; ++mb)
#pragma unroll
      for (int s = 0; s < 4; ++s)
        wgmma_64x64_mn_major<Op>(g_out[mb], desc_add(smem_descriptor(d_o + mb * kBoxBytes), 128 * s),
                                 desc_add(z_desc, 128 * s), 1);
    wgmma_commit();
    wgmma_wait<1>();  // (d z_hat's group; g_out's runs on under the epilogue)
    fence_accumulators(acc);

    // LayerNorm_out's backward: dz = rstd (d z_hat - mean(d z_hat) - z_hat mean(d z_hat z_hat)) over all 128 h.
    float z[2][16];  // z_hat at this thread's rows and columns 8 j + 2 t + e of the half: [hf][2 j + e]
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * warp4 + g + 8 * hf;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 v = unpack_pair<Op>(*reinterpret_cast<const uint32_t*>(z_box + r * ws::kKBytes +
                                                                            ((j ^ (r & 7)) << 4) + 4 * t));
        z[hf][2 * j] = v.x;
        z[hf][2 * j + 1] = v.y;
      }
    }
    float2* mine = exchange + ((i & 1) * kGroups + group) * kPositions;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = 0.f, dot = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          sum += acc[4 * j + 2 * hf + e];
          dot += acc[4 * j + 2 * hf + e] * z[hf][2 * j + e];
        }
      sum = quad_sum(sum);
      dot = quad_sum(dot);
      if (t == 0) mine[16 * warp4 + g + 8 * hf] = make_float2(sum, dot);
    }
    // (both halves' sums written; the exchange's other parity is what the next tile writes, read by now)
    named_barrier(kExchangeBarrier, kBlockThreads);
    const float2* halves = exchange + (i & 1) * kGroups * kPositions;
    uint32_t packed[2][8];  // [hf][j]: dz of the half's columns 8 j + 2 t, + 1 as a bf16 pair
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * warp4 + g + 8 * hf;
      const float2 first = halves[r], second = halves[kPositions + r];
      const float mean = (first.x + second.x) * (1.f / kH), mean_dot = (first.y + second.y) * (1.f / kH);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        packed[hf][j] = pack_pair<Op>(rstd[hf] * (acc[4 * j + 2 * hf] - mean - z[hf][2 * j] * mean_dot),
                                      rstd[hf] * (acc[4 * j + 2 * hf + 1] - mean - z[hf][2 * j + 1] * mean_dot));
    }
    // The half's dz per 32 h.
#pragma unroll
    for (int part = 0; part < kHalf / kPartH; ++part)
      input_pass::wgmma_rs::store_rows_part(scratch + part * kScratchBytes, packed, part, &map_dz, batch,
                                            kHalf * group + kPartH * part, p0);
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < kKTiles; ++mb) fence_accumulators(g_out[mb]);
    // The stage is read (both products and the z_hat loads): TMA may refill it once both warpgroups say so.
    release_stage_to_tma(1 + group, 128);
    if (tid == 0) mbar_arrive(&empty[stage]);
  }

  // The block's partial: g_out[c][h] at row blockIdx.x of [rows, C, H] (zeros where the block had no tile).
  float* out = args.g_out + int64_t(blockIdx.x) * kC * kH;
#pragma unroll
  for (int mb = 0; mb < kKTiles; ++mb)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int c = 64 * mb + 16 * warp4 + g + 8 * hf, h = kHalf * group + 8 * j + 2 * t;
        *reinterpret_cast<float2*>(out + c * kH + h) = make_float2(g_out[mb][4 * j + 2 * hf], g_out[mb][4 * j + 2 * hf + 1]);
      }
  if (tid == 0) bulk_wait<0>();  // (the dz boxes written before the block retires)
}

// Whether it takes dz_planes_g_out's sizes: bf16 operands, pair_dim and hidden 128, plane rows TMA can address (N^2,
// a block's rows x N, a multiple of 8: 16-byte rows of the box maps) and positions it can count.
inline bool takes(const BackwardArgs& args) {
  const int64_t plane = plane_positions(args);
  return args.operand == Dtype::bf16 && args.c == kC && args.h == kH && tensor_map_encoder() != nullptr &&
         plane % 8 == 0 && args.batch * plane < (int64_t(1) << 31) && kSmemBytes <= max_smem_optin();
}

inline cudaError_t launch(const BackwardArgs& args) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!takes(args) || args.d_o == nullptr || args.w_out_f == nullptr || args.rows == nullptr ||
      args.rstd == nullptr || args.a_planes == nullptr || args.g_out == nullptr || args.g_out_rows < 1 ||
      args.g_out_rows > 65535 || !aligned(args.d_o) || !aligned(args.rows) || !aligned(args.a_planes) ||
      !aligned(args.g_out))
    return cudaErrorInvalidValue;
  const int64_t plane = plane_positions(args);
  CUtensorMap map_d_o, map_z_hat, map_dz;
  if (!encode_rows_map(&map_d_o, args.d_o, args.batch * plane, kC) ||
      !encode_rows_map(&map_z_hat, args.rows, args.batch * plane, kH) ||
      !encode_kmajor_map<Op>(&map_dz, args.a_planes, args.batch, kH, plane, kPartH))
    return cudaErrorNotSupported;
  const cudaError_t status = fused::allow_smem<kernel>(kSmemBytes);
  if (status != cudaSuccess) return status;
  // (every row of the partials written, by one block each, whether or not it has tiles)
  kernel<<<static_cast<unsigned>(args.g_out_rows), kBlockThreads, kSmemBytes, args.stream>>>(args, map_d_o, map_z_hat,
                                                                                             map_dz);
  return cudaGetLastError();
}

}  // namespace dz_g_out
}  // namespace backward
}  // namespace trimul
