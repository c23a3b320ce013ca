// output pass — LayerNorm_out over h of the contraction result (fp32 statistics), out_proj + bias,
// the output gate sigmoid(out_gate(pair or LayerNorm_in(pair))) and their product, written once in
// the input dtype.
#include "tma.cuh"

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
  // Copy lanes: 2^shift per row (>= chunks), so a lane's chunk and first row come from shifts and its
  // (h, row) walk advances by a carry instead of two integer divisions per chunk (those were a quarter
  // of this kernel's instructions at (16,32,64,32), ncu 2026-12-01).
  const int shift = 32 - __clz(chunks - 1), slots = T::kThreads >> shift;
  const int ch = threadIdx.x & ((1 << shift) - 1), slot = threadIdx.x >> shift;
  const int step_h = slots / rows_per_h, step_r = slots - step_h * rows_per_h;
  const int first_h = slot / rows_per_h, first_r = slot - first_h * rows_per_h;
  for (int h0 = 0; h0 < hidden; h0 += group) {
    const int hs = min(group, hidden - h0);
    if (ch < chunks)
      for (int hh = first_h, r = first_r; hh < hs;) {
        const Op* src = (r < a_rows ? a_t + int64_t(i_lo + r) * args.ld : b_t + int64_t(r - a_rows) * args.ld) +
                        (h0 + hh) * plane + ch * kVec;
        cp_async16(stage + (hh * rows_per_h + r) * row_stride + ch * 16, src, true);
        hh += step_h;
        r += step_r;
        if (r >= rows_per_h) {
          r -= rows_per_h;
          ++hh;
        }
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
  // With the in-pass contraction (z == nullptr) where ForwardArgs::gate_rows_first, z goes into its own region
  // behind the stage, so the gate rows can go into x_res first; otherwise z arrives into x_res's region and
  // the gate rows are staged after its LayerNorm.
  const bool fused_z = args.z == nullptr && args.gate_rows_first;

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
  float* z_raw = fused_z ? reinterpret_cast<float*>(contract_stage + args.contract_stage_bytes)
                         : reinterpret_cast<float*>(x_res);
  const auto stage_gate_rows = [&] {
    stage_rows<M, TIn, T::kWarps>(rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair),
                                  x_res, x_stride, static_cast<const TIn*>(args.pair), row_off, T::BM,
                                  static_cast<int>(args.c), static_cast<int>(args.c_pad),
                                  args.gate_normalized ? args.ln_in_w : nullptr, args.ln_in_b, args.eps_in);
  };
  {
    if (args.z != nullptr) {
      const z_t<M>* z_plane = static_cast<const z_t<M>*>(args.z) + batch * hidden * plane + q0;
      constexpr int kQuads = T::BM / 4;
      for (int q = threadIdx.x; q < hidden * kQuads; q += T::kThreads) {
        const int h = q / kQuads, quad = q % kQuads;
        const bool ok = q0 + quad * 4 < plane;  // (plane is a multiple of 4: whole quads)
        const z_t<M>* src = z_plane + h * plane + quad * 4;
        if constexpr (std::is_same<z_t<M>, float>::value) {
          cp_async16(z_raw + h * T::BM + quad * 4, ok ? src : z_plane, ok);
        } else {  // (bf16 z: widened through registers; this kernel takes the small and odd problems)
          float4 wide = make_float4(0.f, 0.f, 0.f, 0.f);
          if (ok) {
            const uint2 raw = *reinterpret_cast<const uint2*>(src);
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
            wide = make_float4(lo.x, lo.y, hi.x, hi.y);
          }
          *reinterpret_cast<float4*>(z_raw + h * T::BM + quad * 4) = wide;
        }
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
    } else {
      if (fused_z) {
        // The gate rows read only the caller's pair_repr: staged before waiting for the input pass (launched
        // as its programmatic dependent, TRIMUL_PDL), so they load during its tail, off the chain after it.
        __syncthreads();  // row_off is in
        stage_gate_rows();
      }
      wait_for_prior_grid();
      if (args.contract_stage_bytes > 0) contract_tile_staged<op_t<M>, T>(z_raw, contract_stage, args, batch, q0);
      else contract_tile<op_t<M>, T>(z_raw, args, batch, q0);
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
        y[e] = (valid && h < hidden) ? (z_raw[h * T::BM + m] - stats.x) * stats.y : 0.f;
      }
      store_operands<M, V>(dst, h0, y);
    }
    __syncthreads();  // z_raw is about to become x_res (given z)
  }
  if (!fused_z) stage_gate_rows();
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
  return 4 * (int64_t(l.c_rows) * (l.x_stride + l.z_stride) + 2 * l.c_rows + kPairs * l.words_per_pair());
}

// k128: pair_dim and hidden both 128 (c = c_pad = h = h_pad): the strides, slab and chunk counts are
// constants, so the products' ldmatrix addresses are immediate offsets (ncu, profile 14: the generic
// kernel's products spent ~240 IMAD and ~110 MOV per 128 HMMA on them) and no store needs a guard.
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

// Bytes if this pass runs resident for these sizes, else 0.
template <Mode M>
int64_t applicable(const ForwardArgs& args) {
  if constexpr (M != Mode::bf16 && M != Mode::f16) {
    return 0;
  } else {
    if (args.z == nullptr || args.z_dtype != z_dtype_for(M) || args.h_pad > kMaxHidden) return 0;
    if (args.c_pad * static_cast<int64_t>(sizeof(op_t<M>)) > kMaxSlabs * kSlabBytes) return 0;
    return persistent_bytes(args.batch * ceil_div(args.n * args.ldz, kRows), kPairs, bytes<M>(args));
  }
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args, int64_t smem_bytes) {
  if (args.c == kMaxHidden && args.c_pad == kMaxHidden && args.h == kMaxHidden && args.h_pad == kMaxHidden)
    return launch_persistent<kernel<M, TIn, true>>(args, args.n * args.ldz, kRows, kPairs, kThreads, smem_bytes);
  return launch_persistent<kernel<M, TIn, false>>(args, args.n * args.ldz, kRows, kPairs, kThreads, smem_bytes);
}

}  // namespace resident

// ---- wgmma + TMA, warp-specialized (sm_90a) ----------------------------------------------------
// First in auto at pair_dim > 128 and at "highest" (output_wgmma_first says why). The input pass's v8a design
// applied to this pass: one block per SM of 16 warps,
// - the producer warp streams out_gate's and out_proj's rows with TMA, per chunk of 128 output
//   channels out_gate's k-tiles then out_proj's (or loads them all once where they fit);
// - 7 stager warps write each tile's positions (128, or 64 where 128 leave room for one row
//   buffer only) into one of two row buffers: LayerNorm_out(z)
//   (z is h-major: four lanes per position, a quarter of h each in registers, statistics by
//   shuffles) and the gate's source rows (pair or LayerNorm_in(pair)), both 128-byte swizzled;
// - two MMA warpgroups each take 64 of every chunk's 128 channels (the weights are A) for one half
//   of the tile's positions at a time (m64n64): the gate product first, its sigmoid kept in 32
//   registers, then out_proj in the same accumulators, and the product of the two stored per
//   channel. (Streamed weights pass once per 64 positions.)
// "highest" multiplies fp16x3 as the input pass's wgmma kernel does (ForwardArgs::w_gate_f16x3):
// both row sets as fp16 parts and remainders, each GEMM three k-segments against the prepared
// [hi | lo] weights. z's rows (normalized: at most sqrt(H) in magnitude) take one scale; the
// gate's source rows, of no known range, each take their own (F16ScaledRows), which the epilogue
// undoes per position before the biases. "high" takes the same with one part per operand where
// ForwardArgs::high_f16 asks (kF16; the default, NOTES v14).
namespace wgmma_tiles {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;  // (a weight chunk: 128 output channels, 64 per MMA warpgroup)

// Positions per tile P: 128 (two m64n64 halves) where two row buffers fit, else 64 (one half: a
// pair_dim 384 tile's rows then fit twice, or TF32 rows once); a template parameter.
constexpr int kHalf = 64;  // positions per m64n64 product
constexpr int kStagingLoads = 8;  // 16-byte loads in flight per stager lane (gate rows)
constexpr int kZLanes = 4;         // lanes per position in the z LayerNorm
constexpr int kMaxHPad = 128;      // h_pad this kernel takes: a quarter in one lane's registers

// Shared memory from a 1024-byte boundary for tiles of `positions`: per buffer the gate-row and z
// k-tiles (positions x 128 bytes each) and the positions' output offsets; the weight stages; the
// stagers' pair-row offsets; the barriers.
// Scaled fp16 (kF16): each position's scale-back factor for the gate; split operands ("highest"):
// two planes per buffer (fp16 parts, then remainders).
__host__ __device__ inline int64_t plan_bytes(int kt_x, int kt_z, int buffers, int stages, int positions,
                                              int planes = 1, bool scaled = false) {
  return int64_t(buffers) * (planes * (kt_x + kt_z) * int64_t(positions) * kKBytes + positions * 8 +
                             (scaled ? positions * 4 : 0)) +
         int64_t(stages) * kStageBytes + positions * 8 + 2 * (stages + buffers) * 8;
}

struct Plan {
  PassPlan ring;
  int positions = 0;
};

// LayerNorm_out over h of z (normalized only: its affine is folded into out_proj) for the tile's
// positions, into swizzled rows [0, fill) of h (zeros at
// h >= hidden and for positions whose row_off is negative). kZLanes lanes share a position, each
// holding a contiguous quarter of [0, fill) in registers, so one load instruction reads 32 bytes
// of each of four h planes, and the rows are written with 16-byte stores.
template <Mode M, int P, class Dst>
__device__ void stage_z_rows(Dst dst, const z_t<M>* __restrict__ z_tile, int64_t plane, int hidden, int fill,
                             const int64_t* row_off,
                             float eps, int warp) {
  constexpr int kPerLane = kMaxHPad / kZLanes;
  constexpr int kSlots = 32 / kZLanes;                        // positions per warp per round
  constexpr int V = 16 / static_cast<int>(sizeof(op_t<M>));  // elements per 16-byte store
  const int lane = threadIdx.x & 31, sub = lane % kZLanes, slot = lane / kZLanes;
  const int per_lane = fill / kZLanes;  // a multiple of V: fill is whole 128-byte k-tiles
  const int h0 = sub * per_lane;
  if (hidden == kMaxHPad && fill == kMaxHPad) {
    // H = 128 (the issue's shapes): no guard or select per h, and the LayerNorm as one FFMA on the
    // shifted values (profile 14: the guarded loop was ~10% of the pair_dim-384 kernel's
    // instructions). A position-less lane reads the tile's first position (always in the plane)
    // and gets rstd = centre = 0: zeros.
    for (int m0 = warp * kSlots; m0 < P; m0 += kStagerWarps * kSlots) {
      const int m = m0 + slot;
      const bool valid = row_off[m] >= 0;
      float v[kPerLane];
      const z_t<M>* src = z_tile + int64_t(h0) * plane + (valid ? m : 0);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        v[e] = to_float(*src);
        src += plane;
      }
      const float shift = __shfl_sync(0xffffffffu, v[0], lane & ~(kZLanes - 1));
      float sum = 0.f, sum_sq = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        v[e] -= shift;
        sum += v[e];
        sum_sq = fmaf(v[e], v[e], sum_sq);
      }
#pragma unroll
      for (int offset = 1; offset < kZLanes; offset <<= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
      }
      const float2 moments = shifted_moments(sum, sum_sq, hidden, eps);
      const float rstd = valid ? moments.y : 0.f, centre = -moments.x * rstd;
#pragma unroll
      for (int e0 = 0; e0 < kPerLane; e0 += V) {
        float y[V];
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = fmaf(v[e0 + e], rstd, centre);
        dst.template store<M, V>(m, h0 + e0, y);
      }
    }
    return;
  }
  for (int m0 = warp * kSlots; m0 < P; m0 += kStagerWarps * kSlots) {
    const int m = m0 + slot;
    const bool valid = row_off[m] >= 0;
    float v[kPerLane];
    const z_t<M>* src = z_tile + int64_t(h0) * plane + m;  // (one running pointer: 32 precomputed
#pragma unroll                                            // 64-bit addresses would spill)
    for (int e = 0; e < kPerLane; ++e) {
      v[e] = (valid && e < per_lane && h0 + e < hidden) ? to_float(*src) : 0.f;
      src += plane;
    }
    // Statistics around the position's first value (h = 0, held by the group's first lane).
    const float shift = __shfl_sync(0xffffffffu, v[0], lane & ~(kZLanes - 1));
    float sum = 0.f, sum_sq = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const float d = (e < per_lane && h0 + e < hidden) ? v[e] - shift : 0.f;
      sum += d;
      sum_sq += d * d;
    }
#pragma unroll
    for (int offset = 1; offset < kZLanes; offset <<= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    }
    const float2 stats = shifted_stats(shift, sum, sum_sq, hidden, eps);
#pragma unroll
    for (int e0 = 0; e0 < kPerLane; e0 += V) {
      if (e0 >= per_lane) break;
      float y[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int h = h0 + e0 + e;
        y[e] = (valid && h < hidden) ? (v[e0 + e] - stats.x) * stats.y : 0.f;
      }
      dst.template store<M, V>(m, h0 + e0, y);
    }
  }
}

// The weight ring as the MMA warps see it: stage index and phase bit of the next k-tile. With
// every stage resident the caller points `stage` at the k-tiles it wants (they never change).
struct WeightRing {
  uint64_t* full;
  uint64_t* empty;
  uint8_t* base;
  int stages;
  bool resident;
  int stage = 0;
  uint32_t phase = 0;
};

// acc += the weights' next `count` k-tiles (this warpgroup's 64 rows of each) x 64 positions of
// the rows' k-tiles (starting at b_tiles, tile_bytes apart).
// Split ("highest", fp16x3): 2 x count weight k-tiles ([hi | lo]): each hi k-tile against the
// rows' fp16 parts and remainders (`small_rows`, the same k-tile offsets), each lo against the parts.
template <typename Op, bool kSplit>
__device__ __forceinline__ void multiply_k_tiles(float (&acc)[32], WeightRing& ring, int consumer,
                                                 const uint8_t* b_tiles, int tile_bytes, int count, bool leader,
                                                 const uint8_t* small_rows = nullptr) {
  int held = -1;  // the stage the k-tile before this one read
  const int total = kSplit ? 2 * count : count;
  for (int kt = 0; kt < total; ++kt) {
    const int s = ring.stage;
    mbar_wait(&ring.full[s], ring.resident ? 0u : ring.phase);
    const uint64_t desc_a = smem_descriptor(ring.base + s * kStageBytes + consumer * kGroupRowBytes);
    const int row_kt = kSplit && kt >= count ? kt - count : kt;
    wgmma_k_tile<Op>(acc, desc_a, smem_descriptor(b_tiles + row_kt * tile_bytes));
    if (kSplit && kt < count) wgmma_k_tile<Op>(acc, desc_a, smem_descriptor(small_rows + kt * tile_bytes));
    // The previous k-tile's MMAs are done once at most this one is in flight: free its stage.
    wgmma_wait<1>();
    if (!ring.resident && held >= 0 && leader) mbar_arrive(&ring.empty[held]);
    held = s;
    if (++ring.stage == ring.stages) {
      ring.stage = 0;
      ring.phase ^= 1u;
    }
  }
  wgmma_wait<0>();
  if (!ring.resident && held >= 0 && leader) mbar_arrive(&ring.empty[held]);
}

// One weight k-tile into stage `slot`: k-tile i of chunk `chunk`, out_gate's k-tiles first, then
// out_proj's.
__device__ __forceinline__ void load_weight_tile(uint8_t* weights, uint64_t* full, int slot, int chunk, int i,
                                                 int kt_x, int elems, const CUtensorMap* map_gate,
                                                 const CUtensorMap* map_out) {
  mbar_expect_tx(&full[slot], kStageBytes);
  if (i < kt_x)
    tma_load_2d(weights + slot * kStageBytes, map_gate, i * elems, chunk * kChunkRows, &full[slot]);
  else
    tma_load_2d(weights + slot * kStageBytes, map_out, (i - kt_x) * elems, chunk * kChunkRows, &full[slot]);
}

template <Mode M, typename TIn, int P, bool kF16 = M == Mode::tf32x3>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_gate,
           const __grid_constant__ CUtensorMap map_out, int64_t tiles_per_batch, int buffers, int stages) {
  using Op = pass_op_t<M, kF16>;
  constexpr bool kSplit = M == Mode::tf32x3;  // (implies kF16)
  constexpr int kPlanes = kRowPlanes<M>, kSegs = kSegments<M>;
  constexpr int kRowTileBytes = P * kKBytes;
  extern __shared__ uint8_t smem_raw[];
  // (an offset from smem_raw keeps the compiler aware that these are shared-memory pointers)
  uint8_t* rows = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int kt_x = k_tiles(args.c_pad, sizeof(Op)), kt_z = k_tiles(args.h_pad, sizeof(Op));
  if ((rows - smem_raw) + plan_bytes(kt_x, kt_z, buffers, stages, P, kPlanes, kF16) > dynamic_smem_size()) __trap();
  // Per buffer: gate-row k-tiles, then z's (split: that plane of fp16 parts, then the remainders').
  const int plane_bytes = (kt_x + kt_z) * kRowTileBytes, buffer_bytes = kPlanes * plane_bytes;
  uint8_t* weights = rows + buffers * buffer_bytes;
  int64_t* out_rows = reinterpret_cast<int64_t*>(weights + stages * kStageBytes);  // [buffers][P]
  int64_t* row_off = out_rows + buffers * P;
  float* pos_down = reinterpret_cast<float*>(row_off + P);  // kF16: [buffers][P], each gate row's scale back
  uint64_t* w_full = reinterpret_cast<uint64_t*>(pos_down + (kF16 ? buffers * P : 0));
  uint64_t* w_empty = w_full + stages;
  uint64_t* rows_full = w_empty + stages;
  uint64_t* rows_empty = rows_full + buffers;
  init_pass_barriers(w_full, w_empty, stages, rows_full, rows_empty, buffers, kMmaGroups, kStagerThreads);
  // (the last block-wide barrier: the three roles part here)

  const int64_t tiles = args.batch * tiles_per_batch, plane = args.n * args.ldz;
  const int chunks = static_cast<int>(ceil_div(args.c, kChunkRows));
  const int per_chunk = kSegs * (kt_x + kt_z), w_tiles = chunks * per_chunk;
  const bool resident = w_tiles <= stages;
  constexpr int kElemsPerKTile = kKBytes / static_cast<int>(sizeof(Op));
  const int warp = warp_index(), lane = threadIdx.x & 31;

  if (warp == kThreads / 32 - 1) {  // the producer
    if (lane != 0) return;
    if (resident) {
      for (int w = 0; w < w_tiles; ++w)
        load_weight_tile(weights, w_full, w, w / per_chunk, w % per_chunk, kSegs * kt_x, kElemsPerKTile, &map_gate,
                         &map_out);
      return;
    }
    FillRing ring{w_empty, stages};  // streamed: each chunk's k-tiles once per half of the positions
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x)
      for (int chunk = 0; chunk < chunks; ++chunk)
        for (int half = 0; half < P / kHalf; ++half)
          for (int i = 0; i < per_chunk; ++i) {
            ring.wait_free();
            load_weight_tile(weights, w_full, ring.slot, chunk, i, kSegs * kt_x, kElemsPerKTile, &map_gate, &map_out);
            ring.advance();
          }
    return;
  }

  if (threadIdx.x >= kMmaThreads) {  // a stager
    const int stager = threadIdx.x - kMmaThreads, stager_warp = stager >> 5;
    const bool vectorized = rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair);
    // Zeros up to the end of the last k-tiles: the weights there are zero (TMA fills past c_pad /
    // h_pad), but 0 x stale shared memory could be NaN.
    const int x_fill = kt_x * kElemsPerKTile, z_fill = kt_z * kElemsPerKTile;
    const z_t<M>* z_all = static_cast<const z_t<M>*>(args.z);
    const uint32_t n = static_cast<uint32_t>(args.n), ldz = static_cast<uint32_t>(args.ldz);
    FillRing ring{rows_empty, buffers};
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      ring.wait_free();
      const int buf = ring.slot;
      const int64_t batch = tile / tiles_per_batch, q0 = (tile - batch * tiles_per_batch) * P;
      named_barrier(1, kStagerThreads);  // every stager is done with the last tile's row_off
      if (stager < P) {
        // plane < 2^32 (checked at launch): 32-bit division.
        const int64_t q = q0 + stager;
        const uint32_t i = static_cast<uint32_t>(q) / ldz, j = static_cast<uint32_t>(q) - i * ldz;
        const bool valid = q < plane && i < n && j < n;
        row_off[stager] = valid ? batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : -1;
        out_rows[buf * P + stager] = valid ? ((batch * args.n + i) * args.n + j) * args.c : -1;
      }
      named_barrier(1, kStagerThreads);
      uint8_t* x_rows = rows + buf * buffer_bytes;
      const SwizzledRows x_dst{x_rows, kRowTileBytes}, z_dst{x_rows + kt_x * kRowTileBytes, kRowTileBytes};
      const z_t<M>* z_tile = z_all + batch * args.h * plane + q0;
      const float* gate_ln = args.gate_normalized ? args.ln_in_w : nullptr;
      if constexpr (kF16) {
        // (one plane: the remainders' places unused)
        const SwizzledRows x_small{x_dst.base + plane_bytes, kRowTileBytes}, z_small{z_dst.base + plane_bytes, kRowTileBytes};
        stage_z_rows<M, P>(F16SwizzledRows<kPlanes>{z_dst, z_small, args.f16x3_scales[kZRows]}, z_tile, plane,
                           static_cast<int>(args.h), z_fill, row_off, args.eps_out, stager_warp);
        const F16ScaledRows<kPlanes> x_split{F16SwizzledRows<kPlanes>{x_dst, x_small, 1.f}, pos_down + buf * P,
                                             args.f16x3_scales[kGateDown]};
        stage_rows_to<M, TIn, kStagerWarps, kStagingLoads>(x_split, vectorized, static_cast<const TIn*>(args.pair),
                                                           row_off, P, static_cast<int>(args.c), x_fill, gate_ln,
                                                           args.ln_in_b, args.eps_in, stager_warp);
      } else {
        stage_z_rows<M, P>(z_dst, z_tile, plane, static_cast<int>(args.h), z_fill, row_off, args.eps_out,
                           stager_warp);
        stage_rows_to<M, TIn, kStagerWarps, kStagingLoads>(x_dst, vectorized, static_cast<const TIn*>(args.pair),
                                                           row_off, P, static_cast<int>(args.c), x_fill, gate_ln,
                                                           args.ln_in_b, args.eps_in, stager_warp);
      }
      fence_proxy_async();  // st.shared writes, read by wgmma through the async proxy
      mbar_arrive(&rows_full[buf]);
      ring.advance();
    }
    return;
  }

  // An MMA thread: output channels c and c + 8 of each chunk, at positions 8j + 2t, 8j + 2t + 1 of
  // each half of the tile. Halves of 64 positions (m64n64) keep the gate's sigmoid and the
  // accumulators (32 + 32 registers) side by side without spilling.
  const int consumer = warp >> 2, warp4 = warp & 3, g = lane >> 2, t = lane & 3;
  const bool leader = (threadIdx.x & 127) == 0;
  constexpr int kHalfBytes = kHalf * kKBytes;  // 64 swizzled rows: a 1024-byte multiple
  WeightRing ring{w_full, w_empty, weights, stages, resident};
  // (kF16: out_proj's products are 2^(s_z + t_out) times too large, the biases to match)
  const float out_up = kF16 ? args.f16x3_scales[kOutUp] : 1.f;
  int buf = 0;
  uint32_t buf_phase = 0;
  TIn* out = static_cast<TIn*>(args.out);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint8_t* x_rows = rows + buf * buffer_bytes;
    const uint8_t* z_rows = x_rows + kt_x * kRowTileBytes;
    const int64_t* tile_out = out_rows + buf * P;
    const float* tile_down = pos_down + buf * P;  // (split)
    mbar_wait(&rows_full[buf], buf_phase);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int c = chunk * kChunkRows + consumer * 64 + warp4 * 16 + g;
      const bool c_ok = c < args.c, c8_ok = c + 8 < args.c;
      const float gate_bias = c_ok ? args.b_gate[c] : 0.f, gate_bias8 = c8_ok ? args.b_gate[c + 8] : 0.f;
      const float out_bias = c_ok ? args.b_out[c] * out_up : 0.f, out_bias8 = c8_ok ? args.b_out[c + 8] * out_up : 0.f;
      for (int half = 0; half < P / kHalf; ++half) {
        if (resident) ring.stage = chunk * per_chunk;  // the chunk's k-tiles, again for each half
        float acc[32];  // (written only while no wgmma is in flight)
        if constexpr (kF16) start_accumulators(acc, 0.f, 0.f);  // (the biases after each position's scale)
        else start_accumulators(acc, gate_bias, gate_bias8);
        multiply_k_tiles<Op, kSplit>(acc, ring, consumer, x_rows + half * kHalfBytes, kRowTileBytes, kt_x, leader,
                                     x_rows + plane_bytes + half * kHalfBytes);
        float gate[32];  // sigmoid of the gate, in the accumulators' layout
        if constexpr (kF16) {
          // Each position's gate row was scaled on its own: back by its factor (times 2^-t_gate),
          // then the bias; and out_proj's scale back folded into the sigmoid's reciprocal (kF16 is
          // an fp32 mode's arithmetic: the accurate sigmoid).
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float down = tile_down[half * kHalf + 8 * j + 2 * t + e];
              gate[4 * j + e] = sigmoid_over(fmaf(acc[4 * j + e], down, gate_bias), out_up);
              gate[4 * j + 2 + e] = sigmoid_over(fmaf(acc[4 * j + 2 + e], down, gate_bias8), out_up);
            }
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) gate[i] = gate_sigmoid<M>(acc[i]);
        }
        start_accumulators(acc, out_bias, out_bias8);
        multiply_k_tiles<Op, kSplit>(acc, ring, consumer, z_rows + half * kHalfBytes, kRowTileBytes, kt_z, leader,
                                     z_rows + plane_bytes + half * kHalfBytes);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t row = tile_out[half * kHalf + 8 * j + 2 * t + e];
            if (row < 0) continue;
            if (c_ok) out[row + c] = from_float<TIn>(acc[4 * j + e] * gate[4 * j + e]);
            if (c8_ok) out[row + c + 8] = from_float<TIn>(acc[4 * j + 2 + e] * gate[4 * j + 2 + e]);
          }
        }
      }
    }
    mbar_arrive(&rows_empty[buf]);  // this thread's products on these rows are done
    if (++buf == buffers) {
      buf = 0;
      buf_phase ^= 1u;
    }
  }
}

// The buffers, stages and bytes this kernel would take these sizes with (bytes 0: it does not):
// z from a separate contraction (fp32), h_pad <= 128, bf16 / fp16 / TF32 operands, an sm_90a build
// on Hopper, a problem that gives every SM a tile (plan_pass says how buffers and stages are chosen).
template <Mode M, typename TIn, bool kF16 = M == Mode::tf32x3>
Plan plan(const ForwardArgs& args) {
  if (args.z == nullptr || args.z_dtype != z_dtype_for(M) || args.h_pad > kMaxHPad) return Plan{};
  if (tensor_map_encoder() == nullptr) return Plan{};
  // kF16: the prepared fp16 weights, and rows the stagers' vectorized path takes (only it scales
  // rows one by one).
  if (kF16 && (args.w_gate_f16x3 == nullptr || args.w_out_f16x3 == nullptr || args.f16x3_scales == nullptr ||
               !fused::rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair)))
    return Plan{};
  using Op = pass_op_t<M, kF16>;
  const int kt_x = k_tiles(args.c_pad, sizeof(Op)), kt_z = k_tiles(args.h_pad, sizeof(Op));
  const int w_tiles = static_cast<int>(ceil_div(args.c, kChunkRows)) * kSegments<M> * (kt_x + kt_z);
  // None unless the tiles give every SM one (smaller problems measured faster on the other kernels).
  const auto ring = [&](int positions) {
    if (args.batch * ceil_div(args.n * args.ldz, positions) < sm_count()) return PassPlan{};
    return plan_pass(
        [=](int buffers, int stages) {
          return plan_bytes(kt_x, kt_z, buffers, stages, positions, kRowPlanes<M>, kF16);
        },
        w_tiles, kMaxStages);
  };
  // 128 positions with two buffers, else 64 with two (the weights then stream as often: once per
  // 64 positions either way), else whichever fits with one.
  const PassPlan wide = ring(128), narrow = ring(64);
  if (wide.buffers == 2 || (wide.bytes != 0 && narrow.buffers != 2)) return Plan{wide, 128};
  if (narrow.bytes != 0) return Plan{narrow, 64};
  return Plan{};
}

template <Mode M, typename TIn, int P, bool kF16>
cudaError_t launch_positions(const ForwardArgs& args, const PassPlan& ring, const CUtensorMap& map_gate,
                             const CUtensorMap& map_out) {
  const cudaError_t status = allow_smem<kernel<M, TIn, P, kF16>>(ring.bytes);
  if (status != cudaSuccess) return status;
  const int64_t tiles_per_batch = ceil_div(args.n * args.ldz, P);
  const int64_t blocks = std::min<int64_t>(sm_count(), args.batch * tiles_per_batch);
  kernel<M, TIn, P, kF16><<<static_cast<unsigned>(blocks), kThreads, ring.bytes, args.stream>>>(
      args, map_gate, map_out, tiles_per_batch, ring.buffers, ring.stages);
  return cudaGetLastError();
}

template <Mode M, typename TIn, bool kF16 = M == Mode::tf32x3>
cudaError_t launch(const ForwardArgs& args, const Plan& plan) {
  using Op = pass_op_t<M, kF16>;
  const int64_t rows = ceil_div(args.c, kChunkRows) * kChunkRows;  // w_gate / w_out rows (zero past C)
  // (kF16: the prepared [hi | lo] fp16 weights of whole k-tiles each; one plane reads the hi segment)
  const auto cols = [&](int64_t k_pad) { return kF16 ? f16_weight_cols(k_pad) : k_pad; };
  CUtensorMap map_gate, map_out;
  if (!encode_kmajor_map<Op>(&map_gate, kF16 ? args.w_gate_f16x3 : args.w_gate, 0, rows, cols(args.c_pad), kChunkRows) ||
      !encode_kmajor_map<Op>(&map_out, kF16 ? args.w_out_f16x3 : args.w_out, 0, rows, cols(args.h_pad), kChunkRows))
    return cudaErrorNotSupported;
  return plan.positions == 128 ? launch_positions<M, TIn, 128, kF16>(args, plan.ring, map_gate, map_out)
                               : launch_positions<M, TIn, 64, kF16>(args, plan.ring, map_gate, map_out);
}

// The kernel for mode M in the arithmetic with_f16_arith picks.
template <Mode M, typename TIn>
cudaError_t plan_and_launch(const ForwardArgs& args) {
  return with_f16_arith<M>(args, [&](auto f16) {
    constexpr bool kF16 = decltype(f16)::value;
    const Plan chosen = plan<M, TIn, kF16>(args);
    return chosen.positions != 0 ? launch<M, TIn, kF16>(args, chosen) : cudaErrorNotSupported;
  });
}

}  // namespace wgmma_tiles

// ---- The rows in registers at pair_dim 384 (sm_90a): wgmma_rs_wide ----------------------------------
// The input pass's wgmma_rs_wide pattern for this pass ("medium": bf16 z; pair_dim 384, H 128, the gate on the raw
// rows): two MMA warpgroups per block, each on its own 64-position tiles; blocks 2i and 2i + 1 walk the same
// tiles, each computing one half of the 384 output channels against that half's out_gate and out_proj rows,
// resident (144 + 48 KB). Per tile a warpgroup takes z's [128 h][64 positions] tile by TMA (the next tile's is
// issued once this one is in registers), reads it as wgmma A fragments by ldmatrix.trans and LayerNorms them
// there (quad shuffles; the fragments hold bf16 (z - mean), rstd applies in the epilogue); loads the gate's raw
// pair rows as A fragments straight from global memory (two channels per load: w_gate's own k order); then per
// 64 output channels the gate product (K = 384) and out_proj's (K = 128), and out = sigmoid(gate + b) *
// (rstd proj + b) is stored from the accumulators. First in the default order where it applies (NOTES v29).
namespace wgmma_rs_wide {

using namespace ::trimul::tma;
using namespace ::trimul::tma::ws;  // (kKBytes)

constexpr int kGroups = 2;  // MMA warpgroups per block, each on its own tiles
constexpr int kThreads = 128 * kGroups;
constexpr int kPositions = 64;                                  // per tile: wgmma's M
constexpr int kC = 384, kH = 128;                               // the pair_dim and hidden it takes
constexpr int kHalfC = kC / 2, kParts = kHalfC / 64;            // a block's output channels, in N = 64 parts
constexpr int kGateSteps = kC / 16, kZSteps = kH / 16;          // k16 steps of each product
constexpr int kTileBytes = 64 * kKBytes;                        // a k-tile of a part's 64 weight rows
constexpr int kGateTiles = kC * 2 / kKBytes, kOutTiles = kH * 2 / kKBytes;  // k-tiles per part
constexpr int kZBytes = kH * kPositions * 2;                    // z's [128 h][64 positions] bf16 tile
// Dynamic shared memory: the weights (1024-byte aligned), each warpgroup's z tile, the half's biases, barriers.
constexpr int64_t kSmemBytes =
    1023 + int64_t(kParts) * (kGateTiles + kOutTiles) * kTileBytes + kGroups * kZBytes + 2 * kHalfC * 4 + (1 + kGroups) * 8;

template <typename TIn>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const ForwardArgs args, const __grid_constant__ CUtensorMap map_gate,
           const __grid_constant__ CUtensorMap map_out, const __grid_constant__ CUtensorMap map_z,
           int64_t tiles_per_batch) {
  using Op = __nv_bfloat16;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* w_gate = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // [part][k-tile]
  uint8_t* w_out = w_gate + kParts * kGateTiles * kTileBytes;                        // [part][k-tile]
  uint8_t* z_all = w_out + kParts * kOutTiles * kTileBytes;
  float* gate_bias = reinterpret_cast<float*>(z_all + kGroups * kZBytes);
  float* out_bias = gate_bias + kHalfC;
  uint64_t* w_full = reinterpret_cast<uint64_t*>(out_bias + kHalfC);
  uint64_t* z_full = w_full + 1;
  const int c_base = static_cast<int>(blockIdx.x & 1) * kHalfC;  // this block's half of the channels
  const int warp = warp_index(), lane = threadIdx.x & 31;
  const int group = warp >> 2, warp4 = warp & 3, t = lane & 3, g = lane >> 2, tid = threadIdx.x & 127;
  uint8_t* z_tile = z_all + group * kZBytes;
  const int64_t n = args.n, plane = n * args.ldz, tiles = args.batch * tiles_per_batch;
  const int64_t stride = int64_t(gridDim.x >> 1) * kGroups;
  int64_t tile = int64_t(blockIdx.x >> 1) * kGroups + group;
  const auto load_z = [&](int64_t at) {  // (the warpgroup's first thread)
    const int64_t batch = at / tiles_per_batch;
    mbar_expect_tx(&z_full[group], kZBytes);
    tma_load_2d(z_tile, &map_z, static_cast<int>((at - batch * tiles_per_batch) * kPositions),
                static_cast<int>(batch * kH), &z_full[group]);
  };
  if (threadIdx.x == 0) {
    mbar_init(w_full, 1);
    for (int i = 0; i < kGroups; ++i) mbar_init(&z_full[i], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_expect_tx(w_full, kParts * (kGateTiles + kOutTiles) * kTileBytes);
    for (int p = 0; p < kParts; ++p) {
      for (int kt = 0; kt < kGateTiles; ++kt)
        tma_load_2d(w_gate + (p * kGateTiles + kt) * kTileBytes, &map_gate, kt * (kKBytes / 2), c_base + 64 * p, w_full);
      for (int kt = 0; kt < kOutTiles; ++kt)
        tma_load_2d(w_out + (p * kOutTiles + kt) * kTileBytes, &map_out, kt * (kKBytes / 2), c_base + 64 * p, w_full);
    }
  }
  if (tid == 0 && tile < tiles) load_z(tile);
  for (int c = threadIdx.x; c < kHalfC; c += kThreads) {
    gate_bias[c] = args.b_gate[c_base + c];
    out_bias[c] = args.b_out[c_base + c];
  }
  __syncthreads();
  mbar_wait(w_full, 0);

  const TIn* pair = static_cast<const TIn*>(args.pair);
  TIn* out = static_cast<TIn*>(args.out);
  int z_parity = 0;
  for (; tile < tiles; tile += stride) {
    const int64_t batch = tile / tiles_per_batch, q0 = (tile - batch * tiles_per_batch) * kPositions;
    // z's A fragments (rows: positions 16 warp4 + g and + 8; k: h), block k of ldmatrix x4 = (h half k / 2,
    // position half k % 2), so zf[s] = {row g h 16 s + 2 t .., row g + 8 the same, row g h + 8, row g + 8 h + 8}.
    mbar_wait(&z_full[group], z_parity);
    z_parity ^= 1;
    uint32_t zf[kZSteps][4];
    {
      const int k = lane >> 3, r = lane & 7, chunk = 2 * warp4 + (k & 1);
#pragma unroll
      for (int s = 0; s < kZSteps; ++s) {
        const int h = 16 * s + 8 * (k >> 1) + r;
        ldmatrix_x4_trans(zf[s], smem_u32(z_tile) + h * kKBytes + ((chunk ^ (h & 7)) << 4));
      }
    }
    named_barrier(1 + group, 128);  // the tile is in every thread's registers: the next one may land
    if (tid == 0 && tile + stride < tiles) load_z(tile + stride);
    // LayerNorm_out per position over its 128 h (a quad holds a row's): mean out of the fragments, rstd kept.
    float z_rstd[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float2 v[kZSteps][2];
      float sum = 0.f;
#pragma unroll
      for (int s = 0; s < kZSteps; ++s) {
        v[s][0] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zf[s][hf]));
        v[s][1] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zf[s][2 + hf]));
        sum += (v[s][0].x + v[s][0].y) + (v[s][1].x + v[s][1].y);
      }
      const float mean = quad_sum(sum) * (1.f / kH);
      float sum_sq = 0.f;
#pragma unroll
      for (int s = 0; s < kZSteps; ++s)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          v[s][u].x -= mean;
          v[s][u].y -= mean;
          sum_sq = fmaf(v[s][u].x, v[s][u].x, fmaf(v[s][u].y, v[s][u].y, sum_sq));
          zf[s][u == 0 ? hf : 2 + hf] = pack_pair<Op>(v[s][u].x, v[s][u].y);
        }
      z_rstd[hf] = rsqrtf(quad_sum(sum_sq) * (1.f / kH) + args.eps_out);
    }
    // The gate's raw rows as A fragments: channels 16 s + 2 t + {0, 1} (xf[s][hf]) and + 8 (xf[s][2 + hf]).
    uint32_t xf[kGateSteps][4];
    int64_t out_off[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      // (plane < 2^32, checked at launch: 32-bit division, as the other output kernels)
      const uint32_t q = static_cast<uint32_t>(q0 + 16 * warp4 + g + 8 * hf);
      const uint32_t i = q / static_cast<uint32_t>(args.ldz), j = q - i * static_cast<uint32_t>(args.ldz);
      const bool valid = q < plane && j < n;
      const int64_t row = valid ? batch * args.pair_sb + i * args.pair_sr + j * args.pair_sc : -1;
      out_off[hf] = valid ? ((batch * n + i) * n + j) * kC + c_base : -1;
      if constexpr (std::is_same<TIn, float>::value) {
        float2 lo[kGateSteps], hi[kGateSteps];
#pragma unroll
        for (int s = 0; s < kGateSteps; ++s) {
          lo[s] = row >= 0 ? *reinterpret_cast<const float2*>(pair + row + 16 * s + 2 * t) : make_float2(0.f, 0.f);
          hi[s] = row >= 0 ? *reinterpret_cast<const float2*>(pair + row + 16 * s + 8 + 2 * t) : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int s = 0; s < kGateSteps; ++s) {
          xf[s][hf] = pack_pair<Op>(lo[s].x, lo[s].y);
          xf[s][2 + hf] = pack_pair<Op>(hi[s].x, hi[s].y);
          asm volatile("" : "+r"(xf[s][hf]), "+r"(xf[s][2 + hf]));  // (packed here, not at the first product)
        }
      } else {  // (bf16 rows: the pairs are the operands as they are)
#pragma unroll
        for (int s = 0; s < kGateSteps; ++s) {
          xf[s][hf] = row >= 0 ? *reinterpret_cast<const uint32_t*>(pair + row + 16 * s + 2 * t) : 0u;
          xf[s][2 + hf] = row >= 0 ? *reinterpret_cast<const uint32_t*>(pair + row + 16 * s + 8 + 2 * t) : 0u;
        }
      }
    }
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      float gate[32], proj[32];
      const uint8_t* wg = w_gate + p * kGateTiles * kTileBytes;
      const uint8_t* wo = w_out + p * kOutTiles * kTileBytes;
      // Two commit groups: the gate's sigmoids are taken while out_proj's product is still in flight.
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kGateSteps; ++s)
        wgmma_rs_64x64<Op>(gate, xf[s], desc_add(smem_descriptor(wg + (s / 4) * kTileBytes), 2 * (s % 4)), s > 0);
      wgmma_commit();
#pragma unroll
      for (int s = 0; s < kZSteps; ++s)
        wgmma_rs_64x64<Op>(proj, zf[s], desc_add(smem_descriptor(wo + (s / 4) * kTileBytes), 2 * (s % 4)), s > 0);
      wgmma_commit();
      wgmma_wait<1>();
      fence_accumulators(gate);
      // gate[4 j + 2 hf + e]: position row g + 8 hf, the part's channel 8 j + 2 t + e (proj likewise).
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 bg = *reinterpret_cast<const float2*>(gate_bias + 64 * p + 8 * j + 2 * t);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          gate[4 * j + 2 * hf] = gate_sigmoid<Mode::bf16>(gate[4 * j + 2 * hf] + bg.x);
          gate[4 * j + 2 * hf + 1] = gate_sigmoid<Mode::bf16>(gate[4 * j + 2 * hf + 1] + bg.y);
        }
      }
      wgmma_wait<0>();
      fence_accumulators(proj);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        if (out_off[hf] < 0) continue;
        TIn* dst = out + out_off[hf] + 64 * p + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 bo = *reinterpret_cast<const float2*>(out_bias + 64 * p + 8 * j + 2 * t);
          store_pair(dst + 8 * j, fmaf(proj[4 * j + 2 * hf], z_rstd[hf], bo.x) * gate[4 * j + 2 * hf],
                     fmaf(proj[4 * j + 2 * hf + 1], z_rstd[hf], bo.y) * gate[4 * j + 2 * hf + 1], true, true);
        }
      }
    }
  }
}

// Whether it takes these sizes: sm_90a on Hopper, "medium" (bf16 operands and z), pair_dim 384 and H 128
// exactly, the gate on the raw rows in 16-byte vectors, a separate contraction's z, an even grid.
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  if constexpr (M == Mode::bf16) {
    return tensor_map_encoder() != nullptr && args.z != nullptr && args.z_dtype == Dtype::bf16 && args.c == kC &&
           args.c_pad == kC && args.h == kH && args.h_pad == kH && !args.gate_normalized &&
           rows_vectorizable<TIn>(args.c, args.pair_sb, args.pair_sr, args.pair_sc, args.pair) &&
           (args.n * args.ldz) % 8 == 0 && args.batch * kH < (int64_t(1) << 31) && kSmemBytes <= max_smem_optin() &&
           sm_count() >= 2;
  }
  return false;
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  using Op = __nv_bfloat16;
  const int64_t plane = args.n * args.ldz;
  CUtensorMap map_gate, map_out, map_z;
  if (!encode_kmajor_map<Op>(&map_gate, args.w_gate, 0, kC, kC, 64) ||
      !encode_kmajor_map<Op>(&map_out, args.w_out, 0, kC, kH, 64) ||
      !encode_kmajor_map<Op>(&map_z, args.z, 0, args.batch * kH, plane, kH))
    return cudaErrorNotSupported;
  const int64_t tiles_per_batch = ceil_div(plane, kPositions);
  const int64_t pairs = std::min<int64_t>(sm_count() / 2, ceil_div(args.batch * tiles_per_batch, kGroups));
  const cudaError_t status = allow_smem<kernel<TIn>>(kSmemBytes);
  if (status != cudaSuccess) return status;
  kernel<TIn><<<static_cast<unsigned>(2 * pairs), kThreads, kSmemBytes, args.stream>>>(args, map_gate, map_out, map_z,
                                                                                     tiles_per_batch);
  return cudaGetLastError();
}

}  // namespace wgmma_rs_wide

template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  return choose_tiling(Smem<M, Wide>::bytes(args.c_pad, args.h_pad), Smem<M, Narrow>::bytes(args.c_pad, args.h_pad),
                      args.batch * ceil_div(args.n * args.ldz, Wide::BM));
}

// The in-pass contraction's own z region (ForwardArgs::gate_rows_first), behind the contraction stage:
// H x BM fp32 where it fits beside a tile's `base` bytes without costing a block per multiprocessor; else 0.
template <class T>
int64_t fused_z_bytes(const ForwardArgs& args, int64_t base) {
  if (args.z != nullptr) return 0;
  const int64_t bytes = args.h_pad * T::BM * 4;
  if (2 * base + 2048 <= max_smem_per_sm()) return 2 * (base + bytes) + 2048 <= max_smem_per_sm() ? bytes : 0;
  return base + bytes <= max_smem_optin() ? bytes : 0;
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
  const int64_t z_bytes = fused_z_bytes<T>(args, base);
  staged.gate_rows_first = z_bytes > 0;
  base += z_bytes;
  staged.contract_stage_bytes = contract_stage_bytes<M, T>(args, base);
  return launch_tiles<kernel<M, TIn, T>, T>(staged, args.n * args.ldz, base + staged.contract_stage_bytes,
                                            args.dependent_output_launch && args.z == nullptr);
}

// Which kernel takes the pass: wgmma (pair_dim > 128, or "highest"), resident, then streamed, the first that
// applies; with TRIMUL_OUTPUT_PASS set, only the one it names where that applies (ForwardArgs::output_pin).
// The wgmma kernel is first only where it measured faster (2026-12-01, H200, NOTES v9, v11): at
// pair_dim 384 (e.g. (1,1024,384,128) medium 2787 -> 2213 µs, high 6340 -> 3960) and at "highest"
// (fp16x3: (1,1024,128,128) 1931 -> 1487), not at pair_dim 128 otherwise (medium 685 -> 1123,
// high 1240 -> 1513). "high" as scaled fp16 (ForwardArgs::high_f16) takes it first at every pair_dim, as
// "highest" does ((1,1024,128,128) high: 1014 µs; the TF32 mma.sync kernel 1166 in v10; NOTES v14).
template <Mode M>
bool output_wgmma_first(const ForwardArgs& args) {
  return M == Mode::tf32x3 || (M == Mode::tf32 && args.high_f16) || args.c > 128;
}

template <Mode M, typename TIn>
cudaError_t launch_mode(const ForwardArgs& args) {
  if (args.z != nullptr && args.z_dtype != z_dtype_for(M)) return cudaErrorInvalidValue;
  const char* pinned = args.output_pin;
  // (at pair_dim 384 5-6% faster than the wgmma kernel, NOTES v29)
  if constexpr (M == Mode::bf16) {
    if (pin_allows(pinned, "wgmma_rs_wide") && wgmma_rs_wide::applicable<M, TIn>(args)) {
      const cudaError_t status = wgmma_rs_wide::launch<M, TIn>(args);
      if (status != cudaErrorNotSupported) return status;  // else another kernel takes it
    }
  }
  if (pin_allows(pinned, "wgmma") && (pinned != nullptr || output_wgmma_first<M>(args))) {
    const cudaError_t status = wgmma_tiles::plan_and_launch<M, TIn>(args);
    if (status != cudaErrorNotSupported) return status;  // else another kernel takes it
  }
  if constexpr (M == Mode::bf16 || M == Mode::f16)
    if (pin_allows(pinned, "resident"))
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
  if (args.n * args.ldz + output_pass::Wide::BM >= (int64_t(1) << 32)) return cudaErrorNotSupported;
  return fused::dispatch_pass(args, [&](auto mode, auto pair) -> cudaError_t {
    return output_pass::launch_mode<decltype(mode)::value, typename decltype(pair)::type>(args);
  });
}

}  // namespace trimul
