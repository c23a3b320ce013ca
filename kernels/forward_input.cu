// input pass — LayerNorm_in, the four gated projections and the mask in one read of pair_repr,
// writing a_t / b_t straight into the contraction's [B*H, N, ld] layout (both directions).
#include "fused.cuh"

namespace trimul {
namespace input_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;

// Pair rows stay resident (LayerNorm-ed) while the interleaved proj/gate weights stream past in
// chunks of BN columns (BN/2 hidden channels).
using Wide = Tiling<4, 2, 2, 8>;    // BM 128, BN 128
using Narrow = Tiling<2, 4, 2, 4>;  // BM 64, BN 128: for fp32 operands with a wide pair_dim

template <Mode M, class T>
struct Smem {
  static constexpr int kOutStride = T::BM + 16 / static_cast<int>(sizeof(op_t<M>));
  static int64_t bytes(int64_t c_pad) {
    return int64_t(T::BM) * resident_stride<M>(c_pad) * 4 + int64_t(kStages) * T::BN * kSlabStride * 4 +
           int64_t(T::BN / 2) * kOutStride * sizeof(op_t<M>) + T::BM * 4 + T::BM * 8;
  }
};

// A block owns BM consecutive positions p of one batch's flattened [N, ld] operand plane
// (f = p / ld, k = p % ld), so each h row of its output is one contiguous run of a_t / b_t and
// small N packs several f rows into a tile instead of padding one out to BM.
// Two blocks per multiprocessor (one stages while the other multiplies): <= 128 registers.
template <Mode M, typename TIn, class T>
__global__ void __launch_bounds__(T::kThreads, 2) kernel(const ForwardArgs args, int64_t p_tiles) {
  using Op = op_t<M>;
  constexpr bool kRounded = M == Mode::tf32;  // operands written as TF32 values already
  constexpr int kOutStride = Smem<M, T>::kOutStride;
  extern __shared__ __align__(16) uint32_t smem[];
  const int a_stride = resident_stride<M>(args.c_pad);
  uint32_t* a_res = smem;
  uint32_t* stages = a_res + T::BM * a_stride;
  Op* out_stage = reinterpret_cast<Op*>(stages + kStages * T::BN * kSlabStride);
  float* mask_v = reinterpret_cast<float*>(out_stage + (T::BN / 2) * kOutStride);
  int64_t* row_off = reinterpret_cast<int64_t*>(mask_v + T::BM);

  const int64_t n = args.n, plane = n * args.ld;
  const int64_t p0 = (blockIdx.x % p_tiles) * T::BM;
  const int64_t batch = blockIdx.x / p_tiles;

  // The weights' first slabs load while the rows are staged.
  const int64_t w_ld = args.c_pad * static_cast<int64_t>(sizeof(Op));
  const int k_slabs = static_cast<int>(w_ld / kSlabBytes);
  const int chunks = static_cast<int>(2 * args.rows_ab / T::BN);
  auto stream = make_slab_stream<T>(stages, chunks * k_slabs,
                                    ChunkedSlabs(static_cast<const char*>(args.w_in), w_ld, T::BN, k_slabs));
  stream.prime();

  for (int m = threadIdx.x; m < T::BM; m += T::kThreads) {
    // plane < 2^32 (checked at launch): 32-bit division is a fraction of a 64-bit one's cost.
    const int64_t p = p0 + m;
    const uint32_t f = static_cast<uint32_t>(p) / static_cast<uint32_t>(args.ld);
    const uint32_t k = static_cast<uint32_t>(p) - f * static_cast<uint32_t>(args.ld);
    const int64_t row = args.incoming ? k : f, col = args.incoming ? f : k;
    const bool valid = p < plane && k < n;
    row_off[m] = valid ? batch * args.pair_sb + row * args.pair_sr + col * args.pair_sc : -1;
    mask_v[m] = valid ? load_mask(args.mask, args.mask_kind,
                                  batch * args.mask_sb + row * args.mask_sr + col * args.mask_sc)
                      : 0.f;
  }
  __syncthreads();
  stage_rows<M, TIn, T::kWarps>(rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair),
                                a_res, a_stride, static_cast<const TIn*>(args.pair), row_off, T::BM,
                                static_cast<int>(args.c), static_cast<int>(args.c_pad), args.ln_in_w,
                                args.ln_in_b, args.eps_in);
  // (the stream's first next() synchronises before anyone reads a_res)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN, g = lane >> 2, t = lane & 3;
  const int chunks_per_half = chunks / 2;
  constexpr int kVec = 16 / sizeof(Op);
  constexpr int kVecsPerRow = T::BM / kVec;

  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int half = chunk / chunks_per_half;  // 0: a, 1: b
    const int64_t w_row0 = int64_t(chunk) * T::BN;
    float acc[T::MT][T::NT][4];
    gemm_streamed<M, T, kRounded>(acc, a_res, a_stride, k_slabs, stream);
    // Columns come in (proj, gate) pairs, so each thread holds both halves of its outputs. The
    // previous chunk's copy-out finished before this product's first slab synchronised. Mask
    // values are read into registers first: out_stage's stores would otherwise force a reload
    // of them (both live in shared memory) for every output.
#pragma unroll
    for (int mi = 0; mi < T::MT; ++mi) {
      const int m0 = wm * T::MT * 16 + mi * 16 + g;
      const float mask_lo = mask_v[m0], mask_hi = mask_v[m0 + 8];
#pragma unroll
      for (int ni = 0; ni < T::NT; ++ni) {
        const int col = wn * T::NT * 8 + ni * 8 + 2 * t;
        const float2 bias = *reinterpret_cast<const float2*>(args.b_in + w_row0 + col);  // (proj, gate)
        const float lo = (acc[mi][ni][0] + bias.x) * gate_sigmoid<M>(acc[mi][ni][1] + bias.y) * mask_lo;
        const float hi = (acc[mi][ni][2] + bias.x) * gate_sigmoid<M>(acc[mi][ni][3] + bias.y) * mask_hi;
        out_stage[(col / 2) * kOutStride + m0] = to_operand<M>(lo);
        out_stage[(col / 2) * kOutStride + m0 + 8] = to_operand<M>(hi);
      }
    }
    __syncthreads();
    // Positions with k in [n, ld) get zeros (their mask is 0): the contraction reads whole k-slabs.
    // Each thread copies one fixed 16-byte column v of out_stage down the rows r, so the
    // destination pointer only steps by one plane per row.
    constexpr int kRowsPerPass = T::kThreads / kVecsPerRow;
    static_assert(T::kThreads % kVecsPerRow == 0 && (T::BN / 2) % kRowsPerPass == 0, "copy-out covers the tile");
    const int v = threadIdx.x % kVecsPerRow, r0 = threadIdx.x / kVecsPerRow;
    const int64_t h0 = (w_row0 - half * args.rows_ab) / 2 + r0;
    const int64_t p = p0 + v * kVec;
    if (p < plane) {
      Op* dst = static_cast<Op*>(half ? args.b_t : args.a_t) + (batch * args.h + h0) * plane + p;
      const int64_t rows_left = args.h - (h0 - r0);  // rows r < this exist
      const int rows = rows_left < T::BN / 2 ? static_cast<int>(rows_left) : T::BN / 2;
#pragma unroll 4
      for (int r = r0; r < rows; r += kRowsPerPass, dst += kRowsPerPass * plane)
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out_stage + r * kOutStride + v * kVec);
    }
  }
  stream.drain();
}

// The tiling this pass uses for these sizes and its shared memory; {false, 0} if none fits.
template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  return choose_tiling(Smem<M, Wide>::bytes(args.c_pad), Smem<M, Narrow>::bytes(args.c_pad),
                      args.batch * ceil_div(args.n * args.ld, Wide::BM));
}

template <Mode M, typename TIn>
cudaError_t launch_mode(const ForwardArgs& args) {
  return launch_chosen<kernel<M, TIn, Wide>, Wide, kernel<M, TIn, Narrow>, Narrow>(args, choose<M>(args), args.n * args.ld);
}

}  // namespace input_pass

int64_t input_pass_smem(const ForwardArgs& args) {
  return fused::chosen_bytes(args, [&](auto mode) { return input_pass::choose<decltype(mode)::value>(args); });
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
