// output pass — LayerNorm_out over h of the contraction result (fp32 statistics), out_proj + bias,
// the output gate sigmoid(out_gate(pair or LayerNorm_in(pair))) and their product, written once in
// the input dtype.
#include "fused.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;

// Both A operands stay resident: LayerNorm_out(z) [BM, H] and the gate source [BM, C]; out_gate
// and out_proj weights stream past in chunks of BN output channels, each chunk's two products held
// in registers together.
using Wide = Tiling<4, 2, 2, 4>;    // BM 128, BN 64
using Narrow = Tiling<2, 4, 2, 4>;  // BM 64, BN 128: wide pair_dim (32x32 warp tiles)

template <Mode M, class T>
struct Smem {
  static constexpr int kParts = T::kThreads / T::BM;  // threads sharing one pair's h-reduction
  static int64_t bytes(int64_t c_pad, int64_t h_pad) {
    const int64_t x_region = std::max<int64_t>(int64_t(T::BM) * resident_stride<M>(c_pad) * 4,
                                               h_pad * T::BM * 4);  // raw z rows share it
    return int64_t(T::BM) * resident_stride<M>(h_pad) * 4 + x_region +
           int64_t(kStages) * T::BN * kSlabStride * 4 + 2 * kParts * T::BM * 4 + 2 * T::BM * 8;
  }
};

// contract_tile's loads in flight per thread: kContractH h values x kContractBatch 16-byte vectors
// of each of its two rows.
constexpr int kContractBatch = 4, kContractH = 2;

// z[h][m] for the tile's positions straight from a_t / b_t (fp32 FMA), for small N where a
// separate contraction launch would cost more than this (see kFusedContractionMaxN).
template <typename Op, class T>
__device__ void contract_tile(float* z_raw, const ForwardArgs& args, int64_t batch, int64_t q0) {
  constexpr int kVec = 16 / sizeof(Op);
  const int64_t n = args.n, plane = n * args.ld;
  const Op* a_t = static_cast<const Op*>(args.a_t);
  const Op* b_t = static_cast<const Op*>(args.b_t);
  // Loads for kH h values x kBatch vectors of each row are in flight at once (16 uint4 of
  // registers): each round of loads is a full L2 round trip, and a small problem is a chain of them.
  constexpr int kBatch = kContractBatch, kH = kContractH;
  constexpr int kBatches = ceil_div(kFusedContractionMaxN, kBatch * kVec);
  constexpr int kStep = T::kThreads / T::BM;  // threads sharing a position, each its own h values
  const int m = threadIdx.x % T::BM;
  const uint32_t q = static_cast<uint32_t>(q0 + m);
  const uint32_t i = q / static_cast<uint32_t>(args.ldz), j = q - i * static_cast<uint32_t>(args.ldz);
  const bool valid = i < n && j < n;
  for (int h0 = threadIdx.x / T::BM; h0 < args.h; h0 += kH * kStep) {
    float sum[kH] = {};
    if (valid) {
      const Op* a_row[kH];
      const Op* b_row[kH];
      bool has[kH];
#pragma unroll
      for (int u = 0; u < kH; ++u) {
        const int h = h0 + u * kStep;
        has[u] = h < args.h;
        a_row[u] = a_t + (batch * args.h + (has[u] ? h : h0)) * plane + i * args.ld;
        b_row[u] = b_t + (batch * args.h + (has[u] ? h : h0)) * plane + j * args.ld;
      }
#pragma unroll
      for (int part = 0; part < kBatches; ++part) {
        if (part * kBatch * kVec >= n) break;
        uint4 av[kH][kBatch], bv[kH][kBatch];
#pragma unroll
        for (int u = 0; u < kH; ++u)
#pragma unroll
          for (int v = 0; v < kBatch; ++v) {  // rows are zero past n up to ld
            const int k = (part * kBatch + v) * kVec;
            const bool ok = has[u] && k < n;
            av[u][v] = ok ? *reinterpret_cast<const uint4*>(a_row[u] + k) : make_uint4(0, 0, 0, 0);
            bv[u][v] = ok ? *reinterpret_cast<const uint4*>(b_row[u] + k) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
        for (int u = 0; u < kH; ++u)
#pragma unroll
          for (int v = 0; v < kBatch; ++v) {
            const Op* ae = reinterpret_cast<const Op*>(&av[u][v]);
            const Op* be = reinterpret_cast<const Op*>(&bv[u][v]);
#pragma unroll
            for (int e = 0; e < kVec; ++e) sum[u] = fmaf(to_float(ae[e]), to_float(be[e]), sum[u]);
          }
      }
    }
#pragma unroll
    for (int u = 0; u < kH; ++u)
      if (h0 + u * kStep < args.h) z_raw[(h0 + u * kStep) * T::BM + m] = sum[u];
  }
}

// The same z[h][m] with the tile's a and b rows staged in shared memory first (cp.async, many h
// at once): a tile's positions share few a rows (one per i) and its b rows (one per j), so the
// block loads each row once instead of every thread walking its own rows a full L2 round trip at a
// time. Rows are padded by 16 bytes so lanes reading consecutive b rows hit different banks.
// `stage` holds args.contract_stage_bytes (>= one h's rows: the host checks).
template <typename Op, class T>
__device__ void contract_tile_staged(float* z_raw, uint8_t* stage, const ForwardArgs& args, int64_t batch,
                                     int64_t q0) {
  constexpr int kVec = 16 / sizeof(Op);
  constexpr int kStep = T::kThreads / T::BM;  // threads sharing a position, each its own h values
  const int n = static_cast<int>(args.n), ldz = static_cast<int>(args.ldz), hidden = static_cast<int>(args.h);
  const int64_t plane = args.n * args.ld;
  const int chunks = (n + kVec - 1) / kVec;  // 16-byte chunks per row (zeros past n up to ld)
  const int row_stride = chunks * 16 + 16;
  const int i_lo = static_cast<int>(q0 / ldz);
  const int i_hi = min(n - 1, static_cast<int>((q0 + T::BM - 1) / ldz));
  const int a_rows = i_hi - i_lo + 1, rows_per_h = a_rows + n;
  const int group = static_cast<int>(args.contract_stage_bytes / (int64_t(rows_per_h) * row_stride));
  const Op* a_t = static_cast<const Op*>(args.a_t) + batch * hidden * plane;
  const Op* b_t = static_cast<const Op*>(args.b_t) + batch * hidden * plane;

  const int m = threadIdx.x % T::BM, part = threadIdx.x / T::BM;
  const uint32_t q = static_cast<uint32_t>(q0 + m);
  const uint32_t i = q / static_cast<uint32_t>(ldz), j = q - i * static_cast<uint32_t>(ldz);
  const bool valid = i < static_cast<uint32_t>(n) && j < static_cast<uint32_t>(n);
  const int a_off = valid ? (static_cast<int>(i) - i_lo) * row_stride : 0;
  const int b_off = valid ? (a_rows + static_cast<int>(j)) * row_stride : 0;
  for (int h0 = 0; h0 < hidden; h0 += group) {
    const int hs = min(group, hidden - h0);
    const int per_h = rows_per_h * chunks;
    for (int c = threadIdx.x; c < hs * per_h; c += T::kThreads) {
      const int hh = c / per_h, rem = c - hh * per_h;
      const int r = rem / chunks, ch = rem - r * chunks;
      const Op* src = (r < a_rows ? a_t + int64_t(i_lo + r) * args.ld : b_t + int64_t(r - a_rows) * args.ld) +
                      (h0 + hh) * plane + ch * kVec;
      cp_async16(stage + (hh * rows_per_h + r) * row_stride + ch * 16, src, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int hh = part; hh < hs; hh += kStep) {
      float sum = 0.f;
      if (valid) {
        const uint8_t* base = stage + hh * rows_per_h * row_stride;
        const uint4* a_row = reinterpret_cast<const uint4*>(base + a_off);
        const uint4* b_row = reinterpret_cast<const uint4*>(base + b_off);
        for (int v = 0; v < chunks; ++v) {
          const uint4 av = a_row[v], bv = b_row[v];
          const Op* ae = reinterpret_cast<const Op*>(&av);
          const Op* be = reinterpret_cast<const Op*>(&bv);
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum = fmaf(to_float(ae[e]), to_float(be[e]), sum);
        }
      }
      z_raw[(h0 + hh) * T::BM + m] = sum;
    }
    __syncthreads();  // the next group's rows overwrite the stage
  }
}

// A block owns BM consecutive positions q = i * ldz + j of one batch's z plane, so z rows load as
// contiguous runs and small N packs several output rows i into one tile.
// Two blocks per multiprocessor (one stages while the other multiplies): <= 128 registers.
template <Mode M, typename TIn, class T>
__global__ void __launch_bounds__(T::kThreads, 2) kernel(const ForwardArgs args, int64_t q_tiles) {
  constexpr int kParts = Smem<M, T>::kParts;
  constexpr bool kRounded = M == Mode::tf32;
  extern __shared__ __align__(16) uint32_t smem[];
  const int z_stride = resident_stride<M>(args.h_pad), x_stride = resident_stride<M>(args.c_pad);
  uint32_t* z_res = smem;
  uint32_t* x_res = z_res + T::BM * z_stride;
  const int64_t x_region_words = std::max<int64_t>(int64_t(T::BM) * x_stride, args.h_pad * T::BM);
  uint32_t* stages = x_res + x_region_words;
  float* partial = reinterpret_cast<float*>(stages + kStages * T::BN * kSlabStride);
  int64_t* row_off = reinterpret_cast<int64_t*>(partial + 2 * kParts * T::BM);
  int64_t* out_row = row_off + T::BM;  // element offset of each position's output row
  uint8_t* contract_stage = reinterpret_cast<uint8_t*>(out_row + T::BM);  // args.contract_stage_bytes

  const int64_t n = args.n, hidden = args.h, plane = n * args.ldz;
  const int64_t q0 = (blockIdx.x % q_tiles) * T::BM;
  const int64_t batch = blockIdx.x / q_tiles;

  // Per output chunk of BN channels: out_gate's slabs (K = C), then out_proj's (K = H).
  const int64_t c_ld = args.c_pad * static_cast<int64_t>(sizeof(op_t<M>));
  const int64_t h_ld = args.h_pad * static_cast<int64_t>(sizeof(op_t<M>));
  const int c_slabs = static_cast<int>(c_ld / kSlabBytes), h_slabs = static_cast<int>(h_ld / kSlabBytes);
  const int chunks = static_cast<int>(ceil_div(args.c, T::BN));
  auto stream = make_slab_stream<T>(
      stages, chunks * (c_slabs + h_slabs),
      AlternatingSlabs(ChunkedSlabs(static_cast<const char*>(args.w_gate), c_ld, T::BN, c_slabs),
                       ChunkedSlabs(static_cast<const char*>(args.w_out), h_ld, T::BN, h_slabs)));

  // z rows [H][BM] for this tile arrive (by cp.async, all in flight at once, or computed for small
  // N) into the region x_res takes later; LayerNorm_out then runs over h for each pair (column m),
  // reduced across kParts threads, and writes its operand rows with vector stores.
  float* z_raw = reinterpret_cast<float*>(x_res);
  {
    if (args.z != nullptr) {
      const float* z_plane = static_cast<const float*>(args.z) + batch * hidden * plane + q0;
      constexpr int kQuads = T::BM / 4;
      for (int q = threadIdx.x; q < hidden * kQuads; q += T::kThreads) {
        const int h = q / kQuads, quad = q % kQuads;
        const bool ok = q0 + quad * 4 < plane;
        const float* src = z_plane + h * plane + quad * 4;
        cp_async16(z_raw + h * T::BM + quad * 4, ok ? src : z_plane, ok);
      }
      cp_async_commit();
    }
    stream.prime();  // the weights' first slabs load during the staging
    if (threadIdx.x < T::BM) {
      // plane < 2^32 (checked at launch): 32-bit division is a fraction of a 64-bit one's cost.
      const uint32_t q = static_cast<uint32_t>(q0 + threadIdx.x);
      const uint32_t i = q / static_cast<uint32_t>(args.ldz), j = q - i * static_cast<uint32_t>(args.ldz);
      const bool valid = i < n && j < n;
      row_off[threadIdx.x] = valid ? batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : -1;
      out_row[threadIdx.x] = valid ? ((batch * n + i) * n + j) * args.c : -1;
    }
    if (args.z != nullptr) {
      cp_async_wait<kStages - 1>();  // the z group, not the weights behind it
    } else if (args.contract_stage_bytes > 0) {
      contract_tile_staged<op_t<M>, T>(z_raw, contract_stage, args, batch, q0);
    } else {
      contract_tile<op_t<M>, T>(z_raw, args, batch, q0);
    }
    __syncthreads();

    constexpr int V = 16 / sizeof(op_t<M>);  // h values per operand vector store
    const int m = threadIdx.x % T::BM, part = threadIdx.x / T::BM;
    const bool valid = row_off[m] >= 0;
    const float shift = valid ? z_raw[m] : 0.f;
    float sum = 0.f, sum_sq = 0.f;
    for (int h0 = part * V; h0 < hidden; h0 += kParts * V)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float d = h0 + e < hidden ? z_raw[(h0 + e) * T::BM + m] - shift : 0.f;
        sum += d;
        sum_sq += d * d;
      }
    partial[part * T::BM + m] = sum;
    partial[(kParts + part) * T::BM + m] = sum_sq;
    __syncthreads();
    sum = 0.f;
    sum_sq = 0.f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      sum += partial[p * T::BM + m];
      sum_sq += partial[(kParts + p) * T::BM + m];
    }
    const float2 stats = shifted_stats(shift, sum, sum_sq, static_cast<int>(hidden), args.eps_out);
    uint32_t* dst = z_res + m * z_stride;
    for (int h0 = part * V; h0 < args.h_pad; h0 += kParts * V) {
      float y[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int h = h0 + e;
        y[e] = (valid && h < hidden)
                   ? (z_raw[h * T::BM + m] - stats.x) * stats.y * args.ln_out_w[h] + args.ln_out_b[h]
                   : 0.f;
      }
      store_operands<M, V>(dst, h0, y);
    }
    __syncthreads();  // z_raw is about to become x_res
  }
  stage_rows<M, TIn, T::kWarps>(rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair),
                                x_res, x_stride, static_cast<const TIn*>(args.pair), row_off, T::BM,
                                static_cast<int>(args.c), static_cast<int>(args.c_pad),
                                args.gate_normalized ? args.ln_in_w : nullptr, args.ln_in_b, args.eps_in);
  // (the stream's first next() synchronises before anyone reads x_res)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN, g = lane >> 2, t = lane & 3;
  const bool paired = (args.c % 2) == 0;
  TIn* out = static_cast<TIn*>(args.out);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int64_t c0 = int64_t(chunk) * T::BN;
    float gate[T::MT][T::NT][4], proj[T::MT][T::NT][4];
    gemm_streamed<M, T, kRounded>(gate, x_res, x_stride, c_slabs, stream);
    gemm_streamed<M, T, kRounded>(proj, z_res, z_stride, h_slabs, stream);
    // Biases into registers before any store: the output stores may alias them as far as the
    // compiler knows, which would reload both per output element.
    float gate_bias[T::NT][2], out_bias[T::NT][2];
#pragma unroll
    for (int ni = 0; ni < T::NT; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t c = c0 + wn * T::NT * 8 + ni * 8 + 2 * t + e;
        gate_bias[ni][e] = c < args.c ? args.b_gate[c] : 0.f;
        out_bias[ni][e] = c < args.c ? args.b_out[c] : 0.f;
      }
#pragma unroll
    for (int mi = 0; mi < T::MT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = wm * T::MT * 16 + mi * 16 + g + hh * 8;
        const int64_t row_start = out_row[m];
        if (row_start < 0) continue;
        TIn* row = out + row_start;
#pragma unroll
        for (int ni = 0; ni < T::NT; ++ni) {
          const int64_t c = c0 + wn * T::NT * 8 + ni * 8 + 2 * t;
          if (c >= args.c) continue;
          const bool both = c + 1 < args.c;
          const float v0 = gate_sigmoid<M>(gate[mi][ni][2 * hh] + gate_bias[ni][0]) *
                           (proj[mi][ni][2 * hh] + out_bias[ni][0]);
          const float v1 = gate_sigmoid<M>(gate[mi][ni][2 * hh + 1] + gate_bias[ni][1]) *
                           (proj[mi][ni][2 * hh + 1] + out_bias[ni][1]);
          store_pair(row + c, v0, v1, both, paired);
        }
      }
  }
  stream.drain();
}

// ---- Resident weights (16-bit operands, z given, H <= 128, weights that fit) --------------------
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
  return 4 * (int64_t(l.c_rows) * (l.x_stride + l.z_stride) + 2 * l.c_rows + 2 * args.h_pad +
              kPairs * l.words_per_pair());
}

template <Mode M, typename TIn>
__global__ void __launch_bounds__(kThreads, 1) kernel(const ForwardArgs args, int64_t tiles_per_batch) {
  using Op = op_t<M>;
  extern __shared__ __align__(16) uint32_t smem[];
  const Layout l = layout<M>(args);
  uint32_t* w_gate = smem;
  uint32_t* w_out = w_gate + l.c_rows * l.x_stride;
  float* gate_bias = reinterpret_cast<float*>(w_out + l.c_rows * l.z_stride);
  float* out_bias = gate_bias + l.c_rows;
  float* ln_w = out_bias + l.c_rows;
  float* ln_b = ln_w + args.h_pad;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pair = warp >> 1, side = warp & 1;
  uint32_t* own = reinterpret_cast<uint32_t*>(ln_b + args.h_pad) + pair * l.words_per_pair();
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
    for (int h = threadIdx.x; h < args.h_pad; h += kThreads) {
      ln_w[h] = h < args.h ? args.ln_out_w[h] : 0.f;
      ln_b[h] = h < args.h ? args.ln_out_b[h] : 0.f;
    }
    cp_async_wait<0>();
    __syncthreads();
  }

  const int64_t n = args.n, hidden = args.h, plane = n * args.ldz, tiles = args.batch * tiles_per_batch;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = l.c_rows / kChunk;
  const int x_slabs = static_cast<int>(args.c_pad * sizeof(Op) / kSlabBytes);
  const int z_slabs = static_cast<int>(args.h_pad * sizeof(Op) / kSlabBytes);
  const bool vectorized = rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
  const bool paired = (args.c % 2) == 0;
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
      // All of this position's z in registers (one coalesced 128-byte load per h across the
      // warp), then its LayerNorm_out row written as operands.
      // (invalid lanes read position 0 of the plane, always in bounds; their rows are written as
      // zeros below whatever it holds)
      const float* z = static_cast<const float*>(args.z) + batch * hidden * plane + (valid ? q : 0);
      const int h_first = side * kHalfHidden;  // this warp's half of h
      const float* z_half = z + h_first * plane;
      float zv[kHalfHidden];
      if (hidden == kMaxHidden) {  // the common case without a guard per load
#pragma unroll
        for (int h = 0; h < kHalfHidden; ++h) zv[h] = z_half[h * plane];
      } else {
#pragma unroll
        for (int h = 0; h < kHalfHidden; ++h) zv[h] = h_first + h < hidden ? z_half[h * plane] : 0.f;
      }
      const float shift = z[0];  // both halves shift by the position's first value
      float sum = 0.f, sum_sq = 0.f;
#pragma unroll
      for (int h = 0; h < kHalfHidden; ++h) {
        const float d = h_first + h < hidden ? zv[h] - shift : 0.f;
        sum += d;
        sum_sq += d * d;
      }
      partial[side * kRows + lane] = make_float2(sum, sum_sq);
      pair_sync();
      const float2 other = partial[(1 - side) * kRows + lane];
      const float2 stats =
          shifted_stats(shift, sum + other.x, sum_sq + other.y, static_cast<int>(hidden), args.eps_out);
      uint32_t* dst = z_rows + lane * l.z_stride;
#pragma unroll
      for (int h0 = 0; h0 < kHalfHidden; h0 += 8) {
        if (h_first + h0 >= args.h_pad) break;
        float y[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int h = h_first + h0 + e;
          y[e] = valid ? (zv[h0 + e] - stats.x) * stats.y * ln_w[h] + ln_b[h] : 0.f;
        }
        store_operands<M, 8>(dst, h_first + h0, y);
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
            if (paired) {  // C even: c < C means c + 1 < C; predicated stores
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

// Bytes if this pass runs resident for these sizes, else 0.
template <Mode M>
int64_t applicable(const ForwardArgs& args) {
  if constexpr (M != Mode::bf16 && M != Mode::f16) {
    return 0;
  } else {
    if (args.z == nullptr || args.z_dtype != Dtype::f32 || args.h_pad > kMaxHidden) return 0;
    if (args.c_pad * static_cast<int64_t>(sizeof(op_t<M>)) > kMaxSlabs * kSlabBytes) return 0;
    return persistent_bytes(args.batch * ceil_div(args.n * args.ldz, kRows), kPairs, bytes<M>(args));
  }
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args, int64_t smem_bytes) {
  return launch_persistent<kernel<M, TIn>>(args, args.n * args.ldz, kRows, kPairs, kThreads, smem_bytes);
}

}  // namespace resident

template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  return choose_tiling(Smem<M, Wide>::bytes(args.c_pad, args.h_pad), Smem<M, Narrow>::bytes(args.c_pad, args.h_pad),
                      args.batch * ceil_div(args.n * args.ldz, Wide::BM));
}

// Shared memory for contract_tile_staged behind a tile's `base` bytes: all H at once where that
// fits, else as many whole h as fit (keeping two blocks per multiprocessor where base allowed two).
// 0 (contract_tile, from registers) when z comes from a contraction launch, or when the staged
// path would take as many rounds of loads as the register path (each round is a full L2 latency).
template <Mode M, class T>
int64_t contract_stage_bytes(const ForwardArgs& args, int64_t base) {
  if (args.z != nullptr) return 0;
  constexpr int64_t kVec = 16 / sizeof(op_t<M>);
  const int64_t row_stride = ceil_div(args.n, kVec) * 16 + 16;
  const int64_t a_rows = std::min<int64_t>(args.n, T::BM / args.ldz + 2);  // distinct i in a tile
  const int64_t per_h = (a_rows + args.n) * row_stride;
  int64_t cap = max_smem_optin() - base;
  if (2 * base + 2048 <= max_smem_per_sm()) cap = std::min(cap, (max_smem_per_sm() - 2048) / 2 - base);
  const int64_t bytes = std::min(per_h * args.h, cap / per_h * per_h);
  if (bytes < per_h) return 0;
  const int64_t staged_rounds = ceil_div(args.h, bytes / per_h);
  const int64_t register_rounds = ceil_div(args.h, kContractH * (T::kThreads / T::BM)) * ceil_div(args.n, kContractBatch * kVec);
  return staged_rounds < register_rounds ? bytes : 0;
}

template <Mode M, typename TIn, class T>
cudaError_t launch_tiling(const ForwardArgs& args, int64_t base) {
  ForwardArgs staged = args;
  staged.contract_stage_bytes = contract_stage_bytes<M, T>(args, base);
  return launch_tiles<kernel<M, TIn, T>, T>(staged, args.n * args.ldz, base + staged.contract_stage_bytes);
}

template <Mode M, typename TIn>
cudaError_t launch_mode(const ForwardArgs& args) {
  if constexpr (M == Mode::bf16 || M == Mode::f16)
    if (const int64_t bytes = resident::applicable<M>(args)) return resident::launch<M, TIn>(args, bytes);
  const auto choice = choose<M>(args);
  if (choice.second == 0) return cudaErrorNotSupported;
  return choice.first ? launch_tiling<M, TIn, Wide>(args, choice.second)
                      : launch_tiling<M, TIn, Narrow>(args, choice.second);
}

}  // namespace output_pass

int64_t output_pass_smem(const ForwardArgs& args) {
  return fused::chosen_bytes(args, [&](auto mode) {
    constexpr Mode M = decltype(mode)::value;
    if (const int64_t bytes = output_pass::resident::applicable<M>(args)) return std::pair<bool, int64_t>{false, bytes};
    return output_pass::choose<M>(args);
  });
}

cudaError_t launch_output_pass(const ForwardArgs& args) {
  if (args.batch == 0 || args.n == 0) return cudaSuccess;
  if (args.z != nullptr && args.z_dtype != Dtype::f32) return cudaErrorInvalidValue;
  if (args.n * args.ldz + output_pass::Wide::BM >= (int64_t(1) << 32)) return cudaErrorNotSupported;
  return fused::dispatch_pass(args, [&](auto mode, auto pair) -> cudaError_t {
    return output_pass::launch_mode<decltype(mode)::value, typename decltype(pair)::type>(args);
  });
}

}  // namespace trimul
