// position_gemm.cuh — what the position_gemm kernels (position_gemm_wgmma_*.cu) share: the block of two consumer
// warpgroups and a producer warpgroup that hands its registers over, a tile's three products with A from
// registers, the output tiles' stores, the operand checks and launches, and the weight gradients' fixed chunks with
// their ordered sum. Each kernel file keeps what its operand type changes: the split, the fragments, the stages.
#pragma once
#include "tma.cuh"

#include <cuda_fp16.h>

namespace trimul {
namespace position_gemm {

using namespace ::trimul::tma;

constexpr int kBM = 128, kBN = 128;  // an output tile: two consumer warpgroups of 64 rows, 128 columns
constexpr int kConsumerThreads = 256, kThreads = kConsumerThreads + 128;
// Registers per thread after the hand-over. A block of 384 threads starts at 168 a thread (the register file's
// 64K over 12 warps: ptxas's limit under __launch_bounds__(384, 1), which a kernel with setmaxnreg takes whole);
// the producer group, which needs few, gives back 144 a thread and each consumer thread takes 72. (A block of
// 288 threads does not launch above 168 either: the hardware charges a block's registers as if its warps were a
// multiple of four.)
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168,
              "the consumers' registers come from the producer group's");
constexpr int kGradChunk = static_cast<int>(kPositionGemmGradChunk);  // positions per weight-gradient chunk

inline int64_t padded(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// fp32 rows that TMA reads: contiguous in k with a 16-byte row pitch and base.
inline bool rows_take(const float* rows, int64_t ld, int64_t width) {
  return ld >= width && ld % 4 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0;
}

// The block's shared memory from a 1024-byte boundary (the 128-byte swizzle's atoms), derived from smem_raw itself
// so that the compiler keeps shared-space accesses (LDS / STS, not generic LD.E).
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* smem_raw) {
  return smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
}

// The warp-specialized block: thread 0 sets up `stages` full / empty barrier pairs (empty: every consumer thread
// arrives after its own reads of the stage); the producer group gives its registers away and its first thread runs
// fill(ring); the two consumer groups take them and run consume(). The caller's kernel ends with this call.
template <typename Fill, typename Consume>
__device__ __forceinline__ void run_block(uint64_t* full, uint64_t* empty, int stages, const Fill& fill,
                                          const Consume& consume) {
  if (threadIdx.x == 0) {
    init_barrier_pairs(full, 1, empty, kConsumerThreads, stages);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumerThreads) {
#ifdef TRIMUL_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
#endif
    if (threadIdx.x == kConsumerThreads) {
      FillRing ring{empty, stages};
      fill(ring);
    }
    return;
  }
#ifdef TRIMUL_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
#endif
  consume();
}

// One k-step of a 64x128 product with A from registers and B K-major in shared memory (desc_b), into wgmma's
// 64 accumulators: TF32 (Op float) k8, A's fragment a[0] row lane / 4 of the warp's 16, k lane % 4, a[1] the row 8
// further, a[2], a[3] the same at k + 4 (CUTLASS's ALayout_64x8); fp16 k16, mma.m16n8k16's A layout (a[0] row
// lane / 4, k 2 (lane % 4) + {0, 1}, the lower k in the low half; a[1] the row 8 further; a[2], a[3] the same at
// k + 8). The registers must stay unchanged until the group is waited for.
#define TRIMUL_WGMMA_RS_64X128_KMAJOR(INSTR, TAIL)                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" INSTR                                      \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
               "{%64, %65, %66, %67}, %68, p" TAIL ";\n}\n"                                             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <typename Op>
__device__ __forceinline__ void wgmma_rs_64x128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                int accumulate) {
  static_assert(std::is_same<Op, float>::value || std::is_same<Op, __half>::value, "tf32 or fp16 parts");
#ifdef TRIMUL_SM90A
  if constexpr (std::is_same<Op, float>::value)
    TRIMUL_WGMMA_RS_64X128_KMAJOR("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", ", 1, 1");
  else
    TRIMUL_WGMMA_RS_64X128_KMAJOR("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", ", 1, 1, 0");
#endif
}
#undef TRIMUL_WGMMA_RS_64X128_KMAJOR

// One tile's three products into acc (overwritten: its first product starts from zero), committed as one group:
// per k-step j (32 bytes of B apart), lo.hi, hi.lo, hi.hi with the A fragments hi[j], lo[j] from registers and
// B's parts at desc_hi, desc_lo. The fragments must stay unchanged until the group is waited for.
template <typename Op>
__device__ __forceinline__ void products(float (&acc)[64], const uint32_t (&hi)[4][4], const uint32_t (&lo)[4][4],
                                         uint64_t desc_hi, uint64_t desc_lo) {
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    wgmma_rs_64x128<Op>(acc, lo[j], desc_add(desc_hi, 2 * j), j > 0);
    wgmma_rs_64x128<Op>(acc, hi[j], desc_add(desc_lo, 2 * j), 1);
    wgmma_rs_64x128<Op>(acc, hi[j], desc_add(desc_hi, 2 * j), 1);
  }
  wgmma_commit();
}

// A consumer warpgroup's 64 x 128 fp32 sums (wgmma's accumulator layout: per n8 block j, total[4j], [4j + 1] the
// warp's row g, columns 8j + 2t, + 1; total[4j + 2], [4j + 3] the row 8 further) into out (row pitch ld_out) at
// rows row0 (this thread's row g) and row0 + 8, columns n0 + ...; rows >= m and columns >= n skipped; each column
// times col_scales[col] where kScaled, plus bias[col] where given.
template <bool kScaled>
__device__ __forceinline__ void store_tile(const float (&total)[64], int64_t row0, int64_t n0, int t, int64_t m,
                                           int64_t n, const float* __restrict__ col_scales,
                                           const float* __restrict__ bias, float* __restrict__ out, int64_t ld_out) {
  const int64_t row8 = row0 + 8;
  // (8-byte stores need an even row pitch and an 8-byte-aligned base)
  const bool pairs = (ld_out & 1) == 0 && (reinterpret_cast<uintptr_t>(out) & 7) == 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int64_t col = n0 + 8 * j + 2 * t;
    if (col >= n) continue;
    const bool two = col + 1 < n;
    const float b0 = bias != nullptr ? bias[col] : 0.0f, b1 = bias != nullptr && two ? bias[col + 1] : 0.0f;
    float v[4];
    if constexpr (kScaled) {
      const float c0 = col_scales[col], c1 = two ? col_scales[col + 1] : 0.0f;
      v[0] = total[4 * j] * c0 + b0, v[1] = total[4 * j + 1] * c1 + b1;
      v[2] = total[4 * j + 2] * c0 + b0, v[3] = total[4 * j + 3] * c1 + b1;
    } else {
      v[0] = total[4 * j] + b0, v[1] = total[4 * j + 1] + b1, v[2] = total[4 * j + 2] + b0, v[3] = total[4 * j + 3] + b1;
    }
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

// The weight gradients' per-chunk sums of one 64 x 128 tile (store_tile's layout) into partials [n][k] of a chunk.
__device__ __forceinline__ void store_partials(const float (&total)[64], float* __restrict__ out, int64_t row0,
                                               int64_t n0, int t, int64_t n, int64_t k) {
  const int64_t row8 = row0 + 8;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int64_t col = n0 + 8 * j + 2 * t;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = r == 0 ? row0 : row8;
      if (row >= n) continue;
      if (col < k) out[row * k + col] = total[4 * j + 2 * r];
      if (col + 1 < k) out[row * k + col + 1] = total[4 * j + 2 * r + 1];
    }
  }
}

// A persistent rows block's producer: this block's tiles (blockIdx.x, + gridDim.x, ... of `tiles`; tile i is row
// block i / n_tiles, column block i % n_tiles, so the n tiles of one row block run side by side and read their rows
// once from memory), each tile's k_tiles stages in turn; load_stage(stage, barrier, m0, n0, kt) issues a stage's
// boxes once the stage is free and its barrier expects stage_bytes.
template <typename LoadStage>
__device__ __forceinline__ void fill_tiles(FillRing& ring, uint8_t* smem, uint64_t* full, int stage_bytes, int tiles,
                                           int n_tiles, int k_tiles, const LoadStage& load_stage) {
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int m0 = (tile / n_tiles) * kBM, n0 = (tile % n_tiles) * kBN;
    for (int kt = 0; kt < k_tiles; ++kt) {
      ring.wait_free();
      uint8_t* stage = smem + ring.slot * stage_bytes;
      mbar_expect_tx(&full[ring.slot], stage_bytes);
      load_stage(stage, &full[ring.slot], m0, n0, kt);
      ring.advance();
    }
  }
}

// A weight-gradient block's place: its output tile (m0 over d's columns, n0 over x's), its chunk of kGradChunk
// positions from p0, and that chunk's tiles of tile_positions positions.
struct GradBlock {
  int m0, n0, chunk, k_tiles;
  int64_t p0;
};
__device__ __forceinline__ GradBlock grad_block(int64_t positions, int m_tiles, int n_tiles, int tile_positions) {
  const int tiles = m_tiles * n_tiles;
  const int tile = static_cast<int>(blockIdx.x % tiles), chunk = static_cast<int>(blockIdx.x / tiles);
  const int64_t p0 = int64_t(chunk) * kGradChunk;
  const int k_tiles = static_cast<int>((std::min<int64_t>(positions - p0, kGradChunk) + tile_positions - 1) /
                                       tile_positions);
  return {(tile / n_tiles) * kBM, (tile % n_tiles) * kBN, chunk, k_tiles, p0};
}

// A weight-gradient block's producer: each tile's stage holds d's four boxes (tile_positions x 32 columns), then
// x's four.
__device__ __forceinline__ void fill_grad_stages(FillRing& ring, uint8_t* smem, uint64_t* full, int stage_bytes,
                                                 int tile_positions, const GradBlock& block,
                                                 const CUtensorMap* map_d, const CUtensorMap* map_x) {
  const int box_bytes = tile_positions * 32 * 4;
  for (int kt = 0; kt < block.k_tiles; ++kt) {
    ring.wait_free();
    uint8_t* stage = smem + ring.slot * stage_bytes;
    const int row = static_cast<int>(block.p0 + int64_t(kt) * tile_positions);
    mbar_expect_tx(&full[ring.slot], stage_bytes);
    for (int b = 0; b < 4; ++b) {
      tma_load_2d(stage + b * box_bytes, map_d, block.m0 + 32 * b, row, &full[ring.slot]);
      tma_load_2d(stage + (4 + b) * box_bytes, map_x, block.n0 + 32 * b, row, &full[ring.slot]);
    }
    ring.advance();
  }
}

namespace {
// out[i] = sum over chunks c = 0, 1, .. of partials[c][i], in that order.
__global__ void grad_sum_kernel(const float* __restrict__ partials, int64_t chunks, int64_t count, int64_t cols,
                                float* __restrict__ out, int64_t ld_out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) sum += partials[c * count + i];
    out[(i / cols) * ld_out + i % cols] = sum;
  }
}
}  // namespace

// rows_gemm on Kernel (map_rows, map_w, m, n, k_tiles, n_pad, n_tiles, tiles, extra..., bias, out, ld_out): the
// rows' map in boxes of 128 rows x 32 k, W's split parts [2 n_pad][k_pad] of WOp in boxes of 128 n x 128 bytes,
// k_tiles of k_tile k, a persistent grid of at most one block per SM over the 128 x 128 tiles.
template <auto Kernel, typename WOp, typename... Extra>
cudaError_t launch_rows(const BackwardArgs& args, int64_t n_pad, int64_t k_pad, int k_tile, int smem_bytes,
                        Extra... extra) {
  if (args.pass != BackwardPass::rows_gemm || args.gemm_out == nullptr || args.gemm_ld_out < args.gemm_n)
    return cudaErrorInvalidValue;
  if (args.gemm_m == 0) return cudaSuccess;
  CUtensorMap map_rows, map_w;
  if (!encode_kmajor_map<float>(&map_rows, args.gemm_rows, 0, args.gemm_m, args.gemm_k, kBM, args.gemm_ld) ||
      !encode_kmajor_map<WOp>(&map_w, args.gemm_w_split, 0, 2 * n_pad, k_pad, kBN))
    return cudaErrorNotSupported;
  const cudaError_t status = fused::allow_smem<Kernel>(smem_bytes);
  if (status != cudaSuccess) return status;
  const int n_tiles = static_cast<int>(n_pad / kBN);
  const int64_t tiles = ceil_div(args.gemm_m, kBM) * n_tiles;
  const int64_t blocks = std::min<int64_t>(tiles, std::max<int64_t>(sm_count(), 1));
  Kernel<<<static_cast<unsigned>(blocks), kThreads, smem_bytes, args.stream>>>(
      map_rows, map_w, args.gemm_m, args.gemm_n, static_cast<int>(k_pad / k_tile), static_cast<int>(n_pad), n_tiles,
      static_cast<int>(tiles), extra..., args.gemm_bias, args.gemm_out, args.gemm_ld_out);
  return cudaGetLastError();
}

// rows_grad on Kernel (map_d, map_x, positions, n, k, m_tiles, n_tiles, partials: one block per chunk of
// kGradChunk positions and 128 x 128 output tile, boxes of box_positions x 32 columns), then the chunks' ordered
// sum into gemm_out: the same bits on any GPU.
template <auto Kernel>
cudaError_t launch_grad(const BackwardArgs& args, int box_positions, int smem_bytes) {
  const int64_t chunks = position_gemm_grad_chunks(args.gemm_m);
  if (args.gemm_out == nullptr || args.gemm_ld_out < args.gemm_k || args.gemm_partials == nullptr ||
      args.gemm_partial_floats < chunks * args.gemm_n * args.gemm_k)
    return cudaErrorInvalidValue;
  if (chunks > 0) {
    CUtensorMap map_d, map_x;
    if (!encode_kmajor_map<float>(&map_d, args.gemm_d, 0, args.gemm_m, args.gemm_n, box_positions, args.gemm_ld_d) ||
        !encode_kmajor_map<float>(&map_x, args.gemm_rows, 0, args.gemm_m, args.gemm_k, box_positions, args.gemm_ld))
      return cudaErrorNotSupported;
    const cudaError_t status = fused::allow_smem<Kernel>(smem_bytes);
    if (status != cudaSuccess) return status;
    const int m_tiles = static_cast<int>(ceil_div(args.gemm_n, kBM)), n_tiles = static_cast<int>(ceil_div(args.gemm_k, kBN));
    Kernel<<<static_cast<unsigned>(chunks * m_tiles * n_tiles), kThreads, smem_bytes, args.stream>>>(
        map_d, map_x, args.gemm_m, args.gemm_n, args.gemm_k, m_tiles, n_tiles, args.gemm_partials);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) return launched;
  }
  const int64_t count = args.gemm_n * args.gemm_k;
  grad_sum_kernel<<<static_cast<unsigned>(std::min<int64_t>(ceil_div(count, 256), 4096)), 256, 0, args.stream>>>(
      args.gemm_partials, chunks, count, args.gemm_k, args.gemm_out, args.gemm_ld_out);
  return cudaGetLastError();
}

}  // namespace position_gemm
}  // namespace trimul
