// wgmma_ws — Hopper (sm_90a), warp-specialized: a producer warp streams out_gate's and out_proj's weights
// by TMA, stager warps write LayerNorm_out(z) and the gate's rows as swizzled tiles, two MMA warpgroups.
#include "output_pass.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

// The input pass's wgmma_ws design applied to this pass (where it takes the call: plan() says, the registry
// why): one block per SM of 16 warps,
// - the producer warp streams out_gate's and out_proj's rows with TMA, per chunk of 128 output
//   channels out_gate's k-tiles then out_proj's (or loads them all once where they fit);
// - 7 stager warps write each tile's positions (128, or 64 where 128 leave room for one row
//   buffer only) into one of two row buffers: LayerNorm_out(z)
//   (z is h-major: four lanes per position, a quarter of h each in registers, statistics by
//   shuffles) and the gate's source rows (pair or LayerNorm_in(pair)), both 128-byte swizzled;
// - two MMA warpgroups each take 64 of every chunk's 128 channels (the weights are A) for one half
//   of the tile's positions at a time (m64n64): the gate product first, its sigmoid kept in 32
//   registers, then out_proj in the same accumulators, and the product of the two stored per
//   channel. (Streamed weights pass once per 64 positions.)
// "highest" multiplies fp16x3 as the input pass's wgmma kernel does (ForwardArgs::w_gate_f16x3):
// both row sets as fp16 parts and remainders, each GEMM three k-segments against the prepared
// [hi | lo] weights. z's rows (normalized: at most sqrt(H) in magnitude) take one scale; the
// gate's source rows, of no known range, each take their own (F16ScaledRows), which the epilogue
// undoes per position before the biases. "high" takes the same with one part per operand (kF16).
namespace wgmma_ws {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;  // (a weight chunk: 128 output channels, 64 per MMA warpgroup)

// Positions per tile P: 128 (two m64n64 halves) where two row buffers fit, else 64 (one half: a
// pair_dim 384 tile's rows then fit twice, or TF32 rows once); a template parameter.
constexpr int kHalf = 64;  // positions per m64n64 product
constexpr int kStagingLoads = 8;  // 16-byte loads in flight per stager lane (gate rows)
constexpr int kZLanes = 4;         // lanes per position in the z LayerNorm
constexpr int kMaxHPad = 128;      // h_pad this kernel takes: a quarter in one lane's registers

// Shared memory from a 1024-byte boundary for tiles of `positions`: per buffer the gate-row and z
// k-tiles (positions x 128 bytes each) and the positions' output offsets; the weight stages; the
// stagers' pair-row offsets; the barriers.
// Scaled fp16 (kF16): each position's scale-back factor for the gate; split operands ("highest"):
// two planes per buffer (fp16 parts, then remainders).
__host__ __device__ inline int64_t plan_bytes(int kt_x, int kt_z, int buffers, int stages, int positions,
                                              int planes = 1, bool scaled = false) {
  return int64_t(buffers) * (planes * (kt_x + kt_z) * int64_t(positions) * kKBytes + positions * 8 +
                             (scaled ? positions * 4 : 0)) +
         int64_t(stages) * kStageBytes + positions * 8 + 2 * (stages + buffers) * 8;
}

struct Plan {
  PassPlan ring;
  int positions = 0;
};

// LayerNorm_out over h of z (normalized only: its affine is folded into out_proj) for the tile's
// positions, into swizzled rows [0, fill) of h (zeros at
// h >= hidden and for positions whose row_off is negative). kZLanes lanes share a position, each
// holding a contiguous quarter of [0, fill) in registers, so one load instruction reads 32 bytes
// of each of four h planes, and the rows are written with 16-byte stores.
template <Mode M, int P, class Dst>
__device__ void stage_z_rows(Dst dst, const z_t<M>* __restrict__ z_tile, int64_t plane, int hidden, int fill,
                             const int64_t* row_off,
                             float eps, int warp) {
  constexpr int kPerLane = kMaxHPad / kZLanes;
  constexpr int kSlots = 32 / kZLanes;                        // positions per warp per round
  constexpr int V = 16 / static_cast<int>(sizeof(op_t<M>));  // elements per 16-byte store
  const int lane = threadIdx.x & 31, sub = lane % kZLanes, slot = lane / kZLanes;
  const int per_lane = fill / kZLanes;  // a multiple of V: fill is whole 128-byte k-tiles
  const int h0 = sub * per_lane;
  if (hidden == kMaxHPad && fill == kMaxHPad) {
    // H = 128 (the issue's shapes): no guard or select per h, and the LayerNorm as one FFMA on the
    // shifted values (ncu: the guarded loop was a tenth of the pair_dim-384 kernel's instructions).
    // A position-less lane reads the tile's first position (always in the plane)
    // and gets rstd = centre = 0: zeros.
    for (int m0 = warp * kSlots; m0 < P; m0 += kStagerWarps * kSlots) {
      const int m = m0 + slot;
      const bool valid = row_off[m] >= 0;
      float v[kPerLane];
      const z_t<M>* src = z_tile + int64_t(h0) * plane + (valid ? m : 0);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        v[e] = to_float(*src);
        src += plane;
      }
      const float shift = __shfl_sync(0xffffffffu, v[0], lane & ~(kZLanes - 1));
      float sum = 0.f, sum_sq = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        v[e] -= shift;
        sum += v[e];
        sum_sq = fmaf(v[e], v[e], sum_sq);
      }
#pragma unroll
      for (int offset = 1; offset < kZLanes; offset <<= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
      }
      const float2 moments = shifted_moments(sum, sum_sq, hidden, eps);
      const float rstd = valid ? moments.y : 0.f, centre = -moments.x * rstd;
#pragma unroll
      for (int e0 = 0; e0 < kPerLane; e0 += V) {
        float y[V];
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = fmaf(v[e0 + e], rstd, centre);
        dst.template store<M, V>(m, h0 + e0, y);
      }
    }
    return;
  }
  for (int m0 = warp * kSlots; m0 < P; m0 += kStagerWarps * kSlots) {
    const int m = m0 + slot;
    const bool valid = row_off[m] >= 0;
    float v[kPerLane];
    const z_t<M>* src = z_tile + int64_t(h0) * plane + m;  // (one running pointer: 32 precomputed
#pragma unroll                                            // 64-bit addresses would spill)
    for (int e = 0; e < kPerLane; ++e) {
      v[e] = (valid && e < per_lane && h0 + e < hidden) ? to_float(*src) : 0.f;
      src += plane;
    }
    // Statistics around the position's first value (h = 0, held by the group's first lane).
    const float shift = __shfl_sync(0xffffffffu, v[0], lane & ~(kZLanes - 1));
    float sum = 0.f, sum_sq = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const float d = (e < per_lane && h0 + e < hidden) ? v[e] - shift : 0.f;
      sum += d;
      sum_sq += d * d;
    }
#pragma unroll
    for (int offset = 1; offset < kZLanes; offset <<= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    }
    const float2 stats = shifted_stats(shift, sum, sum_sq, hidden, eps);
#pragma unroll
    for (int e0 = 0; e0 < kPerLane; e0 += V) {
      if (e0 >= per_lane) break;
      float y[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int h = h0 + e0 + e;
        y[e] = (valid && h < hidden) ? (v[e0 + e] - stats.x) * stats.y : 0.f;
      }
      dst.template store<M, V>(m, h0 + e0, y);
    }
  }
}

// The weight ring as the MMA warps see it: stage index and phase bit of the next k-tile. With
// every stage resident the caller points `stage` at the k-tiles it wants (they never change).
struct WeightRing {
  uint64_t* full;
  uint64_t* empty;
  uint8_t* base;
  int stages;
  bool resident;
  int stage = 0;
  uint32_t phase = 0;
};

// acc += the weights' next `count` k-tiles (this warpgroup's 64 rows of each) x 64 positions of
// the rows' k-tiles (starting at b_tiles, tile_bytes apart).
// Split ("highest", fp16x3): 2 x count weight k-tiles ([hi | lo]): each hi k-tile against the
// rows' fp16 parts and remainders (`small_rows`, the same k-tile offsets), each lo against the parts.
template <typename Op, bool kSplit>
__device__ __forceinline__ void multiply_k_tiles(float (&acc)[32], WeightRing& ring, int consumer,
                                                 const uint8_t* b_tiles, int tile_bytes, int count, bool leader,
                                                 const uint8_t* small_rows = nullptr) {
  int held = -1;  // the stage the k-tile before this one read
  const int total = kSplit ? 2 * count : count;
  for (int kt = 0; kt < total; ++kt) {
    const int s = ring.stage;
    mbar_wait(&ring.full[s], ring.resident ? 0u : ring.phase);
    const uint64_t desc_a = smem_descriptor(ring.base + s * kStageBytes + consumer * kGroupRowBytes);
    const int row_kt = kSplit && kt >= count ? kt - count : kt;
    wgmma_k_tile<Op>(acc, desc_a, smem_descriptor(b_tiles + row_kt * tile_bytes));
    if (kSplit && kt < count) wgmma_k_tile<Op>(acc, desc_a, smem_descriptor(small_rows + kt * tile_bytes));
    // The previous k-tile's MMAs are done once at most this one is in flight: free its stage.
    wgmma_wait<1>();
    if (!ring.resident && held >= 0 && leader) mbar_arrive(&ring.empty[held]);
    held = s;
    if (++ring.stage == ring.stages) {
      ring.stage = 0;
      ring.phase ^= 1u;
    }
  }
  wgmma_wait<0>();
  if (!ring.resident && held >= 0 && leader) mbar_arrive(&ring.empty[held]);
}

// One weight k-tile into stage `slot`: k-tile i of chunk `chunk`, out_gate's k-tiles first, then
// out_proj's.
__device__ __forceinline__ void load_weight_tile(uint8_t* weights, uint64_t* full, int slot, int chunk, int i,
                                                 int kt_x, int elems, const CUtensorMap* map_gate,
                                                 const CUtensorMap* map_out) {
  mbar_expect_tx(&full[slot], kStageBytes);
  if (i < kt_x)
    tma_load_2d(weights + slot * kStageBytes, map_gate, i * elems, chunk * kChunkRows, &full[slot]);
  else
    tma_load_2d(weights + slot * kStageBytes, map_out, (i - kt_x) * elems, chunk * kChunkRows, &full[slot]);
}

template <Mode M, typename TIn, int P, bool kF16>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_gate,
           const __grid_constant__ CUtensorMap map_out, int64_t tiles_per_batch, int buffers, int stages) {
  using Op = pass_op_t<M, kF16>;
  constexpr bool kSplit = M == Mode::highest;  // (implies kF16)
  constexpr int kPlanes = kRowPlanes<M>, kSegs = kSegments<M>;
  constexpr int kRowTileBytes = P * kKBytes;
  extern __shared__ uint8_t smem_raw[];
  // (an offset from smem_raw keeps the compiler aware that these are shared-memory pointers)
  uint8_t* rows = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int kt_x = k_tiles(args.c_pad, sizeof(Op)), kt_z = k_tiles(args.h_pad, sizeof(Op));
  if ((rows - smem_raw) + plan_bytes(kt_x, kt_z, buffers, stages, P, kPlanes, kF16) > dynamic_smem_size()) __trap();
  // Per buffer: gate-row k-tiles, then z's (split: that plane of fp16 parts, then the remainders').
  const int plane_bytes = (kt_x + kt_z) * kRowTileBytes, buffer_bytes = kPlanes * plane_bytes;
  uint8_t* weights = rows + buffers * buffer_bytes;
  int64_t* out_rows = reinterpret_cast<int64_t*>(weights + stages * kStageBytes);  // [buffers][P]
  int64_t* row_off = out_rows + buffers * P;
  float* pos_down = reinterpret_cast<float*>(row_off + P);  // kF16: [buffers][P], each gate row's scale back
  uint64_t* w_full = reinterpret_cast<uint64_t*>(pos_down + (kF16 ? buffers * P : 0));
  uint64_t* w_empty = w_full + stages;
  uint64_t* rows_full = w_empty + stages;
  uint64_t* rows_empty = rows_full + buffers;
  init_pass_barriers(w_full, w_empty, stages, rows_full, rows_empty, buffers, kMmaGroups, kStagerThreads);
  // (the last block-wide barrier: the three roles part here)

  const int64_t tiles = args.batch * tiles_per_batch, plane = args.n * args.ldz;
  const int chunks = static_cast<int>(ceil_div(args.c, kChunkRows));
  const int per_chunk = kSegs * (kt_x + kt_z), w_tiles = chunks * per_chunk;
  const bool resident = w_tiles <= stages;
  constexpr int kElemsPerKTile = kKBytes / static_cast<int>(sizeof(Op));
  const int warp = warp_index(), lane = threadIdx.x & 31;

  if (warp == kThreads / 32 - 1) {  // the producer
    if (lane != 0) return;
    if (resident) {
      for (int w = 0; w < w_tiles; ++w)
        load_weight_tile(weights, w_full, w, w / per_chunk, w % per_chunk, kSegs * kt_x, kElemsPerKTile, &map_gate,
                         &map_out);
      return;
    }
    FillRing ring{w_empty, stages};  // streamed: each chunk's k-tiles once per half of the positions
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x)
      for (int chunk = 0; chunk < chunks; ++chunk)
        for (int half = 0; half < P / kHalf; ++half)
          for (int i = 0; i < per_chunk; ++i) {
            ring.wait_free();
            load_weight_tile(weights, w_full, ring.slot, chunk, i, kSegs * kt_x, kElemsPerKTile, &map_gate, &map_out);
            ring.advance();
          }
    return;
  }

  if (threadIdx.x >= kMmaThreads) {  // a stager
    const int stager = threadIdx.x - kMmaThreads, stager_warp = stager >> 5;
    const bool vectorized = rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
    // Zeros up to the end of the last k-tiles: the weights there are zero (TMA fills past c_pad /
    // h_pad), but 0 x stale shared memory could be NaN.
    const int x_fill = kt_x * kElemsPerKTile, z_fill = kt_z * kElemsPerKTile;
    const z_t<M>* z_all = static_cast<const z_t<M>*>(args.z);
    const uint32_t n = static_cast<uint32_t>(args.n), ldz = static_cast<uint32_t>(args.ldz);
    FillRing ring{rows_empty, buffers};
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      ring.wait_free();
      const int buf = ring.slot;
      const int64_t batch = tile / tiles_per_batch, q0 = (tile - batch * tiles_per_batch) * P;
      named_barrier(1, kStagerThreads);  // every stager is done with the last tile's row_off
      if (stager < P) {
        // plane < 2^32 (checked at launch): 32-bit division.
        const int64_t q = q0 + stager;
        const uint32_t i = static_cast<uint32_t>(q) / ldz, j = static_cast<uint32_t>(q) - i * ldz;
        const bool valid = q < plane && i < n && j < n;
        row_off[stager] = valid ? batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : -1;
        out_rows[buf * P + stager] = valid ? ((batch * args.n + i) * args.n + j) * args.c : -1;
      }
      named_barrier(1, kStagerThreads);
      uint8_t* x_rows = rows + buf * buffer_bytes;
      const SwizzledRows x_dst{x_rows, kRowTileBytes}, z_dst{x_rows + kt_x * kRowTileBytes, kRowTileBytes};
      const z_t<M>* z_tile = z_all + batch * args.h * plane + q0;
      const float* gate_ln = args.gate_normalized ? args.ln_in_w : nullptr;
      if constexpr (kF16) {
        // (one plane: the remainders' places unused)
        const SwizzledRows x_small{x_dst.base + plane_bytes, kRowTileBytes}, z_small{z_dst.base + plane_bytes, kRowTileBytes};
        stage_z_rows<M, P>(F16SwizzledRows<kPlanes>{z_dst, z_small, args.f16x3_scales[kZRows]}, z_tile, plane,
                           static_cast<int>(args.h), z_fill, row_off, args.eps_out, stager_warp);
        const F16ScaledRows<kPlanes> x_split{F16SwizzledRows<kPlanes>{x_dst, x_small, 1.f}, pos_down + buf * P,
                                             args.f16x3_scales[kGateDown]};
        stage_rows_to<M, TIn, kStagerWarps, kStagingLoads>(x_split, vectorized, static_cast<const TIn*>(args.pair),
                                                           row_off, P, static_cast<int>(args.c), x_fill, gate_ln,
                                                           args.ln_in_b, args.eps_in, stager_warp);
      } else {
        stage_z_rows<M, P>(z_dst, z_tile, plane, static_cast<int>(args.h), z_fill, row_off, args.eps_out,
                           stager_warp);
        stage_rows_to<M, TIn, kStagerWarps, kStagingLoads>(x_dst, vectorized, static_cast<const TIn*>(args.pair),
                                                           row_off, P, static_cast<int>(args.c), x_fill, gate_ln,
                                                           args.ln_in_b, args.eps_in, stager_warp);
      }
      fence_proxy_async();  // st.shared writes, read by wgmma through the async proxy
      mbar_arrive(&rows_full[buf]);
      ring.advance();
    }
    return;
  }

  // An MMA thread: output channels c and c + 8 of each chunk, at positions 8j + 2t, 8j + 2t + 1 of
  // each half of the tile. Halves of 64 positions (m64n64) keep the gate's sigmoid and the
  // accumulators (32 + 32 registers) side by side without spilling.
  const int consumer = warp >> 2, warp4 = warp & 3, g = lane >> 2, t = lane & 3;
  const bool leader = (threadIdx.x & 127) == 0;
  constexpr int kHalfBytes = kHalf * kKBytes;  // 64 swizzled rows: a 1024-byte multiple
  WeightRing ring{w_full, w_empty, weights, stages, resident};
  // (kF16: out_proj's products are 2^(s_z + t_out) times too large, the biases to match)
  const float out_up = kF16 ? args.f16x3_scales[kOutUp] : 1.f;
  int buf = 0;
  uint32_t buf_phase = 0;
  TIn* out = static_cast<TIn*>(args.out);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint8_t* x_rows = rows + buf * buffer_bytes;
    const uint8_t* z_rows = x_rows + kt_x * kRowTileBytes;
    const int64_t* tile_out = out_rows + buf * P;
    const float* tile_down = pos_down + buf * P;  // (split)
    mbar_wait(&rows_full[buf], buf_phase);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int c = chunk * kChunkRows + consumer * 64 + warp4 * 16 + g;
      const bool c_ok = c < args.c, c8_ok = c + 8 < args.c;
      const float gate_bias = c_ok ? args.b_gate[c] : 0.f, gate_bias8 = c8_ok ? args.b_gate[c + 8] : 0.f;
      const float out_bias = c_ok ? args.b_out[c] * out_up : 0.f, out_bias8 = c8_ok ? args.b_out[c + 8] * out_up : 0.f;
      for (int half = 0; half < P / kHalf; ++half) {
        if (resident) ring.stage = chunk * per_chunk;  // the chunk's k-tiles, again for each half
        float acc[32];  // (written only while no wgmma is in flight)
        if constexpr (kF16) start_accumulators(acc, 0.f, 0.f);  // (the biases after each position's scale)
        else start_accumulators(acc, gate_bias, gate_bias8);
        multiply_k_tiles<Op, kSplit>(acc, ring, consumer, x_rows + half * kHalfBytes, kRowTileBytes, kt_x, leader,
                                     x_rows + plane_bytes + half * kHalfBytes);
        float gate[32];  // sigmoid of the gate, in the accumulators' layout
        if constexpr (kF16) {
          // Each position's gate row was scaled on its own: back by its factor (times 2^-t_gate),
          // then the bias; and out_proj's scale back folded into the sigmoid's reciprocal (kF16 is
          // an fp32 mode's arithmetic: the accurate sigmoid).
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float down = tile_down[half * kHalf + 8 * j + 2 * t + e];
              gate[4 * j + e] = sigmoid_over(fmaf(acc[4 * j + e], down, gate_bias), out_up);
              gate[4 * j + 2 + e] = sigmoid_over(fmaf(acc[4 * j + 2 + e], down, gate_bias8), out_up);
            }
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) gate[i] = gate_sigmoid<M>(acc[i]);
        }
        start_accumulators(acc, out_bias, out_bias8);
        multiply_k_tiles<Op, kSplit>(acc, ring, consumer, z_rows + half * kHalfBytes, kRowTileBytes, kt_z, leader,
                                     z_rows + plane_bytes + half * kHalfBytes);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t row = tile_out[half * kHalf + 8 * j + 2 * t + e];
            if (row < 0) continue;
            if (c_ok) out[row + c] = from_float<TIn>(acc[4 * j + e] * gate[4 * j + e]);
            if (c8_ok) out[row + c + 8] = from_float<TIn>(acc[4 * j + 2 + e] * gate[4 * j + 2 + e]);
          }
        }
      }
    }
    mbar_arrive(&rows_empty[buf]);  // this thread's products on these rows are done
    if (++buf == buffers) {
      buf = 0;
      buf_phase ^= 1u;
    }
  }
}

// The buffers, stages and bytes this kernel would take these sizes with (bytes 0: it does not):
// z from a separate contraction, h_pad <= 128, an sm_90a build on Hopper, a problem that gives every SM
// a tile (plan_pass says how buffers and stages are chosen), and pair_dim > 128 or an fp32 mode: at
// pair_dim <= 128 in the 16-bit modes the resident mma.sync kernel is faster.
template <Mode M, typename TIn>
Plan plan(const ForwardArgs& args) {
  constexpr bool kF16 = kF16Arith<M>;
  if (!kF16 && args.c <= 128) return Plan{};
  if (args.z == nullptr || args.z_dtype != z_dtype_for(M) || args.h_pad > kMaxHPad) return Plan{};
  if (tensor_map_encoder() == nullptr) return Plan{};
  // kF16: the prepared fp16 weights, and rows the stagers' vectorized path takes (only it scales
  // rows one by one).
  if (kF16 && (args.w_gate_f16x3 == nullptr || args.w_out_f16x3 == nullptr || args.f16x3_scales == nullptr ||
               !fused::rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair)))
    return Plan{};
  using Op = pass_op_t<M>;
  const int kt_x = k_tiles(args.c_pad, sizeof(Op)), kt_z = k_tiles(args.h_pad, sizeof(Op));
  const int w_tiles = static_cast<int>(ceil_div(args.c, kChunkRows)) * kSegments<M> * (kt_x + kt_z);
  // None unless the tiles give every SM one (smaller problems measured faster on the other kernels).
  const auto ring = [&](int positions) {
    if (args.batch * ceil_div(args.n * args.ldz, positions) < sm_count()) return PassPlan{};
    return plan_pass(
        [=](int buffers, int stages) {
          return plan_bytes(kt_x, kt_z, buffers, stages, positions, kRowPlanes<M>, kF16);
        },
        w_tiles, kMaxStages);
  };
  // 128 positions with two buffers, else 64 with two (the weights then stream as often: once per
  // 64 positions either way), else whichever fits with one.
  const PassPlan wide = ring(128), narrow = ring(64);
  if (wide.buffers == 2 || (wide.bytes != 0 && narrow.buffers != 2)) return Plan{wide, 128};
  if (narrow.bytes != 0) return Plan{narrow, 64};
  return Plan{};
}

template <Mode M, typename TIn, int P, bool kF16>
cudaError_t launch_positions(const ForwardArgs& args, const PassPlan& ring, const CUtensorMap& map_gate,
                             const CUtensorMap& map_out) {
  const cudaError_t status = allow_smem<kernel<M, TIn, P, kF16>>(ring.bytes);
  if (status != cudaSuccess) return status;
  const int64_t tiles_per_batch = ceil_div(args.n * args.ldz, P);
  const int64_t blocks = std::min<int64_t>(sm_count(), args.batch * tiles_per_batch);
  kernel<M, TIn, P, kF16><<<static_cast<unsigned>(blocks), kThreads, ring.bytes, args.stream>>>(
      args, map_gate, map_out, tiles_per_batch, ring.buffers, ring.stages);
  return cudaGetLastError();
}

template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return plan<M, TIn>(args).positions != 0;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  constexpr bool kF16 = kF16Arith<M>;
  using Op = pass_op_t<M>;
  const Plan chosen = plan<M, TIn>(args);
  if (chosen.positions == 0) return cudaErrorNotSupported;
  const int64_t rows = ceil_div(args.c, kChunkRows) * kChunkRows;  // w_gate / w_out rows (zero past C)
  // (kF16: the prepared [hi | lo] fp16 weights of whole k-tiles each; one plane reads the hi segment)
  const auto cols = [&](int64_t k_pad) { return kF16 ? f16_weight_cols(k_pad) : k_pad; };
  CUtensorMap map_gate, map_out;
  if (!encode_kmajor_map<Op>(&map_gate, kF16 ? args.w_gate_f16x3 : args.w_gate, 0, rows, cols(args.c_pad), kChunkRows) ||
      !encode_kmajor_map<Op>(&map_out, kF16 ? args.w_out_f16x3 : args.w_out, 0, rows, cols(args.h_pad), kChunkRows))
    return cudaErrorNotSupported;
  return chosen.positions == 128 ? launch_positions<M, TIn, 128, kF16>(args, chosen.ring, map_gate, map_out)
                                 : launch_positions<M, TIn, 64, kF16>(args, chosen.ring, map_gate, map_out);
}

}  // namespace wgmma_ws
}  // namespace output_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS(output, wgmma_ws, trimul::output_pass::wgmma_ws, trimul::fused::kAllModes);
