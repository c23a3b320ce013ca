// input_backward_d_pair.cuh — wgmma_rs's d_pair from d proj: d x_hat = d proj W_in_f (+ d gate W_gate_f, the gate
// on the normalized input) on the tensor cores, LayerNorm_in's backward on the accumulators; d x_hat is never
// written. The rows kernel's d_pair reads d x_hat [P, C] in fp32, which a cuBLAS GEMM wrote and a second one
// (the gate's share, in place) read and wrote again: 2 of the ~2.3 GiB those three moved at N = 1024. Here each
// warpgroup takes 64-position tiles: the d proj row tile (then d gate's) arrives by TMA in 64-column boxes,
// kStages in flight, and meets the resident weights as wgmma's A and B from shared memory (both K-major, 128-byte
// swizzle); the weights, [W_in_f; W_gate_f] transposed into C rows of 4H (+ C) bf16, are laid out by each block
// from the fp32 parameters (no host-side preparation). The pair rows of the tile are read into registers while
// the tile multiplies; the statistics are recomputed from them in fp32 and each row's means come from quad
// shuffles over the accumulators' layout (a row's 128 channels live in four lanes). d pair leaves in pair's dtype.
#pragma once
#include "input_backward_rows.cuh"
#include "tma.cuh"

namespace trimul {
namespace backward {
namespace d_pair_mma {

using namespace ::trimul::tma;
namespace ws = ::trimul::tma::ws;
using Op = __nv_bfloat16;

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kBlockThreads = 128 * kGroups;
constexpr int kPositions = 64;                      // per tile: wgmma's M
constexpr int kC = 128;                             // the pair_dim it takes: wgmma's N, a row per tile row
constexpr int kKCols = ws::kKBytes / 2;             // k columns per 128-byte k-tile
constexpr int kStages = 4;                          // d proj / d gate boxes in flight per warpgroup
constexpr int kBoxBytes = kPositions * ws::kKBytes; // a box: 64 positions x 64 columns, bf16

// 128-byte k-tiles of the product: d proj's 4H columns, then d gate's C.
inline int k_tiles(int64_t h, bool gate) { return static_cast<int>((4 * h + (gate ? kC : 0)) / kKCols); }

// Dynamic shared memory: the resident weights (1024-byte aligned; a k-tile is C rows of 128 bytes), per
// warpgroup its box ring, the boxes' barriers.
inline int64_t smem_bytes(int k_tiles) {
  return 1023 + int64_t(k_tiles) * ws::kStageBytes + kGroups * kStages * kBoxBytes + kGroups * kStages * 8;
}

// The weights as wgmma reads a K-major B (the layout a TMA box load with 128-byte swizzle gives): k-tile kt holds
// row c (output channel of d x_hat), columns k = 64 kt .. + 63, each 16-byte chunk XOR-swizzled by its row;
// column k < 4H is W_in_f[k][c], k >= 4H is W_gate_f[k - 4H][c]. All threads of the block.
__device__ __forceinline__ void lay_out_weights(const BackwardArgs& args, uint8_t* weights, int k_tiles) {
  const int proj_cols = static_cast<int>(4 * args.h);
  for (int index = threadIdx.x; index < k_tiles * 8 * kC; index += kBlockThreads) {
    const int c = index % kC, chunk = (index / kC) % 8, kt = index / (8 * kC), k0 = kt * kKCols + 8 * chunk;
    const float* source = k0 < proj_cols ? args.w_in_f + int64_t(k0) * kC + c
                                         : args.w_gate_f + int64_t(k0 - proj_cols) * kC + c;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = source[e * kC];  // (a warp's 32 channels: one 128-byte line per e)
    const uint4 packed = make_uint4(pack_pair<Op>(v[0], v[1]), pack_pair<Op>(v[2], v[3]), pack_pair<Op>(v[4], v[5]),
                                    pack_pair<Op>(v[6], v[7]));
    *reinterpret_cast<uint4*>(weights + kt * ws::kStageBytes + c * ws::kKBytes + ((chunk ^ (c & 7)) << 4)) = packed;
  }
  fence_proxy_async();  // (wgmma reads the weights through the async proxy)
}

// The sum of v over the four lanes of a quad (one row of the accumulators).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <typename TPair>
__global__ void __launch_bounds__(kBlockThreads, 1)
    kernel(const BackwardArgs args, const __grid_constant__ CUtensorMap map_proj,
           const __grid_constant__ CUtensorMap map_gate, int k_tiles) {
  using Pair2 = Pack<2, TPair>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* weights = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* rings = weights + k_tiles * ws::kStageBytes;
  uint64_t* barriers = reinterpret_cast<uint64_t*>(rings + kGroups * kStages * kBoxBytes);

  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3, tid = threadIdx.x & 127;
  uint8_t* ring = rings + group * kStages * kBoxBytes;
  uint64_t* full = barriers + group * kStages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kGroups * kStages; ++i) mbar_init(&barriers[i], 1);
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t positions = args.batch * args.n * args.n, tiles = ceil_div(positions, int64_t(kPositions));
  const int64_t stride = int64_t(gridDim.x) * kGroups, first = int64_t(blockIdx.x) * kGroups + group;
  const int proj_tiles = static_cast<int>(4 * args.h / kKCols);
  // The warpgroup's it-th box: k-tile it % k_tiles of its (it / k_tiles)-th tile, into stage it % kStages.
  const auto issue = [&](int64_t it) {
    const int64_t tile = first + it / k_tiles * stride;
    if (tile >= tiles) return;
    const int kt = static_cast<int>(it % k_tiles), stage = static_cast<int>(it % kStages);
    mbar_expect_tx(&full[stage], kBoxBytes);
    const bool proj = kt < proj_tiles;
    tma_load_2d(ring + stage * kBoxBytes, proj ? &map_proj : &map_gate, (proj ? kt : kt - proj_tiles) * kKCols,
                static_cast<int>(tile * kPositions), &full[stage]);
  };
  if (tid == 0)
    for (int it = 0; it < kStages; ++it) issue(it);
  lay_out_weights(args, weights, k_tiles);  // (the first boxes load meanwhile)
  __syncthreads();

  const TPair* pair = static_cast<const TPair*>(args.pair);
  TPair* d_pair = static_cast<TPair*>(args.d_pair);
  const float inv_c = 1.f / kC;
  int64_t it = 0;  // the next box to take
  for (int64_t tile = first; tile < tiles; tile += stride) {
    // This thread's rows of the tile (the accumulators' rows): 16 warp4 + lane / 4 and 8 further; of each,
    // channels 8 j + 2 t, + 1 (j < 16). Their pair values load while the tile multiplies.
    int64_t row[2];
    Pair2 x_raw[2][16];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      row[hf] = tile * kPositions + 16 * warp4 + (lane >> 2) + 8 * hf;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (row[hf] < positions) x_raw[hf][j] = *reinterpret_cast<const Pair2*>(pair + row[hf] * kC + 8 * j + 2 * t);
    }

    float acc[64];
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int stage = static_cast<int>(it % kStages);
      mbar_wait(&full[stage], static_cast<int>((it / kStages) & 1));
      wgmma_k_tile<Op>(acc, smem_descriptor(ring + stage * kBoxBytes), smem_descriptor(weights + kt * ws::kStageBytes),
                       kt == 0);
      // The previous k-tile's MMAs are done once at most this one is in flight: its stage takes a box further on.
      wgmma_wait<1>();
      if (kt > 0 && tid == 0) issue(it - 1 + kStages);
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (tid == 0) issue(it - 1 + kStages);

    // LayerNorm_in's backward per row: d pair = rstd (d x_hat - mean(d x_hat) - x_hat mean(d x_hat x_hat)) (+ the
    // raw gate's share), the statistics from the pair row in fp32 (two passes, as the rows kernel's).
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const bool valid = row[hf] < positions;
      float x[32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        x[2 * j] = valid ? to_float(x_raw[hf][j].x[0]) : 0.f;
        x[2 * j + 1] = valid ? to_float(x_raw[hf][j].x[1]) : 0.f;
      }
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) sum += x[i];
      const float mean = quad_sum(sum) * inv_c;
      float squares = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) squares += (x[i] - mean) * (x[i] - mean);
      const float rstd = rsqrtf(quad_sum(squares) * inv_c + args.eps);
      float sum_d = 0.f, dot = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float d = acc[4 * j + 2 * hf + e];
          sum_d += d;
          dot += d * (x[2 * j + e] - mean) * rstd;
        }
      const float mean_d = quad_sum(sum_d) * inv_c, mean_dot = quad_sum(dot) * inv_c;
      if (!valid) continue;
      const float* add = args.d_rows_add != nullptr ? args.d_rows_add + row[hf] * kC : nullptr;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int c = 8 * j + 2 * t;
        const float2 extra = add != nullptr ? *reinterpret_cast<const float2*>(add + c) : make_float2(0.f, 0.f);
        float out[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          out[e] = rstd * (acc[4 * j + 2 * hf + e] - mean_d - (x[2 * j + e] - mean) * rstd * mean_dot) +
                   (e ? extra.y : extra.x);
        store_pack<2>(d_pair + row[hf] * kC + c, out);
      }
    }
  }
}

// Whether it takes d_pair's sizes: bf16 operands, rows of 128 channels, 4H whole k-tiles (H a multiple of 16), the
// weights with the gate's (the larger case) and the rings in shared memory, positions TMA can address.
bool takes(const BackwardArgs& args) {
  const int64_t positions = args.batch * args.n * args.n;
  return args.operand == Dtype::bf16 && args.c == kC && args.h % 16 == 0 && args.h > 0 &&
         tensor_map_encoder() != nullptr && positions < (int64_t(1) << 31) &&
         smem_bytes(k_tiles(args.h, true)) <= max_smem_optin();
}

cudaError_t launch(const BackwardArgs& args) {
  const auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool gate = args.d_gate != nullptr;
  if (!takes(args) || args.rows == nullptr || args.w_in_f == nullptr || args.pair == nullptr ||
      args.d_pair == nullptr || gate != (args.w_gate_f != nullptr) || !aligned(args.rows) || !aligned(args.d_gate) ||
      !aligned(args.pair) || !aligned(args.d_pair) || !aligned(args.d_rows_add))
    return cudaErrorInvalidValue;
  const int64_t positions = args.batch * args.n * args.n;
  if (positions == 0) return cudaSuccess;
  CUtensorMap map_proj, map_gate;
  if (!encode_kmajor_map<Op>(&map_proj, args.rows, 0, positions, 4 * args.h, kPositions) ||
      !encode_kmajor_map<Op>(&map_gate, gate ? args.d_gate : args.rows, 0, positions, gate ? kC : 4 * args.h,
                             kPositions))
    return cudaErrorNotSupported;
  const int tiles_k = k_tiles(args.h, gate);
  const int64_t bytes = smem_bytes(tiles_k);
  const int64_t blocks = std::min<int64_t>(sm_count(), ceil_div(ceil_div(positions, int64_t(kPositions)), kGroups));
  return dispatch_out(args.pair_dtype, [&](auto pair) {
    using TPair = typename decltype(pair)::type;
    const cudaError_t status = fused::allow_smem<kernel<TPair>>(bytes);
    if (status != cudaSuccess) return status;
    kernel<TPair><<<static_cast<unsigned>(blocks), kBlockThreads, bytes, args.stream>>>(args, map_proj, map_gate,
                                                                                       tiles_k);
    return cudaGetLastError();
  });
}

}  // namespace d_pair_mma
}  // namespace backward
}  // namespace trimul
