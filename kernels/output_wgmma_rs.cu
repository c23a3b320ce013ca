// wgmma_rs — Hopper (sm_90a): z (TMA + ldmatrix.trans) and the gate rows as wgmma's register operands
// against resident weights, the output staged per warp and stored in whole lines; "medium", pair_dim 128, hidden 128.
#include "output_pass.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

// ---- The rows in registers at pair_dim 128 (sm_90a): wgmma_rs -----------------------------------------
// wgmma_rs_384's pattern at pair_dim 128, where all of out_gate's and out_proj's weights fit one block (32 KB
// each): two MMA warpgroups per block, each on its own 64-position tiles. Per tile a warpgroup takes z's
// [128 h][64 positions] tile by TMA (the next tile's issued once this one is in registers), reads it as wgmma
// A fragments by ldmatrix.trans and LayerNorms them there (the fragments hold bf16 (z - mean), rstd applies
// in the epilogue). The gate rows come as A fragments too, 8 adjacent channels per 16-byte load (the next
// tile's loads in flight while this tile multiplies): the block writes out_gate's weights into shared
// memory with k permuted to match (a thread's k-steps 2u and 2u + 1 hold channels 32u + 8t .. + 7 of its
// rows), and with the gate on LayerNorm_in(pair) the rows are normalized in registers (statistics over the
// quad that holds a row). Per 64 output channels: the gate product and out_proj's (K = 128 each), then out =
// sigmoid(gate + b) * (rstd proj + b) through a per-warp staging tile (row-swizzled), so each store
// instruction writes whole 128-byte lines of output rows instead of 16 bytes of eight rows. With
// ForwardArgs::gate_rows (kGateRows) the gate's rows are those bf16 rows instead of pair's (the training
// forward's x_hat, a raw gate), and out keeps pair's dtype.
namespace wgmma_rs {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;  // (kKBytes)

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kWarps = 4 * kGroups, kThreads = 32 * kWarps;
constexpr int kPositions = 64;                        // per tile: wgmma's M
constexpr int kC = 128, kH = 128;                     // the pair_dim and hidden it takes
constexpr int kParts = kC / 64;                       // output channels in N = 64 parts
constexpr int kSteps = kC / 16;                       // k16 steps of each product (K = C = H = 128)
constexpr int kTileBytes = 64 * kKBytes;              // a k-tile of a part's 64 weight rows
constexpr int kKTiles = kC * 2 / kKBytes;             // k-tiles per part and product
constexpr int kWeightBytes = kParts * kKTiles * kTileBytes;  // one product's weights
constexpr int kZBytes = kZBoxBytes;  // z's tile: load_z_tile's box
static_assert(kH == kZBoxH && kPositions == kZBoxPositions, "a tile is one z box");

template <typename TIn>
constexpr int stage_row_bytes() { return 64 * static_cast<int>(sizeof(TIn)); }  // a warp's staged row of a part
// Dynamic shared memory: both weights (1024-byte aligned), each warpgroup's z tile, each warp's staging tile
// (16 rows of a part) and its rows' output offsets, the biases and LayerNorm_in's affine, the barriers.
template <typename TIn>
constexpr int64_t smem_bytes() {
  return 1023 + 2 * kWeightBytes + kGroups * kZBytes + kWarps * (16 * stage_row_bytes<TIn>() + 16 * 8) + 4 * kC * 4 +
         kGroups * 8;
}

// The channel that k-step s's logical k (0..15) of a thread's A fragment holds: the fragment's registers are
// (row, k 2t + {0, 1}) and (row, k 2t + 8 + {0, 1}); here they hold channels 32u + 8t + 4v + {0, 1} and
// + {2, 3} for s = 2u + v, so that thread t's channels of k-steps 2u and 2u + 1 are one 16-byte load.
__device__ __forceinline__ int gate_channel(int s, int kk) {
  const int hi = kk >> 3, t = (kk & 7) >> 1, e = kk & 1;
  return 32 * (s >> 1) + 8 * t + 4 * (s & 1) + 2 * hi + e;
}

// Weight matrix `w` ([128 rows][ld] 16-bit) into shared memory as wgmma's B operand: [part][k-tile] tiles of 64
// rows x 128 bytes of k, 16-byte chunks XOR-swizzled by row % 8 (TMA's 128-byte swizzle, smem_descriptor);
// logical k of the tile holds column col(k) of the row.
template <class Column>
__device__ __forceinline__ void write_weights(uint8_t* dst, const __nv_bfloat16* __restrict__ w, int64_t ld,
                                              Column&& col) {
  for (int e = threadIdx.x; e < kC * kC; e += kThreads) {
    const int row = e / kC, k = e - row * kC;  // (consecutive threads: consecutive k of a row)
    const int part = row >> 6, n = row & 63, kt = k >> 6, kk = k & 63;
    uint8_t* at = dst + (part * kKTiles + kt) * kTileBytes + n * kKBytes + (((kk >> 3) ^ (n & 7)) << 4) + (kk & 7) * 2;
    *reinterpret_cast<__nv_bfloat16*>(at) = w[row * ld + col(k)];
  }
}

// Eight adjacent channels of a row: one 16-byte load of 16-bit rows, two of fp32 ones.
template <typename TIn>
struct EightChannels {
  uint4 raw[sizeof(TIn) / 2];
  __device__ __forceinline__ void load(const TIn* p) {
#pragma unroll
    for (int i = 0; i < int(sizeof(TIn) / 2); ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < int(sizeof(TIn) / 2); ++i) raw[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void widen(float (&x)[8]) const {
    const TIn* e = reinterpret_cast<const TIn*>(raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
  }
};

template <typename TIn, bool kGateRows>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_z, int64_t tiles_per_batch) {
  using Op = __nv_bfloat16;
  using TRow = std::conditional_t<kGateRows, Op, TIn>;  // the gate rows' type
  constexpr int kRowBytes = stage_row_bytes<TIn>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* w_gate = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // [part][k-tile], k permuted
  uint8_t* w_out = w_gate + kWeightBytes;                                           // [part][k-tile]
  uint8_t* z_all = w_out + kWeightBytes;
  uint8_t* stage_all = z_all + kGroups * kZBytes;
  int64_t* out_rows_all = reinterpret_cast<int64_t*>(stage_all + kWarps * 16 * kRowBytes);
  float* gate_bias = reinterpret_cast<float*>(out_rows_all + kWarps * 16);
  float* out_bias = gate_bias + kC;
  float* ln_w = out_bias + kC;
  float* ln_b = ln_w + kC;
  uint64_t* z_full = reinterpret_cast<uint64_t*>(ln_b + kC);
  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3, g = lane >> 2, tid = threadIdx.x & 127;
  uint8_t* z_tile = z_all + group * kZBytes;
  uint8_t* stage = stage_all + warp * 16 * kRowBytes;
  int64_t* out_rows = out_rows_all + warp * 16;
  const int64_t n = args.n, plane_rows = pair_rows(args), plane = plane_rows * args.ldz;
  const int64_t tiles = args.batch * tiles_per_batch;
  const int64_t stride = int64_t(gridDim.x) * kGroups;
  int64_t tile = int64_t(blockIdx.x) * kGroups + group;
  const bool normalized = !kGateRows && args.gate_normalized;
  const auto load_z = [&](int64_t at) { load_z_tile(z_tile, &map_z, &z_full[group], at, tiles_per_batch); };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kGroups; ++i) mbar_init(&z_full[i], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (tid == 0 && tile < tiles) load_z(tile);
  write_weights(w_gate, static_cast<const Op*>(args.w_gate), args.c_pad,
                [](int k) { return gate_channel(k >> 4, k & 15); });
  write_weights(w_out, static_cast<const Op*>(args.w_out), args.h_pad, [](int k) { return k; });
  for (int c = threadIdx.x; c < kC; c += kThreads) {
    gate_bias[c] = args.b_gate[c];
    out_bias[c] = args.b_out[c];
    if (normalized) {  // (read only on the normalized gate's path)
      ln_w[c] = args.ln_in_w[c];
      ln_b[c] = args.ln_in_b[c];
    }
  }
  fence_proxy_async();  // (the weights were written by st.shared; wgmma reads them through the async proxy)
  __syncthreads();

  const TRow* gate_rows = static_cast<const TRow*>(kGateRows ? args.gate_rows : args.pair);
  TIn* out = static_cast<TIn*>(args.out);
  // This thread's gate rows of a tile (positions 16 warp4 + g and + 8: its rows of the A fragments), channels
  // 32u + 8t .. + 7 of each, and the rows' output offsets (-1: no position).
  const auto load_rows = [&](int64_t at, EightChannels<TRow> (&rows)[2][4], int64_t (&out_off)[2]) {
    const int64_t batch = at / tiles_per_batch, q0 = (at - batch * tiles_per_batch) * kPositions;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      // (plane < 2^32, applicable(): 32-bit division)
      const uint32_t q = static_cast<uint32_t>(q0 + 16 * warp4 + g + 8 * hf);
      const uint32_t i = q / static_cast<uint32_t>(args.ldz), j = q - i * static_cast<uint32_t>(args.ldz);
      const bool valid = at < tiles && q < plane && j < n;
      out_off[hf] = valid ? ((batch * plane_rows + i) * n + j) * kC : -1;
      // (gate rows [P, kC]: a position's row starts where its out row does)
      const int64_t row = !valid ? -1 : kGateRows ? out_off[hf] : batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (row >= 0) rows[hf][u].load(gate_rows + row + 32 * u + 8 * t);
        else rows[hf][u].clear();
      }
    }
  };
  EightChannels<TRow> rows[2][4];
  int64_t out_off[2];
  load_rows(tile, rows, out_off);
  int z_parity = 0;
  for (; tile < tiles; tile += stride) {
    mbar_wait(&z_full[group], z_parity);
    z_parity ^= 1;
    uint32_t zf[kSteps][4];
    z_fragments(zf, z_tile, warp4, lane);
    release_stage_to_tma(1 + group, 128);  // the tile is in every thread's registers: the next one may land
    if (tid == 0 && tile + stride < tiles) load_z(tile + stride);
    float z_rstd[2];
    center_z_fragments(zf, z_rstd, args.eps_out);
    // The gate rows as A fragments (gate_channel's order): raw, or LayerNorm_in-ed with its affine.
    uint32_t xf[kSteps][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float x[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) rows[hf][u].widen(x[u]);
      if (normalized) {
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int e = 0; e < 8; ++e) sum += x[u][e];
        const float mean = quad_sum(sum) * (1.f / kC);
        float sum_sq = 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            x[u][e] -= mean;
            sum_sq = fmaf(x[u][e], x[u][e], sum_sq);
          }
        const float rstd = rsqrtf(quad_sum(sum_sq) * (1.f / kC) + args.eps_in);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 w0 = *reinterpret_cast<const float4*>(ln_w + 32 * u + 8 * t);
          const float4 w1 = *reinterpret_cast<const float4*>(ln_w + 32 * u + 8 * t + 4);
          const float4 b0 = *reinterpret_cast<const float4*>(ln_b + 32 * u + 8 * t);
          const float4 b1 = *reinterpret_cast<const float4*>(ln_b + 32 * u + 8 * t + 4);
          const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
          const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) x[u][e] = fmaf(x[u][e] * rstd, w[e], b[e]);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if constexpr (std::is_same<TRow, Op>::value) {
          if (!normalized) {  // (bf16 rows: the pairs are the operands as they are)
            xf[2 * u][hf] = rows[hf][u].raw[0].x;
            xf[2 * u][2 + hf] = rows[hf][u].raw[0].y;
            xf[2 * u + 1][hf] = rows[hf][u].raw[0].z;
            xf[2 * u + 1][2 + hf] = rows[hf][u].raw[0].w;
            continue;
          }
        }
        xf[2 * u][hf] = pack_pair<Op>(x[u][0], x[u][1]);
        xf[2 * u][2 + hf] = pack_pair<Op>(x[u][2], x[u][3]);
        xf[2 * u + 1][hf] = pack_pair<Op>(x[u][4], x[u][5]);
        xf[2 * u + 1][2 + hf] = pack_pair<Op>(x[u][6], x[u][7]);
      }
    }
    if (t == 0) {
      out_rows[g] = out_off[0];
      out_rows[g + 8] = out_off[1];
    }
    __syncwarp();
    load_rows(tile + stride, rows, out_off);  // in flight while this tile multiplies and stores

#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      float gate[32], proj[32];
      gated_part_products(gate, proj, xf, zf, w_gate + p * kKTiles * kTileBytes, w_out + p * kKTiles * kTileBytes,
                          gate_bias + 64 * p, t);
      // Into the warp's staging tile: row r = g + 8 hf, the 16-byte chunk of channel 8 j + 2 t XOR-swizzled by
      // r % 8 (a store instruction's lanes then hit every bank once).
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 bo = *reinterpret_cast<const float2*>(out_bias + 64 * p + 8 * j + 2 * t);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = g + 8 * hf, byte = (8 * j + 2 * t) * static_cast<int>(sizeof(TIn));
          uint8_t* at = stage + r * kRowBytes + ((((byte >> 4) ^ (r & 7))) << 4) + (byte & 15);
          const float v0 = fmaf(proj[4 * j + 2 * hf], z_rstd[hf], bo.x) * gate[4 * j + 2 * hf];
          const float v1 = fmaf(proj[4 * j + 2 * hf + 1], z_rstd[hf], bo.y) * gate[4 * j + 2 * hf + 1];
          if constexpr (std::is_same<TIn, float>::value) *reinterpret_cast<float2*>(at) = make_float2(v0, v1);
          else *reinterpret_cast<uint32_t*>(at) = pack_pair<TIn>(v0, v1);
        }
      }
      __syncwarp();
      // The warp's 16 rows of this part out, 16 bytes per lane: each instruction writes whole rows' runs.
      constexpr int kChunksPerRow = kRowBytes / 16, kRowsPerStore = 32 / kChunksPerRow;
      const int c = lane % kChunksPerRow;
#pragma unroll
      for (int k = 0; k < 16 / kRowsPerStore; ++k) {
        const int r = k * kRowsPerStore + lane / kChunksPerRow;
        const int64_t row = out_rows[r];
        const uint4 v = *reinterpret_cast<const uint4*>(stage + r * kRowBytes + ((c ^ (r & 7)) << 4));
        if (row >= 0) *reinterpret_cast<uint4*>(out + row + 64 * p + c * (16 / static_cast<int>(sizeof(TIn)))) = v;
      }
      __syncwarp();  // (the next part's values overwrite the staging tile)
    }
  }
}

// Whether it takes these sizes: sm_90a on Hopper, "medium" (bf16 operands and z), pair_dim and H 128 exactly
// (out_gate / out_proj rows of 128), rows in 16-byte vectors (pair's, or gate_rows 16-byte aligned, read as a
// raw gate), a separate contraction's z whose planes TMA can read (rows of 16-byte multiples), planes below 2^31
// positions (the z tile's TMA coordinate is a signed 32-bit position within its plane).
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return tensor_map_encoder() != nullptr && args.z != nullptr && args.z_dtype == Dtype::bf16 && args.c == kC &&
         args.c_pad == kC && args.h == kH && args.h_pad == kH && gate_rows_vectorizable<TIn>(args) &&
         (pair_rows(args) * args.ldz) % 8 == 0 && pair_rows(args) * args.ldz < (int64_t(1) << 31) &&
         args.batch * kH < (int64_t(1) << 31) && smem_bytes<TIn>() <= max_smem_optin();
}

template <typename TIn, bool kGateRows>
cudaError_t launch_grid(const ForwardArgs& args, const CUtensorMap& map_z, int64_t blocks, int64_t tiles_per_batch) {
  constexpr int64_t bytes = smem_bytes<TIn>();
  const cudaError_t status = allow_smem<kernel<TIn, kGateRows>>(bytes);
  if (status != cudaSuccess) return status;
  kernel<TIn, kGateRows><<<static_cast<unsigned>(blocks), kThreads, bytes, args.stream>>>(args, map_z, tiles_per_batch);
  return cudaGetLastError();
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  const int64_t plane = pair_rows(args) * args.ldz;
  CUtensorMap map_z;
  if (!encode_kmajor_map<__nv_bfloat16>(&map_z, args.z, 0, args.batch * kH, plane, kH)) return cudaErrorNotSupported;
  const int64_t tiles_per_batch = ceil_div(plane, kPositions);
  const int64_t blocks = std::min<int64_t>(sm_count(), ceil_div(args.batch * tiles_per_batch, kGroups));
  return args.gate_rows != nullptr ? launch_grid<TIn, true>(args, map_z, blocks, tiles_per_batch)
                                   : launch_grid<TIn, false>(args, map_z, blocks, tiles_per_batch);
}

}  // namespace wgmma_rs

}  // namespace output_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS_WITH(output, wgmma_rs, trimul::output_pass::wgmma_rs, trimul::fused::kBf16Mode, true, true);
