// wgmma_rs_384 — Hopper (sm_90a): z (TMA + ldmatrix.trans) and the raw gate rows as wgmma's register
// operands, half the output channels' weights resident per block; "medium", pair_dim 384, hidden 128.
#include "output_pass.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

// ---- The rows in registers at pair_dim 384 (sm_90a): wgmma_rs_384 ----------------------------------
// The input pass's wgmma_rs_384 pattern for this pass ("medium": bf16 z; pair_dim 384, H 128, the gate on the raw
// rows): two MMA warpgroups per block, each on its own 64-position tiles; blocks 2i and 2i + 1 walk the same
// tiles, each computing one half of the 384 output channels against that half's out_gate and out_proj rows,
// resident (144 + 48 KB). Per tile a warpgroup takes z's [128 h][64 positions] tile by TMA (the next tile's is
// issued once this one is in registers), reads it as wgmma A fragments by ldmatrix.trans and LayerNorms them
// there (quad shuffles; the fragments hold bf16 (z - mean), rstd applies in the epilogue); loads the gate's raw
// pair rows as A fragments straight from global memory (two channels per load: w_gate's own k order); then per
// 64 output channels the gate product (K = 384) and out_proj's (K = 128), and out = sigmoid(gate + b) *
// (rstd proj + b) is stored from the accumulators. With ForwardArgs::gate_rows (kGateRows) the gate's rows are
// those bf16 rows instead of pair's (the training forward's x_hat), and out keeps pair's dtype: fp32 pairs then
// read no fp32 rows at all.
namespace wgmma_rs_384 {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;  // (kKBytes)

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kThreads = 128 * kGroups;
constexpr int kPositions = 64;                                  // per tile: wgmma's M
constexpr int kC = 384, kH = 128;                               // the pair_dim and hidden it takes
constexpr int kHalfC = kC / 2, kParts = kHalfC / 64;            // a block's output channels, in N = 64 parts
constexpr int kGateSteps = kC / 16, kZSteps = kH / 16;          // k16 steps of each product
constexpr int kTileBytes = 64 * kKBytes;                        // a k-tile of a part's 64 weight rows
constexpr int kGateTiles = kC * 2 / kKBytes, kOutTiles = kH * 2 / kKBytes;  // k-tiles per part
constexpr int kZBytes = kZBoxBytes;  // z's tile: load_z_tile's box
static_assert(kH == kZBoxH && kPositions == kZBoxPositions, "a tile is one z box");
// Dynamic shared memory: the weights (1024-byte aligned), each warpgroup's z tile, the half's biases, barriers.
constexpr int64_t kSmemBytes =
    1023 + int64_t(kParts) * (kGateTiles + kOutTiles) * kTileBytes + kGroups * kZBytes + 2 * kHalfC * 4 + (1 + kGroups) * 8;

// One half-row's A fragments of the gate product from a row of `row` (nullptr: past the plane, zeros):
// channels 16 s + 2 t + {0, 1} into xf[s][hf], + 8 into xf[s][2 + hf]; fp32 rows rounded to bf16 pairs.
template <typename TRow>
__device__ __forceinline__ void gate_row_fragments(uint32_t (&xf)[kGateSteps][4], int hf, const TRow* row, int t) {
  if constexpr (std::is_same<TRow, float>::value) {
    float2 lo[kGateSteps], hi[kGateSteps];
#pragma unroll
    for (int s = 0; s < kGateSteps; ++s) {
      lo[s] = row != nullptr ? *reinterpret_cast<const float2*>(row + 16 * s + 2 * t) : make_float2(0.f, 0.f);
      hi[s] = row != nullptr ? *reinterpret_cast<const float2*>(row + 16 * s + 8 + 2 * t) : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int s = 0; s < kGateSteps; ++s) {
      xf[s][hf] = pack_pair<__nv_bfloat16>(lo[s].x, lo[s].y);
      xf[s][2 + hf] = pack_pair<__nv_bfloat16>(hi[s].x, hi[s].y);
      asm volatile("" : "+r"(xf[s][hf]), "+r"(xf[s][2 + hf]));  // (packed here, not at the first product)
    }
  } else {  // (bf16 rows: the pairs are the operands as they are)
#pragma unroll
    for (int s = 0; s < kGateSteps; ++s) {
      xf[s][hf] = row != nullptr ? *reinterpret_cast<const uint32_t*>(row + 16 * s + 2 * t) : 0u;
      xf[s][2 + hf] = row != nullptr ? *reinterpret_cast<const uint32_t*>(row + 16 * s + 8 + 2 * t) : 0u;
    }
  }
}

template <typename TIn, bool kGateRows>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_gate,
           const __grid_constant__ CUtensorMap map_out, const __grid_constant__ CUtensorMap map_z,
           int64_t tiles_per_batch) {
  using Op = __nv_bfloat16;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* w_gate = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // [part][k-tile]
  uint8_t* w_out = w_gate + kParts * kGateTiles * kTileBytes;                        // [part][k-tile]
  uint8_t* z_all = w_out + kParts * kOutTiles * kTileBytes;
  float* gate_bias = reinterpret_cast<float*>(z_all + kGroups * kZBytes);
  float* out_bias = gate_bias + kHalfC;
  uint64_t* w_full = reinterpret_cast<uint64_t*>(out_bias + kHalfC);
  uint64_t* z_full = w_full + 1;
  const int c_base = static_cast<int>(blockIdx.x & 1) * kHalfC;  // this block's half of the channels
  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3, g = lane >> 2, tid = threadIdx.x & 127;
  uint8_t* z_tile = z_all + group * kZBytes;
  const int64_t n = args.n, plane = n * args.ldz, tiles = args.batch * tiles_per_batch;
  const int64_t stride = int64_t(gridDim.x >> 1) * kGroups;
  int64_t tile = int64_t(blockIdx.x >> 1) * kGroups + group;
  const auto load_z = [&](int64_t at) { load_z_tile(z_tile, &map_z, &z_full[group], at, tiles_per_batch); };
  if (threadIdx.x == 0) {
    mbar_init(w_full, 1);
    for (int i = 0; i < kGroups; ++i) mbar_init(&z_full[i], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_expect_tx(w_full, kParts * (kGateTiles + kOutTiles) * kTileBytes);
    for (int p = 0; p < kParts; ++p) {
      for (int kt = 0; kt < kGateTiles; ++kt)
        tma_load_2d(w_gate + (p * kGateTiles + kt) * kTileBytes, &map_gate, kt * (kKBytes / 2), c_base + 64 * p, w_full);
      for (int kt = 0; kt < kOutTiles; ++kt)
        tma_load_2d(w_out + (p * kOutTiles + kt) * kTileBytes, &map_out, kt * (kKBytes / 2), c_base + 64 * p, w_full);
    }
  }
  if (tid == 0 && tile < tiles) load_z(tile);
  for (int c = threadIdx.x; c < kHalfC; c += kThreads) {
    gate_bias[c] = args.b_gate[c_base + c];
    out_bias[c] = args.b_out[c_base + c];
  }
  __syncthreads();
  mbar_wait(w_full, 0);

  TIn* out = static_cast<TIn*>(args.out);
  int z_parity = 0;
  for (; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_batch, q0 = (tile - batch * tiles_per_batch) * kPositions;
    mbar_wait(&z_full[group], z_parity);
    z_parity ^= 1;
    uint32_t zf[kZSteps][4];
    z_fragments(zf, z_tile, warp4, lane);
    release_stage_to_tma(1 + group, 128);  // the tile is in every thread's registers: the next one may land
    if (tid == 0 && tile + stride < tiles) load_z(tile + stride);
    float z_rstd[2];
    center_z_fragments(zf, z_rstd, args.eps_out);
    // The gate's raw rows as A fragments: channels 16 s + 2 t + {0, 1} (xf[s][hf]) and + 8 (xf[s][2 + hf]).
    uint32_t xf[kGateSteps][4];
    int64_t out_off[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      // (plane < 2^32, checked at launch: 32-bit division, as the other output kernels)
      const uint32_t q = static_cast<uint32_t>(q0 + 16 * warp4 + g + 8 * hf);
      const uint32_t i = q / static_cast<uint32_t>(args.ldz), j = q - i * static_cast<uint32_t>(args.ldz);
      const bool valid = q < plane && j < n;
      out_off[hf] = valid ? ((batch * n + i) * n + j) * kC + c_base : -1;
      if constexpr (kGateRows) {  // (the [P, kC] gate rows: the position's row starts where its out row does)
        const __nv_bfloat16* rows = static_cast<const __nv_bfloat16*>(args.gate_rows);
        gate_row_fragments(xf, hf, valid ? rows + (out_off[hf] - c_base) : nullptr, t);
      } else {
        const TIn* pair = static_cast<const TIn*>(args.pair);
        gate_row_fragments(xf, hf, valid ? pair + batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : nullptr,
                           t);
      }
    }
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      float gate[32], proj[32];
      gated_part_products(gate, proj, xf, zf, w_gate + p * kGateTiles * kTileBytes, w_out + p * kOutTiles * kTileBytes,
                          gate_bias + 64 * p, t);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        if (out_off[hf] < 0) continue;
        TIn* dst = out + out_off[hf] + 64 * p + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 bo = *reinterpret_cast<const float2*>(out_bias + 64 * p + 8 * j + 2 * t);
          store_pair(dst + 8 * j, fmaf(proj[4 * j + 2 * hf], z_rstd[hf], bo.x) * gate[4 * j + 2 * hf],
                     fmaf(proj[4 * j + 2 * hf + 1], z_rstd[hf], bo.y) * gate[4 * j + 2 * hf + 1], true, true);
        }
      }
    }
  }
}

// Whether it takes these sizes: sm_90a on Hopper, "medium" (bf16 operands and z), pair_dim 384 and H 128
// exactly, the gate on the raw rows in 16-byte vectors (pair's, or gate_rows 16-byte aligned), a separate
// contraction's z, planes below 2^31 positions (the z tile's TMA coordinate is a signed 32-bit position), an even
// grid.
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return tensor_map_encoder() != nullptr && args.z != nullptr && args.z_dtype == Dtype::bf16 && args.c == kC &&
         args.c_pad == kC && args.h == kH && args.h_pad == kH && !args.gate_normalized &&
         gate_rows_vectorizable<TIn>(args) &&
         (args.n * args.ldz) % 8 == 0 && args.n * args.ldz < (int64_t(1) << 31) &&
         args.batch * kH < (int64_t(1) << 31) && kSmemBytes <= max_smem_optin() &&
         sm_count() >= 2;
}

template <typename TIn, bool kGateRows>
cudaError_t launch_grid(const ForwardArgs& args, const CUtensorMap& map_gate, const CUtensorMap& map_out,
                        const CUtensorMap& map_z, int64_t pairs, int64_t tiles_per_batch) {
  const cudaError_t status = allow_smem<kernel<TIn, kGateRows>>(kSmemBytes);
  if (status != cudaSuccess) return status;
  kernel<TIn, kGateRows><<<static_cast<unsigned>(2 * pairs), kThreads, kSmemBytes, args.stream>>>(
      args, map_gate, map_out, map_z, tiles_per_batch);
  return cudaGetLastError();
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  using Op = __nv_bfloat16;
  const int64_t plane = args.n * args.ldz;
  CUtensorMap map_gate, map_out, map_z;
  if (!encode_kmajor_map<Op>(&map_gate, args.w_gate, 0, kC, kC, 64) ||
      !encode_kmajor_map<Op>(&map_out, args.w_out, 0, kC, kH, 64) ||
      !encode_kmajor_map<Op>(&map_z, args.z, 0, args.batch * kH, plane, kH))
    return cudaErrorNotSupported;
  const int64_t tiles_per_batch = ceil_div(plane, kPositions);
  const int64_t pairs = std::min<int64_t>(sm_count() / 2, ceil_div(args.batch * tiles_per_batch, kGroups));
  return args.gate_rows != nullptr ? launch_grid<TIn, true>(args, map_gate, map_out, map_z, pairs, tiles_per_batch)
                                   : launch_grid<TIn, false>(args, map_gate, map_out, map_z, pairs, tiles_per_batch);
}

}  // namespace wgmma_rs_384

}  // namespace output_pass
}  // namespace trimul

TRIMUL_REGISTER_OUTPUT_PASS_READING_GATE_ROWS(wgmma_rs_384, trimul::output_pass::wgmma_rs_384, trimul::fused::kBf16Mode);
