// wgmma_ws — Hopper (sm_90a), warp-specialized: a producer warp streams the weights by TMA, stager
// warps LayerNorm rows into swizzled tiles, two MMA warpgroups multiply; fp16x3 at "highest".
#include "input_pass.cuh"

namespace trimul {
namespace input_pass {

// One block per SM of 16 warps (4 per scheduler: 128 registers each) with three jobs, so that
// loading a tile's rows (DRAM latency), multiplying (tensor cores) and storing overlap instead of
// taking turns:
// - the producer warp: one thread streams the grouped proj/gate weights with TMA, 128 rows x 128
//   bytes of k per stage, through an mbarrier ring running ahead into the next tile's weights; or,
//   where all of them fit in the ring, loads them once (they are the same for every tile);
// - 7 stager warps LayerNorm a tile's 128 positions (P; 64 for split rows at wide pair_dim, plan()) into
//   128-byte-swizzled k-tiles (wgmma's B operand), into one of two row buffers while the MMA warps
//   multiply the other;
// - two MMA warpgroups each multiply 64 of every 128 weight rows (A) by the staged tile: m64n128
//   (m64n64 at P = 64; k16 for 16-bit operands, k8 for TF32), accumulators started from the biases. Rows grouped by
//   16 put a thread's proj and gate of one h at the same two positions, so the gated pair goes
//   straight to a_t / b_t, as in the streamed kernel.
// Where two row buffers do not fit (split rows at pair_dim 384) there is one: staging and products then
// take turns.
// "highest" multiplies fp16x3 (ForwardArgs::w_in_f16x3): the stagers write each row, scaled by 2^s_in,
// as its fp16 part and fp16 remainder (two planes); the prepared weights hold [hi | lo] per row,
// and each hi k-tile multiplies the rows' hi and lo k-tiles, each lo k-tile their hi: hi.hi + hi.lo + lo.hi,
// about 3xTF32's accuracy at twice its tensor-core rate and half its shared memory.
// a_t / b_t get the planned contraction's operands (store_contraction_pair: whole, or fp16 or TF32 parts
// and remainders). "high" takes the same scaled fp16 arithmetic with one plane and one product (kF16:
// TF32's 11-bit significand at the fp16 rate).
namespace wgmma_ws {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;

constexpr int kStagingLoads = 12;  // 16-byte loads in flight per stager lane
constexpr int kStreamLoads = 4;    // the same for the streamed staging, double-buffered (8 spilled there)

// Shared memory for `buffers` row buffers of `positions` rows (the wgmma's N: 128 or 64) and
// `planes` planes (2: split operands), and `stages` weight stages, from a 1024-byte boundary.
__host__ __device__ inline int64_t plan_bytes(int kt_count, int buffers, int stages, int positions, int planes = 1) {
  return int64_t(buffers) * planes * kt_count * positions * kKBytes + int64_t(stages) * kStageBytes +
         buffers * positions * 4 + positions * 8 + 2 * (stages + buffers) * 8;
}

struct Plan {
  PassPlan ring;
  int positions = 0;  // per tile (P); 0: the kernel does not take the problem
};

// 16-bit a / b (not kF16's scaled or split operands) go out through a per-MMA-warp scratch of 8 rows
// x P values (stage_row_pairs_x4, store_staged_rows) where the launch leaves room for it after the
// plan's bytes (pair_dim 128; at 384 the plan's buffers and stages fill shared memory).
template <Mode M, bool kF16>
constexpr bool kStagedAb = !kF16 && (M == Mode::bf16 || M == Mode::f16);
constexpr int kMmaWarps = kMmaThreads / 32;
__host__ __device__ constexpr int64_t ab_scratch_bytes(int positions) { return kMmaWarps * 8 * positions * 2; }

// The proj/gate product of one h at one position, gated and masked (tanh.approx on 16-bit paths),
// from the position's scale: gate_scale(mask), computed once per position by the stagers. The gate
// from its accumulator, its bias and (kF16) the products' scale back, gate_down: on the 16-bit paths
// the bias and tanh's halving are one FFMA (a tenth of the epilogue's instructions, by ncu's count).
template <Mode M>
__device__ __forceinline__ float gate_scale(float mask) {
  return M == Mode::bf16 || M == Mode::f16 ? 0.5f * mask : mask;
}
template <Mode M, bool kF16>
__device__ __forceinline__ float gated(float proj, float gate_acc, float gate_bias, float gate_down, float scale) {
  if constexpr (M == Mode::bf16 || M == Mode::f16) {
    return gated_16bit_half(proj, fmaf(gate_acc, 0.5f, 0.5f * gate_bias), scale);
  } else {
    const float gate = kF16 ? (gate_acc + gate_bias) * gate_down : gate_acc + gate_bias;
    return proj * gate_sigmoid<M>(gate) * scale;
  }
}

// Streamed staging (streams_rows): the stagers' row groups
// (Stager::group_rows() rows each) are numbered over this block's tiles in order and handed out
// round-robin, so a warp that staged two groups of one tile stages fewer of the next (the rounds
// kernel gives warps 0-3 two load rounds of every 128-position tile and warps 4-6 one); each lane
// locates its own rows, so no row offsets are shared and no named barrier waits per tile. Every
// stager thread still arrives once per tile on rows_full, after its groups of that tile.
// Double-buffered: a warp issues its next group's loads (possibly the next tile's, whose buffer may
// still be in use: only registers are written) before it LayerNorms and stores the current one, so
// the loads' latency overlaps the arithmetic (ncu: staging in rounds, the stagers wait on their own loads
// for a large part of their time). The masks wait in registers until the group's buffer is known to be free.
// (The stager is built per tile, as the rounds kernel's stage_rows_vec does: kept live across the tile
// loop, its hoisted LayerNorm weights made the loop spill.)
template <Mode M, typename TIn, int P, int VECS>
__device__ __forceinline__ void stream_tile_rows(const ForwardArgs& args, int k_fill, int lanes_log2, uint8_t* rows,
                                                 int buffer_bytes, float* scale_v, uint64_t* rows_full,
                                                 uint64_t* rows_empty, int buffers, int64_t tiles,
                                                 int64_t tiles_per_batch, int warp) {
  using Stager = VecRowStager<M, TIn, VECS, kStreamLoads>;
  constexpr int kGroup = Stager::kGroup;
  const int group_rows = Stager::group_rows(lanes_log2);
  const int groups_per_tile = static_cast<int>(ceil_div(P, group_rows));
  const int slots = 32 >> lanes_log2, slot = (threadIdx.x & 31) >> lanes_log2;
  const int64_t plane = args.n * args.ld;
  const TIn* pair = static_cast<const TIn*>(args.pair);
  // This warp's groups in order: group g of tile t, then g + kStagerWarps (past the tile's last,
  // into this block's next tile).
  const auto next_of = [&](int64_t& tile, int& group) {
    while (group >= groups_per_tile && tile < tiles) {
      group -= groups_per_tile;
      tile += gridDim.x;
    }
  };
  // A tile's batch, first position p0 and its f0 = p0 / ld, k0 = p0 % ld (the divisions once per tile,
  // not per row: a row's f and k step from them, at most 128 / ld + 1 times).
  struct TileAt {
    int64_t batch, p0;
    uint32_t f0, k0;
  };
  const uint32_t ld = static_cast<uint32_t>(args.ld);
  const auto tile_at = [&](int64_t tile) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * P;
    const uint32_t f0 = static_cast<uint32_t>(p0) / ld;  // (plane < 2^32: checked at launch)
    return TileAt{batch, p0, f0, static_cast<uint32_t>(p0) - f0 * ld};
  };
  // Row offsets (-1: none) and masks of the group's rows for this lane.
  const auto locate = [&](int64_t tile, const TileAt& at, int group, int64_t (&off)[kGroup], float (&mask)[kGroup]) {
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      const int m = group * group_rows + r * slots + slot;
      off[r] = -1;
      mask[r] = 0.f;
      if (tile < tiles && m < P) {
        uint32_t f = at.f0, k = at.k0 + m;
        while (k >= ld) {
          k -= ld;
          ++f;
        }
        locate_fk(args, at.batch, f, k, at.p0 + m < plane && k < args.n, off[r], mask[r]);
      }
    }
  };
  int64_t cur_tile = blockIdx.x;
  int cur_group = warp;
  next_of(cur_tile, cur_group);
  TileAt cur_at = tile_at(cur_tile);
  int64_t off[kGroup];
  float mask[kGroup];
  uint4 raw[kGroup][VECS];
  bool loaded = false;  // raw holds (cur_tile, cur_group)'s rows
  FillRing ring{rows_empty, buffers};
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    ring.wait_free();
    const int buf = ring.slot;
    const SwizzledRows dst{rows + buf * buffer_bytes, P * kKBytes};
    const Stager stager(static_cast<int>(args.c), k_fill, args.ln_in_w, args.ln_in_b, args.eps_in, lanes_log2);
    if (!loaded && cur_tile == tile) {
      locate(cur_tile, cur_at, cur_group, off, mask);
      stager.load(pair, off, raw);
      loaded = true;
    }
    while (cur_tile == tile) {
      int64_t next_tile = cur_tile;
      int next_group = cur_group + kStagerWarps;
      next_of(next_tile, next_group);
      const TileAt next_at = next_tile == cur_tile ? cur_at : tile_at(next_tile);
      int64_t next_off[kGroup];
      float next_mask[kGroup];
      uint4 next_raw[kGroup][VECS];
      locate(next_tile, next_at, next_group, next_off, next_mask);  // (none past the last tile: offsets -1)
      stager.load(pair, next_off, next_raw);
      const int m0 = cur_group * group_rows;
#pragma unroll
      for (int r = 0; r < kGroup; ++r) {
        const int m = m0 + r * slots + slot;
        if (stager.sub == 0 && m < P) scale_v[buf * P + m] = gate_scale<M>(mask[r]);
      }
      stager.stage(dst, raw, off, m0, P);
      // (a copy, not two register sets whose roles swap: that version spilled 400 bytes)
#pragma unroll
      for (int r = 0; r < kGroup; ++r) {
        off[r] = next_off[r];
        mask[r] = next_mask[r];
#pragma unroll
        for (int l = 0; l < VECS; ++l) raw[r][l] = next_raw[r][l];
      }
      cur_tile = next_tile;
      cur_at = next_at;
      cur_group = next_group;
    }
    fence_proxy_async();  // st.shared writes, read by wgmma through the async proxy
    mbar_arrive(&rows_full[buf]);
    ring.advance();
  }
}

// kStream: the stagers take the streamed staging's round-robin row groups (stream_tile_rows; a separate
// instantiation, so its register pressure stays out of the rounds kernel).
template <Mode M, typename TIn, int P, bool kF16, bool kStream>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_w, int64_t tiles_per_batch, int buffers,
           int stages) {
  allow_dependent_launch();
  static_assert(P == 128 || P == 64, "m64n128 or m64n64 products");
  using Op = pass_op_t<M, kF16>;
  constexpr int kRowTileBytes = P * kKBytes;
  constexpr bool kSplit = M == Mode::highest;  // (implies kF16)
  constexpr int kPlanes = kRowPlanes<M>, kSegs = kSegments<M>;
  extern __shared__ uint8_t smem_raw[];
  // (offset from smem_raw, not an integer round trip: the compiler then knows every pointer below
  // is shared memory and emits LDS/STS instead of generic loads that wait like global ones)
  uint8_t* rows = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int kt_count = k_tiles(args.c_pad, sizeof(Op));
  // The host leaves no slack for realignment where the plan would not fit with it (a dynamic
  // shared-memory base is 1024-byte aligned in practice); a base that is not must not go unnoticed.
  if ((rows - smem_raw) + plan_bytes(kt_count, buffers, stages, P, kPlanes) > dynamic_smem_size()) __trap();
  const int buffer_bytes = kPlanes * kt_count * kRowTileBytes;  // (split: the fp16 parts, then the remainders)
  uint8_t* weights = rows + buffers * buffer_bytes;
  // [buffers][P]: each position's gate_scale(mask) (split: times 2^-(s_in+t_in)), by the stagers
  float* scale_v = reinterpret_cast<float*>(weights + stages * kStageBytes);
  int64_t* row_off = reinterpret_cast<int64_t*>(scale_v + buffers * P);
  uint64_t* w_full = reinterpret_cast<uint64_t*>(row_off + P);
  uint64_t* w_empty = w_full + stages;
  uint64_t* rows_full = w_empty + stages;
  uint64_t* rows_empty = rows_full + buffers;
  init_pass_barriers(w_full, w_empty, stages, rows_full, rows_empty, buffers, kMmaGroups, kStagerThreads);
  // (the last block-wide barrier: the three roles part here)

  const int64_t tiles = args.batch * tiles_per_batch, plane = args.n * args.ld;
  const int chunks = static_cast<int>(2 * args.rows_ab / kChunkRows);
  const int chunk_tiles = kSegs * kt_count;  // weight k-tiles per chunk
  const int w_tiles = chunks * chunk_tiles;    // weight stages per tile, chunk-major
  const bool resident = w_tiles <= stages;
  constexpr int kElemsPerKTile = kKBytes / static_cast<int>(sizeof(Op));
  const int warp = warp_index(), lane = threadIdx.x & 31;

  if (warp == kThreads / 32 - 1) {  // the producer
    if (lane != 0) return;
    if (resident) {
      for (int i = 0; i < w_tiles; ++i) {
        mbar_expect_tx(&w_full[i], kStageBytes);
        tma_load_2d(weights + i * kStageBytes, &map_w, (i % chunk_tiles) * kElemsPerKTile,
                    (i / chunk_tiles) * kChunkRows, &w_full[i]);
      }
      return;
    }
    FillRing ring{w_empty, stages};
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x)
      for (int chunk = 0; chunk < chunks; ++chunk)
        for (int kt = 0; kt < chunk_tiles; ++kt) {
          ring.wait_free();
          const int s = ring.slot;
          mbar_expect_tx(&w_full[s], kStageBytes);
          tma_load_2d(weights + s * kStageBytes, &map_w, kt * kElemsPerKTile, chunk * kChunkRows, &w_full[s]);
          ring.advance();
        }
    return;
  }

  if (threadIdx.x >= kMmaThreads) {  // a stager
    const int stager = threadIdx.x - kMmaThreads;
    const bool vectorized = rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
    // Zeros up to the end of the last k-tile: the weights there are zero (TMA fills past c_pad),
    // but 0 x stale shared memory could be NaN.
    const int k_fill = kt_count * kElemsPerKTile;
    float row_scale = 1.f, down = 1.f;  // kF16: 2^s_in, 2^-(s_in+t_in)
    if constexpr (kF16) {
      row_scale = args.f16x3_scales[kInRows];
      down = args.f16x3_scales[kInDown];
    }
    if constexpr (kStream) {
      static_assert(!kF16, "the streamed staging: plain 16-bit rows only (streams_rows)");
      if (with_row_vectors<TIn>(vectorized, k_fill, [&](auto vecs, int lanes_log2) {
            stream_tile_rows<M, TIn, P, decltype(vecs)::value>(args, k_fill, lanes_log2, rows, buffer_bytes, scale_v,
                                                               rows_full, rows_empty, buffers, tiles, tiles_per_batch,
                                                               stager >> 5);
          }))
        return;
      __trap();  // (launch_positions takes this kernel for vectorizable rows only)
    } else {
    FillRing ring{rows_empty, buffers};
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      ring.wait_free();
      const int buf = ring.slot;
      const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * P;
      named_barrier(1, kStagerThreads);  // every stager is done with the last tile's row_off
      if (stager < P) {
        float mask;
        locate_position(args, batch, p0 + stager, plane, row_off[stager], mask);
        scale_v[buf * P + stager] = kF16 ? gate_scale<M>(mask) * down : gate_scale<M>(mask);
      }
      named_barrier(1, kStagerThreads);
      const SwizzledRows big{rows + buf * buffer_bytes, kRowTileBytes};
      if constexpr (kF16)
        stage_rows_to<M, TIn, kStagerWarps, kStagingLoads>(
            F16SwizzledRows<kPlanes>{big, SwizzledRows{big.base + kt_count * kRowTileBytes, kRowTileBytes}, row_scale},
            vectorized,
            static_cast<const TIn*>(args.pair), row_off, P, static_cast<int>(args.c), k_fill, args.ln_in_w,
            args.ln_in_b, args.eps_in, stager >> 5);
      else
        stage_rows_to<M, TIn, kStagerWarps, kStagingLoads>(
            big, vectorized, static_cast<const TIn*>(args.pair), row_off, P, static_cast<int>(args.c),
            k_fill, args.ln_in_w, args.ln_in_b, args.eps_in, stager >> 5);
      fence_proxy_async();  // st.shared writes, read by wgmma through the async proxy
      mbar_arrive(&rows_full[buf]);
      ring.advance();
    }
    }
    return;
  }

  // An MMA thread.
  const int consumer = warp >> 2, warp4 = warp & 3, g = lane >> 2, t = lane & 3;
  const bool leader = (threadIdx.x & 127) == 0;
  // Ring positions kept as counters and phase bits (stages and buffers are launch arguments:
  // a division per k-tile would cost more than the k-tile's bookkeeping).
  int stage = 0, buf = 0;
  uint32_t stage_phase = 0, buf_phase = 0;
  // This thread's weight row of chunk c: c * kChunkRows + row_in_chunk (proj of h), + 8 (its gate).
  const int row_in_chunk = consumer * 64 + warp4 * 16 + g;
  // (Split: the biases times 2^(s_in+t_in), the scale of the accumulators' products; see ForwardArgs.)
  const float up = kF16 ? args.f16x3_scales[kInUp] : 1.f;
  // 16-bit a / b: stored through this warp's scratch (stage_row_pairs_x4, store_staged_rows) where the
  // launch left room for it after the plan's bytes (ab_scratch_bytes); else pair by pair.
  uint8_t* ab_scratch = nullptr;
  if constexpr (kStagedAb<M, kF16>) {
    const int64_t at = ceil_div(int64_t(rows - smem_raw) + plan_bytes(kt_count, buffers, stages, P, kPlanes), 128) * 128;
    if (at + ab_scratch_bytes(P) <= dynamic_smem_size()) ab_scratch = smem_raw + at + warp * (ab_scratch_bytes(P) / kMmaWarps);
  }
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * P;
    const int in_plane = static_cast<int>(std::min<int64_t>(plane - p0, P));  // even: plane is
    const uint8_t* tile_rows = rows + buf * buffer_bytes;
    const float* scale_t = scale_v + buf * P;
    mbar_wait(&rows_full[buf], buf_phase);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      // This thread's weight row r (proj of h) and r + 8 (gate of the same h), at positions
      // 8j + 2t, 8j + 2t + 1 of n8 block j.
      const int64_t r = int64_t(chunk) * kChunkRows + row_in_chunk;
      // The first k-tile overwrites the accumulators and the epilogue adds the biases (loaded here: the
      // k-loop hides their latency). Starting the accumulators from the biases instead cost ~200
      // register moves per chunk (ptxas copied the 64-value start pattern once per k-loop version).
      const float proj_bias = args.b_in[r] * up, gate_bias = args.b_in[r + 8] * up;
      float acc[P / 2];
      int held = -1;  // the stage the k-tile before this one read
      for (int kt = 0; kt < chunk_tiles; ++kt) {
        const int s = resident ? chunk * chunk_tiles + kt : stage;
        mbar_wait(&w_full[s], resident ? 0u : stage_phase);
        // The rows' k-tile (split: a weight hi k-tile against the rows' hi and lo k-tiles, the
        // remainders' plane kt_count k-tiles after the fp16 parts'; a lo k-tile against their hi).
        const int row_kt = kSplit && kt >= kt_count ? kt - kt_count : kt;
        const uint64_t desc_a = smem_descriptor(weights + s * kStageBytes + consumer * kGroupRowBytes);
        const uint64_t desc_b = smem_descriptor(tile_rows + row_kt * kRowTileBytes);
        wgmma_k_tile<Op, kSplit>(acc, desc_a, desc_b, kt == 0);
        // (the remainders' descriptor kt_count k-tiles on: its address field counts 16 bytes, and
        // shared memory ends far below its 2^18-byte reach)
        if (kSplit && kt < kt_count) wgmma_k_tile<Op, kSplit>(acc, desc_a, desc_b + kt_count * (kRowTileBytes >> 4));
        // The previous k-tile's MMAs are done once at most this one is in flight: free its stage.
        wgmma_wait<1>();
        if (!resident) {
          if (held >= 0 && leader) mbar_arrive(&w_empty[held]);
          held = stage;
          if (++stage == stages) {
            stage = 0;
            stage_phase ^= 1u;
          }
        }
      }
      wgmma_wait<0>();
      if (held >= 0 && leader) mbar_arrive(&w_empty[held]);

      const bool second = r >= args.rows_ab;  // b's rows follow a's
      const int64_t local = r - (second ? args.rows_ab : 0);
      const int64_t h0 = (local >> 4) * 8, h = h0 + g;  // (h0: the warp's first h)
      void* out_base = second ? args.b_t : args.a_t;
      if constexpr (kStagedAb<M, kF16>) {
        if (ab_scratch != nullptr && in_plane == P) {  // (warp-uniform, as stmatrix needs)
          if (h0 >= args.h) continue;
          const auto pair_at = [&](int j) {  // (positions 8j + 2t, + 1)
            const float2 scale = *reinterpret_cast<const float2*>(scale_t + 8 * j + 2 * t);
            return pack_pair<op_t<M>>(gated<M, kF16>(acc[4 * j] + proj_bias, acc[4 * j + 2], gate_bias, 1.f, scale.x),
                                      gated<M, kF16>(acc[4 * j + 1] + proj_bias, acc[4 * j + 3], gate_bias, 1.f, scale.y));
          };
#pragma unroll
          for (int q = 0; q < P / 32; ++q)
            stage_row_pairs_x4<P>(ab_scratch, q, pair_at(4 * q), pair_at(4 * q + 1), pair_at(4 * q + 2), pair_at(4 * q + 3));
          store_staged_rows<P>(static_cast<op_t<M>*>(out_base) + (batch * args.h + h0) * plane + p0, plane,
                               static_cast<int>(std::min<int64_t>(8, args.h - h0)), ab_scratch);
          continue;
        }
      }
      if (h >= args.h) continue;
      const int64_t out_index = (batch * args.h + h) * plane + p0;
      op_t<M>* out = static_cast<op_t<M>*>(out_base) + out_index;
      // (kF16: the gates' 2^-(s_in+t_in) and the fp16 contraction operands' scale, read once here:
      // read per use, behind the stores to a_t / b_t that might alias them, they were global loads
      // per pair that the multiplies waited on)
      const float gate_down = kF16 ? args.f16x3_scales[kInDown] : 1.f;
      const float ab_up = kF16 && args.ab_f16 ? args.f16x3_scales[kAbUp] : 0.f;
#pragma unroll
      for (int j = 0; j < P / 8; ++j) {
        const int m = 8 * j + 2 * t;
        const float2 scale = *reinterpret_cast<const float2*>(scale_t + m);  // (split: proj's 2^-(s_in+t_in) in it)
        const float v0 = gated<M, kF16>(acc[4 * j] + proj_bias, acc[4 * j + 2], gate_bias, gate_down, scale.x);
        const float v1 = gated<M, kF16>(acc[4 * j + 1] + proj_bias, acc[4 * j + 3], gate_bias, gate_down, scale.y);
        if (m < in_plane) {
          if constexpr (kF16) store_contraction_pair<M>(out_base, out_index + m, v0, v1, args.small_offset, ab_up);
          else store_operand_pair<M>(out + m, v0, v1);
        }
      }
    }
    mbar_arrive(&rows_empty[buf]);  // this thread's products on these rows are done, its masks read
    if (++buf == buffers) {
      buf = 0;
      buf_phase ^= 1u;
    }
  }
}

// The buffers, stages and bytes this kernel would take these sizes with (bytes 0: it does not): an
// sm_90a build on Hopper, the prepared fp16 weights in the fp32 modes (plan_pass says how buffers and
// stages are chosen). Any problem size: with fewer 128-position tiles than SMs (the seed shapes) it is
// the fastest input kernel in every mode (bench/NOTES.md).
template <Mode M>
Plan plan(const ForwardArgs& args) {
  constexpr bool kF16 = kF16Arith<M>;
  if (tensor_map_encoder() == nullptr || 2 * args.rows_ab >= (int64_t(1) << 31)) return Plan{};
  if (kF16 && (args.w_in_f16x3 == nullptr || args.f16x3_scales == nullptr)) return Plan{};
  const int kt = k_tiles(args.c_pad, sizeof(pass_op_t<M>));
  const int w_tiles = static_cast<int>(2 * args.rows_ab / kChunkRows) * kSegments<M> * kt;
  const auto bytes_at = [=](int tile_positions) {
    return [=](int buffers, int stages) { return plan_bytes(kt, buffers, stages, tile_positions, kRowPlanes<M>); };
  };
  const PassPlan ring = plan_pass(bytes_at(128), w_tiles, kMaxStages);
  // Split rows where two 128-position buffers do not fit (pair_dim 384): one 64-position buffer and a
  // 6-stage weight ring, which measured faster than one 128-position buffer and 2 stages.
  if (kRowPlanes<M> == 2 && ring.buffers == 1) {
    for (int stages = std::min(6, w_tiles); stages >= 2; --stages)
      if (const PassPlan narrow = sized_plan(bytes_at(64), 1, stages); narrow.bytes != 0) return Plan{narrow, 64};
  }
  return Plan{ring, ring.bytes != 0 ? 128 : 0};
}

// Whether the stagers stream their rows (stream_tile_rows): 16-bit operands, rows of pair_dim <= 128
// in 16-byte vectors, where it measured faster than staging in rounds; wider rows take rounds.
template <Mode M, typename TIn>
bool streams_rows(const ForwardArgs& args) {
  return (M == Mode::bf16 || M == Mode::f16) && args.c_pad <= 128 &&
         rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
}

template <Mode M, typename TIn, int P, bool kStream>
cudaError_t launch_positions(const ForwardArgs& args, const PassPlan& ring, const CUtensorMap& map_w) {
  constexpr bool kF16 = kF16Arith<M>;
  // (the a / b store scratch after the plan's bytes, 128-byte aligned, where it fits: kStagedAb)
  int64_t bytes = ring.bytes;
  if (kStagedAb<M, kF16> && ceil_div(bytes, 128) * 128 + ab_scratch_bytes(P) <= max_smem_optin())
    bytes = ceil_div(bytes, 128) * 128 + ab_scratch_bytes(P);
  const cudaError_t status = allow_smem<kernel<M, TIn, P, kF16, kStream>>(bytes);
  if (status != cudaSuccess) return status;
  const int64_t tiles_per_batch = ceil_div(args.n * args.ld, P);
  const int64_t blocks = std::min<int64_t>(sm_count(), args.batch * tiles_per_batch);
  kernel<M, TIn, P, kF16, kStream><<<static_cast<unsigned>(blocks), kThreads, bytes, args.stream>>>(
      args, map_w, tiles_per_batch, ring.buffers, ring.stages);
  return cudaGetLastError();
}

template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return plan<M>(args).positions != 0;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  constexpr bool kF16 = kF16Arith<M>;
  using Op = pass_op_t<M>;
  const Plan chosen = plan<M>(args);
  if (chosen.positions == 0) return cudaErrorNotSupported;
  // The grouped proj/gate weights [2 * rows_ab, c_pad] (kF16: the prepared [hi | lo] of whole
  // k-tiles each; one plane reads the hi segment only): boxes of 128 bytes of k x 128 rows, zeros
  // past the row.
  const int64_t cols = kF16 ? f16_weight_cols(args.c_pad) : args.c_pad;
  CUtensorMap map_w;
  if (!encode_kmajor_map<Op>(&map_w, kF16 ? args.w_in_f16x3 : args.w_in, 0, 2 * args.rows_ab, cols, kChunkRows))
    return cudaErrorNotSupported;
  if constexpr (M == Mode::highest) {  // (64-position tiles: split rows at wide pair_dim, plan())
    if (chosen.positions == 64) return launch_positions<M, TIn, 64, false>(args, chosen.ring, map_w);
  }
  if constexpr (M == Mode::bf16 || M == Mode::f16) {
    if (streams_rows<M, TIn>(args)) return launch_positions<M, TIn, 128, true>(args, chosen.ring, map_w);
  }
  return launch_positions<M, TIn, 128, false>(args, chosen.ring, map_w);
}

}  // namespace wgmma_ws
}  // namespace input_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS(input, wgmma_ws, trimul::input_pass::wgmma_ws, trimul::fused::kAllModes);
