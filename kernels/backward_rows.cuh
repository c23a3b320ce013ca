// backward_rows.cuh — what the backward's memory passes (BackwardPass) share: tiles that turn position
// rows into the contraction's planes and back, warp sums, and the launch checks. A tile is one plane row
// r of every hidden channel's plane of batch b, columns k0 .. k0 + 31: its 32 positions are (b, r, k),
// or (b, k, r) for the incoming direction's a/b planes. Reading or writing a tile through shared memory
// keeps both sides coalesced: 32 consecutive plane elements per channel, one position's channels per warp.
#pragma once
#include "common.cuh"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace trimul {
namespace backward {

constexpr int kTile = 32;                // positions per tile
constexpr int kWarps = 8;                // per block
constexpr int kThreads = 32 * kWarps;
constexpr int kTileStride = kTile + 1;   // shared-memory row of one channel (+1: no bank conflicts)

// (__fdividef: 2 ulp, well inside fp32's "highest" budget; an IEEE division is most of a pass's instructions)
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// V consecutive elements of a row in one access (V = 4: 8 bytes of a 16-bit type, 16 of fp32), as floats.
template <int V, typename T>
struct alignas(sizeof(T) * V) Pack {
  T x[V];
};

template <int V, typename T>
__device__ __forceinline__ void load_pack(const T* p, float* out) {
  const Pack<V, T> pack = *reinterpret_cast<const Pack<V, T>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(pack.x[i]);
}

template <int V, typename T>
__device__ __forceinline__ void store_pack(T* p, const float* in) {
  Pack<V, T> pack;
#pragma unroll
  for (int i = 0; i < V; ++i) pack.x[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<V, T>*>(p) = pack;
}

// The vector width of a pass's row accesses: 4 where the row width and the stride of rows inside a wider buffer
// (ld, BackwardArgs::ld_rows; 0: none) are multiples of 4 and every row buffer starts 16-byte aligned (so each
// row does), else 1.
inline int row_vector(int64_t width, std::initializer_list<const void*> rows, int64_t ld = 0) {
  for (const void* p : rows)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return width % 4 == 0 && ld % 4 == 0 ? 4 : 1;
}

template <typename F>
cudaError_t dispatch_vector(int vector, F&& f) {
  return vector == 4 ? f(std::integral_constant<int, 4>{}) : f(std::integral_constant<int, 1>{});
}

// Per-block partial sums (BackwardArgs::sums): each warp adds its positions' values into its own row of
// `width` floats in shared memory; sum_rows_out adds the warps' rows in a fixed order into the block's row.
__device__ __forceinline__ void sum_rows_clear(float* rows, int64_t width) {
  for (int64_t i = threadIdx.x; i < kWarps * width; i += kThreads) rows[i] = 0.f;
}

__device__ __forceinline__ void sum_rows_out(const float* rows, int64_t width, float* sums) {
  for (int64_t c = threadIdx.x; c < width; c += kThreads) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += rows[w * width + c];
    sums[blockIdx.x * width + c] = total;
  }
}

// The two means over a row that LayerNorm's backward needs, by one warp: of d and of d x_hat, where
// x_hat = (x - shift) scale, or the row itself where it is already normalized (kNormalized: shift and scale
// unused).
template <int V, bool kNormalized, typename TX>
__device__ __forceinline__ void layer_norm_grad_means(const float* __restrict__ d_row, const TX* __restrict__ x_row,
                                                      int64_t width, float shift, float scale, float* mean_d,
                                                      float* mean_dot) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f, dot = 0.f;
  for (int64_t c = lane * V; c < width; c += 32 * V) {
    float x[V], d[V];
    load_pack<V>(x_row + c, x);
    load_pack<V>(d_row + c, d);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      sum += d[i];
      if constexpr (kNormalized) {
        dot += d[i] * x[i];
      } else {
        dot += d[i] * (x[i] - shift) * scale;
      }
    }
  }
  *mean_d = warp_sum(sum) / width;
  *mean_dot = warp_sum(dot) / width;
}

struct Tile {
  int64_t b, r, k0;
  int64_t rows, n;  // the planes' rows and columns (pair_rows, N)
  int count;  // positions in the tile (the last of a row may have fewer than kTile)
};

__device__ __forceinline__ Tile tile_at(int64_t index, const BackwardArgs& args) {
  const int64_t n = args.n, rows = pair_rows(args), per_row = ceil_div(n, kTile);
  Tile t;
  t.k0 = index % per_row * kTile;
  t.r = index / per_row % rows;
  t.b = index / per_row / rows;
  t.rows = rows;
  t.n = n;
  t.count = static_cast<int>(n - t.k0 < kTile ? n - t.k0 : kTile);
  return t;
}

// Position (row index into [P, width] rows) of the tile's q-th element (transposed: square planes only, as
// plan_backward keeps blocks of rows to the outgoing layout).
__device__ __forceinline__ int64_t tile_position(const Tile& t, int q, bool transposed) {
  const int64_t k = t.k0 + q;
  return transposed ? (t.b * t.n + k) * t.n + t.r : (t.b * t.rows + t.r) * t.n + k;
}

// Element (h, q) of the tile in the planes [B*H, rows, N].
__device__ __forceinline__ int64_t plane_index(const Tile& t, int64_t h, int q, int64_t hidden) {
  return ((t.b * hidden + h) * t.rows + t.r) * t.n + t.k0 + q;
}

// Copies tile values between planes and shared memory [h][kTileStride] (fp32), all threads of the block.
// kVectorRead (a pass that reads one set of planes and little else: z_rows): whole tiles of rows whose length is
// a multiple of 4 load 4 adjacent positions per lane, four loads in flight per thread before any is stored, so a
// warp reads 4 channels' rows per instruction (scalar loads keep too few bytes in flight: such a pass reads at a
// third of the bandwidth); the tile's stores stay conflict-free. d_proj, which reads two sets of planes and
// holds more registers, ran slower with it (bench/NOTES.md): scalar there.
template <bool kVectorRead = false, typename T>
__device__ __forceinline__ void planes_to_tile(const T* planes, float* tile, const Tile& t, int64_t hidden) {
  constexpr int kVector = 4, kLanesPerRow = kTile / kVector, kRowsPerPass = kThreads / kLanesPerRow, kBatch = 4;
  if (kVectorRead && t.count == kTile && t.n % kVector == 0) {
    const int q = static_cast<int>(threadIdx.x % kLanesPerRow) * kVector;
    for (int64_t h0 = threadIdx.x / kLanesPerRow; h0 < hidden; h0 += kBatch * kRowsPerPass) {
      float v[kBatch][kVector];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t h = h0 + u * kRowsPerPass;
        if (h < hidden) load_pack<kVector>(planes + plane_index(t, h, q, hidden), v[u]);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t h = h0 + u * kRowsPerPass;
        if (h < hidden) {
#pragma unroll
          for (int j = 0; j < kVector; ++j) tile[h * kTileStride + q + j] = v[u][j];
        }
      }
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < hidden * kTile; i += kThreads) {
    const int64_t h = i / kTile;
    const int q = static_cast<int>(i % kTile);
    if (q < t.count) tile[h * kTileStride + q] = to_float(planes[plane_index(t, h, q, hidden)]);
  }
}

template <typename T>
__device__ __forceinline__ void tile_to_planes(const float* tile, T* planes, const Tile& t, int64_t hidden) {
  for (int64_t i = threadIdx.x; i < hidden * kTile; i += kThreads) {
    const int64_t h = i / kTile;
    const int q = static_cast<int>(i % kTile);
    if (q < t.count) planes[plane_index(t, h, q, hidden)] = from_float<T>(tile[h * kTileStride + q]);
  }
}

__host__ __device__ inline int64_t tile_count(const BackwardArgs& args) {
  return args.batch * pair_rows(args) * ceil_div(args.n, kTile);
}

// Shared memory of a tile pass with `planes` tiles of H channels.
inline int64_t tile_bytes(const BackwardArgs& args, int planes) {
  return int64_t(planes) * args.h * kTileStride * static_cast<int64_t>(sizeof(float));
}

template <typename Kernel>
cudaError_t launch_blocks(Kernel kernel, const BackwardArgs& args, int64_t blocks, int64_t bytes) {
  if (bytes > max_smem_optin()) return cudaErrorNotSupported;
  if (bytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(bytes));
    if (status != cudaSuccess) return status;
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, bytes, args.stream>>>(args);
  return cudaGetLastError();
}

// A tile kernel: one block per tile, or kBackwardSumRows blocks looping over the tiles where it sums.
template <typename Kernel>
cudaError_t launch_tiles(Kernel kernel, const BackwardArgs& args, int64_t bytes, bool sums = false) {
  const int64_t tiles = tile_count(args);
  return launch_blocks(kernel, args, sums ? std::min(tiles, kBackwardSumRows) : tiles, bytes);
}

// A row kernel (one warp per position, grid-stride): kBackwardSumRows blocks where it sums.
template <typename Kernel>
cudaError_t launch_rows(Kernel kernel, const BackwardArgs& args, int64_t bytes = 0, bool sums = false) {
  const int64_t warps = ceil_div(positions(args), kWarps);
  const int64_t blocks = std::min<int64_t>(warps, sums ? kBackwardSumRows : 8 * std::max<int64_t>(sm_count(), 1) * 8);
  return launch_blocks(kernel, args, blocks, bytes);
}

// The grid of a persistent pass that sums over positions at one block per SM (the wgmma passes): one wave, so
// that each SM lays out its resident weights once and no partial wave of blocks runs after the rest. The sums'
// order, and so their bits, follow the grid: fixed for a GPU, as cuBLAS's GEMMs' bits are. `wanted`: blocks
// with work.
inline int64_t persistent_sum_blocks(int64_t wanted) {
  return std::min<int64_t>(wanted, std::min<int64_t>(std::max<int64_t>(sm_count(), 1), kBackwardSumRows));
}

}  // namespace backward
}  // namespace trimul
