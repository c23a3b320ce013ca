// wgmma_rs.cuh — the register-row input kernels' shared parts (wgmma_rs, wgmma_rs_384): the rows as
// wgmma's A operand from registers, resident weights by TMA, two accumulator sets in turn, and the
// gated parts out through a transposing scratch by TMA box stores.
#pragma once
#include "input_pass.cuh"

namespace trimul {
namespace input_pass {

// wgmma_ws stages LayerNorm-ed rows in shared memory (wgmma's B operand) through 7 stager warps whose
// loads in flight are bounded by their registers (~28 KB per SM at pair_dim 128, which bounds that kernel's
// bandwidth there). Here the rows are wgmma's A operand, from registers: each MMA
// warpgroup loads its own 64-position tiles (a thread: two rows, 32 channels of each: 8 loads of 4
// channels per row), LayerNorms them in registers (statistics over a quad: two shuffles), and multiplies
// them by the resident weights in parts of 64 weight rows (N = 64), two accumulator sets in turn; the next
// tile's rows (32 KB per warpgroup for fp32 rows) load while this tile's parts multiply and store. The
// weights come prepared for it (ForwardArgs::w_in_rows: LayerNorm_in's affine folded in, k permuted so that
// a k-step's fragment is 4 adjacent channels of a row, and the biases as one more k-step against ones).
// The gated outputs go out through a per-warpgroup scratch, transposed by stmatrix.trans (32 h rows x 64
// positions per part), as one TMA box store per part.
namespace wgmma_rs {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kThreads = 128 * kGroups;
constexpr int kPositions = 64;                      // per tile: wgmma's M
constexpr int kC = 128;                             // the pair_dim it takes
constexpr int kSteps = kC / 16;                     // k16 steps of the rows
// 128-byte k-tiles per weight chunk: the rows' two, then the biases' (ForwardArgs::w_in_rows: columns kC and
// kC + 1 hold each weight row's bias as a 16-bit part and remainder, multiplied by ones in a ninth k-step,
// so the accumulators come out biased: no bias loads or adds in the epilogue).
constexpr int kKTiles = kC * 2 / kKBytes + 1;
constexpr int kScratchBytes = 2 * 32 * kPositions * 2;  // per warpgroup: two buffers of 32 h x 64 positions

inline int64_t weight_tiles(int64_t rows_ab) { return 2 * rows_ab / kChunkRows * kKTiles; }
// Dynamic shared memory: the resident weights (1024-byte aligned), the scratches, the weights' barriers.
inline int64_t smem_bytes(int64_t rows_ab, int groups = kGroups) {
  return 1023 + weight_tiles(rows_ab) * (kStageBytes + 8) + groups * kScratchBytes;
}

// Four adjacent channels of a row as one load: 16 bytes of fp32 rows, 8 of 16-bit ones.
template <typename TIn>
struct FourChannels {
  using Raw = std::conditional_t<std::is_same<TIn, float>::value, float4, uint2>;
  static __device__ __forceinline__ Raw load(const TIn* p) { return *reinterpret_cast<const Raw*>(p); }
  static __device__ __forceinline__ float4 widen(const Raw& raw) {
    if constexpr (std::is_same<TIn, float>::value) {
      return raw;
    } else {
      const TIn* e = reinterpret_cast<const TIn*>(&raw);
      return make_float4(to_float(e[0]), to_float(e[1]), to_float(e[2]), to_float(e[3]));
    }
  }
};

// A part's gated 16-bit values out (packed[qq][k]: this thread's pairs of 8x8 block q = 2 qq + k / 2, rows of
// half k % 2, as the accumulators hold them): each block into the warpgroup's scratch `buf` transposed
// (stmatrix.trans: row = h, 8 positions), its 16-byte chunk XOR-swizzled by h % 8 (TMA's 128-byte swizzle,
// `buf` 1024-byte aligned), then the part's box of 32 h x 64 positions at (batch, h0, p0) of a_t or b_t
// ([batch][hidden][plane], `map`: its edges clip h >= hidden and positions past the plane) by one TMA store
// that the warpgroup's first thread issues.
__device__ __forceinline__ void store_part(uint8_t* buf, const uint32_t (&packed)[2][4], const CUtensorMap* map,
                                           int64_t batch, int64_t h0, int64_t p0) {
  const int lane = threadIdx.x & 31, warp4 = (threadIdx.x >> 5) & 3, tid = threadIdx.x & 127;
  const int k = lane >> 3, i = lane & 7;  // (lane 8k + i: row i of block k)
#pragma unroll
  for (int qq = 0; qq < 2; ++qq) {
    const int q = 2 * qq + (k >> 1), hf = k & 1;
    stmatrix_x4<true>(smem_u32(buf) + (8 * q + i) * (2 * kPositions) + (((2 * warp4 + hf) ^ i) << 4), packed[qq][0],
                      packed[qq][1], packed[qq][2], packed[qq][3]);
  }
  fence_proxy_async();  // (the TMA engine reads `buf` through the async proxy)
  // The previous part's box has left the other buffer (which the next part writes) once this barrier passes.
  if (tid == 0) bulk_wait_read<0>();
  named_barrier(1 + (threadIdx.x >> 7), 128);
  if (tid == 0) {
    tma_store(map, buf, static_cast<int>(p0), static_cast<int>(h0), static_cast<int>(batch));
    bulk_commit();
  }
}

// Part `part` (32 h) of a warpgroup's 64 rows as the m64nN accumulators hold them, rows[hf][j] the 16-bit pair of
// row half hf at columns 8 j + 2 t, + 1: its blocks in store_part's order (q = 2 qq + k / 2 of the part's four 8-h
// blocks, row half k % 2), then store_part.
template <int kBlocks>
__device__ __forceinline__ void store_rows_part(uint8_t* buf, const uint32_t (&rows)[2][kBlocks], int part,
                                                const CUtensorMap* map, int64_t batch, int64_t h0, int64_t p0) {
  uint32_t box[2][4];
#pragma unroll
  for (int qq = 0; qq < 2; ++qq)
#pragma unroll
    for (int k = 0; k < 4; ++k) box[qq][k] = rows[k & 1][4 * part + 2 * qq + (k >> 1)];
  store_part(buf, box, map, batch, h0, p0);
}

// Whether a register-row kernel for rows of `c` channels takes these sizes: sm_90a on Hopper, rows of exactly
// c channels in 16-byte vectors, the prepared weights (ForwardArgs::w_in_rows), H <= 128 (rows_ab <= 256), the
// kernel's `smem` bytes of shared memory, and a_t / b_t whose TMA coordinates fit 31 bits.
template <typename TIn>
bool takes_rows(const ForwardArgs& args, int c, int64_t smem) {
  return tensor_map_encoder() != nullptr && args.c == c && args.c_pad == c && args.w_in_rows != nullptr &&
         rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair) &&
         args.rows_ab <= 2 * kChunkRows && smem <= max_smem_optin() && pair_rows(args) * args.ld < (int64_t(1) << 31) &&
         args.batch < (int64_t(1) << 31);
}

// Launches a register-row kernel instance (both kernels' signature) on `blocks` blocks with `bytes` of shared
// memory: the prepared weights' map (rows of c_pad + 64 columns, 128-row boxes) and the a_t / b_t maps.
template <auto Kernel, typename Op>
cudaError_t launch_kernel(const ForwardArgs& args, int64_t blocks, int64_t bytes, int64_t tiles_per_batch,
                          int threads = kThreads) {
  // (a_t / b_t: boxes of 32 h x 64 positions, store_part)
  const int64_t plane = pair_rows(args) * args.ld;
  CUtensorMap map_w, map_a, map_b;
  if (!encode_kmajor_map<Op>(&map_w, args.w_in_rows, 0, 2 * args.rows_ab, args.c_pad + 64, kChunkRows) ||
      !encode_kmajor_map<Op>(&map_a, args.a_t, args.batch, args.h, plane, 32) ||
      !encode_kmajor_map<Op>(&map_b, args.b_t, args.batch, args.h, plane, 32))
    return cudaErrorNotSupported;
  const cudaError_t status = allow_smem<Kernel>(bytes);
  if (status != cudaSuccess) return status;
  Kernel<<<static_cast<unsigned>(blocks), threads, bytes, args.stream>>>(args, map_w, map_a, map_b, tiles_per_batch);
  return cudaGetLastError();
}

// A register-row kernel's resident weights by TMA, issued by thread 0: tile i (of `tiles`, kStageBytes each) is
// k-tile i % k_tiles of the 128-row chunk i / k_tiles of the map's rows from row_base, on barrier full[i]
// (initialised here; the block syncs once between the initialisation and the loads).
__device__ __forceinline__ void load_resident_weights(uint8_t* weights, uint64_t* full, int tiles, int k_tiles,
                                                      const CUtensorMap* map, int row_base) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < tiles; ++i) mbar_init(&full[i], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < tiles; ++i) {
      mbar_expect_tx(&full[i], kStageBytes);
      tma_load_2d(weights + i * kStageBytes, map, (i % k_tiles) * (kKBytes / 2), row_base + (i / k_tiles) * kChunkRows,
                  &full[i]);
    }
}

// A tile's kParts (even) N = 64 parts, two accumulator sets in turn: part p + 1's products are issued before
// part p's stores, so the products' latency hides under the epilogue. multiply(part, acc) issues and commits
// a part's wgmmas, store(part, acc) takes its finished accumulators. (kParts a template argument, the loop
// unrolled: with a runtime count the last round's branch merged two definitions of acc0 by register moves
// while a wgmma wrote it, and ptxas serialized every wgmma.)
template <int kParts, class Multiply, class Store>
__device__ __forceinline__ void multiply_and_store_parts(Multiply&& multiply, Store&& store) {
  static_assert(kParts % 2 == 0, "parts in pairs");
  float acc0[32], acc1[32];
  multiply(0, acc0);
#pragma unroll
  for (int part = 0; part < kParts; part += 2) {
    multiply(part + 1, acc1);
    wgmma_wait<1>();
    fence_accumulators(acc0);
    store(part, acc0);
    if (part + 2 < kParts) {
      multiply(part + 2, acc0);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    fence_accumulators(acc1);
    store(part + 1, acc1);
  }
}


}  // namespace wgmma_rs
}  // namespace input_pass
}  // namespace trimul
