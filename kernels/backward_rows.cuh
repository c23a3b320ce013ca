// backward_rows.cuh — what the backward's memory passes (BackwardPass) share: tiles that turn position
// rows into the contraction's planes and back, warp sums, and the launch checks. A tile is one plane row
// r of every hidden channel's plane of batch b, columns k0 .. k0 + 31: its 32 positions are (b, r, k),
// or (b, k, r) for the incoming direction's a/b planes. Reading or writing a tile through shared memory
// keeps both sides coalesced: 32 consecutive plane elements per channel, one position's channels per warp.
#pragma once
#include "common.cuh"

namespace trimul {
namespace backward {

constexpr int kTile = 32;                // positions per tile
constexpr int kWarps = 8;                // per block
constexpr int kThreads = 32 * kWarps;
constexpr int kTileStride = kTile + 1;   // shared-memory row of one channel (+1: no bank conflicts)

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

struct Tile {
  int64_t b, r, k0;
  int count;  // positions in the tile (the last of a row may have fewer than kTile)
};

__device__ __forceinline__ Tile tile_at(int64_t index, int64_t n) {
  const int64_t per_row = ceil_div(n, kTile);
  Tile t;
  t.k0 = index % per_row * kTile;
  t.r = index / per_row % n;
  t.b = index / per_row / n;
  t.count = static_cast<int>(n - t.k0 < kTile ? n - t.k0 : kTile);
  return t;
}

// Position (row index into [P, width] rows) of the tile's q-th element.
__device__ __forceinline__ int64_t tile_position(const Tile& t, int q, int64_t n, bool transposed) {
  const int64_t k = t.k0 + q;
  return transposed ? (t.b * n + k) * n + t.r : (t.b * n + t.r) * n + k;
}

// Element (h, q) of the tile in the planes [B*H, N, N].
__device__ __forceinline__ int64_t plane_index(const Tile& t, int64_t h, int q, int64_t n, int64_t hidden) {
  return ((t.b * hidden + h) * n + t.r) * n + t.k0 + q;
}

// Copies tile values between planes and shared memory [h][kTileStride] (fp32), all threads of the block.
template <typename T>
__device__ __forceinline__ void planes_to_tile(const T* planes, float* tile, const Tile& t, int64_t n,
                                               int64_t hidden) {
  for (int64_t i = threadIdx.x; i < hidden * kTile; i += kThreads) {
    const int64_t h = i / kTile;
    const int q = static_cast<int>(i % kTile);
    if (q < t.count) tile[h * kTileStride + q] = to_float(planes[plane_index(t, h, q, n, hidden)]);
  }
}

template <typename T>
__device__ __forceinline__ void tile_to_planes(const float* tile, T* planes, const Tile& t, int64_t n,
                                               int64_t hidden) {
  for (int64_t i = threadIdx.x; i < hidden * kTile; i += kThreads) {
    const int64_t h = i / kTile;
    const int q = static_cast<int>(i % kTile);
    if (q < t.count) planes[plane_index(t, h, q, n, hidden)] = from_float<T>(tile[h * kTileStride + q]);
  }
}

inline int64_t tile_count(const BackwardArgs& args) { return args.batch * args.n * ceil_div(args.n, kTile); }

// Shared memory of a tile pass with `planes` tiles of H channels.
inline int64_t tile_bytes(const BackwardArgs& args, int planes) {
  return int64_t(planes) * args.h * kTileStride * static_cast<int64_t>(sizeof(float));
}

// Launches a tile kernel (one block per tile) with `bytes` of dynamic shared memory.
template <typename Kernel>
cudaError_t launch_tiles(Kernel kernel, const BackwardArgs& args, int64_t bytes) {
  if (bytes > max_smem_optin()) return cudaErrorNotSupported;
  if (bytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(bytes));
    if (status != cudaSuccess) return status;
  }
  kernel<<<static_cast<unsigned>(tile_count(args)), kThreads, bytes, args.stream>>>(args);
  return cudaGetLastError();
}

// Launches a row kernel: one warp per position, grid-stride.
template <typename Kernel>
cudaError_t launch_rows(Kernel kernel, const BackwardArgs& args) {
  const int64_t positions = args.batch * args.n * args.n;
  const int64_t blocks = std::min<int64_t>(ceil_div(positions, kWarps), 16 * std::max<int64_t>(sm_count(), 1) * 8);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, args.stream>>>(args);
  return cudaGetLastError();
}

}  // namespace backward
}  // namespace trimul
