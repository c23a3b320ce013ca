// wgmma_rs_384 — Hopper (sm_90a): wgmma_rs for rows of 384 channels, one side's weights resident per
// block, partner blocks on the same tiles; 16-bit operands, hidden <= 128.
#include "wgmma_rs.cuh"

namespace trimul {
namespace input_pass {

// ---- The rows in registers at pair_dim 384 (sm_90a): wgmma_rs_384 ----------------------------------
// wgmma_rs's pattern where all of w_in (384 KB at H = 128) does not fit in shared memory: each block keeps
// one side's rows resident (a's or b's half of ForwardArgs::w_in_rows, 192 KB at H = 128), and blocks 2i and
// 2i + 1 (one per side) walk the same tiles, so a pair row one of them reads is an L2 hit for the other.
// A thread's 96 channels of a row are in registers at once, so the LayerNorm is exact two-pass (the mean by
// quad shuffles, then the centred squares); the fragments hold bf16 / fp16 (x - mean), whose rounding is
// relative to the row's spread as a normalized value's would be, and rstd and the biases (w_in_rows'
// columns c_pad, c_pad + 1: no bias k-step here, its tiles would not fit) apply in the epilogue.
namespace wgmma_rs_384 {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;

using wgmma_rs::kGroups;
using wgmma_rs::kPositions;
using wgmma_rs::kScratchBytes;
using wgmma_rs::kThreads;
constexpr int kC = 384;                    // the pair_dim it takes
constexpr int kSteps = kC / 16;            // k16 steps of the rows
constexpr int kKTiles = kC * 2 / kKBytes;  // 128-byte k-tiles per 128-row weight chunk

// Dynamic shared memory for one side's rows_ab weight rows: the weights (1024-byte aligned), the scratches,
// the side's biases, the weights' barriers.
inline int64_t smem_bytes(int64_t rows_ab) {
  const int64_t tiles = rows_ab / kChunkRows * kKTiles;
  return 1023 + tiles * (kStageBytes + 8) + kGroups * kScratchBytes + rows_ab * 4;
}

// The x_hat row of one position (ForwardArgs::x_hat, row `position` in pair_repr's order, whatever pair's
// strides) from its centred fragments:
// (x - mean) as the fragments hold it, times rstd, rounded again (the forward multiplies those fragments and
// scales by rstd after: the backward's operand is as close to what the forward used as a recompute's). A quad's
// four 8-byte stores per k-step fill one 32-byte sector. With it the row's rstd (ForwardArgs::x_hat_rstd).
template <typename Op>
__device__ __forceinline__ void store_x_hat_row(const ForwardArgs& args, int64_t position,
                                                const uint32_t (&frag)[kSteps][4], int hf, float rstd, int t) {
  if (t == 0 && args.x_hat_rstd != nullptr) args.x_hat_rstd[position] = rstd;
  uint2* dst = reinterpret_cast<uint2*>(static_cast<Op*>(args.x_hat) + position * kC + 4 * t);
  const auto scaled = [&](uint32_t pair) {
    const float2 v = unpack_pair<Op>(pair);
    return pack_pair<Op>(v.x * rstd, v.y * rstd);
  };
#pragma unroll
  for (int s = 0; s < kSteps; ++s) dst[4 * s] = make_uint2(scaled(frag[s][hf]), scaled(frag[s][2 + hf]));
}

// kChunks: 128-row weight chunks per side, rows_ab / 128 (1 or 2: H <= 64, 128). TIn: the pair rows' type.
// kXHat: the rows also go to ForwardArgs::x_hat (its own instance), each partner block writing one of a
// thread's two rows.
template <Mode M, int kChunks, typename TIn, bool kXHat>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_a,
           const __grid_constant__ CUtensorMap map_b, int64_t tiles_per_batch) {
  allow_dependent_launch();
  using Op = op_t<M>;
  using Four = wgmma_rs::FourChannels<TIn>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* weights = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  constexpr int w_tiles = kChunks * kKTiles, side_rows = kChunks * kChunkRows;
  uint8_t* scratch_all = weights + w_tiles * kStageBytes;
  float* bias = reinterpret_cast<float*>(scratch_all + kGroups * kScratchBytes);  // [side_rows]
  uint64_t* w_full = reinterpret_cast<uint64_t*>(bias + side_rows);
  const int side = static_cast<int>(blockIdx.x & 1);  // 0: a's rows, 1: b's
  const int64_t row_base = int64_t(side) * args.rows_ab;
  wgmma_rs::load_resident_weights(weights, w_full, w_tiles, kKTiles, &map_w, static_cast<int>(row_base));
  {
    const Op* rows = static_cast<const Op*>(args.w_in_rows);
    const int64_t pitch = args.c_pad + 64;
    for (int r = threadIdx.x; r < side_rows; r += kThreads) {
      const Op* b = rows + (row_base + r) * pitch + args.c_pad;  // (a part and its remainder)
      bias[r] = to_float(b[0]) + to_float(b[1]);
    }
  }
  __syncthreads();

  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3;
  uint8_t* scratch = scratch_all + group * kScratchBytes;
  const int64_t tiles = args.batch * tiles_per_batch, plane = args.n * args.ld;
  const int64_t stride = int64_t(gridDim.x >> 1) * kGroups;
  const TIn* pair = static_cast<const TIn*>(args.pair);
  // This thread's rows of a tile: positions 16 warp4 + lane / 4 and 8 further (its rows of the wgmma's
  // A fragment); of each, channels 16 s + 4 t .. + 3 for k-step s (w_in_rows' k permutation).
  const int row0 = 16 * warp4 + (lane >> 2);
  for (int i = 0; i < w_tiles; ++i) mbar_wait(&w_full[i], 0);
  int parity = 0;  // the scratch buffer the next part writes
  for (int64_t tile = int64_t(blockIdx.x >> 1) * kGroups + group; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
    // Row hf's k-step s: channels 16 s + 4 t + {0, 1} in frag[s][hf], + {2, 3} in frag[s][2 + hf], centred.
    uint32_t frag[kSteps][4];
    float rstd[2], half_scale[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      int64_t off;
      float mask;
      locate_position(args, batch, p0 + row0 + 8 * hf, plane, off, mask);
      half_scale[hf] = 0.5f * mask;
      float4 x[kSteps];
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        x[s] = off >= 0 ? Four::widen(Four::load(pair + off + 16 * s + 4 * t)) : make_float4(0.f, 0.f, 0.f, 0.f);
      float sum = 0.f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) sum += (x[s].x + x[s].y) + (x[s].z + x[s].w);
      const float mean = quad_sum(sum) * (1.f / kC);
      float sum_sq = 0.f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        float4& v = x[s];
        v.x -= mean;
        v.y -= mean;
        v.z -= mean;
        v.w -= mean;
        sum_sq = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, sum_sq))));
        frag[s][hf] = pack_pair<Op>(v.x, v.y);
        frag[s][2 + hf] = pack_pair<Op>(v.z, v.w);
        // (packed here, row by row: left free, ptxas sank the conversions to the first product. fp32 rows
        // still take 254-255 registers and spill 8 bytes (H 128) to 104 (H <= 64) around the second row's 24
        // loads; 16-bit rows 252-254, none)
        asm volatile("" : "+r"(frag[s][hf]), "+r"(frag[s][2 + hf]));
      }
      rstd[hf] = rsqrtf(quad_sum(sum_sq) * (1.f / kC) + args.eps_in);
      if constexpr (kXHat) {
        if (hf == side && off >= 0)
          store_x_hat_row<Op>(args, plane_position(args, batch, p0 + row0 + 8 * hf), frag, hf, rstd[hf], t);
      }
    }

    // The side's weight rows in parts of 64 (N = 64: 32 h), two accumulator sets in turn (as wgmma_rs).
    constexpr int parts = 2 * kChunks;
    const auto multiply = [&](int part, float(&acc)[32]) {
      const uint8_t* w = weights + (part >> 1) * kKTiles * kStageBytes + (part & 1) * kGroupRowBytes;
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        wgmma_rs_64x64<Op>(acc, frag[s], desc_add(smem_descriptor(w + (s / 4) * kStageBytes), 2 * (s % 4)), s > 0);
      wgmma_commit();
    };
    const auto store = [&](int part, const float(&acc)[32]) {
      uint8_t* buf = scratch + parity * (kScratchBytes / 2);
      parity ^= 1;
      // As wgmma_rs's store, with each product first scaled by its row's rstd and biased:
      // acc[8 q + 2 hf + e] is proj of the part's column 16 q + 2 t + e, acc[8 q + 4 + 2 hf + e] its gate (+ 8).
      uint32_t packed[2][4];
#pragma unroll
      for (int qq = 0; qq < 2; ++qq)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int q = 2 * qq + (k >> 1), hf = k & 1;
          const float2 bp = *reinterpret_cast<const float2*>(bias + part * 64 + 16 * q + 2 * t);
          const float2 bg = *reinterpret_cast<const float2*>(bias + part * 64 + 16 * q + 8 + 2 * t);
          const float p0v = fmaf(acc[8 * q + 2 * hf], rstd[hf], bp.x), p1v = fmaf(acc[8 * q + 2 * hf + 1], rstd[hf], bp.y);
          const float g0 = fmaf(acc[8 * q + 4 + 2 * hf], rstd[hf], bg.x), g1 = fmaf(acc[8 * q + 5 + 2 * hf], rstd[hf], bg.y);
          packed[qq][k] = pack_pair<Op>(gated_16bit_half(p0v, 0.5f * g0, half_scale[hf]),
                                        gated_16bit_half(p1v, 0.5f * g1, half_scale[hf]));
        }
      wgmma_rs::store_part(buf, packed, side ? &map_b : &map_a, batch, int64_t(part) * 32, p0);
    };
    wgmma_rs::multiply_and_store_parts<parts>(multiply, store);
  }
  if ((threadIdx.x & 127) == 0) bulk_wait<0>();  // (the boxes written before the block retires)
}

// Whether it takes these sizes: a 16-bit mode and takes_rows at pair_dim 384 with one side's weights
// resident, and an even grid; x_hat in the bf16 mode only (the backward's operand is bf16 there).
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return wgmma_rs::takes_rows<TIn>(args, kC, smem_bytes(args.rows_ab)) && sm_count() >= 2 &&
         (args.x_hat == nullptr || M == Mode::bf16);
}

template <Mode M, typename TIn, bool kXHat>
cudaError_t launch_instance(const ForwardArgs& args) {
  const int64_t tiles_per_batch = ceil_div(args.n * args.ld, kPositions);
  const int64_t pairs = std::min<int64_t>(sm_count() / 2, ceil_div(args.batch * tiles_per_batch, kGroups));
  const int64_t bytes = smem_bytes(args.rows_ab);
  switch (args.rows_ab / kChunkRows) {  // (one side's 128-row chunks)
    case 1:
      return wgmma_rs::launch_kernel<kernel<M, 1, TIn, kXHat>, op_t<M>>(args, 2 * pairs, bytes, tiles_per_batch);
    case 2:
      return wgmma_rs::launch_kernel<kernel<M, 2, TIn, kXHat>, op_t<M>>(args, 2 * pairs, bytes, tiles_per_batch);
    default: return cudaErrorNotSupported;
  }
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  if constexpr (M == Mode::bf16) {
    if (args.x_hat != nullptr) return launch_instance<M, TIn, true>(args);
  }
  return launch_instance<M, TIn, false>(args);
}

}  // namespace wgmma_rs_384

}  // namespace input_pass
}  // namespace trimul

TRIMUL_REGISTER_INPUT_PASS_WRITING_X_HAT(wgmma_rs_384, trimul::input_pass::wgmma_rs_384, trimul::fused::k16BitModes);
