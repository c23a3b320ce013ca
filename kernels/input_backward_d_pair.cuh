// input_backward_d_pair.cuh — wgmma_rs's d_pair from d proj: d x_hat = d proj W_in_f (+ d gate W_gate_f, the gate
// on the normalized input) on the tensor cores, LayerNorm_in's backward on the accumulators; d x_hat is never
// written. The rows kernel's d_pair reads d x_hat [P, C] in fp32, which a cuBLAS GEMM wrote and a second one
// (the gate's share, in place) read and wrote again: most of those three steps' bytes. Here each
// warpgroup takes 64-position tiles: the d proj row tile (then d gate's) arrives by TMA in 64-column boxes,
// kStages in flight, and meets the resident weights as wgmma's A and B from shared memory (both K-major, 128-byte
// swizzle); the weights, [W_in_f; W_gate_f] transposed into C rows of 4H (+ C) bf16, are laid out by each block
// from the fp32 parameters (no host-side preparation). The pair rows of the tile are read into registers while
// the tile multiplies; the statistics are recomputed from them in fp32 and each row's means come from quad
// shuffles over the accumulators' layout (a row's 128 channels live in four lanes). d pair leaves in pair's dtype.
// The tile loop is backward_wgmma_rows.cuh's (shared with output_backward wgmma's dz_planes).
#pragma once
#include "backward_wgmma_rows.cuh"

namespace trimul {
namespace backward {
namespace d_pair_mma {

using namespace ::trimul::backward::wgmma_rows;
constexpr int kC = kN;  // the pair_dim it takes: the product's columns, a whole row per accumulator row

// 128-byte k-tiles of the product: d proj's 4H columns, then d gate's C.
inline int k_tiles(int64_t h, bool gate) { return static_cast<int>((4 * h + (gate ? kC : 0)) / kKCols); }

// LayerNorm_in's backward on a tile's d x_hat accumulators: the pair rows load in begin() (while the tile
// multiplies), the statistics are recomputed from them in fp32 (two passes, as the rows kernel's), and d pair =
// rstd (d x_hat - mean(d x_hat) - x_hat mean(d x_hat x_hat)) (+ the raw gate's share) leaves in pair's dtype.
template <typename TPair>
struct PairEpilogue {
  using Pair2 = Pack<2, TPair>;
  const BackwardArgs& args;
  int64_t positions;
  int64_t row[2];
  Pair2 x_raw[2][16];

  __device__ __forceinline__ int t() const { return threadIdx.x & 3; }

  __device__ __forceinline__ void begin(int64_t, int64_t p0) {
    const int lane = threadIdx.x & 31, warp4 = (threadIdx.x >> 5) & 3;
    const TPair* pair = static_cast<const TPair*>(args.pair);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      row[hf] = p0 + 16 * warp4 + (lane >> 2) + 8 * hf;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (row[hf] < positions) x_raw[hf][j] = *reinterpret_cast<const Pair2*>(pair + row[hf] * kC + 8 * j + 2 * t());
    }
  }

  __device__ __forceinline__ void end(int64_t, int64_t, const float (&acc)[64]) {
    constexpr float inv_c = 1.f / kC;
    TPair* d_pair = static_cast<TPair*>(args.d_pair);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const bool valid = row[hf] < positions;
      float x[32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        x[2 * j] = valid ? to_float(x_raw[hf][j].x[0]) : 0.f;
        x[2 * j + 1] = valid ? to_float(x_raw[hf][j].x[1]) : 0.f;
      }
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) sum += x[i];
      const float mean = quad_sum(sum) * inv_c;
      float squares = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) squares += (x[i] - mean) * (x[i] - mean);
      const float rstd = rsqrtf(quad_sum(squares) * inv_c + args.eps);
      float mean_d, mean_dot;
      row_grad_means<false>(acc, hf, x, mean, rstd, &mean_d, &mean_dot);
      if (!valid) continue;
      const float* add = args.d_rows_add != nullptr ? args.d_rows_add + row[hf] * kC : nullptr;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int c = 8 * j + 2 * t();
        const float2 extra = add != nullptr ? *reinterpret_cast<const float2*>(add + c) : make_float2(0.f, 0.f);
        float out[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          out[e] = rstd * (acc[4 * j + 2 * hf + e] - mean_d - (x[2 * j + e] - mean) * rstd * mean_dot) +
                   (e ? extra.y : extra.x);
        store_pack<2>(d_pair + row[hf] * kC + c, out);
      }
    }
  }
};

template <typename TPair>
__global__ void __launch_bounds__(kBlockThreads, 1)
    kernel(const BackwardArgs args, const __grid_constant__ CUtensorMap map_proj,
           const __grid_constant__ CUtensorMap map_gate, const Sources w, int64_t batches, int64_t plane) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  PairEpilogue<TPair> epilogue{args, plane};
  run_tiles(smem, &map_proj, &map_gate, w, batches, plane, epilogue);
}

// Whether it takes d_pair's sizes: bf16 operands, rows of 128 channels, 4H whole k-tiles (H a multiple of 16), the
// weights with the gate's (the larger case) and the rings in shared memory, positions TMA can address.
bool takes(const BackwardArgs& args) {
  const int64_t positions = ::trimul::positions(args);
  return args.operand == Dtype::bf16 && args.c == kC && args.h % 16 == 0 && args.h > 0 &&
         tensor_map_encoder() != nullptr && positions < (int64_t(1) << 31) &&
         smem_bytes(k_tiles(args.h, true), 0) <= max_smem_optin();
}

cudaError_t launch(const BackwardArgs& args) {
  const auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool gate = args.d_gate != nullptr;
  if (!takes(args) || args.rows == nullptr || args.w_in_f == nullptr || args.pair == nullptr ||
      args.d_pair == nullptr || gate != (args.w_gate_f != nullptr) || !aligned(args.rows) || !aligned(args.d_gate) ||
      !aligned(args.pair) || !aligned(args.d_pair) || !aligned(args.d_rows_add))
    return cudaErrorInvalidValue;
  const Sources w{k_tiles(args.h, gate), static_cast<int>(4 * args.h / kKCols), args.w_in_f, args.w_gate_f};
  const int64_t positions = ::trimul::positions(args);
  if (positions == 0) return cudaSuccess;
  CUtensorMap map_proj, map_gate;
  if (!encode_rows_map(&map_proj, args.rows, positions, 4 * args.h) ||
      !encode_rows_map(&map_gate, gate ? args.d_gate : args.rows, positions, gate ? kC : 4 * args.h))
    return cudaErrorNotSupported;
  // (the positions as one run: a tile's rows are position rows wherever they fall)
  return dispatch_out(args.pair_dtype, [&](auto pair) {
    return wgmma_rows::launch<kernel<typename decltype(pair)::type>>(args, map_proj, map_gate, w, 1, positions, 0);
  });
}

}  // namespace d_pair_mma
}  // namespace backward
}  // namespace trimul
