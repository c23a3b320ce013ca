// streamed — mma.sync; LayerNorm_out(z) and the gate's rows resident, out_gate's and out_proj's weights
// streamed in chunks; any precision; at small N it computes z itself from a and b (in_output_pass).
#include "output_pass.cuh"

#include <algorithm>

namespace trimul {
namespace output_pass {

namespace streamed {

// Both A operands stay resident: LayerNorm_out(z) [BM, H] and the gate source [BM, C]; out_gate
// and out_proj weights stream past in chunks of BN output channels, each chunk's two products held
// in registers together.
using Tiles128 = Tiling<4, 2, 2, 4>;    // BM 128, BN 64
using Tiles64 = Tiling<2, 4, 2, 4>;  // BM 64, BN 128: wide pair_dim (32x32 warp tiles)

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
  // of this kernel's instructions at the seed shapes, by ncu's count).
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
  constexpr bool kRounded = M == Mode::high;
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
        // as its programmatic dependent: launch_tiling), so they load during its tail, off the chain after it.
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

template <Mode M>
std::pair<bool, int64_t> choose(const ForwardArgs& args) {
  return choose_tiling(Smem<M, Tiles128>::bytes(args.c_pad, args.h_pad), Smem<M, Tiles64>::bytes(args.c_pad, args.h_pad),
                      args.batch * ceil_div(args.n * args.ldz, Tiles128::BM));
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
  // (with the in-pass contraction right after the input pass, its programmatic dependent: its prologue
  // overlaps that kernel's tail, and it waits for a_t / b_t before it reads them)
  return launch_tiles<kernel<M, TIn, T>, T>(staged, args.n * args.ldz, base + staged.contract_stage_bytes,
                                            args.z == nullptr && args.output_follows_input);
}

// Any mode, any sizes whose tile fits in shared memory; without z (in_output_pass) N <= kFusedContractionMaxN.
template <Mode M, typename TIn>
bool applicable(const ForwardArgs& args) {
  return choose<M>(args).second != 0 && (args.z != nullptr || args.n <= kFusedContractionMaxN);
}

template <Mode M, typename TIn>
cudaError_t launch(const ForwardArgs& args) {
  const auto choice = choose<M>(args);
  if (choice.second == 0) return cudaErrorNotSupported;
  return choice.first ? launch_tiling<M, TIn, Tiles128>(args, choice.second)
                      : launch_tiling<M, TIn, Tiles64>(args, choice.second);
}

// The contraction this kernel does itself (contract_tile): in the fused forward at small N, on operands
// stored whole (op_t of the mode: no split or scaled fp16 ones).
inline bool contracts_here(const ContractArgs& args) {
  return args.fused && args.m <= kFusedContractionMaxN && args.n <= kFusedContractionMaxN && !args.split &&
         args.z_scale == nullptr;
}

}  // namespace streamed
}  // namespace output_pass
}  // namespace trimul

TRIMUL_REGISTER_PASS(output, streamed, trimul::output_pass::streamed, trimul::fused::kAllModes);
TRIMUL_REGISTER_CONTRACTION_IN_OUTPUT_PASS(in_output_pass, trimul::output_pass::streamed::contracts_here);
