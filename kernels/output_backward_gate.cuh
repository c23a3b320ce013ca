// output_backward_gate.cuh — output_backward wgmma's z_gate_grad pass: the output side's front half in one kernel.
// The rows kernel runs it as four steps: z_rows (z planes -> z_hat rows, rstd), two cuBLAS GEMMs (o = z_hat
// W_out_f^T + b_out_f, gate_pre = gate_rows W_g^T + b_g, both [P, C] in the operand dtype) and gate_grad (reads
// d out, o and gate_pre, writes d o and d gate in place). Here a warpgroup takes a 64-position tile of z by TMA
// (the forward output pass's box and fragments), normalizes it in registers, multiplies z_hat and the gate rows
// by the resident W_out_f and W_g on wgmma (the forward output pass's products), and turns the fp32 accumulators
// into d o = d out s and d gate = d out o s (1 - s) at once: o and gate_pre are never written. It writes z_hat
// and rstd (the weight gradient's and dz_planes' operands), d o and d gate, and the column sums of d o and d gate
// (the biases' gradients: one block per SM with fixed tiles, each warp's columns reduce-scattered into
// registers, the warps' rows added in order, so the bits are fixed for a GPU). Rows leave through a per-warp
// staging tile as whole 128-byte lines. The gate rows land by TMA with d out, a tile ahead (loads in registers a
// tile ahead would spill: the kernel sits near 255), and become A fragments by ldmatrix. Hopper (sm_90a), bf16
// operands, pair_dim and hidden 128.
#pragma once
#include "backward_wgmma_rows.cuh"
#include "output_pass.cuh"

namespace trimul {
namespace backward {
namespace gate_mma {

using namespace ::trimul::backward::wgmma_rows;  // (the block shape: two warpgroups on their own 64-position tiles)
using ::trimul::output_pass::kZBoxBytes;

constexpr int kC = 128, kH = 128;            // the pair_dim and hidden it takes
constexpr int kSteps = kC / 16;              // k16 steps of each product (K = C = H = 128)
constexpr int kParts = kC / 64;              // output channels in N = 64 parts
constexpr int kTileBytes = 64 * ws::kKBytes; // a k-tile of a part's 64 weight rows
constexpr int kKTiles = kC * 2 / ws::kKBytes;
constexpr int kWeightBytes = kParts * kKTiles * kTileBytes;  // one product's weights, bf16
constexpr int kStageRowBytes = 256;          // a staged row: z_hat's 128 h, or a part's 64 d o then 64 d gate
constexpr int kStageBytes = 16 * kStageRowBytes;  // per warp: its 16 positions
constexpr int kWarps = kBlockThreads / 32;
static_assert(kH == ::trimul::output_pass::kZBoxH && kPositions == ::trimul::output_pass::kZBoxPositions,
              "a tile is one z box");

// A warpgroup's d out tile: 64 positions x 128 channels of TOut, as TMA boxes of 128 bytes of channels x 64
// positions with the 128-byte swizzle ([part][box of the part]: one box per part in 16 bits, two in fp32).
template <typename TOut>
constexpr int kDOutBoxCols = 128 / static_cast<int>(sizeof(TOut));
constexpr int kDOutBoxBytes = 128 * kPositions;
template <typename TOut>
constexpr int kDOutBytes = kC / kDOutBoxCols<TOut> * kDOutBoxBytes;
// A warpgroup's gate rows: 64 positions x 128 channels bf16, two boxes of 64 channels (128-byte swizzle).
constexpr int kGateRowsBytes = kC / 64 * kDOutBoxBytes;

// Dynamic shared memory: both weights (1024-byte aligned), each warpgroup's d out tile with its gate rows, and its
// z box (TMA's swizzled boxes: 1024-byte multiples after the weights), each warp's staging tile, the two biases,
// the boxes' barriers (z's, then d out's). The block's sums reuse the weights' bytes once the tiles are done.
inline int64_t smem_bytes(int64_t d_out_bytes) {
  return 1023 + 2 * kWeightBytes + kGroups * (d_out_bytes + kGateRowsBytes + kZBoxBytes) + kWarps * kStageBytes +
         2 * kC * 4 + 2 * kGroups * 8;
}
static_assert(kWarps * 2 * kC * 4 <= 2 * kWeightBytes, "the warps' sums fit in the weights' bytes");

// Weight matrix w (fp32 [128 out][ld >= 128 k], row-major) into shared memory as wgmma's B operand: [part][k-tile]
// tiles of 64 rows x 128 bytes of k, 16-byte chunks XOR-swizzled by row % 8 (smem_descriptor's layout); logical
// k of a row holds column col(k). All threads of the block.
template <class Column>
__device__ __forceinline__ void lay_out(uint8_t* dst, const float* __restrict__ w, int ld, Column&& col) {
#pragma unroll 4  // (four rounds of loads in flight: the layout is a chain of L2 round trips)
  for (int index = threadIdx.x; index < kC * kC / 8; index += kBlockThreads) {
    const int row = index / (kC / 8), chunk = index % (kC / 8), part = row >> 6, n = row & 63;
    const int kt = chunk / 8, c = chunk % 8;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = w[row * ld + col(8 * chunk + e)];
    *reinterpret_cast<uint4*>(dst + (part * kKTiles + kt) * kTileBytes + n * ws::kKBytes + ((c ^ (n & 7)) << 4)) =
        make_uint4(pack_pair<Op>(v[0], v[1]), pack_pair<Op>(v[2], v[3]), pack_pair<Op>(v[4], v[5]),
                   pack_pair<Op>(v[6], v[7]));
  }
}

// This thread's d out pairs of a part from the warpgroup's tile: row r of the tile, the part's channels
// 8 j + 2 t + {0, 1} at d[2 j + {0, 1}] (the accumulators' columns).
template <typename TOut>
__device__ __forceinline__ void d_out_pairs(const uint8_t* tile, int part, int r, int t, float (&d)[16]) {
  constexpr int kCols = kDOutBoxCols<TOut>, kChunkCols = 16 / static_cast<int>(sizeof(TOut));
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int k = 64 * part + 8 * j + 2 * t, col = k % kCols, chunk = col / kChunkCols;
    const uint8_t* box = tile + (k / kCols) * kDOutBoxBytes + r * 128;
    load_pack<2>(reinterpret_cast<const TOut*>(box + ((chunk ^ (r & 7)) << 4)) + col % kChunkCols, &d[2 * j]);
  }
}

// This thread's gate-row A fragments of the warpgroup's tile (rows 16 warp4 + g and + 8, channels 16 s + 2 t ..
// and + 8: wgmma's k order) from the two swizzled 64-channel boxes, by ldmatrix (lane 8 k + i gives row i of
// block k: rows + 8 (k % 2), channels + 8 (k / 2)).
__device__ __forceinline__ void gate_fragments(uint32_t (&xf)[kSteps][4], const uint8_t* tile, int warp4, int lane) {
  const int row = 16 * warp4 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int chunk = 2 * s + (lane >> 4), box = chunk >> 3;
    ::trimul::mma::ldmatrix_x4(xf[s], reinterpret_cast<const uint32_t*>(tile + box * kDOutBoxBytes + row * 128 +
                                                                         (((chunk & 7) ^ (row & 7)) << 4)));
  }
}

template <typename TOut>
__global__ void __launch_bounds__(kBlockThreads, 1)
    kernel(const BackwardArgs args, const __grid_constant__ CUtensorMap map_z,
           const __grid_constant__ CUtensorMap map_d_out, const __grid_constant__ CUtensorMap map_gate,
           int64_t tiles_per_batch) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* w_gate = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* w_out = w_gate + kWeightBytes;
  uint8_t* d_out_all = w_out + kWeightBytes;  // per warpgroup: d out's boxes, then the gate rows'
  uint8_t* z_all = d_out_all + kGroups * (kDOutBytes<TOut> + kGateRowsBytes);
  uint8_t* stage_all = z_all + kGroups * kZBoxBytes;
  float* gate_bias = reinterpret_cast<float*>(stage_all + kWarps * kStageBytes);
  float* out_bias = gate_bias + kC;
  uint64_t* z_full = reinterpret_cast<uint64_t*>(out_bias + kC);
  uint64_t* d_out_full = z_full + kGroups;
  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3, g = lane >> 2, tid = threadIdx.x & 127;
  uint8_t* z_tile = z_all + group * kZBoxBytes;
  uint8_t* d_out_tile = d_out_all + group * (kDOutBytes<TOut> + kGateRowsBytes);
  uint8_t* gate_tile = d_out_tile + kDOutBytes<TOut>;
  uint8_t* stage = stage_all + warp * kStageBytes;
  const int64_t plane = plane_positions(args), tiles = args.batch * tiles_per_batch;
  const int64_t stride = int64_t(gridDim.x) * kGroups;
  int64_t tile = int64_t(blockIdx.x) * kGroups + group;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2 * kGroups; ++i) mbar_init(&z_full[i], 1);
    mbar_init_fence();
  }
  __syncthreads();
  const auto load_z = [&](int64_t at) {
    ::trimul::output_pass::load_z_tile(z_tile, &map_z, &z_full[group], at, tiles_per_batch);
  };
  // A tile's d out rows and gate rows (positions batch * plane + q0 on, the rows' order in both directions) as
  // their boxes. (Rows past the plane: the next batch's, or TMA's zeros; never stored, their d out zeroed.)
  const auto load_d_out = [&](int64_t at) {
    const int64_t batch = at / tiles_per_batch, row = batch * plane + (at - batch * tiles_per_batch) * kPositions;
    mbar_expect_tx(&d_out_full[group], kDOutBytes<TOut> + kGateRowsBytes);
    for (int box = 0; box < kDOutBytes<TOut> / kDOutBoxBytes; ++box)
      tma_load_2d(d_out_tile + box * kDOutBoxBytes, &map_d_out, box * kDOutBoxCols<TOut>, static_cast<int>(row),
                  &d_out_full[group]);
    for (int box = 0; box < kGateRowsBytes / kDOutBoxBytes; ++box)
      tma_load_2d(gate_tile + box * kDOutBoxBytes, &map_gate, 64 * box, static_cast<int>(row), &d_out_full[group]);
  };
  if (tid == 0 && tile < tiles) {
    load_z(tile);
    load_d_out(tile);
  }
  lay_out(w_gate, args.w_gate_f, kC, [](int k) { return k; });
  lay_out(w_out, args.w_out_f, kH, [](int k) { return k; });
  for (int c = threadIdx.x; c < kC; c += kBlockThreads) {
    gate_bias[c] = args.b_gate_f[c];
    out_bias[c] = args.b_out_f[c];
  }
  fence_proxy_async();  // (the weights were written by st.shared; wgmma reads them through the async proxy)
  __syncthreads();

  Op* z_hat = static_cast<Op*>(args.rows);
  Op* d_o = static_cast<Op*>(args.o);
  Op* d_gate = static_cast<Op*>(args.gate_pre);
  // A tile's positions: batch * plane + q for q < plane (the z planes' order is the rows' in both directions);
  // first: the tile's first position, count: how many of its rows have one.
  struct Span {
    int64_t first;
    int count;
  };
  const auto span_of = [&](int64_t at) {
    const int64_t batch = at / tiles_per_batch, q0 = (at - batch * tiles_per_batch) * kPositions;
    return Span{batch * plane + q0, at < tiles ? static_cast<int>(std::min<int64_t>(kPositions, plane - q0)) : 0};
  };
  const auto position = [](const Span& span, int row) -> int64_t { return row < span.count ? span.first + row : -1; };
  // The warp's 16 staged rows out, 16 bytes per lane, two whole 256-byte rows per instruction: chunk c of row r
  // (XOR-swizzled by r % 8 in the staging tile) to dst(position, c).
  const auto rows_out = [&](const Span& span, auto&& dst) {
    __syncwarp();
    const int c = lane & 15;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int r = 2 * k + (lane >> 4);
      const int64_t p = position(span, 16 * warp4 + r);
      const uint4 v = *reinterpret_cast<const uint4*>(stage + r * kStageRowBytes + ((c ^ (r & 7)) << 4));
      if (p >= 0) *reinterpret_cast<uint4*>(dst(p, c)) = v;
    }
    __syncwarp();  // (the staging tile is written again next)
  };

  float sums[kParts][2][2] = {};  // [part][d o, d gate][e]: the part's columns 8 g + 2 t + e, reduce-scattered
  int z_parity = 0, d_out_parity = 0;
  for (; tile < tiles; tile += stride) {
    mbar_wait(&z_full[group], z_parity);
    z_parity ^= 1;
    uint32_t zf[kSteps][4];
    ::trimul::output_pass::z_fragments(zf, z_tile, warp4, lane);
    release_stage_to_tma(1 + group, 128);  // the tile is in every thread's registers: the next one may land
    if (tid == 0 && tile + stride < tiles) load_z(tile + stride);
    const Span span = span_of(tile);

    // LayerNorm_out in registers: z_hat replaces z in the fragments (the product's A operand and the rows written).
    float rstd[2];
    ::trimul::output_pass::center_z_fragments<true>(zf, rstd, args.eps);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t p = position(span, 16 * warp4 + g + 8 * hf);
      if (t == 0 && p >= 0) args.rstd[p] = rstd[hf];
    }
    // z_hat rows: fragment block k of k-step s (rows 8 (k % 2), h 16 s + 8 (k / 2)) by stmatrix into the staging
    // tile's 16-byte chunk 2 s + k / 2, then out as whole rows.
    {
      const int k = lane >> 3, r = (lane & 7) + 8 * (k & 1);
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        stmatrix_x4(smem_u32(stage) + r * kStageRowBytes + (((2 * s + (k >> 1)) ^ (r & 7)) << 4), zf[s][0], zf[s][1],
                    zf[s][2], zf[s][3]);
    }
    rows_out(span, [&](int64_t p, int c) { return z_hat + p * kH + 8 * c; });

    const int64_t row_pos[2] = {position(span, 16 * warp4 + g), position(span, 16 * warp4 + g + 8)};
    mbar_wait(&d_out_full[group], d_out_parity);
    d_out_parity ^= 1;
    uint32_t xf[kSteps][4];
    gate_fragments(xf, gate_tile, warp4, lane);
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      // d out at row g + 8 hf, the part's channel 8 j + 2 t + e at [2 j + e]; zero past the plane, where the box
      // holds the next batch's rows (or TMA's zeros), so that they add nothing to the sums.
      float d[2][16] = {};
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        if (row_pos[hf] >= 0) d_out_pairs<TOut>(d_out_tile, part, 16 * warp4 + g + 8 * hf, t, d[hf]);
      if (part == kParts - 1) {
        release_stage_to_tma(1 + group, 128);  // every thread has its d out: the next tile's may land
        if (tid == 0 && tile + stride < tiles) load_d_out(tile + stride);
      }
      float gate[32], proj[32];
      ::trimul::output_pass::gated_part_products<Mode::highest>(gate, proj, xf, zf, w_gate + part * kKTiles * kTileBytes,
                                                 w_out + part * kKTiles * kTileBytes, gate_bias + 64 * part, t);
      float column[2][16] = {};  // [d o, d gate][2 j + e]: over this thread's two rows
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 bo = *reinterpret_cast<const float2*>(out_bias + 64 * part + 8 * j + 2 * t);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float grad_o[2], grad_gate[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float s = gate[4 * j + 2 * hf + e], o = proj[4 * j + 2 * hf + e] + (e ? bo.y : bo.x);
            const float dv = d[hf][2 * j + e];
            grad_o[e] = dv * s;
            grad_gate[e] = grad_o[e] * o * (1.f - s);
            column[0][2 * j + e] += grad_o[e];
            column[1][2 * j + e] += grad_gate[e];
          }
          // Staged row r = g + 8 hf: d o in 16-byte chunks 0-7, d gate in 8-15, chunk j of each at byte 4 t.
          const int r = g + 8 * hf;
          uint8_t* row = stage + r * kStageRowBytes + 4 * t;
          *reinterpret_cast<uint32_t*>(row + ((j ^ (r & 7)) << 4)) = pack_pair<Op>(grad_o[0], grad_o[1]);
          *reinterpret_cast<uint32_t*>(row + (((8 + j) ^ (r & 7)) << 4)) = pack_pair<Op>(grad_gate[0], grad_gate[1]);
        }
      }
      rows_out(span, [&](int64_t p, int c) { return (c < 8 ? d_o : d_gate) + p * kC + 64 * part + 8 * (c & 7); });
      // The columns' sums over the warp's 16 positions: lane 4 g + t keeps the part's columns 8 g + 2 t + {0, 1}.
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const float2 column_sum = warp_column_sums(column[w], lane);
        sums[part][w][0] += column_sum.x;
        sums[part][w][1] += column_sum.y;
      }
    }
  }

  // The block's sums: each warp's columns into its row (over the weights, read by now), the rows added in order.
  __syncthreads();
  float* warp_rows = reinterpret_cast<float*>(w_gate);
#pragma unroll
  for (int part = 0; part < kParts; ++part)
#pragma unroll
    for (int w = 0; w < 2; ++w)
#pragma unroll
      for (int i = 0; i < 2; ++i) warp_rows[warp * 2 * kC + w * kC + 64 * part + 8 * g + 2 * t + i] = sums[part][w][i];
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * kC; c += kBlockThreads) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += warp_rows[w * 2 * kC + c];
    args.sums[blockIdx.x * 2 * kC + c] = total;
  }
}

// Whether it takes z_gate_grad's sizes: bf16 operands, pair_dim and hidden 128 (the forward output pass's
// products), planes TMA can read (N^2, a block's rows x N, a multiple of 8: 16-byte rows of the box map) and positions it can count.
bool takes(const BackwardArgs& args) {
  const int64_t plane = plane_positions(args);
  const int64_t d_out_bytes = args.d_out_dtype == Dtype::f32 ? kDOutBytes<float> : kDOutBytes<__nv_bfloat16>;
  return args.operand == Dtype::bf16 && args.c == kC && args.h == kH && tensor_map_encoder() != nullptr &&
         plane % 8 == 0 && args.batch * plane < (int64_t(1) << 31) && args.batch * kH < (int64_t(1) << 31) &&
         smem_bytes(d_out_bytes) <= max_smem_optin();
}

cudaError_t launch(const BackwardArgs& args) {
  // (alignment: TMA's 16 bytes for z, d out and the gate rows, the 16-byte row stores)
  const auto aligned = [](const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  if (!takes(args) || args.a_planes == nullptr || args.x_hat == nullptr || args.w_out_f == nullptr ||
      args.b_out_f == nullptr || args.w_gate_f == nullptr || args.b_gate_f == nullptr || args.d_out == nullptr ||
      args.o == nullptr || args.gate_pre == nullptr || args.rows == nullptr || args.rstd == nullptr ||
      args.sums == nullptr || !aligned(args.a_planes, 16) || !aligned(args.x_hat, 16) ||
      !aligned(args.d_out, 16) || !aligned(args.o, 16) ||
      !aligned(args.gate_pre, 16) || !aligned(args.rows, 16))
    return cudaErrorInvalidValue;
  const int64_t plane = plane_positions(args);
  if (args.batch * plane == 0) return cudaSuccess;
  CUtensorMap map_z;
  if (!encode_kmajor_map<Op>(&map_z, args.a_planes, 0, args.batch * kH, plane, kH)) return cudaErrorNotSupported;
  const int64_t tiles_per_batch = ceil_div(plane, kPositions);
  const int64_t blocks = persistent_sum_blocks(ceil_div(args.batch * tiles_per_batch, kGroups));
  return dispatch_out(args.d_out_dtype, [&](auto out) {
    using TOut = typename decltype(out)::type;
    CUtensorMap map_d_out, map_gate;
    if (!encode_kmajor_map<TOut>(&map_d_out, args.d_out, 0, args.batch * plane, kC, kPositions) ||
        !encode_rows_map(&map_gate, args.x_hat, args.batch * plane, kC))
      return cudaErrorNotSupported;
    const int64_t bytes = smem_bytes(kDOutBytes<TOut>);
    const cudaError_t status = fused::allow_smem<kernel<TOut>>(bytes);
    if (status != cudaSuccess) return status;
    kernel<TOut><<<static_cast<unsigned>(blocks), kBlockThreads, bytes, args.stream>>>(args, map_z, map_d_out,
                                                                                      map_gate, tiles_per_batch);
    return cudaGetLastError();
  });
}

}  // namespace gate_mma
}  // namespace backward
}  // namespace trimul
