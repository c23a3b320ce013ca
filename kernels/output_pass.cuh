// output_pass.cuh — what the output-pass kernels share: LayerNorm_out over h of z (its affine folded
// into out_proj), out_proj and the output gate sigmoid(out_gate(pair or LayerNorm_in(pair))), the
// product written once in the input dtype.
#pragma once
#include "tma.cuh"

namespace trimul {
namespace output_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;

// Whether the register-row output kernels read the gate's rows in 16-byte vectors: ForwardArgs::gate_rows
// 16-byte aligned (bf16 rows of exactly c channels, read as a raw gate: gate_normalized false), else pair's rows
// (rows_vectorizable). Host side, for their applicable().
template <typename TIn>
inline bool gate_rows_vectorizable(const ForwardArgs& args) {
  if (args.gate_rows != nullptr)
    return reinterpret_cast<uintptr_t>(args.gate_rows) % 16 == 0 && !args.gate_normalized;
  return rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
}

// The register-row output kernels' z box: [128 h][64 positions] bf16 (its tensor map's box; the kernels' tile).
constexpr int kZBoxH = 128, kZBoxPositions = 64, kZBoxBytes = kZBoxH * kZBoxPositions * 2;

// Issues the TMA load of tile `at`'s z box (of batch at / tiles_per_batch) into z_tile, completing on barrier
// `full`; called by a warpgroup's first thread.
__device__ __forceinline__ void load_z_tile(uint8_t* z_tile, const CUtensorMap* map_z, uint64_t* full, int64_t at,
                                            int64_t tiles_per_batch) {
  const int64_t batch = at / tiles_per_batch;
  ::trimul::tma::mbar_expect_tx(full, kZBoxBytes);
  ::trimul::tma::tma_load_2d(z_tile, map_z, static_cast<int>((at - batch * tiles_per_batch) * kZBoxPositions),
                             static_cast<int>(batch * kZBoxH), full);
}

// The register-row output kernels' z (wgmma_rs, wgmma_rs_384): a warpgroup's [16 kSteps h][64 positions] bf16
// tile, landed by TMA with the 128-byte swizzle, as this thread's wgmma A fragments (rows: positions
// 16 warp4 + g and + 8; k: h). Block k of ldmatrix x4 = (h half k / 2, position half k % 2), so zf[s] = {row g
// h 16 s + 2 t .., row g + 8 the same, row g h + 8, row g + 8 h + 8}.
template <int kSteps>
__device__ __forceinline__ void z_fragments(uint32_t (&zf)[kSteps][4], const uint8_t* z_tile, int warp4, int lane) {
  const int k = lane >> 3, r = lane & 7, chunk = 2 * warp4 + (k & 1);
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int h = 16 * s + 8 * (k >> 1) + r;
    ::trimul::tma::ldmatrix_x4_trans(zf[s], ::trimul::tma::smem_u32(z_tile) + h * ::trimul::tma::ws::kKBytes +
                                                ((chunk ^ (h & 7)) << 4));
  }
}

// LayerNorm_out of the fragments' two positions over their 16 kSteps h (a quad holds a row's): the mean taken
// out of the fragments (bf16 z - mean), 1/std returned per row for the epilogue; kScaled: the fragments hold
// z_hat = (z - mean) / std itself, rounded once from fp32.
template <bool kScaled = false, int kSteps>
__device__ __forceinline__ void center_z_fragments(uint32_t (&zf)[kSteps][4], float (&z_rstd)[2], float eps) {
  constexpr float kInvH = 1.f / (16 * kSteps);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float2 v[kSteps][2];
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      v[s][0] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zf[s][hf]));
      v[s][1] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zf[s][2 + hf]));
      sum += (v[s][0].x + v[s][0].y) + (v[s][1].x + v[s][1].y);
    }
    const float mean = quad_sum(sum) * kInvH;
    float sum_sq = 0.f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        v[s][u].x -= mean;
        v[s][u].y -= mean;
        sum_sq = fmaf(v[s][u].x, v[s][u].x, fmaf(v[s][u].y, v[s][u].y, sum_sq));
      }
    z_rstd[hf] = rsqrtf(quad_sum(sum_sq) * kInvH + eps);
    const float scale = kScaled ? z_rstd[hf] : 1.f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int u = 0; u < 2; ++u)
        zf[s][u == 0 ? hf : 2 + hf] = ::trimul::tma::pack_pair<__nv_bfloat16>(v[s][u].x * scale, v[s][u].y * scale);
  }
}

// A part's (64 output channels') two products on the register fragments: gate = xf . out_gate's rows (kGateSteps
// k16 steps) and proj = zf . out_proj's rows (kZSteps), each part's weights as [k-tile][64 rows x 128 bytes]
// (smem_descriptor's layout) from wg / wo. Two commit groups: the gate's sigmoids (bias from gate_bias, the
// part's 64) are taken while out_proj's product is still in flight. On return gate[4 j + 2 hf + e] holds
// sigmoid(gate + b) (gate_sigmoid<kSigmoid>: the 16-bit modes' tanh.approx unless another mode is named) and
// proj[4 j + 2 hf + e] the product, of position row g + 8 hf and the part's channel 8 j + 2 t + e.
template <Mode kSigmoid = Mode::bf16, int kGateSteps, int kZSteps>
__device__ __forceinline__ void gated_part_products(float (&gate)[32], float (&proj)[32],
                                                    const uint32_t (&xf)[kGateSteps][4],
                                                    const uint32_t (&zf)[kZSteps][4], const uint8_t* wg,
                                                    const uint8_t* wo, const float* gate_bias, int t) {
  using namespace ::trimul::tma;
  constexpr int kTileBytes = 64 * ws::kKBytes;
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < kGateSteps; ++s)
    wgmma_rs_64x64<__nv_bfloat16>(gate, xf[s], desc_add(smem_descriptor(wg + (s / 4) * kTileBytes), 2 * (s % 4)),
                                  s > 0);
  wgmma_commit();
#pragma unroll
  for (int s = 0; s < kZSteps; ++s)
    wgmma_rs_64x64<__nv_bfloat16>(proj, zf[s], desc_add(smem_descriptor(wo + (s / 4) * kTileBytes), 2 * (s % 4)),
                                  s > 0);
  wgmma_commit();
  wgmma_wait<1>();
  fence_accumulators(gate);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 bg = *reinterpret_cast<const float2*>(gate_bias + 8 * j + 2 * t);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      gate[4 * j + 2 * hf] = gate_sigmoid<kSigmoid>(gate[4 * j + 2 * hf] + bg.x);
      gate[4 * j + 2 * hf + 1] = gate_sigmoid<kSigmoid>(gate[4 * j + 2 * hf + 1] + bg.y);
    }
  }
  wgmma_wait<0>();
  fence_accumulators(proj);
}

}  // namespace output_pass
}  // namespace trimul
