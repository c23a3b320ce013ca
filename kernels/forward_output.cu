// output pass — LayerNorm_out over h of the contraction result (fp32 statistics), out_proj + bias,
// the output gate sigmoid(out_gate(pair or LayerNorm_in(pair))) and their product, written once in
// the input dtype.
#include "fused.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;

// A block owns BM pairs (b, i, j0..j0+BM) of one output row. Both A operands stay resident:
// LayerNorm_out(z) [BM, H] and the gate source [BM, C]; out_gate and out_proj weights stream past
// in chunks of BN output channels, each chunk's two products held in registers together.
using Wide = Tiling<4, 2, 2, 4>;    // BM 128, BN 64
using Narrow = Tiling<2, 4, 2, 2>;  // BM 64, BN 64: fp32 operands with a wide pair_dim

template <Mode M, class T>
struct Smem {
  static constexpr int kParts = T::kThreads / T::BM;  // threads sharing one pair's h-reduction
  static int64_t bytes(int64_t c_pad, int64_t h_pad) {
    const int64_t x_region = std::max<int64_t>(int64_t(T::BM) * resident_stride<M>(c_pad) * 4,
                                               h_pad * T::BM * 4);  // raw z rows share it
    return int64_t(T::BM) * resident_stride<M>(h_pad) * 4 + x_region +
           int64_t(kStages) * T::BN * kSlabStride * 4 + 2 * kParts * T::BM * 4 + T::BM * 8;
  }
};

template <Mode M, typename TIn, class T>
__global__ void __launch_bounds__(T::kThreads) kernel(const ForwardArgs args, int64_t j_tiles) {
  constexpr int kParts = Smem<M, T>::kParts;
  extern __shared__ __align__(16) uint32_t smem[];
  const int z_stride = resident_stride<M>(args.h_pad), x_stride = resident_stride<M>(args.c_pad);
  uint32_t* z_res = smem;
  uint32_t* x_res = z_res + T::BM * z_stride;
  const int64_t x_region_words = std::max<int64_t>(int64_t(T::BM) * x_stride, args.h_pad * T::BM);
  uint32_t* stages = x_res + x_region_words;
  float* partial = reinterpret_cast<float*>(stages + kStages * T::BN * kSlabStride);
  int64_t* row_off = reinterpret_cast<int64_t*>(partial + 2 * kParts * T::BM);

  const int64_t n = args.n, hidden = args.h;
  const int64_t tile = blockIdx.x;
  const int64_t j0 = (tile % j_tiles) * T::BM;
  const int64_t i = (tile / j_tiles) % n;
  const int64_t batch = tile / (j_tiles * n);

  // z rows [H][BM] for this tile arrive by cp.async into the region x_res takes later, so all
  // loads are in flight at once; LayerNorm_out then runs over h for each pair (column m),
  // reduced across kParts threads, and writes its operand rows with vector stores.
  float* z_raw = reinterpret_cast<float*>(x_res);
  {
    const float* z_rows = static_cast<const float*>(args.z) + (batch * hidden * n + i) * args.ldz + j0;
    const int64_t h_step = n * args.ldz;
    constexpr int kQuads = T::BM / 4;
    for (int q = threadIdx.x; q < hidden * kQuads; q += T::kThreads) {
      const int h = q / kQuads, quad = q % kQuads;
      const bool ok = j0 + quad * 4 < n;
      cp_async16(z_raw + h * T::BM + quad * 4, ok ? z_rows + h * h_step + quad * 4 : z_rows, ok);
    }
    cp_async_commit();
    if (threadIdx.x < T::BM) {
      const int64_t j = j0 + threadIdx.x;
      row_off[threadIdx.x] = j < n ? batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : -1;
    }
    cp_async_wait<0>();
    __syncthreads();

    constexpr int V = 16 / sizeof(op_t<M>);  // h values per operand vector store
    const int m = threadIdx.x % T::BM, part = threadIdx.x / T::BM;
    const bool valid = j0 + m < n;
    const float shift = valid ? z_raw[m] : 0.f;
    float sum = 0.f, sum_sq = 0.f;
    for (int h0 = part * V; h0 < hidden; h0 += kParts * V)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = h0 + e < hidden ? z_raw[(h0 + e) * T::BM + m] - shift : 0.f;
        sum += d;
        sum_sq += d * d;
      }
    partial[part * T::BM + m] = sum;
    partial[(kParts + part) * T::BM + m] = sum_sq;
    __syncthreads();
    sum = 0.f;
    sum_sq = 0.f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      sum += partial[p * T::BM + m];
      sum_sq += partial[(kParts + p) * T::BM + m];
    }
    const float2 stats = shifted_stats(shift, sum, sum_sq, static_cast<int>(hidden), args.eps_out);
    uint32_t* dst = z_res + m * z_stride;
    for (int h0 = part * V; h0 < args.h_pad; h0 += kParts * V) {
      float y[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int h = h0 + e;
        y[e] = (valid && h < hidden)
                   ? (z_raw[h * T::BM + m] - stats.x) * stats.y * args.ln_out_w[h] + args.ln_out_b[h]
                   : 0.f;
      }
      store_operands<M, V>(dst, h0, y);
    }
    __syncthreads();  // z_raw is about to become x_res
  }
  stage_rows<M, TIn, T::kWarps>(rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair),
                                x_res, x_stride, static_cast<const TIn*>(args.pair), row_off, T::BM,
                                static_cast<int>(args.c), static_cast<int>(args.c_pad),
                                args.gate_normalized ? args.ln_in_w : nullptr, args.ln_in_b, args.eps_in);
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN, g = lane >> 2, t = lane & 3;
  const int64_t c_ld = args.c_pad * static_cast<int64_t>(sizeof(op_t<M>));
  const int64_t h_ld = args.h_pad * static_cast<int64_t>(sizeof(op_t<M>));
  const bool paired = (args.c % 2) == 0;
  TIn* out = static_cast<TIn*>(args.out);
  for (int64_t c0 = 0; c0 < args.c; c0 += T::BN) {
    float gate[T::MT][T::NT][4], proj[T::MT][T::NT][4];
    gemm_resident_a<M, T>(gate, x_res, x_stride, static_cast<const char*>(args.w_gate) + c0 * c_ld, c_ld,
                          static_cast<int>(c_ld / kSlabBytes), stages);
    gemm_resident_a<M, T>(proj, z_res, z_stride, static_cast<const char*>(args.w_out) + c0 * h_ld, h_ld,
                          static_cast<int>(h_ld / kSlabBytes), stages);
#pragma unroll
    for (int mi = 0; mi < T::MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = wm * T::MT * 16 + mi * 16 + g + hh * 8;
        if (j0 + m >= n) continue;
        TIn* row = out + ((batch * n + i) * n + j0 + m) * args.c;
#pragma unroll
        for (int ni = 0; ni < T::NT; ++ni) {
          const int64_t c = c0 + wn * T::NT * 8 + ni * 8 + 2 * t;
          if (c >= args.c) continue;
          const bool both = c + 1 < args.c;
          const float v0 = sigmoid(gate[mi][ni][2 * hh] + args.b_gate[c]) * (proj[mi][ni][2 * hh] + args.b_out[c]);
          const float v1 = both ? sigmoid(gate[mi][ni][2 * hh + 1] + args.b_gate[c + 1]) *
                                      (proj[mi][ni][2 * hh + 1] + args.b_out[c + 1])
                                : 0.f;
          store_pair(row + c, v0, v1, both, paired);
        }
      }
  }
}

template <Mode M, typename TIn, class T>
cudaError_t launch_tiling(const ForwardArgs& args, int64_t smem_bytes) {
  auto fn = kernel<M, TIn, T>;
  const cudaError_t status = allow_smem<kernel<M, TIn, T>>(smem_bytes);
  if (status != cudaSuccess) return status;
  const int64_t j_tiles = ceil_div(args.n, T::BM);
  const int64_t blocks = args.batch * args.n * j_tiles;
  fn<<<static_cast<unsigned>(blocks), T::kThreads, smem_bytes, args.stream>>>(args, j_tiles);
  return cudaGetLastError();
}

template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  const int64_t limit = max_smem_optin();
  const int64_t wide = Smem<M, Wide>::bytes(args.c_pad, args.h_pad);
  const int64_t narrow = Smem<M, Narrow>::bytes(args.c_pad, args.h_pad);
  // Two blocks per multiprocessor overlap one block's staging with the other's products, which
  // beats the wide tile's weight reuse; so the wide tile only where two of them fit.
  if (2 * wide + 2048 <= max_smem_per_sm()) return {true, wide};
  if (narrow <= limit) return {false, narrow};
  if (wide <= limit) return {true, wide};
  return {false, 0};
}

template <Mode M, typename TIn>
cudaError_t launch_mode(const ForwardArgs& args) {
  const auto choice = choose<M>(args);
  if (choice.second == 0) return cudaErrorNotSupported;
  return choice.first ? launch_tiling<M, TIn, Wide>(args, choice.second)
                      : launch_tiling<M, TIn, Narrow>(args, choice.second);
}

}  // namespace output_pass

int64_t output_pass_smem(const ForwardArgs& args) {
  int64_t bytes = 0;
  mma::dispatch_mode(args.mode, [&](auto mode) {
    bytes = output_pass::choose<decltype(mode)::value>(args).second;
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_output_pass(const ForwardArgs& args) {
  if (args.batch == 0 || args.n == 0) return cudaSuccess;
  if (args.z_dtype != Dtype::f32) return cudaErrorInvalidValue;
  return mma::dispatch_mode(args.mode, [&](auto mode) -> cudaError_t {
    constexpr Mode M = decltype(mode)::value;
    switch (args.pair_dtype) {
      case Dtype::f32: return output_pass::launch_mode<M, float>(args);
      case Dtype::bf16:
        if constexpr (M == Mode::bf16) return output_pass::launch_mode<M, __nv_bfloat16>(args);
        break;
      case Dtype::f16:
        if constexpr (M == Mode::f16) return output_pass::launch_mode<M, __half>(args);
        break;
    }
    return cudaErrorNotSupported;
  });
}

}  // namespace trimul
