// wgmma_rs — Hopper (sm_90a): the LayerNorm-ed rows as wgmma's A operand in registers against
// resident weights; 16-bit operands, pair_dim 128, hidden <= 128.
#include "wgmma_rs.cuh"

namespace trimul {
namespace input_pass {
namespace wgmma_rs {

// The tile's x_hat rows (ForwardArgs::x_hat) from the A fragments: this thread's rows row and row + 8 of the
// plane (position p = f ld + k), channels 16 s + 4 t .. + 3 of each k-step as one 8-byte store; a quad's four
// stores are one 32-byte sector, so no staging is needed. With them each row's rstd (ForwardArgs::x_hat_rstd).
__device__ __forceinline__ void store_x_hat(const ForwardArgs& args, int64_t batch, int64_t row, int64_t plane,
                                            const uint32_t (&frag)[kSteps][4], const float (&rstd)[2], int t) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int64_t p = row + 8 * hf;
    uint32_t f, k;
    plane_fk(args, p, f, k);
    if (p >= plane || k >= args.n) continue;
    const int64_t position = plane_position(args, batch, f, k);
    uint2* dst = reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(args.x_hat) + position * kC + 4 * t);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) dst[4 * s] = make_uint2(frag[s][hf], frag[s][2 + hf]);
    if (t == 0 && args.x_hat_rstd != nullptr) args.x_hat_rstd[position] = rstd[hf];
  }
}

// MMA warpgroups per block: three for 16-bit rows (latency-bound with two: ~0.5 eligible warps per
// scheduler; three fit 168 registers), two for fp32 rows (their prefetched rows need ~200 registers).
template <typename TIn>
constexpr int groups_for() { return sizeof(TIn) == 2 ? 3 : 2; }

// kChunks: 128-row weight chunks, 2 * rows_ab / 128 (2 or 4: H <= 64, 128). TIn: the pair rows' type. kXHat:
// the rows also go to ForwardArgs::x_hat (its own instance: the inference forward's registers stay as they are).
template <Mode M, int kChunks, typename TIn, bool kXHat, int kG = groups_for<TIn>()>
__global__ void __launch_bounds__(128 * kG, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_a,
           const __grid_constant__ CUtensorMap map_b, int64_t tiles_per_batch) {
  allow_dependent_launch();
  using Op = op_t<M>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* weights = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  constexpr int w_tiles = kChunks * kKTiles;
  uint8_t* scratch_all = weights + w_tiles * kStageBytes;
  uint64_t* w_full = reinterpret_cast<uint64_t*>(scratch_all + kG * kScratchBytes);
  load_resident_weights(weights, w_full, w_tiles, kKTiles, &map_w, 0);

  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3;
  uint8_t* scratch = scratch_all + group * kScratchBytes;
  const int64_t tiles = args.batch * tiles_per_batch, plane = pair_rows(args) * args.ld;
  const int64_t stride = int64_t(gridDim.x) * kG;
  const TIn* pair = static_cast<const TIn*>(args.pair);
  using Four = FourChannels<TIn>;
  // This thread's rows of a tile: positions 16 warp4 + lane / 4 and 8 further (its rows of the wgmma's
  // A fragment); of each, channels 16 s + 4 t .. + 3 for k-step s, and their masks' bits (converted a tile
  // later: the load stays in flight through this tile's work).
  const int row0 = 16 * warp4 + (lane >> 2);
  const auto load_rows = [&](int64_t tile, typename Four::Raw (&rows)[2][kSteps], uint32_t (&mask_bits)[2]) {
    int64_t off[2] = {-1, -1};
    mask_bits[0] = mask_bits[1] = 0u;
    if (tile < tiles) {
      const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) locate_position(args, batch, p0 + row0 + 8 * hf, plane, off[hf], mask_bits[hf]);
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        rows[hf][s] = off[hf] >= 0 ? Four::load(pair + off[hf] + 16 * s + 4 * t) : typename Four::Raw{};
  };

  int64_t tile = int64_t(blockIdx.x) * kG + group;
  typename Four::Raw raw[2][kSteps];
  uint32_t next_mask[2];
  load_rows(tile, raw, next_mask);
  for (int i = 0; i < w_tiles; ++i) mbar_wait(&w_full[i], 0);
  int parity = 0;  // the scratch buffer the next part writes
  // The bias k-step's A fragment: ones at k = kC, kC + 1 (lane t = 0 of each quad, both rows), zeros elsewhere.
  const uint32_t one_pair = t == 0 ? pack_pair<Op>(1.f, 1.f) : 0u;
  const uint32_t ones[4] = {one_pair, one_pair, 0u, 0u};
  for (; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
    // LayerNorm (shifted by the row's first value, as VecRowStager does) into the A fragments: k-step s
    // holds channels 16 s + 4 t + {0, 1} (frag[s][hf]) and + {2, 3} (frag[s][2 + hf]) of row hf.
    uint32_t frag[kSteps][4];
    float row_rstd[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float shift = __shfl_sync(0xffffffffu, Four::widen(raw[hf][0]).x, lane & ~3);
      float4 x[kSteps];
      float sum = 0.f, sum_sq = 0.f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        float4& v = x[s];
        v = Four::widen(raw[hf][s]);
        v.x -= shift;
        v.y -= shift;
        v.z -= shift;
        v.w -= shift;
        sum += (v.x + v.y) + (v.z + v.w);
        sum_sq = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, sum_sq))));
      }
      const float2 moments = shifted_moments(quad_sum(sum), quad_sum(sum_sq), kC, args.eps_in);
      const float rstd = moments.y, centre = -moments.x * rstd;
      row_rstd[hf] = rstd;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const float4 v = x[s];
        frag[s][hf] = pack_pair<Op>(fmaf(v.x, rstd, centre), fmaf(v.y, rstd, centre));
        frag[s][2 + hf] = pack_pair<Op>(fmaf(v.z, rstd, centre), fmaf(v.w, rstd, centre));
      }
    }
    if constexpr (kXHat) store_x_hat(args, batch, p0 + row0, plane, frag, row_rstd, t);
    // mask / 2 (gated_16bit_half)
    const float half_scale[2] = {0.5f * mask_value(next_mask[0], args.mask_kind),
                                 0.5f * mask_value(next_mask[1], args.mask_kind)};
    load_rows(tile + stride, raw, next_mask);  // in flight while this tile multiplies and stores

    // The weight rows in parts of 64 (N = 64: 32 h of a or b), two accumulator sets in turn: part p + 1
    // multiplies while part p's gated values go out (the products' latency under the epilogue's).
    constexpr int parts = 2 * kChunks;
    const auto multiply = [&](int part, float(&acc)[32]) {
      const uint8_t* w = weights + (part >> 1) * kKTiles * kStageBytes + (part & 1) * kGroupRowBytes;
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        wgmma_rs_64x64<Op>(acc, frag[s], desc_add(smem_descriptor(w + (s / 4) * kStageBytes), 2 * (s % 4)), s > 0);
      wgmma_rs_64x64<Op>(acc, ones, smem_descriptor(w + kSteps / 4 * kStageBytes), 1);  // + the biases
      wgmma_commit();
    };
    const auto store = [&](int part, const float(&acc)[32]) {
      // This thread's columns: weight rows 16 q + 2 t + e of the part (proj of h = 8 q + 2 t + e), + 8 (its gate).
      const int64_t r0 = int64_t(part) * 64;
      uint8_t* buf = scratch + parity * (kScratchBytes / 2);
      parity ^= 1;
      // acc[4 j + 2 hf + e]: position row0 + 8 hf, column 8 j + 2 t + e; columns 16 q .. + 7 are proj of
      // h = 8 q .. + 7, 16 q + 8 .. their gates: 8 x 8 blocks (q, hf) of gated values.
      uint32_t packed[2][4];
#pragma unroll
      for (int qq = 0; qq < 2; ++qq)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int q = 2 * qq + (k >> 1), hf = k & 1;
          const float v0 = gated_16bit_half(acc[8 * q + 2 * hf], 0.5f * acc[8 * q + 4 + 2 * hf], half_scale[hf]);
          const float v1 = gated_16bit_half(acc[8 * q + 2 * hf + 1], 0.5f * acc[8 * q + 5 + 2 * hf], half_scale[hf]);
          packed[qq][k] = pack_pair<Op>(v0, v1);
        }
      const bool second = r0 >= args.rows_ab;  // b's rows follow a's
      const int64_t h0 = (r0 - (second ? args.rows_ab : 0)) / 2;
      store_part(buf, packed, second ? &map_b : &map_a, batch, h0, p0);
    };
    multiply_and_store_parts<parts>(multiply, store);
  }
  if ((threadIdx.x & 127) == 0) bulk_wait<0>();  // (the boxes written before the block retires)
}

// Whether it takes these sizes (a 16-bit mode: its registration): takes_rows at pair_dim 128 with all the
// weights resident; x_hat in the bf16 mode only (the backward's operand is bf16 there).
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return takes_rows<TIn>(args, kC, smem_bytes(args.rows_ab, groups_for<TIn>())) &&
         (args.x_hat == nullptr || M == Mode::bf16);
}

template <Mode M, typename TIn, bool kXHat>
cudaError_t launch_instance(const ForwardArgs& args) {
  const int64_t tiles_per_batch = ceil_div(pair_rows(args) * args.ld, kPositions);
  constexpr int groups = groups_for<TIn>();
  const int64_t blocks = std::min<int64_t>(sm_count(), ceil_div(args.batch * tiles_per_batch, groups));
  const int64_t bytes = smem_bytes(args.rows_ab, groups);
  switch (2 * args.rows_ab / kChunkRows) {  // (the weights' 128-row chunks, a's and b's)
    case 2: return launch_kernel<kernel<M, 2, TIn, kXHat>, op_t<M>>(args, blocks, bytes, tiles_per_batch, 128 * groups);
    case 4: return launch_kernel<kernel<M, 4, TIn, kXHat>, op_t<M>>(args, blocks, bytes, tiles_per_batch, 128 * groups);
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

}  // namespace wgmma_rs
}  // namespace input_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS_WITH(input, wgmma_rs, trimul::input_pass::wgmma_rs, trimul::fused::k16BitModes, true, true);
