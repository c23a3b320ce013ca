// resident — mma.sync with out_gate's and out_proj's weights resident in shared memory, warp pairs on
// their own 32-position tiles; 16-bit operands, pair_dim and hidden <= 128, z given.
#include "output_pass.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

// One block per multiprocessor holds out_gate's and out_proj's weights for the whole pass; each
// pair of warps works on its own tiles of 32 positions: z values (one position per lane, half of H
// in each warp's registers), the gate rows, both products 32 output channels at a time, and the
// gated output stored straight from the accumulators.
namespace resident {

// Warps work in pairs on a tile (as the input pass's resident kernel): each LayerNorms half of
// z's h (their sums meet in shared memory), both stage the gate rows, each computes half of the
// output channels. 16 warps per SM (4 per scheduler) in the shared memory 8 single warps took.
constexpr int kWarps = 16, kPairs = kWarps / 2, kThreads = 32 * kWarps;
constexpr int kRows = 32;     // positions per tile (2 m16 tiles)
constexpr int kChunk = 32;    // output channels per product (4 n8 tiles)
constexpr int kMaxHidden = 128, kHalfHidden = kMaxHidden / 2;
constexpr int kMaxSlabs = 4;  // k-slabs per product: pair_dim and hidden <= 128 (unrolled)

struct Layout {
  int c_rows, x_stride, z_stride;
  // row_off, out_row (64 words each), the pair's partial sums (128), x rows, z rows
  __host__ __device__ int64_t words_per_pair() const { return 256 + int64_t(kRows) * (x_stride + z_stride); }
};

template <Mode M>
__host__ __device__ inline Layout layout(const ForwardArgs& args) {
  return Layout{static_cast<int>(ceil_div(args.c, kChunk) * kChunk), resident_stride<M>(args.c_pad),
                resident_stride<M>(args.h_pad)};
}

template <Mode M>
int64_t bytes(const ForwardArgs& args) {
  const Layout l = layout<M>(args);
  return 4 * (int64_t(l.c_rows) * (l.x_stride + l.z_stride) + 2 * l.c_rows + kPairs * l.words_per_pair());
}

// k128: pair_dim and hidden both 128 (c = c_pad = h = h_pad): the strides, slab and chunk counts are
// constants, so the products' ldmatrix addresses are immediate offsets (ncu: the generic kernel's
// products spend about three integer instructions per HMMA on them) and no store needs a guard.
template <Mode M, typename TIn, bool k128>
__global__ void __launch_bounds__(kThreads, 1) kernel(const ForwardArgs args, int64_t tiles_per_batch) {
  using Op = op_t<M>;
  extern __shared__ __align__(16) uint32_t smem[];
  constexpr int kStride128 = resident_stride<M>(kMaxHidden);
  const Layout l = k128 ? Layout{kMaxHidden, kStride128, kStride128} : layout<M>(args);
  uint32_t* w_gate = smem;
  uint32_t* w_out = w_gate + l.c_rows * l.x_stride;
  float* gate_bias = reinterpret_cast<float*>(w_out + l.c_rows * l.z_stride);
  float* out_bias = gate_bias + l.c_rows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pair = warp >> 1, side = warp & 1;
  uint32_t* own = reinterpret_cast<uint32_t*>(out_bias + l.c_rows) + pair * l.words_per_pair();
  int64_t* row_off = reinterpret_cast<int64_t*>(own);
  int64_t* out_row = row_off + kRows;
  float2* partial = reinterpret_cast<float2*>(own + 128);  // [side][position]: (sum, sum of squares)
  uint32_t* x_rows = own + 256;
  auto pair_sync = [pair] { asm volatile("bar.sync %0, 64;\n" ::"r"(pair + 1) : "memory"); };
  uint32_t* z_rows = x_rows + kRows * l.x_stride;

  {
    const int x_bytes = static_cast<int>(args.c_pad * sizeof(Op)), z_bytes = static_cast<int>(args.h_pad * sizeof(Op));
    const auto same_row = [](int r) { return int64_t(r); };
    copy_rows_async<kThreads>(w_gate, l.x_stride, static_cast<const char*>(args.w_gate), l.c_rows, x_bytes, same_row);
    copy_rows_async<kThreads>(w_out, l.z_stride, static_cast<const char*>(args.w_out), l.c_rows, z_bytes, same_row);
    cp_async_commit();
    for (int c = threadIdx.x; c < l.c_rows; c += kThreads) {
      gate_bias[c] = c < args.c ? args.b_gate[c] : 0.f;
      out_bias[c] = c < args.c ? args.b_out[c] : 0.f;
    }
    cp_async_wait<0>();
    __syncthreads();
  }

  const int64_t n = args.n, hidden = args.h, plane = n * args.ldz, tiles = args.batch * tiles_per_batch;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = l.c_rows / kChunk;
  const int x_slabs = k128 ? kMaxSlabs : static_cast<int>(args.c_pad * sizeof(Op) / kSlabBytes);
  const int z_slabs = k128 ? kMaxSlabs : static_cast<int>(args.h_pad * sizeof(Op) / kSlabBytes);
  const bool vectorized = rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
  const bool paired = k128 || (args.c % 2) == 0;
  TIn* out = static_cast<TIn*>(args.out);
  for (int64_t tile = int64_t(blockIdx.x) * kPairs + pair; tile < tiles; tile += int64_t(gridDim.x) * kPairs) {
    const int64_t batch = tile / tiles_per_batch, q0 = (tile - batch * tiles_per_batch) * kRows;
    // Lane = position q = i * ldz + j of this batch's z plane (plane < 2^32: checked at launch).
    const uint32_t q = static_cast<uint32_t>(q0 + lane);
    const uint32_t i = q / static_cast<uint32_t>(args.ldz), j = q - i * static_cast<uint32_t>(args.ldz);
    const bool valid = q < plane && i < n && j < n;
    if (side == 0) {
      row_off[lane] = valid ? batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : -1;
      out_row[lane] = valid ? ((batch * n + i) * n + j) * args.c : -1;
    }
    {
      // All of this position's z in registers (one coalesced load per h across the warp: 128 bytes,
      // 64 for bf16 z), then its LayerNorm_out row written as operands.
      // (invalid lanes read position 0 of the plane, always in bounds; their rows are written as
      // zeros below whatever it holds)
      const z_t<M>* z = static_cast<const z_t<M>*>(args.z) + batch * hidden * plane + (valid ? q : 0);
      const int h_first = side * kHalfHidden;  // this warp's half of h
      const z_t<M>* z_half = z + h_first * plane;
      float zv[kHalfHidden];
      const bool full = k128 || hidden == kMaxHidden;  // the common case: no guard or select per h below
      if (full) {
#pragma unroll
        for (int h = 0; h < kHalfHidden; ++h) zv[h] = to_float(z_half[h * plane]);
      } else {
#pragma unroll
        for (int h = 0; h < kHalfHidden; ++h) zv[h] = h_first + h < hidden ? to_float(z_half[h * plane]) : 0.f;
      }
      // The LayerNorm-ed value is (z - shift) * rstd + centre: one FFMA on the shifted values the sums
      // already need (shift: both halves shift by the position's first value); a lane without a
      // position gets rstd = centre = 0, so zeros.
      const float shift = to_float(z[0]);
      float sum = 0.f, sum_sq = 0.f;
      if (full) {
#pragma unroll
        for (int h = 0; h < kHalfHidden; ++h) {
          zv[h] -= shift;
          sum += zv[h];
          sum_sq = fmaf(zv[h], zv[h], sum_sq);
        }
      } else {
#pragma unroll
        for (int h = 0; h < kHalfHidden; ++h) {
          zv[h] = h_first + h < hidden ? zv[h] - shift : 0.f;
          sum += zv[h];
          sum_sq = fmaf(zv[h], zv[h], sum_sq);
        }
      }
      partial[side * kRows + lane] = make_float2(sum, sum_sq);
      pair_sync();
      const float2 other = partial[(1 - side) * kRows + lane];
      const float2 moments = shifted_moments(sum + other.x, sum_sq + other.y, static_cast<int>(hidden), args.eps_out);
      const float rstd = valid ? moments.y : 0.f;
      const float centre = -moments.x * rstd;
      uint32_t* dst = z_rows + lane * l.z_stride;
      if (full) {
#pragma unroll
        for (int h0 = 0; h0 < kHalfHidden; h0 += 8) {
          float y[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) y[e] = fmaf(zv[h0 + e], rstd, centre);
          store_operands<M, 8>(dst, h_first + h0, y);
        }
      } else {
#pragma unroll
        for (int h0 = 0; h0 < kHalfHidden; h0 += 8) {
          if (h_first + h0 >= args.h_pad) break;
          float y[8];
#pragma unroll
          for (int e = 0; e < 8; ++e)  // (past H: zeros)
            y[e] = h_first + h0 + e < hidden ? fmaf(zv[h0 + e], rstd, centre) : 0.f;
          store_operands<M, 8>(dst, h_first + h0, y);
        }
      }
    }
    pair_sync();  // row_off and both halves of the z rows are in
    stage_rows<M, TIn, 2>(vectorized, x_rows, l.x_stride, static_cast<const TIn*>(args.pair), row_off, kRows,
                          static_cast<int>(args.c), static_cast<int>(args.c_pad),
                          args.gate_normalized ? args.ln_in_w : nullptr, args.ln_in_b, args.eps_in, side);
    pair_sync();
    for (int chunk = side; chunk < chunks; chunk += 2) {  // this warp's half of the output channels
      const int c0 = chunk * kChunk;
      float gate[2][4][4], proj[2][4][4];
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int c = c0 + ni * 8 + 2 * t;
        const float gb0 = gate_bias[c], gb1 = gate_bias[c + 1], ob0 = out_bias[c], ob1 = out_bias[c + 1];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          gate[mi][ni][0] = gate[mi][ni][2] = gb0;
          gate[mi][ni][1] = gate[mi][ni][3] = gb1;
          proj[mi][ni][0] = proj[mi][ni][2] = ob0;
          proj[mi][ni][1] = proj[mi][ni][3] = ob1;
        }
      }
#pragma unroll
      for (int slab = 0; slab < kMaxSlabs; ++slab)
        if (slab < x_slabs)
          warp_slab<M, 2, 4>(gate, x_rows + slab * kSlabWords, l.x_stride,
                             w_gate + c0 * l.x_stride + slab * kSlabWords, l.x_stride, lane);
#pragma unroll
      for (int slab = 0; slab < kMaxSlabs; ++slab)
        if (slab < z_slabs)
          warp_slab<M, 2, 4>(proj, z_rows + slab * kSlabWords, l.z_stride,
                             w_out + c0 * l.z_stride + slab * kSlabWords, l.z_stride, lane);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int64_t row_start = out_row[mi * 16 + g + hh * 8];
          TIn* row = out + (row_start < 0 ? 0 : row_start) + c0 + 2 * t;
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) {
            const int c = c0 + ni * 8 + 2 * t;
            const float v0 = gated_16bit(proj[mi][ni][2 * hh], gate[mi][ni][2 * hh], 0.5f);
            const float v1 = gated_16bit(proj[mi][ni][2 * hh + 1], gate[mi][ni][2 * hh + 1], 0.5f);
            if (k128) {  // (every channel of the chunk inside C)
              if (row_start >= 0) store_pair(row + ni * 8, v0, v1, true, true);
            } else if (paired) {  // C even: c < C means c + 1 < C; predicated stores
              if (row_start >= 0 && c < args.c) store_pair(row + ni * 8, v0, v1, true, true);
            } else if (row_start >= 0 && c < args.c) {
              store_pair(row + ni * 8, v0, v1, c + 1 < args.c, false);
            }
          }
        }
    }
    pair_sync();  // the next tile's staging overwrites rows both products read
  }
}

// Bytes of shared memory if this pass runs resident for these sizes, else 0: 16-bit operands, z given,
// pair_dim and hidden <= 128, the weights in shared memory, tiles enough to keep every pair of warps busy.
template <Mode M>
int64_t smem(const ForwardArgs& args) {
  if (args.z == nullptr || args.z_dtype != z_dtype_for(M) || args.h_pad > kMaxHidden) return 0;
  if (args.c_pad * static_cast<int64_t>(sizeof(op_t<M>)) > kMaxSlabs * kSlabBytes) return 0;
  return persistent_bytes(args.batch * ceil_div(args.n * args.ldz, kRows), kPairs, bytes<M>(args));
}

template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return smem<M>(args) != 0;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  const int64_t bytes = smem<M>(args);
  if (args.c == kMaxHidden && args.c_pad == kMaxHidden && args.h == kMaxHidden && args.h_pad == kMaxHidden)
    return launch_persistent<kernel<M, TIn, true>>(args, args.n * args.ldz, kRows, kPairs, kThreads, bytes);
  return launch_persistent<kernel<M, TIn, false>>(args, args.n * args.ldz, kRows, kPairs, kThreads, bytes);
}

}  // namespace resident
}  // namespace output_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS(output, resident, trimul::output_pass::resident, trimul::fused::k16BitModes);
