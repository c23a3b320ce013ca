// resident — mma.sync with all proj/gate weights resident in shared memory, warp pairs on their own
// 32-position tiles; 16-bit operands, pair_dim and hidden <= 128.
#include "input_pass.cuh"

namespace trimul {
namespace input_pass {

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

// Bytes of shared memory if this pass runs resident for these sizes, else 0: 16-bit operands, pair_dim
// <= 128, the weights in shared memory, and tiles enough to keep every pair of warps busy.
template <Mode M>
int64_t smem(const ForwardArgs& args) {
  if (args.c_pad * static_cast<int64_t>(sizeof(op_t<M>)) > kMaxSlabs * kSlabBytes) return 0;
  return persistent_bytes(args.batch * ceil_div(args.n * args.ld, kRows), kPairs, bytes<M>(args));
}

template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return smem<M>(args) != 0;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  return launch_persistent<kernel<M, TIn>>(args, args.n * args.ld, kRows, kPairs, kThreads, smem<M>(args));
}

}  // namespace resident
}  // namespace input_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS(input, resident, trimul::input_pass::resident, trimul::fused::k16BitModes);
