// wgmma_pingpong — Hopper (sm_90a): persistent, one block per SM; one producer thread streams TMA
// k-tiles (128-byte swizzle) of this block's 128x128 tiles, in order, through a 6-stage mbarrier ring;
// two consumer warpgroups take the tiles in turn (each its own whole tile: two m64n128 products), so
// one's stores of a finished tile overlap the other's k-loop (wgmma_tma's two warpgroups finish
// together and store while no MMA runs). Same operands and split modes as wgmma_tma.
#include "tma.cuh"

namespace trimul {
namespace contract_wgmma_pingpong {

using namespace ::trimul::tma;

constexpr int BM = 128, BN = 128;
constexpr int kRowBytes = 128;  // bytes of k per tile row: one 128-byte swizzle span
constexpr int kStages = 6, kConsumers = 2;
constexpr int kThreads = 128 * (kConsumers + 1);  // warpgroup 0 produces
constexpr int kATile = BM * kRowBytes, kBTile = BN * kRowBytes, kStageBytes = kATile + kBTile;
constexpr int kSmemBytes = kStages * kStageBytes + 1024 + (2 * kStages + 2) * 8;  // + alignment slack, barriers
constexpr uint32_t kHalfRowsUnits = 64 * kRowBytes / 16;  // rows 64.. of an A tile, in descriptor units

// Where tile t of the whole problem is: its batch plane and first row and column.
struct TileAt {
  int64_t plane;
  int row0, col0;
};
__device__ __forceinline__ TileAt tile_at(int64_t t, int64_t tiles_m, int64_t tiles_n) {
  const int64_t per_plane = tiles_m * tiles_n, plane = t / per_plane, r = t - plane * per_plane;
  return TileAt{plane, static_cast<int>((r / tiles_n) * BM), static_cast<int>((r % tiles_n) * BN)};
}

// The block's tiles are t = blockIdx.x + i * gridDim.x, i = 0, 1, ...; tile i's j-th k-tile is the
// ring's (i * k_total + j)-th use: stage % kStages, round / kStages. full[s] completes when both TMA
// boxes have landed; empty[s] when the one consumer that read it (tile i's: warpgroup 1 + i % 2) is done.
// The consumers take turns (turn[c]: the other one has waited for every k-tile of the tile before
// c's next): a parity wait must not run more than one phase ahead of its barrier, and without the
// turns warpgroup 2 would wait for its first tile's k-tiles while the ring still held the first
// tile's, whose completions have the same parities. The turns also keep the two k-loops apart, so
// one's stores overlap the other's products.
template <typename Op, typename TOut, bool kScaled = false>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b, TOut* __restrict__ z,
           int64_t batch, int64_t m, int64_t n, int64_t ldz, int k_tiles, int segments, const float* z_scale) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  uint64_t* turn = empty + kStages;
  if (threadIdx.x == 0) {
    init_barrier_pairs(full, 1, empty, 1, kStages);
    mbar_init(&turn[0], 1);
    mbar_init(&turn[1], 1);
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t tiles_m = ceil_div(m, BM), tiles_n = ceil_div(n, BN), tiles = batch * tiles_m * tiles_n;
  const int k_total = segments * k_tiles;
  const int warpgroup = warp_index() / 4;
  constexpr int kElemsPerRow = kRowBytes / static_cast<int>(sizeof(Op));

  if (warpgroup == 0) {
    if (threadIdx.x == 0) {
      int64_t it = 0;
      for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const TileAt at = tile_at(t, tiles_m, tiles_n);
        for (int step = 0; step < k_total; ++step, ++it)
          load_contraction_stage<kStages, kATile, kStageBytes>(smem, full, empty, it, &map_a, &map_b, step, k_tiles,
                                                               kElemsPerRow, at.plane, batch, at.row0, at.col0);
      }
    }
    return;
  }

  const int consumer = warpgroup - 1;
  const bool leader = (threadIdx.x & 127) == 0;
  const bool paired_store = (ldz % 2) == 0;
  const float scale = kScaled ? *z_scale : 1.f;
  int64_t i = consumer;  // this warpgroup's tiles: every other one of the block's, its j-th
  int j = 0;
  for (int64_t t = blockIdx.x + consumer * int64_t(gridDim.x); t < tiles; t += 2 * int64_t(gridDim.x), i += 2, ++j) {
    const TileAt at = tile_at(t, tiles_m, tiles_n);
    // Tile i - 1's k-loop done: turn[1]'s phase j is consumer 0's j-th tile (before consumer 1's j-th),
    // turn[0]'s phase j - 1 consumer 1's (j - 1)-th (before consumer 0's j-th).
    if (i > 0) mbar_wait(&turn[consumer], (consumer == 0 ? j - 1 : j) & 1);
    float top[64], bottom[64];  // rows 0-63 and 64-127 of the tile (written by the first k-tile)
    int64_t it = i * k_total;
    for (int kt = 0; kt < k_total; ++kt, ++it) {
      const int s = static_cast<int>(it % kStages);
      mbar_wait(&full[s], static_cast<int>((it / kStages) & 1));
      const uint8_t* stage = smem + s * kStageBytes;
      const uint64_t desc_a = smem_descriptor(stage), desc_b = smem_descriptor(stage + kATile);
      wgmma_k_tile<Op>(top, desc_a, desc_b, kt == 0);
      wgmma_k_tile<Op>(bottom, desc_add(desc_a, kHalfRowsUnits), desc_b, kt == 0);
      // The previous k-tile's MMAs (two commit groups) are done once at most this one's are in
      // flight: free its stage.
      wgmma_wait<2>();
      if (kt > 0 && leader) mbar_arrive(&empty[(it - 1) % kStages]);
    }
    if (leader) mbar_arrive(&turn[1 - consumer]);  // every k-tile of this tile waited for: the other's turn
    wgmma_wait<0>();
    if (k_total > 0 && leader) mbar_arrive(&empty[(it - 1) % kStages]);
    if (k_total == 0) {  // (k = 0: a zero product; the k-loop never wrote the accumulators)
#pragma unroll
      for (int r = 0; r < 64; ++r) top[r] = bottom[r] = 0.f;
    }
    if constexpr (kScaled) {
#pragma unroll
      for (int r = 0; r < 64; ++r) {
        top[r] *= scale;
        bottom[r] *= scale;
      }
    }
    TOut* z_plane = z + at.plane * m * ldz;
    store_accumulators<BN>(z_plane, top, at.row0, at.col0, m, n, ldz, paired_store);
    store_accumulators<BN>(z_plane, bottom, at.row0 + 64, at.col0, m, n, ldz, paired_store);
  }
}

template <typename Op, typename TOut, bool kScaled>
cudaError_t launch_kernel(const ContractArgs& args, const CUtensorMap& map_a, const CUtensorMap& map_b) {
  const int64_t tiles = args.batch * ceil_div(args.m, BM) * ceil_div(args.n, BN);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(fused::sm_count(), tiles)));  // persistent
  return launch_contraction_kernel<kernel<Op, TOut, kScaled>, Op, TOut>(args, map_a, map_b, grid, kThreads, kSmemBytes);
}

cudaError_t launch(const ContractArgs& args) {
  return launch_tma_contraction<BM, BN>(args, [&](auto op_tag, auto out_tag, auto scaled, const CUtensorMap& map_a,
                                                   const CUtensorMap& map_b) {
    return launch_kernel<typename decltype(op_tag)::type, typename decltype(out_tag)::type, decltype(scaled)::value>(
        args, map_a, map_b);
  });
}

}  // namespace contract_wgmma_pingpong
}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(wgmma_pingpong, trimul::contract_wgmma_pingpong::launch);
