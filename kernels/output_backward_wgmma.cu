// wgmma — output_backward: dz planes with d z_hat = d o W_out_f multiplied in the pass, never written; Hopper
// (sm_90a), bf16 operands, hidden 128, pair_dim a multiple of 64 up to 512; at pair_dim 128 the front half in one
// pass too (z_gate_grad, output_backward_gate.cuh), and there dz_planes with out_proj's weight gradient
// (dz_planes_g_out, output_backward_dz_g_out.cuh); other passes as rows'.
// The rows kernel's dz_planes reads d z_hat [P, H] in fp32, which a cuBLAS GEMM wrote just before (the largest of
// the two steps' streams). Here backward_wgmma_rows.cuh's tile loop multiplies d o's row tiles (TMA boxes)
// by the resident W_out_f (laid out by each block from the fp32 parameter), and the epilogue runs LayerNorm_out's
// backward on the accumulators: dz = rstd (d z_hat - mean(d z_hat) - z_hat mean(d z_hat z_hat)), z_hat's row
// and rstd loaded while the tile multiplies, the means by quad shuffles (a row's 128 h live in four lanes). dz
// leaves in the planes' layout: per 32 h, stmatrix.trans into a swizzled scratch and one TMA box store of 32 h x
// 64 positions (the forward input pass's store_part), whose map clips the positions past a batch's plane.
#include "backward_wgmma_rows.cuh"
#include "output_backward_dz_g_out.cuh"
#include "output_backward_gate.cuh"
#include "output_backward_rows.cuh"
#include "wgmma_rs.cuh"

namespace trimul {
namespace backward {
namespace dz_mma {

using namespace ::trimul::backward::wgmma_rows;
constexpr int kH = kN;                    // the hidden it takes: the product's columns, a row per accumulator row
constexpr int kPartH = 32;                // h per box store
constexpr int kScratchBytes = kPartH * kPositions * 2;  // a box's scratch: 32 h x 64 positions, bf16
constexpr int kExtraBytes = kGroups * 2 * kScratchBytes; // per warpgroup two scratches, stores in turn

struct DzEpilogue {
  const BackwardArgs& args;
  const CUtensorMap* map_dz;
  uint8_t* scratch;  // this warpgroup's two
  int64_t plane;
  bool valid[2];
  uint32_t z_raw[2][16];  // z_hat pairs of this thread's columns
  float rstd[2];

  __device__ __forceinline__ void begin(int64_t batch, int64_t p0) {
    const int lane = threadIdx.x & 31, warp4 = (threadIdx.x >> 5) & 3, t = lane & 3;
    const Op* z_hat = static_cast<const Op*>(args.rows);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t p = p0 + 16 * warp4 + (lane >> 2) + 8 * hf, position = batch * plane + p;
      valid[hf] = p < plane;
      rstd[hf] = valid[hf] ? args.rstd[position] : 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        z_raw[hf][j] = valid[hf] ? *reinterpret_cast<const uint32_t*>(z_hat + position * kH + 8 * j + 2 * t) : 0u;
    }
  }

  __device__ __forceinline__ void end(int64_t batch, int64_t p0, const float (&acc)[64]) {
    uint32_t packed[2][16];  // [hf][j]: dz of columns 8 j + 2 t, + 1 as a bf16 pair
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float z[32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&z_raw[hf][j]));
        z[2 * j] = v.x;
        z[2 * j + 1] = v.y;
      }
      float mean, mean_dot;
      row_grad_means<true>(acc, hf, z, 0.f, 1.f, &mean, &mean_dot);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        packed[hf][j] = pack_pair<Op>(rstd[hf] * (acc[4 * j + 2 * hf] - mean - z[2 * j] * mean_dot),
                                      rstd[hf] * (acc[4 * j + 2 * hf + 1] - mean - z[2 * j + 1] * mean_dot));
    }
    // Per 32 h, the two scratches in turn.
#pragma unroll
    for (int part = 0; part < kH / kPartH; ++part)
      input_pass::wgmma_rs::store_rows_part(scratch + (part & 1) * kScratchBytes, packed, part, map_dz, batch,
                                            kPartH * part, p0);
  }
};

__global__ void __launch_bounds__(kBlockThreads, 1)
    kernel(const BackwardArgs args, const __grid_constant__ CUtensorMap map_d_o,
           const __grid_constant__ CUtensorMap map_dz, const Sources w, int64_t batches, int64_t plane) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int group = warp_index() >> 2;
  DzEpilogue epilogue{args, &map_dz, smem + extra_offset(w.k_tiles) + group * 2 * kScratchBytes, plane};
  run_tiles(smem, &map_d_o, &map_d_o, w, batches, plane, epilogue);  // (one source: map_dz is the epilogue's)
  if ((threadIdx.x & 127) == 0) bulk_wait<0>();  // (the boxes written before the block retires)
}

// Whether it takes dz_planes' sizes: bf16 operands, hidden 128 (a row per accumulator row), pair_dim in whole
// k-tiles up to 512 (its weights and the rings in shared memory, with room to spare), plane rows TMA can address
// (N^2, a block's rows x N, a multiple of 8: 16-byte rows of the box map) and positions it can count.
bool takes(const BackwardArgs& args) {
  const int64_t plane = plane_positions(args);
  return args.operand == Dtype::bf16 && args.h == kH && args.c % kKCols == 0 && args.c > 0 && args.c <= 512 &&
         tensor_map_encoder() != nullptr && plane % 8 == 0 && args.batch * plane < (int64_t(1) << 31) &&
         smem_bytes(static_cast<int>(args.c / kKCols), kExtraBytes) <= max_smem_optin();
}

// The rows kernel's passes, but dz_planes without d_rows is this kernel's, and z_gate_grad and dz_planes_g_out
// (their own rules) too.
bool applies(const BackwardArgs& args) {
  if (args.pass == BackwardPass::z_gate_grad) return gate_mma::takes(args);
  if (args.pass == BackwardPass::dz_planes_g_out) return dz_g_out::takes(args);
  if (args.pass == BackwardPass::dz_planes && args.d_rows == nullptr) return takes(args);
  return takes(args) && ::trimul::backward::applies(args);
}

cudaError_t launch(const BackwardArgs& args) {
  if (args.pass == BackwardPass::z_gate_grad) return gate_mma::launch(args);
  if (args.pass == BackwardPass::dz_planes_g_out) return dz_g_out::launch(args);
  if (args.pass != BackwardPass::dz_planes || args.d_rows != nullptr) return ::trimul::backward::launch(args);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!takes(args) || args.d_o == nullptr || args.w_out_f == nullptr || args.rows == nullptr ||
      args.rstd == nullptr || args.a_planes == nullptr || !aligned(args.d_o) || !aligned(args.rows) ||
      !aligned(args.a_planes))
    return cudaErrorInvalidValue;
  const int64_t plane = plane_positions(args);
  if (args.batch * plane == 0) return cudaSuccess;
  CUtensorMap map_d_o, map_dz;
  if (!encode_rows_map(&map_d_o, args.d_o, args.batch * plane, args.c) ||
      !encode_kmajor_map<Op>(&map_dz, args.a_planes, args.batch, kH, plane, kPartH))
    return cudaErrorNotSupported;
  const int k_tiles = static_cast<int>(args.c / kKCols);
  return wgmma_rows::launch<kernel>(args, map_d_o, map_dz, Sources{k_tiles, k_tiles, args.w_out_f, nullptr},
                                    args.batch, plane, kExtraBytes);
}

}  // namespace dz_mma
}  // namespace backward
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(output_backward, wgmma, ::trimul::backward::dz_mma::applies,
                         ::trimul::backward::dz_mma::launch);
