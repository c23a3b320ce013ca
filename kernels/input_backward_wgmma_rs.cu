// wgmma_rs — input_backward: d proj with proj recomputed from x_hat on the tensor cores, never written;
// Hopper (sm_90a), bf16 operands, pair_dim 128, hidden a multiple of 32 up to 128; d pair with d x_hat
// multiplied in the pass (input_backward_d_pair.cuh); other passes as rows'.
// The d_proj pass of input_backward_rows.cuh reads proj, [P, 4H], which a cuBLAS GEMM wrote just before (and the
// step holds at its peak). Here each warpgroup takes 64-position tiles of the da/db planes: the tile's x_hat rows
// are wgmma's A operand from registers (as the forward's input pass holds its LayerNorm-ed rows), W_in_f stays
// resident (laid out by each block from the fp32 parameter: no host-side preparation, whose ATen calls cost more
// than the kernel at small steps); three warpgroups per block, since at two (255 registers, one block per SM) the
// pass is issue-bound; the rows load at their tile, not a tile ahead, which fits 168 registers; proj comes out in
// parts of 64 weight rows (32 h of proj and their gates), two accumulator sets in turn. Each part's da (or db) box,
// 32 h x 64 positions, arrives by TMA (kBoxStages in flight) and ldmatrix.trans puts it in the accumulators' layout
// (the mirror of the forward's transposing stores), so d pa = da s m and d ga = d pa pa (1 - s) are computed in
// registers and leave as whole 16-byte chunks of d proj rows through a per-warp staging tile. The sums over
// positions (the bias gradients) reduce-scatter over a warp's rows into two columns per lane and part, added into
// the warp's row of shared memory across the block's tiles (registers would spill): one block per SM with fixed
// tiles, the warps' rows added in order, so the bits are fixed for a GPU.
// d_proj_d_pair (the gate on LayerNorm_in's rows, its rstd kept by the forward) writes d pair from the same tile:
// each part's d pa / d ga pairs, packed for d proj's store, are also the A fragments of d x_hat += d proj W_in_f
// (the resident W_in tiles read transposed: k = weight row, n = channel), started by d gate W_gate_f (W_gate_f
// resident too, its rows permuted so that a thread's fragment is 4 adjacent channels of its d gate rows, as
// x_hat's); d x_hat's accumulators hold the channels of the thread's x_hat fragments, so LayerNorm_in's backward
// (quad sums per row) runs on them with the kept rstd, and the pair rows and d x_hat are never read or written.
// Two warpgroups there: d x_hat's 64 accumulators do not fit beside three.
#include "input_backward_d_pair.cuh"
#include "input_backward_rows.cuh"
#include "wgmma_rs.cuh"

namespace trimul {
namespace backward {
namespace proj_rs {

// (the backward's wgmma row kernels' tile and staging shapes; the block here has its own warpgroup count)
using namespace ::trimul::backward::wgmma_rows;
// Warpgroups per block, each on its own 64-position tiles: three for d_proj, two with d pair (kDPair).
constexpr int groups_for(bool d_pair) { return d_pair ? 2 : 3; }

constexpr int kC = 128;                                    // the pair_dim it takes
constexpr int kSteps = kC / 16;                            // k16 steps of a row
constexpr int kKTiles = kC * 2 / ws::kKBytes;              // 128-byte k-tiles per 128-row weight chunk
constexpr int kBoxStages = 3;                              // da/db boxes in flight per warpgroup
constexpr int kBoxBytes = 32 * kPositions * 2;             // a part's box: 32 h x 64 positions, bf16
constexpr int kStagingRowBytes = 128;                      // a position's 32 d pa, then 32 d ga (bf16)
constexpr int kStagingBytes = 16 * kStagingRowBytes;       // per warp: its 16 positions
constexpr int kGroupBytes = kBoxStages * kBoxBytes + 4 * kStagingBytes;

// Parts of 64 weight rows: 2H / 32 (a's h in 32s, then b's).
inline int parts_for(int64_t h) { return static_cast<int>(h / 16); }

// Dynamic shared memory: the resident weights (1024-byte aligned; with d pair W_gate_f's chunk after W_in_f's),
// per warpgroup its boxes and staging tiles, the biases, the warps' sums, the boxes' barriers.
inline int64_t smem_bytes(int64_t h, bool d_pair) {
  const int groups = groups_for(d_pair);
  const int64_t w_tiles = parts_for(h) / 2 * kKTiles + (d_pair ? kKTiles : 0);
  return 1023 + w_tiles * ws::kStageBytes + groups * kGroupBytes + 4 * h * int64_t(sizeof(float)) +
         4 * groups * 4 * h * int64_t(sizeof(float)) + groups * kBoxStages * 8;
}

// W_in_f's row (rows pa | ga | pb | gb) at grouped row `row`: a's 2H rows, then b's, 16g + e / 16g + 8 + e the
// proj / gate of h = 8g + e (so that a part's accumulators hold each h's proj and gate in one thread).
__device__ __forceinline__ int grouped_source(int row, int hidden) {
  const int side = row / (2 * hidden), w = row - side * 2 * hidden;
  return (2 * side + (w & 15) / 8) * hidden + (w / 16) * 8 + (w & 7);
}

// The row of W_gate_f (k of d gate) at resident row r: k = 16s + 8hh + 2t + e holds 16s + 4t + 2hh + e, so that a
// thread's A fragment of d gate for k-step s is channels 16s + 4t .. + 3 of its rows (as x_hat's).
__device__ __forceinline__ int gate_source(int r) {
  const int w = r & 15;
  return (r & ~15) + 4 * ((w & 7) >> 1) + 2 * (w >> 3) + (w & 1);
}

// One resident line: channels 16 s .. + 15 of the fp32 weight row `source` into row `row` of the 128-row chunks
// from `weights`, bf16, k permuted within the 16 channels (k = 16s + 8hh + 2t + e holds channel 16s + 4t + 2hh +
// e: a thread's A fragment for k-step s is channels 16s + 4t .. + 3 of its row), each 16-byte chunk XOR-swizzled
// by its row (the layout a TMA box load with 128-byte swizzle gives).
__device__ __forceinline__ void lay_out_line(uint8_t* weights, int row, int s, const float* source) {
  const float4* in = reinterpret_cast<const float4*>(source + 16 * s);
  float4 c[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) c[t] = in[t];  // channels 16 s + 4 t .. + 3
  const uint4 even = make_uint4(pack_pair<Op>(c[0].x, c[0].y), pack_pair<Op>(c[1].x, c[1].y),
                                pack_pair<Op>(c[2].x, c[2].y), pack_pair<Op>(c[3].x, c[3].y));  // hh = 0
  const uint4 odd = make_uint4(pack_pair<Op>(c[0].z, c[0].w), pack_pair<Op>(c[1].z, c[1].w),
                               pack_pair<Op>(c[2].z, c[2].w), pack_pair<Op>(c[3].z, c[3].w));   // hh = 1
  const int r = row % ws::kChunkRows, chunk = 2 * (s % 4);
  uint8_t* line = weights + ((row / ws::kChunkRows) * kKTiles + s / 4) * ws::kStageBytes + r * ws::kKBytes;
  *reinterpret_cast<uint4*>(line + ((chunk ^ (r & 7)) << 4)) = even;
  *reinterpret_cast<uint4*>(line + (((chunk + 1) ^ (r & 7)) << 4)) = odd;
}

// The resident weights as wgmma reads them: W_in_f's grouped rows in 128-row chunks of kKTiles 128-byte k-tiles
// (lay_out_line), the biases in grouped order, and where `gate` is given W_gate_f's rows in gate_source's order
// (one chunk). All threads of the block.
__device__ __forceinline__ void lay_out_weights(const BackwardArgs& args, uint8_t* weights, float* bias,
                                                uint8_t* gate) {
  const int hidden = static_cast<int>(args.h), rows = 4 * hidden;
#pragma unroll 4  // (four rounds of loads in flight: the layout is a chain of L2 round trips)
  for (int index = threadIdx.x; index < rows * kSteps; index += blockDim.x) {
    const int row = index / kSteps, s = index - row * kSteps;
    lay_out_line(weights, row, s, args.w_in_f + int64_t(grouped_source(row, hidden)) * kC);
  }
  if (gate != nullptr)
#pragma unroll 4
    for (int index = threadIdx.x; index < kC * kSteps; index += blockDim.x) {
      const int row = index / kSteps, s = index - row * kSteps;
      lay_out_line(gate, row, s, args.w_gate_f + int64_t(gate_source(row)) * kC);
    }
  for (int row = threadIdx.x; row < rows; row += blockDim.x) bias[row] = args.b_in_f[grouped_source(row, hidden)];
  fence_proxy_async();  // (wgmma reads the weights through the async proxy)
}

// This thread's channels 16 s + 4 t .. + 3 (each k-step's A fragment, the weights' k permutation) of row `pos` of
// [P, kC] rows, one 8-byte load each, row 0's where pos < 0 (zero_outside clears them after): no branch, so that a
// tile's loads all leave before the first is used (with a select per load the compiler waited for each row's
// loads before the next row's branches: one DRAM round trip per row instead of one per tile).
__device__ __forceinline__ void load_row_quads(const Op* rows, int64_t pos, int t, uint2 (&quads)[kSteps]) {
  const Op* row = rows + (pos >= 0 ? pos : 0) * kC + 4 * t;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) quads[s] = *reinterpret_cast<const uint2*>(row + 16 * s);
}
__device__ __forceinline__ void zero_outside(int64_t pos, uint2 (&quads)[kSteps]) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
    if (pos < 0) quads[s] = make_uint2(0u, 0u);
}

// Four d pair values of a row (adjacent channels) in pair's dtype.
__device__ __forceinline__ void store_d_pair(void* d_pair, Dtype dtype, int64_t offset, const float (&v)[4]) {
  switch (dtype) {
    case Dtype::f32: store_pack<4>(static_cast<float*>(d_pair) + offset, v); break;
    case Dtype::bf16: store_pack<4>(static_cast<__nv_bfloat16*>(d_pair) + offset, v); break;
    case Dtype::f16: store_pack<4>(static_cast<__half*>(d_pair) + offset, v); break;
  }
}

// The position (row of x_hat, d proj and the mask) of element p of a batch's N x N plane (rows x N for a block of
// rows, outgoing only): the plane's order outgoing, transposed incoming (the one integer division per row is incoming's: this pass is issue-bound).
__device__ __forceinline__ int64_t position_of(const BackwardArgs& args, int64_t batch, uint32_t p) {
  if (!args.incoming) return batch * plane_positions(args) + p;
  const uint32_t n = static_cast<uint32_t>(args.n), f = p / n, k = p - f * n;
  return (batch * args.n + k) * args.n + f;
}

// The d proj column (of 4H: pa | ga | pb | gb) whose sum lane 4 g + t keeps as its i-th of a part's; the parts
// per side a constant, so that an unrolled part's column costs no division.
template <int kPartsPerSide>
__device__ __forceinline__ int sum_column(int part, int g, int t, int i, int64_t hidden) {
  const int side = part / kPartsPerSide, h = (part % kPartsPerSide) * 32 + 8 * (g >> 1) + 2 * t + i;
  return (2 * side + (g & 1)) * static_cast<int>(hidden) + h;
}

// kMaskGrad: whether it writes d mask (a mask that needs its gradient; otherwise its products are not computed).
// kDPair: d_proj_d_pair (d pair as well).
template <int kParts, bool kMaskGrad, bool kDPair>
__global__ void __launch_bounds__(128 * groups_for(kDPair), 1)
    kernel(const BackwardArgs args, const __grid_constant__ CUtensorMap map_da,
           const __grid_constant__ CUtensorMap map_db, int64_t tiles_per_batch) {
  constexpr int kGroups = groups_for(kDPair);
  constexpr int kWTiles = kParts / 2 * kKTiles, kPartsPerSide = kParts / 2;
  const int64_t hidden = args.h, width = 4 * hidden;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* weights = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* gate_weights = weights + kWTiles * ws::kStageBytes;  // (kDPair: W_gate_f's chunk)
  uint8_t* groups = gate_weights + (kDPair ? kKTiles * ws::kStageBytes : 0);
  float* bias = reinterpret_cast<float*>(groups + kGroups * kGroupBytes);
  float* warp_sums = bias + width;  // [warp][width]: each lane's columns, summed over the block's tiles in order
  uint64_t* barriers = reinterpret_cast<uint64_t*>(warp_sums + 4 * kGroups * width);

  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3, tid = threadIdx.x & 127;
  uint8_t* boxes = groups + group * kGroupBytes;
  uint8_t* staging = boxes + kBoxStages * kBoxBytes + warp4 * kStagingBytes;
  uint64_t* box_full = barriers + group * kBoxStages;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kGroups * kBoxStages; ++i) mbar_init(&barriers[i], 1);
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t plane = plane_positions(args), tiles = args.batch * tiles_per_batch;
  const int64_t stride = int64_t(gridDim.x) * kGroups, first = int64_t(blockIdx.x) * kGroups + group;
  // The warpgroup's it-th box: part it % kParts of its (it / kParts)-th tile, into stage it % kBoxStages.
  const auto issue = [&](int it) {
    const int64_t tile = first + int64_t(it / kParts) * stride;
    if (tile >= tiles) return;
    const int part = it % kParts, stage = it % kBoxStages;
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
    mbar_expect_tx(&box_full[stage], kBoxBytes);
    tma_load(boxes + stage * kBoxBytes, part < kPartsPerSide ? &map_da : &map_db, static_cast<int>(p0),
             (part % kPartsPerSide) * 32, static_cast<int>(batch), &box_full[stage]);
  };
  if (tid == 0)
    for (int it = 0; it < kBoxStages; ++it) issue(it);

  // This thread's rows of a tile (its rows of the wgmma's A fragment): positions 16 warp4 + lane / 4 and 8
  // further; of each, channels 16 s + 4 t .. + 3 for k-step s (the weights' k permutation), and the mask's bits.
  const int row0 = 16 * warp4 + (lane >> 2);
  const Op* x_hat = static_cast<const Op*>(args.x_hat);
  const auto row_positions = [&](int64_t tile, int64_t (&pos)[2]) {
    const int64_t batch = tile < tiles ? tile / tiles_per_batch : 0;
    const int64_t p0 = (tile - batch * tiles_per_batch) * kPositions;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t p = p0 + row0 + 8 * hf;
      pos[hf] = tile < tiles && p < plane ? position_of(args, batch, static_cast<uint32_t>(p)) : -1;
    }
  };

  // A part's 64 resident weight rows: chunk part / 2 of W_in_f's 128-row chunks, its half part % 2.
  const auto part_weights = [&](int part) {
    return weights + (part >> 1) * kKTiles * ws::kStageBytes + (part & 1) * ws::kGroupRowBytes;
  };
  int64_t tile = first;
  lay_out_weights(args, weights, bias, kDPair ? gate_weights : nullptr);  // (the first boxes load meanwhile)
  __syncthreads();
  Op* d_proj = static_cast<Op*>(args.rows);
  {
    const int g = lane >> 2;
#pragma unroll
    for (int part = 0; part < kParts; ++part)
#pragma unroll
      for (int i = 0; i < 2; ++i) warp_sums[warp * width + sum_column<kPartsPerSide>(part, g, t, i, hidden)] = 0.f;
  }
  int it = 0;  // the next box to take
  for (; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_batch, p0 = (tile - batch * tiles_per_batch) * kPositions;
    // The tile's rows (loaded here, not a tile ahead: 32 registers fewer), every load issued before any is used:
    // x_hat's, then (kDPair) d gate's, then the mask bits (their dtype's switch is a branch); the rstd below.
    int64_t row_pos[2];
    row_positions(tile, row_pos);
    uint2 raw[2][kSteps], gate_raw[2][kSteps];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) load_row_quads(x_hat, row_pos[hf], t, raw[hf]);
    if constexpr (kDPair)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) load_row_quads(static_cast<const Op*>(args.d_gate), row_pos[hf], t, gate_raw[hf]);
    uint32_t mask_bits[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      mask_bits[hf] = row_pos[hf] >= 0 ? load_mask_bits(args.mask, args.mask_kind, row_pos[hf]) : 0u;
    uint32_t frag[kSteps][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) zero_outside(row_pos[hf], raw[hf]);
    row_fragments(raw, frag);
    const float mask[2] = {mask_value(mask_bits[0], args.mask_kind), mask_value(mask_bits[1], args.mask_kind)};
    // The staging tile's rows this lane stores: 4 r + lane / 8 of the warp's 16.
    int64_t out_pos[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t p = p0 + 16 * warp4 + 4 * r + (lane >> 3);
      out_pos[r] = p < plane ? position_of(args, batch, static_cast<uint32_t>(p)) : -1;
    }
    float d_mask[2] = {0.f, 0.f};
    // kDPair: d x_hat, [4 j + 2 hf + e] the channel of k-step j / 2 of this thread's fragments of row hf (16 s + 4 t
    // + 2 (j % 2) + e); started by d gate W_gate_f, then each part's d proj W_in_f added. One m64n128 product per
    // k-step: the two 64-channel halves of the resident tiles are their k-tiles, kStageBytes apart (LBO).
    float dx[64];
    float rstd[2] = {0.f, 0.f};  // (kDPair: loaded at the tile's start, not behind the last wgmma wait)
    if constexpr (kDPair) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) rstd[hf] = row_pos[hf] >= 0 ? args.rstd[row_pos[hf]] : 0.f;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) zero_outside(row_pos[hf], gate_raw[hf]);
      uint32_t gate_frag[kSteps][4];
      row_fragments(gate_raw, gate_frag);
      const uint64_t gate_desc = smem_descriptor(gate_weights, ws::kStageBytes);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s)  // (k-step s: W_gate_f's resident rows 16 s .., 2048 bytes on)
        wgmma_rs_64x128_trans_b<Op>(dx, gate_frag[s], desc_add(gate_desc, 128 * s), s > 0);
      wgmma_commit();
    }

    const auto multiply = [&](int part, float(&acc)[32]) {
      const uint8_t* w = part_weights(part);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        wgmma_rs_64x64<Op>(acc, frag[s], desc_add(smem_descriptor(w + (s / 4) * ws::kStageBytes), 2 * (s % 4)), s > 0);
      wgmma_commit();
    };
    const auto store = [&](int part, const float(&acc)[32]) {
      // da (or db) of this part's 32 h at this thread's positions: da[qq][k] holds h = 8 q + 2 t, + 1 of block
      // q = 2 qq + k / 2 at position row0 + 8 (k % 2), the accumulators' pairing.
      const int stage = it % kBoxStages;
      mbar_wait(&box_full[stage], (it / kBoxStages) & 1);
      const uint32_t box = smem_u32(boxes + stage * kBoxBytes);
      uint32_t da[2][4];
      {
        const int k = lane >> 3, i = lane & 7;
#pragma unroll
        for (int qq = 0; qq < 2; ++qq) {
          const int q = 2 * qq + (k >> 1), hf = k & 1;
          ldmatrix_x4_trans(da[qq], box + (8 * q + i) * (2 * kPositions) + (((2 * warp4 + hf) ^ i) << 4));
        }
      }
      release_stage_to_tma(1 + group, 128);  // (every thread has read the stage: it takes the box kBoxStages on)
      if (tid == 0) issue(it + kBoxStages);
      ++it;
      // acc[4 j + 2 hf + e]: position row0 + 8 hf, weight row 8 j + 2 t + e of the part (j = 2 q: proj of
      // h = 8 q + 2 t + e, j = 2 q + 1: its gate).
      const float* b = bias + part * 64;
      uint32_t out[2][2][4];  // [gate][qq][k]: d pa / d ga pairs as da's
      float column[16] = {};  // [2 j + e]: the part's column 8 j + 2 t + e summed over this thread's positions
#pragma unroll
      for (int qq = 0; qq < 2; ++qq)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int q = 2 * qq + (k >> 1), hf = k & 1;
          const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&da[qq][k]));
          const float2 bp = *reinterpret_cast<const float2*>(b + 16 * q + 2 * t);
          const float2 bg = *reinterpret_cast<const float2*>(b + 16 * q + 8 + 2 * t);
          float d_pa[2], d_ga[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pa = acc[8 * q + 2 * hf + e] + (e ? bp.y : bp.x);
            const float s = ::trimul::mma::sigmoid(acc[8 * q + 4 + 2 * hf + e] + (e ? bg.y : bg.x));
            const float das = (e ? d.y : d.x) * s;
            d_pa[e] = das * mask[hf];
            d_ga[e] = d_pa[e] * fmaf(-pa, s, pa);  // d pa pa (1 - s)
            if constexpr (kMaskGrad) d_mask[hf] = fmaf(das, pa, d_mask[hf]);
            column[4 * q + e] += d_pa[e];
            column[4 * q + 2 + e] += d_ga[e];
          }
          out[0][qq][k] = pack_pair<Op>(d_pa[0], d_pa[1]);
          out[1][qq][k] = pack_pair<Op>(d_ga[0], d_ga[1]);
        }
      if constexpr (kDPair) {
        // d x_hat += the part's d proj W_in rows: k-step s is the part's weight rows 16 s .. (d pa of h = 8 s +
        // 2 t + e at k = 2 t + e, its d ga at 8 + 2 t + e: out[.][s / 2][2 (s % 2) + hf]), the resident tile
        // read transposed; the pairs stay unchanged until the next part's wait.
        const uint64_t desc = smem_descriptor(part_weights(part), ws::kStageBytes);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint32_t a[4] = {out[0][s / 2][2 * (s % 2)], out[0][s / 2][2 * (s % 2) + 1], out[1][s / 2][2 * (s % 2)],
                                 out[1][s / 2][2 * (s % 2) + 1]};
          wgmma_rs_64x128_trans_b<Op>(dx, a, desc_add(desc, 128 * s), 1);
        }
        wgmma_commit();
      }
      // d proj out: each 8 x 8 block (position rows, 8 h) into the warp's staging tile (row 8 hf + i of the
      // warp's 16 positions; 16-byte chunk 4 gate + q, XOR-swizzled by the row), then a lane per 16-byte chunk
      // of a row: a position's 32 d pa and 32 d ga as two whole 64-byte runs of its d proj row.
      {
        const int k = lane >> 3, i = lane & 7;
#pragma unroll
        for (int gate = 0; gate < 2; ++gate)
#pragma unroll
          for (int qq = 0; qq < 2; ++qq) {
            const int q = 2 * qq + (k >> 1), hf = k & 1;
            stmatrix_x4(smem_u32(staging) + (8 * hf + i) * kStagingRowBytes + (((4 * gate + q) ^ i) << 4),
                        out[gate][qq][0], out[gate][qq][1], out[gate][qq][2], out[gate][qq][3]);
          }
      }
      __syncwarp();
      const int side = part / kPartsPerSide, h0 = (part % kPartsPerSide) * 32;
      {
        const int chunk = lane & 7;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = 4 * r + (lane >> 3);
          const uint8_t* line = staging + row * kStagingRowBytes;
          const uint4 v = *reinterpret_cast<const uint4*>(line + ((chunk ^ (row & 7)) << 4));
          if (out_pos[r] >= 0)
            *reinterpret_cast<uint4*>(d_proj + out_pos[r] * width + (2 * side + (chunk >> 2)) * hidden + h0 +
                                      8 * (chunk & 3)) = v;
        }
      }
      __syncwarp();  // (the next part's blocks overwrite the staging tile)
      // The columns' sums over the warp's 16 positions: lane 4 g + t keeps the part's columns 8 g + 2 t + {0, 1}.
      const float2 column_sum = warp_column_sums(column, lane);
      {
        const int g = lane >> 2;
        warp_sums[warp * width + sum_column<kPartsPerSide>(part, g, t, 0, hidden)] += column_sum.x;
        warp_sums[warp * width + sum_column<kPartsPerSide>(part, g, t, 1, hidden)] += column_sum.y;
      }
    };
    input_pass::wgmma_rs::multiply_and_store_parts<kParts>(multiply, store);

    if constexpr (kDPair) {
      // LayerNorm_in's backward: d pair = rstd (d x_hat - mean(d x_hat) - x_hat mean(d x_hat x_hat)), a row's 128
      // channels in a quad (x_hat from this thread's fragments, [4 s + i] channel 16 s + 4 t + i).
      wgmma_wait<0>();
      fence_accumulators(dx);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float x[4 * kSteps], d[4 * kSteps];
        float sum = 0.f, dot = 0.f;
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          const float2 lo = unpack_pair<Op>(frag[s][hf]), hi = unpack_pair<Op>(frag[s][2 + hf]);
          const int j = 2 * s;
          x[4 * s] = lo.x;
          x[4 * s + 1] = lo.y;
          x[4 * s + 2] = hi.x;
          x[4 * s + 3] = hi.y;
          d[4 * s] = dx[4 * j + 2 * hf];
          d[4 * s + 1] = dx[4 * j + 2 * hf + 1];
          d[4 * s + 2] = dx[4 * j + 4 + 2 * hf];
          d[4 * s + 3] = dx[4 * j + 5 + 2 * hf];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            sum += d[4 * s + i];
            dot = fmaf(d[4 * s + i], x[4 * s + i], dot);
          }
        }
        const float mean_d = quad_sum(sum) * (1.f / kC), mean_dot = quad_sum(dot) * (1.f / kC);
        if (row_pos[hf] < 0) continue;
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
          float v[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] = rstd[hf] * (d[4 * s + i] - mean_d - x[4 * s + i] * mean_dot);
          store_d_pair(args.d_pair, args.pair_dtype, row_pos[hf] * kC + 16 * s + 4 * t, v);
        }
      }
    }

    if constexpr (kMaskGrad) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float v = d_mask[hf];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (t == 0 && row_pos[hf] >= 0) args.d_mask[row_pos[hf]] = v;
      }
    }
  }

  // The block's sums: the warps' rows added in order.
  __syncthreads();
  for (int64_t c = threadIdx.x; c < width; c += 128 * kGroups) {
    float total = 0.f;
    for (int w = 0; w < 4 * kGroups; ++w) total += warp_sums[w * width + c];
    args.sums[blockIdx.x * width + c] = total;
  }
}

// Whether it takes d_proj's sizes: bf16 operands, rows of 128 channels, H a multiple of 32 up to 128 (whole
// 32-h boxes and parts), plane pitches TMA can address (N^2, a block's rows x N, a multiple of 8: 16-byte rows of the box map),
// and the shared memory.
bool takes(const BackwardArgs& args) {
  const int64_t plane = plane_positions(args);
  return args.operand == Dtype::bf16 && args.c == kC && args.h % 32 == 0 && args.h <= 128 &&
         tensor_map_encoder() != nullptr && plane % 8 == 0 && plane < (int64_t(1) << 31) &&
         args.batch < (int64_t(1) << 31) &&
         smem_bytes(args.h, args.pass == BackwardPass::d_proj_d_pair) <= max_smem_optin();
}

// (d_pair without d_rows: d x_hat multiplied in the pass, input_backward_d_pair.cuh, whose rules are its own)
// (proj_rs writes d proj as whole [P, 4H] rows: no ld_rows)
bool applies(const BackwardArgs& args) {
  if (args.pass == BackwardPass::d_pair && args.d_rows == nullptr) return d_pair_mma::takes(args);
  if (args.pass == BackwardPass::d_proj_d_pair) return takes(args);
  if (args.pass == BackwardPass::d_proj && args.proj == nullptr && args.ld_rows != 0) return false;
  return takes(args) && d_proj_bytes(args) <= max_smem_optin();
}

template <int kParts, bool kMaskGrad, bool kDPair>
cudaError_t launch_parts(const BackwardArgs& args) {
  const int64_t plane = plane_positions(args), tiles_per_batch = ceil_div(plane, kPositions);
  const int64_t blocks = persistent_sum_blocks(ceil_div(args.batch * tiles_per_batch, groups_for(kDPair)));
  CUtensorMap map_da, map_db;
  if (!encode_kmajor_map<Op>(&map_da, args.a_planes, args.batch, args.h, plane, 32) ||
      !encode_kmajor_map<Op>(&map_db, args.b_planes, args.batch, args.h, plane, 32))
    return cudaErrorNotSupported;
  const int64_t bytes = smem_bytes(args.h, kDPair);
  const cudaError_t status = fused::allow_smem<kernel<kParts, kMaskGrad, kDPair>>(bytes);
  if (status != cudaSuccess) return status;
  kernel<kParts, kMaskGrad, kDPair><<<static_cast<unsigned>(blocks), 128 * groups_for(kDPair), bytes, args.stream>>>(
      args, map_da, map_db, tiles_per_batch);
  return cudaGetLastError();
}

template <bool kDPair>
cudaError_t launch_d_proj(const BackwardArgs& args) {
  const bool mask_grad = args.d_mask != nullptr;
  switch (parts_for(args.h)) {
    case 2: return mask_grad ? launch_parts<2, true, kDPair>(args) : launch_parts<2, false, kDPair>(args);
    case 4: return mask_grad ? launch_parts<4, true, kDPair>(args) : launch_parts<4, false, kDPair>(args);
    case 6: return mask_grad ? launch_parts<6, true, kDPair>(args) : launch_parts<6, false, kDPair>(args);
    case 8: return mask_grad ? launch_parts<8, true, kDPair>(args) : launch_parts<8, false, kDPair>(args);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch(const BackwardArgs& args) {
  if (args.pass == BackwardPass::d_pair && args.d_rows == nullptr) return d_pair_mma::launch(args);
  const bool d_pair = args.pass == BackwardPass::d_proj_d_pair;
  if ((args.pass != BackwardPass::d_proj && !d_pair) || args.proj != nullptr) return ::trimul::backward::launch(args);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!takes(args) || args.x_hat == nullptr || args.w_in_f == nullptr || args.b_in_f == nullptr ||
      args.sums == nullptr || args.ld_rows != 0 || !aligned(args.x_hat) || !aligned(args.rows) || !aligned(args.w_in_f) ||
      !aligned(args.a_planes) || !aligned(args.b_planes))
    return cudaErrorInvalidValue;
  if (!d_pair) return launch_d_proj<false>(args);
  // (d gate's rows load 8 bytes at a time, d pair's stores 4 channels at a time)
  if (args.d_gate == nullptr || args.w_gate_f == nullptr || args.rstd == nullptr || args.d_pair == nullptr ||
      !aligned(args.d_gate) || !aligned(args.w_gate_f) || !aligned(args.d_pair))
    return cudaErrorInvalidValue;
  return launch_d_proj<true>(args);
}

}  // namespace proj_rs
}  // namespace backward
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(input_backward, wgmma_rs, ::trimul::backward::proj_rs::applies,
                         ::trimul::backward::proj_rs::launch);
