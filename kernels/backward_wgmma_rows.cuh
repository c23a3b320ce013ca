// backward_wgmma_rows.cuh — the skeleton of the backward's wgmma row kernels (input_backward wgmma_rs's d_pair,
// output_backward wgmma's dz_planes): position rows [P, K] 16-bit, from one tensor or two side by side along k,
// times a resident weight matrix [K, 128] on wgmma, then the kernel's epilogue per 64-position tile on the m64n128
// fp32 accumulators. Two warpgroups per block, each on its own tiles (a persistent grid); each warpgroup's first
// thread keeps kStages row boxes (64 positions x 64 columns) in flight by TMA, so no producer warp is needed: a
// stage takes its next box once the wgmma group that read it is done. The weights are laid out by each block from
// fp32 parameters (no host-side preparation), transposed into wgmma's K-major B with TMA's 128-byte swizzle.
#pragma once
#include "backward_rows.cuh"
#include "tma.cuh"

namespace trimul {
namespace backward {
namespace wgmma_rows {

using namespace ::trimul::tma;
namespace ws = ::trimul::tma::ws;
using Op = __nv_bfloat16;

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kBlockThreads = 128 * kGroups;
constexpr int kPositions = 64;                       // per tile: wgmma's M
constexpr int kN = 128;                              // the product's columns: wgmma's N
constexpr int kKCols = ws::kKBytes / 2;              // k columns per 128-byte k-tile
constexpr int kStages = 4;                           // row boxes in flight per warpgroup
constexpr int kBoxBytes = kPositions * ws::kKBytes;  // a box: 64 positions x 64 columns

// The rows' two sources along k: k-tiles [0, first_tiles) from map_first's [P, 64 first_tiles] rows, the rest
// from map_second's; the weight rows likewise from first (fp32 [64 first_tiles, kN]) and second.
struct Sources {
  int k_tiles, first_tiles;
  const float* first;
  const float* second;
};

// Dynamic shared memory: the resident weights (1024-byte aligned; a k-tile is kN rows of 128 bytes), per
// warpgroup its box ring, the rings' barriers, then `extra` bytes for the epilogue (1024-byte aligned).
__host__ __device__ inline int64_t extra_offset(int k_tiles) {
  return ceil_div(int64_t(k_tiles) * ws::kStageBytes + kGroups * kStages * kBoxBytes + kGroups * kStages * 8, 1024) *
         1024;
}
inline int64_t smem_bytes(int k_tiles, int64_t extra) { return 1023 + extra_offset(k_tiles) + extra; }

// The weights as wgmma reads a K-major B: k-tile kt holds row n (the product's column), k = 64 kt .. + 63, each
// 16-byte chunk XOR-swizzled by its row; element (n, k) is the source's [k][n]. All threads of the block.
__device__ __forceinline__ void lay_out_weights(const Sources& w, uint8_t* weights) {
  const int first_cols = w.first_tiles * kKCols;
#pragma unroll 4  // (four rounds of loads in flight: the layout is a chain of L2 round trips)
  for (int index = threadIdx.x; index < w.k_tiles * 8 * kN; index += kBlockThreads) {
    const int n = index % kN, chunk = (index / kN) % 8, kt = index / (8 * kN), k0 = kt * kKCols + 8 * chunk;
    const float* source = k0 < first_cols ? w.first + int64_t(k0) * kN + n : w.second + int64_t(k0 - first_cols) * kN + n;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = source[e * kN];  // (a warp's 32 columns: one 128-byte line per e)
    const uint4 packed = make_uint4(pack_pair<Op>(v[0], v[1]), pack_pair<Op>(v[2], v[3]), pack_pair<Op>(v[4], v[5]),
                                    pack_pair<Op>(v[6], v[7]));
    *reinterpret_cast<uint4*>(weights + kt * ws::kStageBytes + n * ws::kKBytes + ((chunk ^ (n & 7)) << 4)) = packed;
  }
  fence_proxy_async();  // (wgmma reads the weights through the async proxy)
}

using ::trimul::fused::quad_sum;  // (an accumulator row: a thread holds its columns 8 j + 2 t + {0, 1})

// A thread's two rows (positions g and g + 8 of its warp's 16), loaded as 4 adjacent channels per k-step (the
// weights' k permutation: rows[hf][s] holds channels 16 s + 4 t .. + 3 of row hf), as wgmma's A fragments.
template <int kSteps>
__device__ __forceinline__ void row_fragments(const uint2 (&rows)[2][kSteps], uint32_t (&frag)[kSteps][4]) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      frag[s][hf] = rows[hf][s].x;
      frag[s][2 + hf] = rows[hf][s].y;
    }
}

// A part's 64 columns summed over a warp's 16 accumulator rows: column[2 j + e] is this thread's column 8 j + 2 t
// + e over its two rows; reduce-scattered over lane bits 4, 3, 2, lane 4 g + t returns columns 8 g + 2 t + {0, 1}.
__device__ __forceinline__ float2 warp_column_sums(const float (&column)[16], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float half[8], quarter[4], pair[2];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    half[i] = (b4 ? column[8 + i] : column[i]) + __shfl_xor_sync(0xffffffffu, b4 ? column[i] : column[8 + i], 16);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    quarter[i] = (b3 ? half[4 + i] : half[i]) + __shfl_xor_sync(0xffffffffu, b3 ? half[i] : half[4 + i], 8);
#pragma unroll
  for (int i = 0; i < 2; ++i)
    pair[i] = (b2 ? quarter[2 + i] : quarter[i]) + __shfl_xor_sync(0xffffffffu, b2 ? quarter[i] : quarter[2 + i], 4);
  return make_float2(pair[0], pair[1]);
}

// The two means LayerNorm's backward needs over accumulator row hf (its kN columns, spread over a quad): of d
// and of d x_hat, where x_hat = (x - shift) scale, or x itself where it is already normalized (kNormalized);
// x[2 j + e] is the row's value at this thread's column 8 j + 2 t + e.
template <bool kNormalized>
__device__ __forceinline__ void row_grad_means(const float (&acc)[64], int hf, const float (&x)[32], float shift,
                                               float scale, float* mean_d, float* mean_dot) {
  float sum = 0.f, dot = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d = acc[4 * j + 2 * hf + e];
      sum += d;
      if constexpr (kNormalized) {
        dot += d * x[2 * j + e];
      } else {
        dot += d * (x[2 * j + e] - shift) * scale;
      }
    }
  *mean_d = quad_sum(sum) * (1.f / kN);
  *mean_dot = quad_sum(dot) * (1.f / kN);
}

// The tiles: `batches` runs of `plane` positions (rows batch * plane + p), ceil(plane / 64) tiles each (a tile
// never spans two runs). Per tile, epilogue.begin(batch, p0) before its products (loads that land while they
// run), epilogue.end(batch, p0, acc) after: acc[4 j + 2 hf + e] is row 16 warp4 + lane / 4 + 8 hf of the tile,
// column 8 j + 2 t + e (t = lane % 4). Rows past the run are the next run's rows or zeros (TMA's fill), not
// the tile's: the epilogue must not store them. All threads of the block; `smem` as smem_bytes' layout.
template <class Epilogue>
__device__ __forceinline__ void run_tiles(uint8_t* smem, const CUtensorMap* map_first, const CUtensorMap* map_second,
                                          const Sources& w, int64_t batches, int64_t plane, Epilogue& epilogue) {
  uint8_t* weights = smem;
  uint8_t* rings = weights + w.k_tiles * ws::kStageBytes;
  uint64_t* barriers = reinterpret_cast<uint64_t*>(rings + kGroups * kStages * kBoxBytes);
  const int group = warp_index() >> 2, tid = threadIdx.x & 127;
  uint8_t* ring = rings + group * kStages * kBoxBytes;
  uint64_t* full = barriers + group * kStages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kGroups * kStages; ++i) mbar_init(&barriers[i], 1);
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t tiles_per_run = ceil_div(plane, int64_t(kPositions)), tiles = batches * tiles_per_run;
  const int64_t stride = int64_t(gridDim.x) * kGroups, first = int64_t(blockIdx.x) * kGroups + group;
  const int k_tiles = w.k_tiles;
  // The warpgroup's it-th box: k-tile it % k_tiles of its (it / k_tiles)-th tile, into stage it % kStages.
  const auto issue = [&](int64_t it) {
    const int64_t tile = first + it / k_tiles * stride;
    if (tile >= tiles) return;
    const int kt = static_cast<int>(it % k_tiles), stage = static_cast<int>(it % kStages);
    const int64_t batch = tile / tiles_per_run, row = batch * plane + (tile - batch * tiles_per_run) * kPositions;
    const bool in_first = kt < w.first_tiles;
    mbar_expect_tx(&full[stage], kBoxBytes);
    tma_load_2d(ring + stage * kBoxBytes, in_first ? map_first : map_second,
                (in_first ? kt : kt - w.first_tiles) * kKCols, static_cast<int>(row), &full[stage]);
  };
  if (tid == 0)
    for (int it = 0; it < kStages; ++it) issue(it);
  lay_out_weights(w, weights);  // (the first boxes load meanwhile)
  __syncthreads();

  int64_t it = 0;  // the next box to take
  for (int64_t tile = first; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_run, p0 = (tile - batch * tiles_per_run) * kPositions;
    epilogue.begin(batch, p0);
    float acc[64];
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int stage = static_cast<int>(it % kStages);
      mbar_wait(&full[stage], static_cast<int>((it / kStages) & 1));
      wgmma_k_tile<Op>(acc, smem_descriptor(ring + stage * kBoxBytes), smem_descriptor(weights + kt * ws::kStageBytes),
                       kt == 0);
      // The previous k-tile's MMAs are done once at most this one is in flight: its stage takes a box further on.
      wgmma_wait<1>();
      if (kt > 0 && tid == 0) issue(it - 1 + kStages);
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (tid == 0) issue(it - 1 + kStages);
    epilogue.end(batch, p0, acc);
  }
}

// The tensor map of position rows [rows, cols] (16-bit, 16-byte aligned, cols a multiple of 8) as run_tiles'
// boxes read them; false where the driver refuses it.
inline bool encode_rows_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols) {
  return encode_kmajor_map<Op>(map, base, 0, rows, cols, kPositions);
}

// Launches Kernel (args, map_first, map_second, sources, tiles' batches and plane; run_tiles' arguments, the
// second map free for the epilogue where the rows have one source) on a persistent grid.
template <auto Kernel>
cudaError_t launch(const BackwardArgs& args, const CUtensorMap& map_first, const CUtensorMap& map_second,
                   const Sources& w, int64_t batches, int64_t plane, int64_t extra) {
  const int64_t tiles = batches * ceil_div(plane, int64_t(kPositions));
  if (tiles == 0) return cudaSuccess;
  const int64_t bytes = smem_bytes(w.k_tiles, extra);
  const int64_t blocks = std::min<int64_t>(sm_count(), ceil_div(tiles, kGroups));
  const cudaError_t status = fused::allow_smem<Kernel>(bytes);
  if (status != cudaSuccess) return status;
  Kernel<<<static_cast<unsigned>(blocks), kBlockThreads, bytes, args.stream>>>(args, map_first, map_second, w,
                                                                              batches, plane);
  return cudaGetLastError();
}

}  // namespace wgmma_rows
}  // namespace backward
}  // namespace trimul
