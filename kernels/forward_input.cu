// input pass — LayerNorm_in, the four gated projections and the mask in one read of pair_repr,
// writing a_t / b_t straight into the contraction's [B*H, N, ld] layout (both directions).
#include "tma.cuh"

namespace trimul {
namespace input_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;

// Pair rows stay resident (LayerNorm-ed) while the grouped proj/gate weights stream past in chunks
// of BN rows (BN/2 hidden channels). The weights are the mma's A operand, so each thread's
// accumulators hold (proj, gate) of one h at two adjacent positions: the gated pair goes straight
// to a_t / b_t as one 4- or 8-byte store, with no shared-memory staging or copy-out.
using Wide = SwappedTiling<2, 4, 4, 4>;    // 128 positions, 128 weight rows (64 h) per chunk
using Narrow = SwappedTiling<4, 2, 2, 4>;  // 64 positions: for small problems and wide pair_dim

template <Mode M, class T>
struct Smem {
  static int64_t bytes(int64_t c_pad) {
    return int64_t(T::BM) * resident_stride<M>(c_pad) * 4 + int64_t(kStages) * T::BN * kSlabStride * 4 + T::BM * 4 +
           T::BM * 8;
  }
};

// Pair-row element offset (-1: no position) and mask value of the position at row f, column k of a
// batch's [N, ld] operand plane (valid: the position exists, not padding).
__device__ __forceinline__ void locate_fk(const ForwardArgs& args, int64_t batch, uint32_t f, uint32_t k, bool valid,
                                          int64_t& row_off, float& mask) {
  const int64_t row = args.incoming ? k : f, col = args.incoming ? f : k;
  row_off = valid ? batch * args.pair_sb + row * args.pair_sr + col * args.pair_sc : -1;
  mask = valid ? load_mask(args.mask, args.mask_kind, batch * args.mask_sb + row * args.mask_sr + col * args.mask_sc)
               : 0.f;
}
// The same for position p of the flattened plane (f = p / ld, k = p % ld; k >= n and p >= plane are
// padding). plane < 2^32 (checked at launch): 32-bit division is a fraction of a 64-bit one's cost.
__device__ __forceinline__ void locate_position(const ForwardArgs& args, int64_t batch, int64_t p, int64_t plane,
                                                int64_t& row_off, float& mask) {
  const uint32_t f = static_cast<uint32_t>(p) / static_cast<uint32_t>(args.ld);
  const uint32_t k = static_cast<uint32_t>(p) - f * static_cast<uint32_t>(args.ld);
  locate_fk(args, batch, f, k, p < plane && k < args.n, row_off, mask);
}

// Two adjacent operand values (the destination is aligned for both: positions are even).
// tf32x3 with small_offset != 0: the TF32 part here and the remainder small_offset further on,
// so the contraction needs no splitting of its own (ForwardArgs::small_offset).
template <Mode M>
__device__ __forceinline__ void store_operand_pair(op_t<M>* dst, float v0, float v1, int64_t small_offset = 0);

// The fp32 modes' contraction operands at element `index` of a_t / b_t (`base`): as op_t<M> (TF32
// values; "highest" with small_offset != 0 TF32 parts and remainders), or with `up` != 0
// (ForwardArgs::ab_f16) fp16 values of the values times `up` ("highest" with small_offset: parts
// and remainders).
template <Mode M>
__device__ __forceinline__ void store_contraction_pair(void* base, int64_t index, float v0, float v1,
                                                       int64_t small_offset, float up) {
  if (up == 0.f) {
    store_operand_pair<M>(static_cast<op_t<M>*>(base) + index, v0, v1, small_offset);
    return;
  }
  const __half2 hi = __floats2half2_rn(v0 * up, v1 * up);
  __half* dst = static_cast<__half*>(base) + index;
  *reinterpret_cast<__half2*>(dst) = hi;
  if constexpr (M == Mode::tf32x3) {  // (ab_f16 at "highest" comes with small_offset: split operands)
    const float2 hf = __half22float2(hi);
    *reinterpret_cast<__half2*>(dst + small_offset) = __floats2half2_rn(v0 * up - hf.x, v1 * up - hf.y);
  }
}

template <Mode M>
__device__ __forceinline__ void store_operand_pair(op_t<M>* dst, float v0, float v1, int64_t small_offset) {
  if constexpr (M == Mode::bf16) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
  } else if constexpr (M == Mode::f16) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v0, v1);
  } else if constexpr (M == Mode::tf32x3) {
    if (small_offset == 0) {
      *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    } else {
      const float big0 = to_operand<Mode::tf32>(v0), big1 = to_operand<Mode::tf32>(v1);
      *reinterpret_cast<float2*>(dst) = make_float2(big0, big1);
      *reinterpret_cast<float2*>(dst + small_offset) =
          make_float2(to_operand<Mode::tf32>(v0 - big0), to_operand<Mode::tf32>(v1 - big1));
    }
  } else {
    *reinterpret_cast<float2*>(dst) = make_float2(to_operand<M>(v0), to_operand<M>(v1));
  }
}

// A block owns BM consecutive positions p of one batch's flattened [N, ld] operand plane
// (f = p / ld, k = p % ld), so each h row of its output is one contiguous run of a_t / b_t and
// small N packs several f rows into a tile instead of padding one out to BM.
// Two blocks per multiprocessor (one stages while the other multiplies): <= 128 registers.
template <Mode M, typename TIn, class T>
__global__ void __launch_bounds__(T::kThreads, 2) kernel(const ForwardArgs args, int64_t p_tiles) {
  allow_dependent_launch();
  using Op = op_t<M>;
  constexpr bool kRounded = M == Mode::tf32;  // operands written as TF32 values already
  extern __shared__ __align__(16) uint32_t smem[];
  const int a_stride = resident_stride<M>(args.c_pad);
  uint32_t* a_res = smem;
  uint32_t* stages = a_res + T::BM * a_stride;
  float* mask_v = reinterpret_cast<float*>(stages + kStages * T::BN * kSlabStride);
  int64_t* row_off = reinterpret_cast<int64_t*>(mask_v + T::BM);

  const int64_t plane = args.n * args.ld;
  const int64_t p0 = (blockIdx.x % p_tiles) * T::BM;
  const int64_t batch = blockIdx.x / p_tiles;

  // The weights' first slabs load while the rows are staged.
  const int64_t w_ld = args.c_pad * static_cast<int64_t>(sizeof(Op));
  const int k_slabs = static_cast<int>(w_ld / kSlabBytes);
  const int chunks = static_cast<int>(2 * args.rows_ab / T::BN);
  auto stream = make_slab_stream<T>(stages, chunks * k_slabs,
                                    ChunkedSlabs(static_cast<const char*>(args.w_in), w_ld, T::BN, k_slabs));
  stream.prime();

  for (int m = threadIdx.x; m < T::BM; m += T::kThreads)
    locate_position(args, batch, p0 + m, plane, row_off[m], mask_v[m]);
  __syncthreads();
  stage_rows<M, TIn, T::kWarps>(rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair),
                                a_res, a_stride, static_cast<const TIn*>(args.pair), row_off, T::BM,
                                static_cast<int>(args.c), static_cast<int>(args.c_pad), args.ln_in_w,
                                args.ln_in_b, args.eps_in);
  // (the stream's first next() synchronises before anyone reads a_res)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ws = warp / T::WR, wr = warp % T::WR, g = lane >> 2, t = lane & 3;
  // This thread's positions: 2t, 2t + 1 of each n8 tile. Positions with k in [n, ld) get zeros
  // (their mask is 0): the contraction reads whole k-slabs.
  float mask_r[T::NT][2];
  bool in_plane[T::NT];
#pragma unroll
  for (int ni = 0; ni < T::NT; ++ni) {
    const int m = wr * T::NT * 8 + ni * 8 + 2 * t;
    mask_r[ni][0] = mask_v[m];
    mask_r[ni][1] = mask_v[m + 1];
    in_plane[ni] = p0 + m < plane;  // plane is even, so the pair is wholly in or out
  }
  const int chunks_per_half = chunks / 2;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int half = chunk / chunks_per_half;  // 0: a, 1: b
    const int64_t w_row0 = int64_t(chunk) * T::BN;
    const int64_t h_chunk = (w_row0 - half * args.rows_ab) / 2;  // 16 weight rows hold 8 h
    float acc[T::MT][T::NT][4];
#pragma unroll
    for (int mi = 0; mi < T::MT; ++mi) {
      const int64_t r = w_row0 + ws * T::MT * 16 + mi * 16 + g;
      const float proj_bias = args.b_in[r], gate_bias = args.b_in[r + 8];
#pragma unroll
      for (int ni = 0; ni < T::NT; ++ni) {
        acc[mi][ni][0] = acc[mi][ni][1] = proj_bias;
        acc[mi][ni][2] = acc[mi][ni][3] = gate_bias;
      }
    }
    gemm_streamed_swapped<M, T, kRounded>(acc, a_res, a_stride, k_slabs, stream);
    void* out_base = half ? args.b_t : args.a_t;
    Op* out = static_cast<Op*>(out_base) + batch * args.h * plane + p0;
    // (fp16 contraction operands: their scale, read once here)
    const float ab_up = (M == Mode::tf32 || M == Mode::tf32x3) && args.ab_f16 ? args.f16x3_scales[kAbUp] : 0.f;
#pragma unroll
    for (int mi = 0; mi < T::MT; ++mi) {
      const int64_t h = h_chunk + (ws * T::MT + mi) * 8 + g;
      if (h >= args.h) continue;
      Op* row = out + h * plane;
#pragma unroll
      for (int ni = 0; ni < T::NT; ++ni) {
        if (!in_plane[ni]) continue;
        const float v0 = acc[mi][ni][0] * gate_sigmoid<M>(acc[mi][ni][2]) * mask_r[ni][0];
        const float v1 = acc[mi][ni][1] * gate_sigmoid<M>(acc[mi][ni][3]) * mask_r[ni][1];
        Op* dst = row + wr * T::NT * 8 + ni * 8 + 2 * t;
        if constexpr (M == Mode::tf32 || M == Mode::tf32x3)
          store_contraction_pair<M>(out_base, dst - static_cast<Op*>(out_base), v0, v1, args.small_offset, ab_up);
        else
          store_operand_pair<M>(dst, v0, v1, args.small_offset);
      }
    }
  }
  stream.drain();
}

// ---- Resident weights (16-bit operands, weights that fit in shared memory) -----------------------
// One block per multiprocessor holds all proj/gate weights for the whole pass; each pair of warps
// works on its own tiles of 32 positions (stage + LayerNorm the rows, multiply, store), so there is
// no weight stream, no block barrier after the weights are in, and pairs that wait for their rows
// overlap with pairs that multiply.
namespace resident {

// Warps work in pairs on a tile: both stage its rows, one computes a's outputs, the other b's.
// The weights take ~140 KB, so a tile's rows fit 8 times beside them: 16 warps (4 per scheduler)
// where one warp per tile could only have 8.
constexpr int kWarps = 16, kPairs = kWarps / 2, kThreads = 32 * kWarps;
constexpr int kRows = 32;        // positions per tile (4 n8 tiles)
constexpr int kChunkRows = 64;   // weight rows per product (4 m16 tiles, 32 h)
constexpr int kMaxSlabs = 4;     // k-slabs per product: pair_dim <= 128 (unrolled: no address math)

// Weight rows kept per half (a / b): the grouped rows that hold h < H, rounded to whole chunks.
__host__ __device__ inline int64_t half_rows(int64_t hidden) { return ceil_div(2 * hidden, kChunkRows) * kChunkRows; }

template <Mode M>
int64_t bytes(const ForwardArgs& args) {
  const int64_t rows = 2 * half_rows(args.h), stride = resident_stride<M>(args.c_pad);
  return 4 * (rows * stride + rows + kPairs * (64 + 32 + kRows * stride));
}

template <Mode M, typename TIn>
__global__ void __launch_bounds__(kThreads, 1) kernel(const ForwardArgs args, int64_t tiles_per_batch) {
  allow_dependent_launch();
  using Op = op_t<M>;
  extern __shared__ __align__(16) uint32_t smem[];
  const int stride = resident_stride<M>(args.c_pad);
  const int half = static_cast<int>(half_rows(args.h));
  uint32_t* weights = smem;  // rows [0, half): a's, [half, 2 half): b's
  float* bias = reinterpret_cast<float*>(weights + 2 * half * stride);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pair = warp >> 1, side = warp & 1;
  uint32_t* own = reinterpret_cast<uint32_t*>(bias + 2 * half) + pair * (96 + kRows * stride);
  // The pair's own barrier (id 0 is __syncthreads').
  auto pair_sync = [pair] { asm volatile("bar.sync %0, 64;\n" ::"r"(pair + 1) : "memory"); };
  int64_t* row_off = reinterpret_cast<int64_t*>(own);
  float* mask_v = reinterpret_cast<float*>(own + 64);
  uint32_t* rows = own + 96;

  {
    const auto source_row = [&](int r) -> int64_t { return r < half ? r : r - half + args.rows_ab; };
    copy_rows_async<kThreads>(weights, stride, static_cast<const char*>(args.w_in), 2 * half,
                              static_cast<int>(args.c_pad * sizeof(Op)), source_row);
    cp_async_commit();
    for (int r = threadIdx.x; r < 2 * half; r += kThreads) bias[r] = args.b_in[source_row(r)];
    cp_async_wait<0>();
    __syncthreads();
  }

  const int64_t plane = args.n * args.ld, tiles = args.batch * tiles_per_batch;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = 2 * half / kChunkRows;
  const int k_slabs = static_cast<int>(args.c_pad * static_cast<int64_t>(sizeof(Op)) / kSlabBytes);
  const bool vectorized = rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
  for (int64_t tile = int64_t(blockIdx.x) * kPairs + pair; tile < tiles; tile += int64_t(gridDim.x) * kPairs) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kRows;
    if (side == 0) locate_position(args, batch, p0 + lane, plane, row_off[lane], mask_v[lane]);
    pair_sync();
    stage_rows<M, TIn, 2>(vectorized, rows, stride, static_cast<const TIn*>(args.pair), row_off, kRows,
                          static_cast<int>(args.c), static_cast<int>(args.c_pad), args.ln_in_w, args.ln_in_b,
                          args.eps_in, side);
    pair_sync();
    float half_mask[4][2];
    bool in_plane[4];
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int m = ni * 8 + 2 * t;
      half_mask[ni][0] = 0.5f * mask_v[m];
      half_mask[ni][1] = 0.5f * mask_v[m + 1];
      in_plane[ni] = p0 + m < plane;
    }
    for (int chunk = side * chunks / 2; chunk < (side + 1) * chunks / 2; ++chunk) {  // a's or b's outputs
      const int r0 = chunk * kChunkRows;
      const int second = r0 >= half;  // b's weights
      const int64_t h_chunk = (r0 - second * half) / 2;
      float acc[4][4][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const float proj_bias = bias[r0 + mi * 16 + g], gate_bias = bias[r0 + mi * 16 + g + 8];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          acc[mi][ni][0] = acc[mi][ni][1] = proj_bias;
          acc[mi][ni][2] = acc[mi][ni][3] = gate_bias;
        }
      }
      const uint32_t* w_chunk = weights + r0 * stride;
#pragma unroll
      for (int slab = 0; slab < kMaxSlabs; ++slab)
        if (slab < k_slabs)
          warp_slab<M, 4, 4>(acc, w_chunk + slab * kSlabWords, stride, rows + slab * kSlabWords, stride, lane);
      // Values for every slot, then predicated stores (branches around each would cost more).
      Op* out = static_cast<Op*>(second ? args.b_t : args.a_t) + (batch * args.h + h_chunk + g) * plane + p0 + 2 * t;
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const bool h_ok = h_chunk + mi * 8 + g < args.h;
        Op* row = out + mi * 8 * plane;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const float v0 = gated_16bit(acc[mi][ni][0], acc[mi][ni][2], half_mask[ni][0]);
          const float v1 = gated_16bit(acc[mi][ni][1], acc[mi][ni][3], half_mask[ni][1]);
          if (h_ok && in_plane[ni]) store_operand_pair<M>(row + ni * 8, v0, v1);
        }
      }
    }
    pair_sync();  // the next tile's staging overwrites rows both products read
  }
}

// Bytes if this pass runs resident for these sizes, else 0.
template <Mode M>
int64_t applicable(const ForwardArgs& args) {
  if constexpr (M != Mode::bf16 && M != Mode::f16) {
    return 0;
  } else {
    if (args.c_pad * static_cast<int64_t>(sizeof(op_t<M>)) > kMaxSlabs * kSlabBytes) return 0;
    return persistent_bytes(args.batch * ceil_div(args.n * args.ld, kRows), kPairs, bytes<M>(args));
  }
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args, int64_t smem_bytes) {
  return launch_persistent<kernel<M, TIn>>(args, args.n * args.ld, kRows, kPairs, kThreads, smem_bytes);
}

}  // namespace resident

// ---- wgmma + TMA, warp-specialized (sm_90a) ----------------------------------------------------
// One block per SM of 16 warps (4 per scheduler: 128 registers each) with three jobs, so that
// loading a tile's rows (DRAM latency), multiplying (tensor cores) and storing overlap instead of
// taking turns:
// - the producer warp: one thread streams the grouped proj/gate weights with TMA, 128 rows x 128
//   bytes of k per stage, through an mbarrier ring running ahead into the next tile's weights; or,
//   where all of them fit in the ring, loads them once (they are the same for every tile);
// - 7 stager warps LayerNorm a tile's 128 positions (P; 64 where TRIMUL_INPUT_PLAN asks) into
//   128-byte-swizzled k-tiles (wgmma's B operand), into one of two row buffers while the MMA warps
//   multiply the other;
// - two MMA warpgroups each multiply 64 of every 128 weight rows (A) by the staged tile: m64n128
//   (m64n64 at P = 64; k16 for 16-bit operands, k8 for TF32), accumulators started from the biases. Rows grouped by
//   16 put a thread's proj and gate of one h at the same two positions, so the gated pair goes
//   straight to a_t / b_t, as in the streamed kernel.
// Where two row buffers do not fit (TF32 and split at pair_dim 384) there is one: staging and products then
// take turns, as in the first (v7a) version of this kernel.
// "highest" multiplies fp16x3 (ForwardArgs::w_in_f16x3): the stagers write each row, scaled by 2^s_in,
// as its fp16 part and fp16 remainder (two planes); the prepared weights hold [hi | lo] per row,
// and each hi k-tile multiplies the rows' hi and lo k-tiles, each lo k-tile their hi: hi.hi + hi.lo + lo.hi,
// about 3xTF32's accuracy at twice its tensor-core rate and half its shared memory (NOTES v11).
// a_t / b_t get the split contraction's operands (store_contraction_pair: fp16 or TF32 parts and
// remainders). "high" takes the same scaled fp16 arithmetic with one plane and one product where
// ForwardArgs::high_f16 asks (kF16: TF32's 11-bit significand at the fp16 rate; the default, NOTES v14).
namespace wgmma_tiles {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;

constexpr int kStagingLoads = 12;  // 16-byte loads in flight per stager lane
constexpr int kStreamLoads = 4;    // the same for TRIMUL_INPUT_STAGING=stream, double-buffered (8 spilled there)

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
// plan's bytes (pair_dim 128; at 384 the plan's buffers and stages fill shared memory: NOTES v23).
template <Mode M, bool kF16>
constexpr bool kStagedAb = !kF16 && (M == Mode::bf16 || M == Mode::f16);
constexpr int kMmaWarps = kMmaThreads / 32;
__host__ __device__ constexpr int64_t ab_scratch_bytes(int positions) { return kMmaWarps * 8 * positions * 2; }

// The proj/gate product of one h at one position, gated and masked (tanh.approx on 16-bit paths),
// from the position's scale: gate_scale(mask), computed once per position by the stagers. The gate
// from its accumulator, its bias and (kF16) the products' scale back, gate_down: on the 16-bit paths
// the bias and tanh's halving are one FFMA (~10% of the wgmma input epilogue's instructions, profile 14).
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

// Streamed staging (ForwardArgs::input_staging): the stagers' row groups
// (Stager::group_rows() rows each) are numbered over this block's tiles in order and handed out
// round-robin, so a warp that staged two groups of one tile stages fewer of the next (the rounds
// kernel gives warps 0-3 two load rounds of every 128-position tile and warps 4-6 one); each lane
// locates its own rows, so no row offsets are shared and no named barrier waits per tile. Every
// stager thread still arrives once per tile on rows_full, after its groups of that tile.
// Double-buffered: a warp issues its next group's loads (possibly the next tile's, whose buffer may
// still be in use: only registers are written) before it LayerNorms and stores the current one, so
// the loads' latency overlaps the arithmetic (ncu, profile 14: the stagers waited on their own loads
// ~30% of their time). The masks wait in registers until the group's buffer is known to be free.
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

// kStream: the stagers take TRIMUL_INPUT_STAGING=stream's round-robin row groups (stream_tile_rows; a
// separate instantiation, so its register pressure stays out of the default kernel).
template <Mode M, typename TIn, int P, bool kF16 = M == Mode::tf32x3, bool kStream = false>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_w, int64_t tiles_per_batch, int buffers,
           int stages) {
  allow_dependent_launch();
  static_assert(P == 128 || P == 64, "m64n128 or m64n64 products");
  using Op = pass_op_t<M, kF16>;
  constexpr int kRowTileBytes = P * kKBytes;
  constexpr bool kSplit = M == Mode::tf32x3;  // (implies kF16)
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
      static_assert(!kF16, "TRIMUL_INPUT_STAGING=stream: plain 16-bit rows only (launch_positions)");
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

// The buffers, stages and bytes this kernel would take these sizes with (bytes 0: it does not):
// an sm_90a build on Hopper, bf16 / fp16 / TF32 operands (plan_pass says how buffers and stages are
// chosen); kF16: the prepared fp16 weights. Any problem size: with fewer 128-position tiles than SMs
// (the seed shapes) it measured faster than the other kernels, or within 0.5 us, in every mode (NOTES,
// v17: (16,32,64,32) "highest" 50.3 -> 42.2 us of GPU time per forward).
template <Mode M, bool kF16 = M == Mode::tf32x3>
Plan plan(const ForwardArgs& args) {
  // TRIMUL_INPUT_PLAN may ask for 64-position tiles (smaller row buffers, room for more weight stages,
  // the weights streamed twice as often); else 128.
  const int positions = args.input_plan_positions != 0 ? args.input_plan_positions : 128;
  if (tensor_map_encoder() == nullptr || 2 * args.rows_ab >= (int64_t(1) << 31)) return Plan{};
  if (kF16 && (args.w_in_f16x3 == nullptr || args.f16x3_scales == nullptr)) return Plan{};
  const int kt = k_tiles(args.c_pad, sizeof(pass_op_t<M, kF16>));
  const int w_tiles = static_cast<int>(2 * args.rows_ab / kChunkRows) * kSegments<M> * kt;
  const auto bytes_at = [=](int tile_positions) {
    return [=](int buffers, int stages) { return plan_bytes(kt, buffers, stages, tile_positions, kRowPlanes<M>); };
  };
  const auto bytes = bytes_at(positions);
  const auto with_positions = [=](const PassPlan& ring) { return Plan{ring, ring.bytes != 0 ? positions : 0}; };
  // TRIMUL_INPUT_PLAN: these buffers and stages (all weight k-tiles resident where they number no
  // more), or none where they do not fit.
  if (args.input_plan_buffers != 0)
    return with_positions(sized_plan(bytes, args.input_plan_buffers, std::min(args.input_plan_stages, w_tiles)));
  const PassPlan ring = plan_pass(bytes, w_tiles, kMaxStages);
  // Split rows where two 128-position buffers do not fit (pair_dim 384): one 64-position buffer and a
  // 6-stage weight ring measured faster than one 128-position buffer and 2 stages (NOTES v19, H200:
  // "highest" input (1,1024,384,128) 4544 -> 3706 us, (2,256,384,128) 549 -> 482; 8 stages 3811 / 490).
  if (kRowPlanes<M> == 2 && ring.buffers == 1) {
    for (int stages = std::min(6, w_tiles); stages >= 2; --stages)
      if (const PassPlan narrow = sized_plan(bytes_at(64), 1, stages); narrow.bytes != 0) return Plan{narrow, 64};
  }
  return with_positions(ring);
}

template <Mode M, typename TIn, int P, bool kF16, bool kStream = false>
cudaError_t launch_positions(const ForwardArgs& args, const PassPlan& ring, const CUtensorMap& map_w) {
  // Streamed staging (ForwardArgs::input_staging): the 16-bit modes only (the measured question is "medium"'s).
  if constexpr (!kStream && !kF16 && (M == Mode::bf16 || M == Mode::f16)) {
    const bool stream = args.input_staging == InputStaging::kStream ||
                        (args.input_staging == InputStaging::kAuto && args.c_pad <= 128);
    if (stream && rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair))
      return launch_positions<M, TIn, P, kF16, true>(args, ring, map_w);
  }
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

template <Mode M, typename TIn, bool kF16 = M == Mode::tf32x3>
cudaError_t launch(const ForwardArgs& args, const Plan& plan) {
  using Op = pass_op_t<M, kF16>;
  // The grouped proj/gate weights [2 * rows_ab, c_pad] (kF16: the prepared [hi | lo] of whole
  // k-tiles each; one plane reads the hi segment only): boxes of 128 bytes of k x 128 rows, zeros
  // past the row.
  const int64_t cols = kF16 ? f16_weight_cols(args.c_pad) : args.c_pad;
  CUtensorMap map_w;
  if (!encode_kmajor_map<Op>(&map_w, kF16 ? args.w_in_f16x3 : args.w_in, 0, 2 * args.rows_ab, cols, kChunkRows))
    return cudaErrorNotSupported;
  return plan.positions == 128 ? launch_positions<M, TIn, 128, kF16>(args, plan.ring, map_w)
                               : launch_positions<M, TIn, 64, kF16>(args, plan.ring, map_w);
}

// The kernel for mode M in the arithmetic with_f16_arith picks (at "high" with high_f16 never the
// native TF32 one: it would not write the fp16 contraction operands that ab_f16 asks for).
template <Mode M, typename TIn>
cudaError_t plan_and_launch(const ForwardArgs& args) {
  return with_f16_arith<M>(args, [&](auto f16) {
    constexpr bool kF16 = decltype(f16)::value;
    const Plan chosen = plan<M, kF16>(args);
    return chosen.positions != 0 ? launch<M, TIn, kF16>(args, chosen) : cudaErrorNotSupported;
  });
}

}  // namespace wgmma_tiles

// ---- wgmma with the rows in registers (sm_90a; 16-bit modes, rows of pair_dim 128) -----------------
// wgmma_tiles stages LayerNorm-ed rows in shared memory (wgmma's B operand) through 7 stager warps whose
// loads in flight are bounded by their registers (~28 KB per SM at pair_dim 128, about the 1.9 TB/s that
// kernel reaches there; NOTES v25). Here the rows are wgmma's A operand, from registers: each MMA
// warpgroup loads its own 64-position tiles (a thread: two rows, 32 channels of each: 8 loads of 4
// channels per row), LayerNorms them in registers (statistics over a quad: two shuffles), and multiplies
// them by the resident weights in parts of 64 weight rows (N = 64), two accumulator sets in turn; the next
// tile's rows (32 KB per warpgroup for fp32 rows) load while this tile's parts multiply and store. The
// weights come prepared for it (ForwardArgs::w_in_rows: LayerNorm_in's affine folded in, k permuted so that
// a k-step's fragment is 4 adjacent channels of a row, and the biases as one more k-step against ones).
// The gated outputs go out through a per-warpgroup scratch, transposed by stmatrix.trans (32 h rows x 64
// positions per part), as one TMA box store per part (TRIMUL_AB_STORE=threads: 128-byte runs the warpgroup
// stores itself).
namespace wgmma_rs {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kThreads = 128 * kGroups;
constexpr int kPositions = 64;                      // per tile: wgmma's M
constexpr int kC = 128;                             // the pair_dim it takes
constexpr int kSteps = kC / 16;                     // k16 steps of the rows
// 128-byte k-tiles per weight chunk: the rows' two, then the biases' (ForwardArgs::w_in_rows: columns kC and
// kC + 1 hold each weight row's bias as a 16-bit part and remainder, multiplied by ones in a ninth k-step,
// so the accumulators come out biased: no bias loads or adds in the epilogue).
constexpr int kKTiles = kC * 2 / kKBytes + 1;
constexpr int kScratchBytes = 2 * 32 * kPositions * 2;  // per warpgroup: two buffers of 32 h x 64 positions

inline int64_t weight_tiles(int64_t rows_ab) { return 2 * rows_ab / kChunkRows * kKTiles; }
// Dynamic shared memory: the resident weights (1024-byte aligned), the scratches, the weights' barriers.
inline int64_t smem_bytes(int64_t rows_ab) {
  return 1023 + weight_tiles(rows_ab) * (kStageBytes + 8) + kGroups * kScratchBytes;
}

// Four adjacent channels of a row as one load: 16 bytes of fp32 rows, 8 of 16-bit ones.
template <typename TIn>
struct FourChannels {
  using Raw = std::conditional_t<std::is_same<TIn, float>::value, float4, uint2>;
  static __device__ __forceinline__ Raw load(const TIn* p) { return *reinterpret_cast<const Raw*>(p); }
  static __device__ __forceinline__ float4 widen(const Raw& raw) {
    if constexpr (std::is_same<TIn, float>::value) {
      return raw;
    } else {
      const TIn* e = reinterpret_cast<const TIn*>(&raw);
      return make_float4(to_float(e[0]), to_float(e[1]), to_float(e[2]), to_float(e[3]));
    }
  }
};

// A part's gated 16-bit values out (packed[qq][k]: this thread's pairs of 8x8 block q = 2 qq + k / 2, rows of
// half k % 2, as the accumulators hold them): each block into the warpgroup's scratch `buf` transposed
// (stmatrix.trans: row = h, 8 positions), its 16-byte chunk XOR-swizzled by h % 8 (TMA's 128-byte swizzle,
// `buf` 1024-byte aligned), then the part's box of 32 h x 64 positions at (batch, h0, p0) of `ab` (a_t or
// b_t: [batch][hidden][plane]) out, h0 + h < hidden and positions < p0 + in_plane only: with `map` (ab's
// tensor map, whose edges clip the rest) by one TMA store that the warpgroup's first thread issues, else as
// 128-byte runs that the warpgroup stores itself.
template <typename Op>
__device__ __forceinline__ void store_part(uint8_t* buf, const uint32_t (&packed)[2][4], const CUtensorMap* map,
                                           Op* ab, int64_t plane, int64_t batch, int64_t h0, int64_t p0,
                                           int64_t hidden, int in_plane) {
  const int lane = threadIdx.x & 31, warp4 = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  const int k = lane >> 3, i = lane & 7;  // (lane 8k + i: row i of block k)
#pragma unroll
  for (int qq = 0; qq < 2; ++qq) {
    const int q = 2 * qq + (k >> 1), hf = k & 1;
    stmatrix_x4<true>(smem_u32(buf) + (8 * q + i) * (2 * kPositions) + (((2 * warp4 + hf) ^ i) << 4), packed[qq][0],
                      packed[qq][1], packed[qq][2], packed[qq][3]);
  }
  if (map != nullptr) {
    fence_proxy_async();  // (the TMA engine reads `buf` through the async proxy)
    // The previous part's box has left the other buffer (which the next part writes) once this barrier passes.
    if (tid == 0) bulk_wait_read<0>();
    named_barrier(1 + (threadIdx.x >> 7), 128);
    if (tid == 0) {
      tma_store(map, buf, static_cast<int>(p0), static_cast<int>(h0), static_cast<int>(batch));
      bulk_commit();
    }
    return;
  }
  named_barrier(1 + (threadIdx.x >> 7), 128);  // the warpgroup's blocks are in the scratch
  Op* out = ab + (batch * hidden + h0) * plane + p0;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int h = 16 * it + (tid >> 3), c = tid & 7;
    const uint4 v = *reinterpret_cast<const uint4*>(buf + h * (2 * kPositions) + ((c ^ (h & 7)) << 4));
    if (h0 + h < hidden && 8 * c < in_plane) *reinterpret_cast<uint4*>(out + h * plane + 8 * c) = v;
  }
  // (no barrier after the reads: the next part writes the other buffer, and the one after it passes the next
  // part's barrier first, which every thread reaches after these reads)
}

// A register-row kernel's a_t / b_t maps for store_part (boxes of 32 h x 64 positions); false (the
// warpgroups store themselves) where TRIMUL_AB_STORE=threads or the driver refuses them.
template <typename Op>
bool encode_ab_maps(const ForwardArgs& args, CUtensorMap* map_a, CUtensorMap* map_b) {
  const int64_t plane = args.n * args.ld;
  return args.ab_store_tma && plane < (int64_t(1) << 31) && args.batch < (int64_t(1) << 31) &&
         encode_kmajor_map<Op>(map_a, args.a_t, args.batch, args.h, plane, 32) &&
         encode_kmajor_map<Op>(map_b, args.b_t, args.batch, args.h, plane, 32);
}

// Whether a register-row kernel for rows of `c` channels takes these sizes: sm_90a on Hopper, rows of exactly
// c channels in 16-byte vectors, the prepared weights (ForwardArgs::w_in_rows), H <= 128 (rows_ab <= 256) and
// the kernel's `smem` bytes of shared memory.
template <typename TIn>
bool takes_rows(const ForwardArgs& args, int c, int64_t smem) {
  return tensor_map_encoder() != nullptr && args.c == c && args.c_pad == c && args.w_in_rows != nullptr &&
         rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair) &&
         args.rows_ab <= 2 * kChunkRows && smem <= max_smem_optin();
}

// Launches a register-row kernel instance (both kernels' signature) on `blocks` blocks with `bytes` of shared
// memory: the prepared weights' map (rows of c_pad + 64 columns, 128-row boxes) and the a_t / b_t maps.
template <auto Kernel, typename Op>
cudaError_t launch_kernel(const ForwardArgs& args, int64_t blocks, int64_t bytes, int64_t tiles_per_batch) {
  CUtensorMap map_w, map_a, map_b;
  if (!encode_kmajor_map<Op>(&map_w, args.w_in_rows, 0, 2 * args.rows_ab, args.c_pad + 64, kChunkRows))
    return cudaErrorNotSupported;
  const bool tma_store = encode_ab_maps<Op>(args, &map_a, &map_b);
  const cudaError_t status = allow_smem<Kernel>(bytes);
  if (status != cudaSuccess) return status;
  Kernel<<<static_cast<unsigned>(blocks), kThreads, bytes, args.stream>>>(args, map_w, map_a, map_b, tma_store,
                                                                          tiles_per_batch);
  return cudaGetLastError();
}

// A register-row kernel's resident weights by TMA, issued by thread 0: tile i (of `tiles`, kStageBytes each) is
// k-tile i % k_tiles of the 128-row chunk i / k_tiles of the map's rows from row_base, on barrier full[i]
// (initialised here; the block syncs once between the initialisation and the loads).
__device__ __forceinline__ void load_resident_weights(uint8_t* weights, uint64_t* full, int tiles, int k_tiles,
                                                      const CUtensorMap* map, int row_base) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < tiles; ++i) mbar_init(&full[i], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < tiles; ++i) {
      mbar_expect_tx(&full[i], kStageBytes);
      tma_load_2d(weights + i * kStageBytes, map, (i % k_tiles) * (kKBytes / 2), row_base + (i / k_tiles) * kChunkRows,
                  &full[i]);
    }
}

// A tile's kParts (even) N = 64 parts, two accumulator sets in turn: part p + 1's products are issued before
// part p's stores, so the products' latency hides under the epilogue. multiply(part, acc) issues and commits
// a part's wgmmas, store(part, acc) takes its finished accumulators. (kParts a template argument, the loop
// unrolled: with a runtime count the last round's branch merged two definitions of acc0 by register moves
// while a wgmma wrote it, and ptxas serialized every wgmma.)
template <int kParts, class Multiply, class Store>
__device__ __forceinline__ void multiply_and_store_parts(Multiply&& multiply, Store&& store) {
  static_assert(kParts % 2 == 0, "parts in pairs");
  float acc0[32], acc1[32];
  multiply(0, acc0);
#pragma unroll
  for (int part = 0; part < kParts; part += 2) {
    multiply(part + 1, acc1);
    wgmma_wait<1>();
    fence_accumulators(acc0);
    store(part, acc0);
    if (part + 2 < kParts) {
      multiply(part + 2, acc0);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    fence_accumulators(acc1);
    store(part + 1, acc1);
  }
}

// kChunks: 128-row weight chunks, 2 * rows_ab / 128 (2 or 4: H <= 64, 128). TIn: the pair rows' type.
template <Mode M, int kChunks, typename TIn>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_a,
           const __grid_constant__ CUtensorMap map_b, bool tma_store, int64_t tiles_per_batch) {
  allow_dependent_launch();
  using Op = op_t<M>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* weights = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  constexpr int w_tiles = kChunks * kKTiles;
  uint8_t* scratch_all = weights + w_tiles * kStageBytes;
  uint64_t* w_full = reinterpret_cast<uint64_t*>(scratch_all + kGroups * kScratchBytes);
  load_resident_weights(weights, w_full, w_tiles, kKTiles, &map_w, 0);

  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3;
  uint8_t* scratch = scratch_all + group * kScratchBytes;
  const int64_t tiles = args.batch * tiles_per_batch, plane = args.n * args.ld;
  const int64_t stride = int64_t(gridDim.x) * kGroups;
  const TIn* pair = static_cast<const TIn*>(args.pair);
  using Four = FourChannels<TIn>;
  // This thread's rows of a tile: positions 16 warp4 + lane / 4 and 8 further (its rows of the wgmma's
  // A fragment); of each, channels 16 s + 4 t .. + 3 for k-step s. half_scale: mask / 2 (gated_16bit_half).
  const int row0 = 16 * warp4 + (lane >> 2);
  const auto load_rows = [&](int64_t tile, typename Four::Raw (&rows)[2][kSteps], float (&half_scale)[2]) {
    int64_t off[2] = {-1, -1};
    half_scale[0] = half_scale[1] = 0.f;
    if (tile < tiles) {
      const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mask;
        locate_position(args, batch, p0 + row0 + 8 * hf, plane, off[hf], mask);
        half_scale[hf] = 0.5f * mask;
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        rows[hf][s] = off[hf] >= 0 ? Four::load(pair + off[hf] + 16 * s + 4 * t) : typename Four::Raw{};
  };

  int64_t tile = int64_t(blockIdx.x) * kGroups + group;
  typename Four::Raw raw[2][kSteps];
  float next_scale[2];
  load_rows(tile, raw, next_scale);
  for (int i = 0; i < w_tiles; ++i) mbar_wait(&w_full[i], 0);
  int parity = 0;  // the scratch buffer the next part writes
  // The bias k-step's A fragment: ones at k = kC, kC + 1 (lane t = 0 of each quad, both rows), zeros elsewhere.
  const uint32_t one_pair = t == 0 ? pack_pair<Op>(1.f, 1.f) : 0u;
  const uint32_t ones[4] = {one_pair, one_pair, 0u, 0u};
  for (; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
    const int in_plane = static_cast<int>(std::min<int64_t>(plane - p0, kPositions));  // (a multiple of 32)
    // LayerNorm (shifted by the row's first value, as VecRowStager does) into the A fragments: k-step s
    // holds channels 16 s + 4 t + {0, 1} (frag[s][hf]) and + {2, 3} (frag[s][2 + hf]) of row hf.
    uint32_t frag[kSteps][4];
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
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const float4 v = x[s];
        frag[s][hf] = pack_pair<Op>(fmaf(v.x, rstd, centre), fmaf(v.y, rstd, centre));
        frag[s][2 + hf] = pack_pair<Op>(fmaf(v.z, rstd, centre), fmaf(v.w, rstd, centre));
      }
    }
    const float half_scale[2] = {next_scale[0], next_scale[1]};
    load_rows(tile + stride, raw, next_scale);  // in flight while this tile multiplies and stores

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
      store_part(buf, packed, tma_store ? (second ? &map_b : &map_a) : nullptr,
                 static_cast<Op*>(second ? args.b_t : args.a_t), plane, batch, h0, p0, args.h, in_plane);
    };
    multiply_and_store_parts<parts>(multiply, store);
  }
  if (tma_store && (threadIdx.x & 127) == 0) bulk_wait<0>();  // (the boxes written before the block retires)
}

// Whether it takes these sizes: a 16-bit mode and takes_rows at pair_dim 128 with all the weights resident.
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  if constexpr (M == Mode::bf16 || M == Mode::f16) return takes_rows<TIn>(args, kC, smem_bytes(args.rows_ab));
  return false;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  const int64_t tiles_per_batch = ceil_div(args.n * args.ld, kPositions);
  const int64_t blocks = std::min<int64_t>(sm_count(), ceil_div(args.batch * tiles_per_batch, kGroups));
  const int64_t bytes = smem_bytes(args.rows_ab);
  switch (2 * args.rows_ab / kChunkRows) {  // (the weights' 128-row chunks, a's and b's)
    case 2: return launch_kernel<kernel<M, 2, TIn>, op_t<M>>(args, blocks, bytes, tiles_per_batch);
    case 4: return launch_kernel<kernel<M, 4, TIn>, op_t<M>>(args, blocks, bytes, tiles_per_batch);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace wgmma_rs

// ---- The rows in registers at pair_dim 384 (sm_90a): wgmma_rs_wide ----------------------------------
// wgmma_rs's pattern where all of w_in (384 KB at H = 128) does not fit in shared memory: each block keeps
// one side's rows resident (a's or b's half of ForwardArgs::w_in_rows, 192 KB at H = 128), and blocks 2i and
// 2i + 1 (one per side) walk the same tiles, so a pair row one of them reads is an L2 hit for the other.
// A thread's 96 channels of a row are in registers at once, so the LayerNorm is exact two-pass (the mean by
// quad shuffles, then the centred squares); the fragments hold bf16 / fp16 (x - mean), whose rounding is
// relative to the row's spread as a normalized value's would be, and rstd and the biases (w_in_rows'
// columns c_pad, c_pad + 1: no bias k-step here, its tiles would not fit) apply in the epilogue.
// First in the default order where it applies (NOTES v28).
namespace wgmma_rs_wide {

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

// kChunks: 128-row weight chunks per side, rows_ab / 128 (1 or 2: H <= 64, 128). TIn: the pair rows' type.
template <Mode M, int kChunks, typename TIn>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_a,
           const __grid_constant__ CUtensorMap map_b, bool tma_store, int64_t tiles_per_batch) {
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
    const int in_plane = static_cast<int>(std::min<int64_t>(plane - p0, kPositions));  // (a multiple of 32)
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
      wgmma_rs::store_part(buf, packed, tma_store ? (side ? &map_b : &map_a) : nullptr,
                           static_cast<Op*>(side ? args.b_t : args.a_t), plane, batch, int64_t(part) * 32, p0, args.h,
                           in_plane);
    };
    wgmma_rs::multiply_and_store_parts<parts>(multiply, store);
  }
  if (tma_store && (threadIdx.x & 127) == 0) bulk_wait<0>();  // (the boxes written before the block retires)
}

// Whether it takes these sizes: a 16-bit mode and takes_rows at pair_dim 384 with one side's weights
// resident, and an even grid.
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  if constexpr (M == Mode::bf16 || M == Mode::f16)
    return wgmma_rs::takes_rows<TIn>(args, kC, smem_bytes(args.rows_ab)) && sm_count() >= 2;
  return false;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  const int64_t tiles_per_batch = ceil_div(args.n * args.ld, kPositions);
  const int64_t pairs = std::min<int64_t>(sm_count() / 2, ceil_div(args.batch * tiles_per_batch, kGroups));
  const int64_t bytes = smem_bytes(args.rows_ab);
  switch (args.rows_ab / kChunkRows) {  // (one side's 128-row chunks)
    case 1: return wgmma_rs::launch_kernel<kernel<M, 1, TIn>, op_t<M>>(args, 2 * pairs, bytes, tiles_per_batch);
    case 2: return wgmma_rs::launch_kernel<kernel<M, 2, TIn>, op_t<M>>(args, 2 * pairs, bytes, tiles_per_batch);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace wgmma_rs_wide

// The tiling this pass uses for these sizes and its shared memory; {false, 0} if none fits.
template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  return choose_tiling(Smem<M, Wide>::bytes(args.c_pad), Smem<M, Narrow>::bytes(args.c_pad),
                      args.batch * ceil_div(args.n * args.ld, Wide::BM));
}

// Which kernel takes the pass: wgmma_rs, wgmma, then resident, then streamed, the first that applies; with
// TRIMUL_INPUT_PASS set, only the one it names where that applies (ForwardArgs::input_pin).
template <Mode M, typename TIn>
cudaError_t launch_mode(const ForwardArgs& args) {
  const char* pinned = args.input_pin;
  if constexpr (M == Mode::bf16 || M == Mode::f16) {
    if (pin_allows(pinned, "wgmma_rs") && wgmma_rs::applicable<M, TIn>(args)) {
      const cudaError_t status = wgmma_rs::launch<M, TIn>(args);
      if (status != cudaErrorNotSupported) return status;  // else another kernel takes it
    }
    // (at pair_dim 384 1-3% faster than the wgmma kernel, NOTES v28)
    if (pin_allows(pinned, "wgmma_rs_wide") && wgmma_rs_wide::applicable<M, TIn>(args)) {
      const cudaError_t status = wgmma_rs_wide::launch<M, TIn>(args);
      if (status != cudaErrorNotSupported) return status;  // else another kernel takes it
    }
  }
  if (pin_allows(pinned, "wgmma")) {
    const cudaError_t status = wgmma_tiles::plan_and_launch<M, TIn>(args);
    if (status != cudaErrorNotSupported) return status;  // else another kernel takes it
  }
  if constexpr (M == Mode::bf16 || M == Mode::f16) {
    if (pin_allows(pinned, "resident"))
      if (const int64_t bytes = resident::applicable<M>(args)) return resident::launch<M, TIn>(args, bytes);
  }
  return launch_chosen<kernel<M, TIn, Wide>, Wide, kernel<M, TIn, Narrow>, Narrow>(args, choose<M>(args), args.n * args.ld);
}

}  // namespace input_pass

int64_t input_pass_smem(const ForwardArgs& args) {
  return fused::chosen_bytes(args, [&](auto mode) {
    constexpr Mode M = decltype(mode)::value;
    if (const int64_t bytes = input_pass::resident::applicable<M>(args)) return std::pair<bool, int64_t>{false, bytes};
    // (the wgmma kernel may take the pass instead; the streamed kernel's smem is what must fit)
    return input_pass::choose<M>(args);
  });
}

cudaError_t launch_input_pass(const ForwardArgs& args) {
  if (args.batch == 0 || args.n == 0) return cudaSuccess;
  if (args.rows_ab % input_pass::Wide::BN != 0 || args.ld % 32 != 0) return cudaErrorInvalidValue;
  if (args.n * args.ld + input_pass::Wide::BM >= (int64_t(1) << 32)) return cudaErrorNotSupported;
  return fused::dispatch_pass(args, [&](auto mode, auto pair) -> cudaError_t {
    return input_pass::launch_mode<decltype(mode)::value, typename decltype(pair)::type>(args);
  });
}

}  // namespace trimul
