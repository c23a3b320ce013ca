// wgmma_tf32x3 — position_gemm at "highest": out[M, N] = rows[M, K] W[N, K]^T + bias in fp32, as 3xTF32 on wgmma
// with the rows split in registers: fp32-accurate, and faster than cuBLAS's fp32 GEMMs on the CUDA cores.
// Why fp32-accurate: x = hi + lo with hi = tf32(x), lo = tf32(x - hi) (22 of fp32's 24 significant bits), for
// the rows and W alike; hi.hi + hi.lo + lo.hi drops lo.lo (~2^-22 relative). The tensor cores' fp32 sums truncate,
// and over all of K their error grows linearly with K (bench/NOTES.md): each 32-k tile's
// products start from zero and are added into fp32 registers (rounded), so the truncating sums run over 32 k.
// Layout: a block is two consumer warpgroups (64 rows each) and a producer warp over a 128 x 128 output tile. Each
// of 4 stages holds the block's 128 rows x 32 k (TMA, 128-byte swizzle, zeros past M and K) and 128 n x 32 k of W's
// hi and lo parts (BackwardPass::split_weight lays W out once per call as [2][N_pad][K_pad], k permuted within
// each 32-k tile so that a thread's two 16-byte chunks of a row hold its A fragments of all four k8 steps). A
// thread reads its rows' chunks from shared memory, splits them and issues each k8 step's three products with A
// from registers (lo.hi, hi.lo, hi.hi).
#include "tma.cuh"

namespace trimul {
namespace position_gemm_tf32x3 {

using namespace ::trimul::tma;

constexpr int kBM = 128, kBN = 128, kBK = 32;  // block tile; k per stage: one 128-byte row of fp32
constexpr int kStages = 4;
constexpr int kPartBytes = kBM * kBK * 4;  // 16 KiB: the rows' box, W hi's, W lo's
constexpr int kStageBytes = 3 * kPartBytes;
constexpr int kThreads = 256 + 32;
constexpr int kSmemBytes = 1023 + kStages * kStageBytes + 2 * kStages * 8;
static_assert(kBN == 128 && kBM == 128, "position_gemm_split_floats (api.cuh) pads N to 128 and K to 64");

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = mma::to_tf32(x);
  lo = mma::to_tf32(x - __uint_as_float(hi));
}

// One k8 step of a 64x128 product, A (tf32, 64 x 8) from registers: a[0] row lane / 4 of the warp's 16, k lane %
// 4; a[1] the row 8 further; a[2], a[3] the same at k + 4 (CUTLASS's ALayout_64x8); B K-major in shared memory.
// The registers must stay unchanged until the group is waited for.
__device__ __forceinline__ void wgmma_tf32_rs_64x128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                     int accumulate) {
#ifdef TRIMUL_SM90A
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}

// The k a split weight's slot q (0..31) of a 32-k tile holds: step j = q / 8 reads slots 8j .. 8j + 7 as its k
// 0..7; the thread with lane % 4 = t holds k t and t + 4 of every step, from its 16-byte chunks 2t and 2t + 1 of a
// row (elements 8t .. 8t + 7): element 8t + 2j as k t, 8t + 2j + 1 as k t + 4.
__device__ __forceinline__ int slot_k(int q) {
  const int j = q >> 3, l = q & 7;
  return l < 4 ? 8 * l + 2 * j : 8 * (l - 4) + 2 * j + 1;
}

// W [N, K] (strides sn, sk) -> [2][n_pad][k_pad]: the hi parts, then the lo parts, zeros past N and K.
__global__ void split_weight_kernel(const float* __restrict__ w, int64_t sn, int64_t sk, int64_t n, int64_t k,
                                    int64_t n_pad, int64_t k_pad, float* __restrict__ out) {
  const int64_t total = n_pad * k_pad;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / k_pad, q = i % k_pad;
    const int64_t col = (q & ~int64_t(31)) + slot_k(static_cast<int>(q & 31));
    uint32_t hi, lo;
    split(row < n && col < k ? w[row * sn + col * sk] : 0.0f, hi, lo);
    out[i] = __uint_as_float(hi);
    out[total + i] = __uint_as_float(lo);
  }
}

// This thread's A fragments of a stage's 32 k, from its warpgroup's 64 swizzled rows `rows` (row r's 16-byte chunk
// c at chunk c ^ (r % 8); a warp's rows 16 w4 + g and + 8 both sit at g mod 8), split into tf32 parts
// (hi[j], lo[j]: k8 step j).
__device__ __forceinline__ void load_fragments(uint32_t (&hi)[4][4], uint32_t (&lo)[4][4], const uint8_t* rows, int w4,
                                               int g, int t) {
  const uint8_t* r0 = rows + (16 * w4 + g) * 128;
  const uint8_t* r8 = r0 + 8 * 128;
  const float4 x0 = *reinterpret_cast<const float4*>(r0 + (((2 * t) ^ g) << 4));
  const float4 x1 = *reinterpret_cast<const float4*>(r0 + (((2 * t + 1) ^ g) << 4));
  const float4 y0 = *reinterpret_cast<const float4*>(r8 + (((2 * t) ^ g) << 4));
  const float4 y1 = *reinterpret_cast<const float4*>(r8 + (((2 * t + 1) ^ g) << 4));
  const float row0[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  const float row8[8] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    split(row0[2 * j], hi[j][0], lo[j][0]);
    split(row8[2 * j], hi[j][1], lo[j][1]);
    split(row0[2 * j + 1], hi[j][2], lo[j][2]);
    split(row8[2 * j + 1], hi[j][3], lo[j][3]);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_rows, const __grid_constant__ CUtensorMap map_w, int64_t m,
                int64_t n, int k_tiles, int n_pad, int n_tiles, const float* __restrict__ bias,
                float* __restrict__ out, int64_t ld_out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int n0 = static_cast<int>(blockIdx.x % n_tiles) * kBN;  // (n tiles of one row block run side by side)
  const int64_t m0 = int64_t(blockIdx.x / n_tiles) * kBM;
  if (threadIdx.x == 0) {
    init_barrier_pairs(full, 1, empty, 256, kStages);  // (empty: every consumer thread, after its own reads)
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= 256) {  // the producer warp: one thread issues every stage's three boxes
    if (threadIdx.x == 256) {
      FillRing ring{empty, kStages};
      for (int kt = 0; kt < k_tiles; ++kt) {
        ring.wait_free();
        uint8_t* stage = smem + ring.slot * kStageBytes;
        mbar_expect_tx(&full[ring.slot], kStageBytes);
        tma_load_2d(stage, &map_rows, kt * kBK, static_cast<int>(m0), &full[ring.slot]);
        tma_load_2d(stage + kPartBytes, &map_w, kt * kBK, n0, &full[ring.slot]);
        tma_load_2d(stage + 2 * kPartBytes, &map_w, kt * kBK, n_pad + n0, &full[ring.slot]);
        ring.advance();
      }
    }
    return;
  }
  const int wg = threadIdx.x >> 7, w4 = warp_index() & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float acc[64], total[64];
  uint32_t hi[4][4], lo[4][4];
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int s = kt % kStages;
    mbar_wait(&full[s], (kt / kStages) & 1);
    uint8_t* stage = smem + s * kStageBytes;
    load_fragments(hi, lo, stage + wg * 64 * 128, w4, g, t);
    const uint64_t desc_hi = smem_descriptor(stage + kPartBytes), desc_lo = smem_descriptor(stage + 2 * kPartBytes);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      wgmma_tf32_rs_64x128(acc, lo[j], desc_add(desc_hi, 2 * j), j > 0);
      wgmma_tf32_rs_64x128(acc, hi[j], desc_add(desc_lo, 2 * j), 1);
      wgmma_tf32_rs_64x128(acc, hi[j], desc_add(desc_hi, 2 * j), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(acc);
    fence_proxy_async();  // (this thread's ld.shared of the stage before TMA refills it)
    mbar_arrive(&empty[s]);
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] = kt > 0 ? total[i] + acc[i] : acc[i];
  }
  // The accumulators' layout: per n8 block j, total[4j], [4j + 1] row g of this warp's 16, columns 8j + 2t, + 1;
  // total[4j + 2], [4j + 3] the row 8 further.
  const int64_t row0 = m0 + 64 * wg + 16 * w4 + g, row8 = row0 + 8;
  const bool pairs = (ld_out & 1) == 0;  // (8-byte stores need even row pitches)
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int64_t col = n0 + 8 * j + 2 * t;
    if (col >= n) continue;
    const bool two = col + 1 < n;
    const float b0 = bias != nullptr ? bias[col] : 0.0f, b1 = bias != nullptr && two ? bias[col + 1] : 0.0f;
    const float v[4] = {total[4 * j] + b0, total[4 * j + 1] + b1, total[4 * j + 2] + b0, total[4 * j + 3] + b1};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = r == 0 ? row0 : row8;
      if (row >= m) continue;
      float* p = out + row * ld_out + col;
      if (two && pairs) {
        *reinterpret_cast<float2*>(p) = make_float2(v[2 * r], v[2 * r + 1]);
      } else {
        p[0] = v[2 * r];
        if (two) p[1] = v[2 * r + 1];
      }
    }
  }
}

int64_t padded(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// fp32 rows at "highest" (at "high" cuBLAS's one-pass TF32 is the mode's own rounding), contiguous in k with a
// 16-byte row pitch and base (TMA), K >= 1, TMA's 32-bit coordinates, and Hopper's shared memory.
bool applies(const BackwardArgs& args) {
  return args.operand == Dtype::f32 && args.precision == Precision::highest && tensor_map_encoder() != nullptr &&
         args.gemm_k >= 1 && args.gemm_n >= 1 && args.gemm_ld >= args.gemm_k && args.gemm_ld % 4 == 0 &&
         reinterpret_cast<uintptr_t>(args.gemm_rows) % 16 == 0 && args.gemm_m < (int64_t(1) << 31) &&
         padded(args.gemm_k, 64) < (int64_t(1) << 31) && 2 * padded(args.gemm_n, kBN) < (int64_t(1) << 31) &&
         kSmemBytes <= max_smem_optin();
}

cudaError_t launch(const BackwardArgs& args) {
  if (!applies(args)) return cudaErrorInvalidValue;
  const int64_t n_pad = padded(args.gemm_n, kBN), k_pad = padded(args.gemm_k, 64);
  if (args.gemm_w_split == nullptr || args.gemm_w_split_floats < position_gemm_split_floats(args.gemm_n, args.gemm_k))
    return cudaErrorInvalidValue;
  if (args.pass == BackwardPass::split_weight) {
    if (args.gemm_w == nullptr) return cudaErrorInvalidValue;
    const int64_t blocks = std::min<int64_t>(ceil_div(n_pad * k_pad, 256), 4096);
    split_weight_kernel<<<static_cast<unsigned>(blocks), 256, 0, args.stream>>>(
        args.gemm_w, args.gemm_w_sn, args.gemm_w_sk, args.gemm_n, args.gemm_k, n_pad, k_pad, args.gemm_w_split);
    return cudaGetLastError();
  }
  if (args.pass != BackwardPass::rows_gemm || args.gemm_out == nullptr || args.gemm_ld_out < args.gemm_n)
    return cudaErrorInvalidValue;
  if (args.gemm_m == 0) return cudaSuccess;
  CUtensorMap map_rows, map_w;
  if (!encode_kmajor_map<float>(&map_rows, args.gemm_rows, 0, args.gemm_m, args.gemm_k, kBM, args.gemm_ld) ||
      !encode_kmajor_map<float>(&map_w, args.gemm_w_split, 0, 2 * n_pad, k_pad, kBN))
    return cudaErrorNotSupported;
  const cudaError_t status = fused::allow_smem<gemm_kernel>(kSmemBytes);
  if (status != cudaSuccess) return status;
  const int n_tiles = static_cast<int>(n_pad / kBN);
  const int64_t blocks = ceil_div(args.gemm_m, kBM) * n_tiles;
  gemm_kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, args.stream>>>(
      map_rows, map_w, args.gemm_m, args.gemm_n, static_cast<int>(k_pad / kBK), static_cast<int>(n_pad), n_tiles,
      args.gemm_bias, args.gemm_out, args.gemm_ld_out);
  return cudaGetLastError();
}

}  // namespace position_gemm_tf32x3
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(position_gemm, wgmma_tf32x3, ::trimul::position_gemm_tf32x3::applies,
                         ::trimul::position_gemm_tf32x3::launch);
