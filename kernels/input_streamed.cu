// streamed — mma.sync; a tile's LayerNorm-ed rows stay in shared memory while the grouped proj/gate
// weights stream past in chunks (cp.async pipeline); any precision (3xTF32 at "highest").
#include "input_pass.cuh"

namespace trimul {
namespace input_pass {
namespace streamed {

// Pair rows stay resident (LayerNorm-ed) while the grouped proj/gate weights stream past in chunks
// of BN rows (BN/2 hidden channels). The weights are the mma's A operand, so each thread's
// accumulators hold (proj, gate) of one h at two adjacent positions: the gated pair goes straight
// to a_t / b_t as one 4- or 8-byte store, with no shared-memory staging or copy-out.
using Tiles128 = SwappedTiling<2, 4, 4, 4>;  // 128 positions, 128 weight rows (64 h) per chunk
using Tiles64 = SwappedTiling<4, 2, 2, 4>;   // 64 positions: for small problems and wide pair_dim

template <Mode M, class T>
struct Smem {
  static int64_t bytes(int64_t c_pad) {
    return int64_t(T::BM) * resident_stride<M>(c_pad) * 4 + int64_t(kStages) * T::BN * kSlabStride * 4 + T::BM * 4 +
           T::BM * 8;
  }
};

// A block owns BM consecutive positions p of one batch's flattened [N, ld] operand plane
// (f = p / ld, k = p % ld), so each h row of its output is one contiguous run of a_t / b_t and
// small N packs several f rows into a tile instead of padding one out to BM.
// Two blocks per multiprocessor (one stages while the other multiplies): <= 128 registers.
template <Mode M, typename TIn, class T>
__global__ void __launch_bounds__(T::kThreads, 2) kernel(const ForwardArgs args, int64_t p_tiles) {
  allow_dependent_launch();
  using Op = op_t<M>;
  constexpr bool kRounded = M == Mode::high;  // operands written as TF32 values already
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
    const float ab_up = (M == Mode::high || M == Mode::highest) && args.ab_f16 ? args.f16x3_scales[kAbUp] : 0.f;
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
        if constexpr (M == Mode::high || M == Mode::highest)
          store_contraction_pair<M>(out_base, dst - static_cast<Op*>(out_base), v0, v1, args.small_offset, ab_up);
        else
          store_operand_pair<M>(dst, v0, v1, args.small_offset);
      }
    }
  }
  stream.drain();
}

// The tiling this pass uses for these sizes and its shared memory; {false, 0} if none fits.
template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  return choose_tiling(Smem<M, Tiles128>::bytes(args.c_pad), Smem<M, Tiles64>::bytes(args.c_pad),
                      args.batch * ceil_div(args.n * args.ld, Tiles128::BM));
}

// Any mode, any sizes whose tile fits in shared memory.
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return choose<M>(args).second != 0;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  return launch_chosen<kernel<M, TIn, Tiles128>, Tiles128, kernel<M, TIn, Tiles64>, Tiles64>(args, choose<M>(args),
                                                                                            args.n * args.ld);
}

}  // namespace streamed
}  // namespace input_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS(input, streamed, trimul::input_pass::streamed, trimul::fused::kAllModes);
