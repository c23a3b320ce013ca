// fused.cuh — what the fused input and output passes share: staging pair rows (LayerNorm-ed or raw)
// as a resident shared-memory operand.
#pragma once
#include "mma.cuh"

#include <algorithm>
#include <cstring>

namespace trimul {
namespace fused {

using namespace ::trimul::mma;

template <Mode M>
__device__ __forceinline__ void store_operand(uint32_t* row, int col, float v) {
  reinterpret_cast<op_t<M>*>(row)[col] = to_operand<M>(v);
}

// The sum over a quad (lanes 4k .. 4k + 3): the register-row kernels' per-row statistics, a row's
// fragments spread over its quad.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Mean and 1/std of n values given their sum and sum of squares around `shift` (a value of the
// row, so the subtraction loses nothing when the mean is far from zero).
// (shifted_moments: the mean less `shift`, and 1/std, for normalising the shifted values as one FFMA.)
__device__ __forceinline__ float2 shifted_moments(float sum, float sum_sq, int n, float eps) {
  // (fast division: 2 ulp is far inside every precision's budget, and IEEE division's slow-path
  // check costs a branch per row)
  const float mean_shifted = __fdividef(sum, static_cast<float>(n));
  const float var = fmaxf(__fdividef(sum_sq, static_cast<float>(n)) - mean_shifted * mean_shifted, 0.f);
  return make_float2(mean_shifted, rsqrtf(var + eps));
}
__device__ __forceinline__ float2 shifted_stats(float shift, float sum, float sum_sq, int n, float eps) {
  const float2 moments = shifted_moments(sum, sum_sq, n, eps);
  return make_float2(shift + moments.x, moments.y);
}

template <Mode M, int V>
__device__ __forceinline__ void store_operands(uint32_t* row, int col, const float (&y)[V]) {
  using Op = op_t<M>;
  Op packed[V];
#pragma unroll
  for (int e = 0; e < V; ++e) packed[e] = to_operand<M>(y[e]);
  Op* dst = reinterpret_cast<Op*>(row) + col;
  if constexpr (V * sizeof(Op) == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(packed);
  } else if constexpr (V * sizeof(Op) == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(packed);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) dst[e] = packed[e];
  }
}

// Where staged rows go. PlainRows: row m at base + m * stride (32-bit words), elements in order.
struct PlainRows {
  static constexpr bool kRowScaled = false;  // (see F16ScaledRows)
  uint32_t* base;
  int stride;
  template <Mode M, int V>
  __device__ __forceinline__ void store(int m, int col, const float (&y)[V]) const {
    store_operands<M, V>(base + m * stride, col, y);
  }
  template <Mode M>
  __device__ __forceinline__ void store1(int m, int col, float v) const {
    store_operand<M>(base + m * stride, col, v);
  }
};

// SwizzledRows: wgmma's K-major operand layout with the 128-byte swizzle: k-tile kt (128 bytes of
// every row) at base + kt * tile_bytes, row m's 128 bytes at m * 128 in it, 16-byte chunk c of the
// row at chunk c ^ (m % 8). base is 1024-byte aligned, tile_bytes = rows * 128. A store of V
// elements at a multiple of V stays inside one 16-byte chunk.
struct SwizzledRows {
  static constexpr bool kRowScaled = false;
  uint8_t* base;
  int tile_bytes;
  template <typename Op>
  __device__ __forceinline__ Op* at(int m, int col) const {
    const int byte = col * static_cast<int>(sizeof(Op)), in_row = byte & 127;
    return reinterpret_cast<Op*>(base + (byte >> 7) * tile_bytes + m * 128 +
                                 ((((in_row >> 4) ^ (m & 7)) << 4) | (in_row & 15)));
  }
  template <Mode M, int V>
  __device__ __forceinline__ void store(int m, int col, const float (&y)[V]) const {
    constexpr int kBytes = V * static_cast<int>(sizeof(op_t<M>));
    if constexpr (kBytes == 16 || kBytes == 8) {  // one vector store inside one 16-byte chunk
      store_operands<M, V>(reinterpret_cast<uint32_t*>(at<op_t<M>>(m, col)), 0, y);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) store1<M>(m, col + e, y[e]);
    }
  }
  template <Mode M>
  __device__ __forceinline__ void store1(int m, int col, float v) const {
    *at<op_t<M>>(m, col) = to_operand<M>(v);
  }
};

// Rows for the wgmma passes' scaled fp16 arithmetic: each value times `scale` (a power of two) as
// its fp16 part in `hi` and, with kPlanes 2 (fp16x3), the fp16-rounded remainder in `lo` (the same
// swizzled layout).
template <int kPlanes>
struct F16SwizzledRows {
  static constexpr bool kRowScaled = false;
  SwizzledRows hi, lo;  // (lo: unused with one plane)
  float scale;
  // (one plane: the scaled value goes to the store's rounding directly; a round trip through fp16
  // for a remainder nobody reads cost two conversions per value)
  template <Mode M, int V>
  __device__ __forceinline__ void store(int m, int col, const float (&y)[V]) const {
    float h[V], l[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float v = y[e] * scale;
      h[e] = kPlanes == 2 ? __half2float(__float2half_rn(v)) : v;
      l[e] = v - h[e];  // exact in fp32; rounded to fp16 by the store
    }
    hi.template store<Mode::f16, V>(m, col, h);
    if constexpr (kPlanes == 2) lo.template store<Mode::f16, V>(m, col, l);
  }
  template <Mode M>
  __device__ __forceinline__ void store1(int m, int col, float v) const {
    const float s = v * scale, h = kPlanes == 2 ? __half2float(__float2half_rn(s)) : s;
    hi.template store1<Mode::f16>(m, col, h);
    if constexpr (kPlanes == 2) lo.template store1<Mode::f16>(m, col, s - h);
  }
};

// Power-of-two scale taking `largest` (>= 0) to [2^11, 2^12): fp16 parts never overflow and
// remainders of all but negligible values stay normal. Exponent kept within [-100, 100]. (From the
// float's exponent bits, not frexpf / ldexpf, whose special-value paths ncu counted per row: a
// normal largest is in [2^(e-1), 2^e) with e = biased exponent - 126; zero, subnormal and huge rows
// take the clamps.)
__device__ __forceinline__ int exponent_to_4096(float largest) {
  const int e = static_cast<int>((__float_as_uint(largest) >> 23) & 0xffu) - 126;
  return min(max(12 - e, -100), 100);
}
// 2^e for e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

// Scaled fp16 rows of no known range (out_gate's source rows): each row scaled by its own power of
// two (exponent_to_4096 of its largest magnitude, found by the stager before it stores the row),
// which row_scale() returns to the stager and records, times `down`, as row_down[m] for the
// products' epilogue. The values arrive at store() already scaled.
template <int kPlanes>
struct F16ScaledRows {
  static constexpr bool kRowScaled = true;
  F16SwizzledRows<kPlanes> rows;  // (scale 1)
  float* row_down;
  float down;
  __device__ __forceinline__ float row_scale(int m, float largest, bool record) const {
    const int e = exponent_to_4096(largest);
    if (record) row_down[m] = down * pow2(-e);
    return pow2(e);
  }
  template <Mode M, int V>
  __device__ __forceinline__ void store(int m, int col, const float (&y)[V]) const {
    rows.template store<M, V>(m, col, y);
  }
  template <Mode M>
  __device__ __forceinline__ void store1(int m, int col, float v) const {
    rows.template store1<M>(m, col, v);
  }
};

// Resident operand rows [0, rows): row m = LayerNorm(pair row at element offset row_off[m]) when
// ln_w is given, else the raw row; zeros past C and for rows whose row_off is negative. One warp
// per row; rows up to 512 channels stay in registers between the statistics and the write.
template <Mode M, typename TIn, int WARPS, class Dst>
__device__ void stage_rows_scalar(Dst dst, const TIn* __restrict__ pair,
                           const int64_t* row_off, int rows, int c, int c_pad,
                           const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps, int warp) {
  constexpr int kCached = 16;
  if constexpr (Dst::kRowScaled) {
    __trap();  // (row-scaled rows take the vectorized path only: their kernels decline others at launch)
    return;
  }
  const int lane = threadIdx.x & 31;
  for (int m = warp; m < rows; m += WARPS) {
    const int64_t off = row_off[m];
    if (off < 0) {
      for (int q = lane; q < c_pad; q += 32) dst.template store1<M>(m, q, 0.f);
      continue;
    }
    const TIn* x = pair + off;
    const float shift = to_float(x[0]);
    if (c <= 32 * kCached) {
      float v[kCached];
#pragma unroll
      for (int j = 0; j < kCached; ++j) {
        const int q = lane + 32 * j;
        v[j] = q < c ? to_float(x[q]) : 0.f;
      }
      float2 stats = make_float2(0.f, 1.f);
      if (ln_w != nullptr) {
        float sum = 0.f, sum_sq = 0.f;
#pragma unroll
        for (int j = 0; j < kCached; ++j) {
          const float d = lane + 32 * j < c ? v[j] - shift : 0.f;
          sum += d;
          sum_sq += d * d;
        }
        stats = shifted_stats(shift, warp_sum(sum), warp_sum(sum_sq), c, eps);
      }
#pragma unroll
      for (int j = 0; j < kCached; ++j) {
        const int q = lane + 32 * j;
        if (q >= c_pad) break;
        float y = 0.f;
        if (q < c) y = ln_w != nullptr ? (v[j] - stats.x) * stats.y * ln_w[q] + ln_b[q] : v[j];
        dst.template store1<M>(m, q, y);
      }
    } else {
      float2 stats = make_float2(0.f, 1.f);
      if (ln_w != nullptr) {
        float sum = 0.f, sum_sq = 0.f;
        for (int q = lane; q < c; q += 32) {
          const float d = to_float(x[q]) - shift;
          sum += d;
          sum_sq += d * d;
        }
        stats = shifted_stats(shift, warp_sum(sum), warp_sum(sum_sq), c, eps);
      }
      for (int q = lane; q < c_pad; q += 32) {
        float y = 0.f;
        if (q < c) {
          const float v = to_float(x[q]);
          y = ln_w != nullptr ? (v - stats.x) * stats.y * ln_w[q] + ln_b[q] : v;
        }
        dst.template store1<M>(m, q, y);
      }
    }
  }
}

// 16-byte vectors of rows (VecRowStager, stage_rows_vec)
template <typename TIn>
constexpr int vec_elems() { return 16 / static_cast<int>(sizeof(TIn)); }
constexpr int kMaxRowVectors = 4;  // per lane: C <= 128 * 16 / sizeof(TIn)

template <typename TIn>
__host__ __device__ inline bool rows_vectorizable(int64_t c, int64_t sb, int64_t sr, int64_t sc, const void* base) {
  const int64_t v = vec_elems<TIn>();
  return c % v == 0 && sb % v == 0 && sr % v == 0 && sc % v == 0 &&
         reinterpret_cast<uintptr_t>(base) % 16 == 0 && c <= 32 * v * kMaxRowVectors;
}

// A row is shared by 2^lanes_log2 lanes of a warp (32 >> lanes_log2 rows side by side), each lane
// holding VECS 16-byte vectors of it (lane s of a row takes vectors s, s + L, s + 2L, ...: each load
// instruction reads whole runs of a row). A vector is wholly inside C or wholly past it (C is a
// multiple of the vector), so guards are per vector, and the LayerNorm weights each lane needs
// are the same for every row: loaded once. Few lanes per row keep the statistics' shuffle
// reductions short (log2 L steps instead of 5 per row). One group() call stages kGroup rows per
// lane slot: rows m0 + r * slots + slot, r < kGroup, from element offsets off[r] (-1: no position).
template <Mode M, typename TIn, int VECS, int IN_FLIGHT>
struct VecRowStager {
  using In = TIn;
  static constexpr int V = vec_elems<TIn>();
  static constexpr int kGroup = VECS >= IN_FLIGHT ? 1 : IN_FLIGHT / VECS;  // rows in flight per lane
  static constexpr bool kHoist = VECS * V <= 16;           // LayerNorm weights in registers when small
  int c, c_pad, lanes_log2, L, slots, sub, slot;
  const float* __restrict__ ln_w;
  const float* __restrict__ ln_b;
  float eps;
  bool in_c[VECS];
  bool lane_full = true;
  float w[kHoist ? VECS : 1][V], b[kHoist ? VECS : 1][V];

  __device__ __forceinline__ VecRowStager(int c_, int c_pad_, const float* __restrict__ ln_w_,
                                          const float* __restrict__ ln_b_, float eps_, int lanes_log2_)
      : c(c_), c_pad(c_pad_), lanes_log2(lanes_log2_), L(1 << lanes_log2_), slots(32 >> lanes_log2_),
        sub((threadIdx.x & 31) & ((1 << lanes_log2_) - 1)), slot((threadIdx.x & 31) >> lanes_log2_), ln_w(ln_w_),
        ln_b(ln_b_), eps(eps_) {
#pragma unroll
    for (int l = 0; l < VECS; ++l) {
      const int q = (l * L + sub) * V;
      in_c[l] = q < c;
      lane_full = lane_full && in_c[l];
      if constexpr (kHoist) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          w[l][e] = (ln_w != nullptr && in_c[l]) ? ln_w[q + e] : 1.f;
          b[l][e] = (ln_w != nullptr && in_c[l]) ? ln_b[q + e] : 0.f;
        }
      }
    }
  }
  __host__ __device__ static int group_rows(int lanes_log2) { return kGroup * (32 >> lanes_log2); }
  __device__ __forceinline__ int group_rows() const { return group_rows(lanes_log2); }

  template <class Dst>
  __device__ __forceinline__ void group(Dst dst, const TIn* __restrict__ pair, const int64_t (&off)[kGroup], int m0,
                                        int rows) const {
    uint4 raw[kGroup][VECS];
    load(pair, off, raw);
    stage(dst, raw, off, m0, rows);
  }

  // This lane's vectors of the group's rows (zeros for rows without a position and past C).
  __device__ __forceinline__ void load(const TIn* __restrict__ pair, const int64_t (&off)[kGroup],
                                       uint4 (&raw)[kGroup][VECS]) const {
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
#pragma unroll
      for (int l = 0; l < VECS; ++l)
        raw[r][l] = (off[r] >= 0 && in_c[l]) ? *reinterpret_cast<const uint4*>(pair + off[r] + (l * L + sub) * V)
                                             : make_uint4(0, 0, 0, 0);
    }
  }

  // LayerNorms the loaded rows and stores them to dst (rows m0 + r * slots + slot, those below `rows`).
  template <class Dst>
  __device__ __forceinline__ void stage(Dst dst, const uint4 (&raw)[kGroup][VECS], const int64_t (&off)[kGroup],
                                        int m0, int rows) const {
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      // Every lane takes part in the shuffles, whether or not its row exists.
      const int m = m0 + r * slots + slot;
      float x[VECS][V];
#pragma unroll
      for (int l = 0; l < VECS; ++l)
#pragma unroll
        for (int e = 0; e < V; ++e) x[l][e] = to_float(reinterpret_cast<const TIn*>(&raw[r][l])[e]);
      const bool valid = off[r] >= 0;
      // The LayerNorm-ed value is (x - shift) * rstd + centre, centre = (shift - mean) * rstd: one FFMA
      // per element on the shifted values the statistics already need (shift: a value of the row, so
      // neither the sums nor this lose anything when the mean is far from zero). Without ln_w the row
      // is staged raw (rstd 1, centre 0, nothing shifted).
      float rstd = 1.f, centre = 0.f;
      if (ln_w != nullptr) {
        const float shift = __shfl_sync(0xffffffffu, x[0][0], slot << lanes_log2);
        float sum = 0.f, sum_sq = 0.f;
        if (lane_full) {  // (every vector of this lane inside C: no select per element)
#pragma unroll
          for (int l = 0; l < VECS; ++l)
#pragma unroll
            for (int e = 0; e < V; ++e) {
              x[l][e] -= shift;
              sum += x[l][e];
              sum_sq = fmaf(x[l][e], x[l][e], sum_sq);
            }
        } else {
#pragma unroll
          for (int l = 0; l < VECS; ++l)
#pragma unroll
            for (int e = 0; e < V; ++e) {
              x[l][e] = in_c[l] ? x[l][e] - shift : 0.f;
              sum += x[l][e];
              sum_sq = fmaf(x[l][e], x[l][e], sum_sq);
            }
        }
        for (int offset = L >> 1; offset > 0; offset >>= 1) {
          sum += __shfl_xor_sync(0xffffffffu, sum, offset);
          sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
        }
        const float2 moments = shifted_moments(sum, sum_sq, c, eps);
        rstd = moments.y;
        centre = -moments.x * rstd;
      }
      // A row-scaled destination takes the row times a power of two chosen from its largest
      // staged magnitude (every lane of the row takes part in the reduction). (The staged value's
      // formula is written out here and below: sharing it through a lambda or a helper function
      // changed the instruction selection of 53 measured kernels, by up to 3% of their instructions.)
      float row_scale = 1.f;
      if constexpr (Dst::kRowScaled) {
        float largest = 0.f;
#pragma unroll
        for (int l = 0; l < VECS; ++l)
#pragma unroll
          for (int e = 0; e < V; ++e) {
            float scale = 1.f, offset = 0.f;
            if constexpr (kHoist) {
              scale = w[l][e];
              offset = b[l][e];
            } else if (ln_w != nullptr && in_c[l]) {
              const int q = (l * L + sub) * V;
              scale = ln_w[q + e];
              offset = ln_b[q + e];
            }
            if (valid && in_c[l]) largest = fmaxf(largest, fabsf(fmaf(x[l][e], rstd, centre) * scale + offset));
          }
        for (int offset = L >> 1; offset > 0; offset >>= 1)
          largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
        row_scale = dst.row_scale(m, largest, sub == 0 && m < rows);
      }
      if (m >= rows) continue;
      // (zeros for rows without a position and columns past C, by a branch per vector, not a select
      // per element: scaled destinations must not see unbounded values there)
#pragma unroll
      for (int l = 0; l < VECS; ++l) {
        const int q = (l * L + sub) * V;
        if (q >= c_pad) break;
        float y[V];
        if (valid && in_c[l]) {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            float scale = 1.f, offset = 0.f;
            if constexpr (kHoist) {
              scale = w[l][e];
              offset = b[l][e];
            } else if (ln_w != nullptr) {
              scale = ln_w[q + e];
              offset = ln_b[q + e];
            }
            y[e] = fmaf(x[l][e], rstd, centre) * scale + offset;
            if constexpr (Dst::kRowScaled) y[e] *= row_scale;
          }
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) y[e] = 0.f;
        }
        dst.template store<M, V>(m, q, y);
      }
    }
  }
};

// The same as stage_rows, for rows whose offsets and C are multiples of one 16-byte vector: each
// warp loads several rows at once with 16-byte loads so many loads are in flight (these rows come
// from device memory once and latency, not bandwidth, would otherwise bound the staging).
template <Mode M, typename TIn, int WARPS, int VECS, int IN_FLIGHT, class Dst>
__device__ void stage_rows_vec(Dst dst, const TIn* __restrict__ pair,
                               const int64_t* row_off, int rows, int c, int c_pad,
                               const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps,
                               int lanes_log2, int warp) {
  using Stager = VecRowStager<M, TIn, VECS, IN_FLIGHT>;
  const Stager stager(c, c_pad, ln_w, ln_b, eps, lanes_log2);
  const int step = WARPS * stager.group_rows();
  for (int m0 = warp * stager.group_rows(); m0 < rows; m0 += step) {
    int64_t off[Stager::kGroup];
#pragma unroll
    for (int r = 0; r < Stager::kGroup; ++r) {
      const int m = m0 + r * stager.slots + stager.slot;
      off[r] = m < rows ? row_off[m] : -1;
    }
    stager.group(dst, pair, off, m0, rows);
  }
}

// The vectors per lane (VecRowStager's VECS) and lanes_log2 for rows of c_pad elements: L = the smallest
// power of two lanes per row with at most 4 vectors each, covering c_pad (the padding is written as
// zeros); a row has at most 128 vectors (rows_vectorizable).
template <typename TIn>
__device__ __forceinline__ int row_vectors_per_lane(int c_pad, int& lanes_log2) {
  const int vectors = c_pad / vec_elems<TIn>();
  lanes_log2 = 0;
  while ((4 << lanes_log2) < vectors) ++lanes_log2;
  return static_cast<int>(ceil_div(vectors, 1 << lanes_log2));
}

// Calls run(std::integral_constant<int, VECS>, lanes_log2) with VecRowStager's VECS for rows of c_pad
// elements (stage_rows_to's choice of lanes per row), for the caller to build its stager by value;
// false, without calling it, where the rows are not vectorizable.
template <typename TIn, class Run>
__device__ __forceinline__ bool with_row_vectors(bool vectorized, int c_pad, Run&& run) {
  int lanes_log2 = 0;
  const int per_lane = row_vectors_per_lane<TIn>(c_pad, lanes_log2);
  if (!vectorized || per_lane < 1 || per_lane > 4) return false;
  if (per_lane == 1) run(std::integral_constant<int, 1>{}, lanes_log2);
  else if (per_lane == 2) run(std::integral_constant<int, 2>{}, lanes_log2);
  else if (per_lane == 3) run(std::integral_constant<int, 3>{}, lanes_log2);
  else run(std::integral_constant<int, 4>{}, lanes_log2);
  return true;
}

// Rows [0, rows) of the operand into `dst`, staged by WARPS warps of which this is number `warp`
// (the block's warps, or one warp staging its own rows with WARPS = 1, warp = 0). IN_FLIGHT:
// 16-byte loads each lane keeps in flight (more registers, more bytes on the way per warp: warps
// that only stage can afford more than warps that also multiply).
template <Mode M, typename TIn, int WARPS, int IN_FLIGHT = 8, class Dst>
__device__ void stage_rows_to(Dst dst, bool vectorized, const TIn* __restrict__ pair, const int64_t* row_off,
                              int rows, int c, int c_pad, const float* __restrict__ ln_w,
                              const float* __restrict__ ln_b, float eps, int warp = threadIdx.x >> 5) {
  // (the VECS dispatch written out rather than through with_row_vectors: its lambda changed the SASS
  // of 30 measured kernels)
  int lanes_log2 = 0;
  const int per_lane = row_vectors_per_lane<TIn>(c_pad, lanes_log2);
  if (vectorized && per_lane == 1)
    stage_rows_vec<M, TIn, WARPS, 1, IN_FLIGHT>(dst, pair, row_off, rows, c, c_pad, ln_w, ln_b, eps, lanes_log2, warp);
  else if (vectorized && per_lane == 2)
    stage_rows_vec<M, TIn, WARPS, 2, IN_FLIGHT>(dst, pair, row_off, rows, c, c_pad, ln_w, ln_b, eps, lanes_log2, warp);
  else if (vectorized && per_lane == 3)
    stage_rows_vec<M, TIn, WARPS, 3, IN_FLIGHT>(dst, pair, row_off, rows, c, c_pad, ln_w, ln_b, eps, lanes_log2, warp);
  else if (vectorized && per_lane == 4)
    stage_rows_vec<M, TIn, WARPS, 4, IN_FLIGHT>(dst, pair, row_off, rows, c, c_pad, ln_w, ln_b, eps, lanes_log2, warp);
  else
    stage_rows_scalar<M, TIn, WARPS>(dst, pair, row_off, rows, c, c_pad, ln_w, ln_b, eps, warp);
}

// The same into plain rows a_res + m * a_stride.
template <Mode M, typename TIn, int WARPS>
__device__ void stage_rows(bool vectorized, uint32_t* a_res, int a_stride, const TIn* __restrict__ pair,
                           const int64_t* row_off, int rows, int c, int c_pad,
                           const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps,
                           int warp = threadIdx.x >> 5) {
  stage_rows_to<M, TIn, WARPS>(PlainRows{a_res, a_stride}, vectorized, pair, row_off, rows, c, c_pad, ln_w, ln_b,
                               eps, warp);
}

// `bytes` if a persistent pass (one block per SM working through tiles) has at least `slots_per_sm`
// tiles for every SM and its shared memory fits; else 0. Smaller problems run faster as a
// streamed kernel's many small blocks (each persistent block first loads its weights).
inline int64_t persistent_bytes(int64_t tiles, int slots_per_sm, int64_t bytes) {
  return tiles >= sm_count() * slots_per_sm && bytes <= max_smem_optin() ? bytes : 0;
}

// Which of a pass's two tilings to launch and its shared memory: {wide?, bytes}, bytes 0 when
// neither fits. Two blocks per multiprocessor overlap one block's staging with the other's
// products, which beats the wide tile's weight reuse: so the wide tile only where two of them
// fit, and only when its tiles fill the GPU twice over (a small problem is a latency chain per
// block: the narrow tile halves each block's chain and doubles the blocks).
inline std::pair<bool, int64_t> choose_tiling(int64_t wide_bytes, int64_t narrow_bytes, int64_t wide_tiles) {
  const int64_t limit = max_smem_optin();
  if (wide_tiles >= 2 * sm_count() && 2 * wide_bytes + 2048 <= max_smem_per_sm()) return {true, wide_bytes};
  if (narrow_bytes <= limit) return {false, narrow_bytes};
  if (wide_bytes <= limit) return {true, wide_bytes};
  return {false, 0};
}

// The modes a pass kernel is built for (TRIMUL_REGISTER_PASS): a bit per Mode.
enum ModeSet : unsigned {
  kAllModes = 0xFu,
  k16BitModes = (1u << static_cast<int>(Mode::bf16)) | (1u << static_cast<int>(Mode::f16)),
  kBf16Mode = 1u << static_cast<int>(Mode::bf16),
};

// f(mode tag, pair type tag) for the (mode, pair dtype) pairs a fused pass takes, of the modes in kModes:
// fp32 pairs in any mode, bf16/fp16 pairs only in their own mode; `otherwise` for the rest (f is not
// instantiated for them).
template <unsigned kModes, typename R, typename F>
R dispatch_pass(const ForwardArgs& args, R otherwise, F&& f) {
  R result = otherwise;
  dispatch_mode(args.mode, [&](auto mode) -> cudaError_t {
    constexpr Mode M = decltype(mode)::value;
    if constexpr (((kModes >> static_cast<int>(M)) & 1u) != 0) {
      switch (args.pair_dtype) {
        case Dtype::f32: result = f(mode, TypeTag<float>{}); break;
        case Dtype::bf16:
          if constexpr (M == Mode::bf16) result = f(mode, TypeTag<__nv_bfloat16>{});
          break;
        case Dtype::f16:
          if constexpr (M == Mode::f16) result = f(mode, TypeTag<__half>{});
          break;
      }
    }
    return cudaSuccess;
  });
  return result;
}

// Raises a kernel's dynamic shared memory limit once per device and size. The kernel is a
// template argument so each kernel gets its own table (one per signature would be wrong).
template <auto Kernel>
cudaError_t allow_smem(int64_t bytes) {
  constexpr int kMaxDevices = 64;
  static int64_t allowed[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (device < kMaxDevices && allowed[device] >= bytes) return cudaSuccess;
  status = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status == cudaSuccess && device < kMaxDevices) allowed[device] = bytes;
  return status;
}

// In an input-pass kernel, first thing: its programmatic dependent (the output pass with the in-pass
// contraction, launch_tiles' `dependent`) may launch once every block of this grid has started, so the
// dependent's blocks take SMs as this grid's blocks retire and run their prologue (weights, gate rows)
// during its tail; without it the trigger is implicit at the grid's completion. A no-op without a dependent.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// In a kernel launched as a programmatic dependent (launch_tiles' `dependent`): waits until the
// kernel before it in the stream has finished and its writes are visible; a no-op otherwise.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches a pass kernel of tiling T (arguments: the forward's args and the tiles per batch) over
// `positions` positions per batch, BM per block. `dependent`: as a programmatic dependent of the
// kernel before it in the stream (Hopper's PDL; a plain launch on GPUs before compute capability 9.0):
// the kernel must call wait_for_prior_grid() before it touches anything that kernel writes.
template <auto Kernel, class T>
cudaError_t launch_tiles(const ForwardArgs& args, int64_t positions, int64_t smem_bytes, bool dependent = false) {
  const cudaError_t status = allow_smem<Kernel>(smem_bytes);
  if (status != cudaSuccess) return status;
  const int64_t tiles = ceil_div(positions, T::BM);
  if (dependent && compute_capability_major() >= 9) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(args.batch * tiles));
    config.blockDim = dim3(T::kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    config.stream = args.stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, Kernel, args, tiles);
  }
  Kernel<<<static_cast<unsigned>(args.batch * tiles), T::kThreads, smem_bytes, args.stream>>>(args, tiles);
  return cudaGetLastError();
}

// Launches the tiling a pass's choose_tiling picked ({wide?, bytes}; bytes 0: none fits).
template <auto Kernel128, class Tiles128, auto Kernel64, class Tiles64>
cudaError_t launch_chosen(const ForwardArgs& args, std::pair<bool, int64_t> choice, int64_t positions) {
  if (choice.second == 0) return cudaErrorNotSupported;
  return choice.first ? launch_tiles<Kernel128, Tiles128>(args, positions, choice.second)
                      : launch_tiles<Kernel64, Tiles64>(args, positions, choice.second);
}

// Rows [0, rows) of row_bytes each (a multiple of 16, also the source pitch) from src row
// src_row(r) into shared memory at dst + r * dst_stride words, by cp.async across the block's THREADS
// threads; the caller commits and waits.
template <int THREADS, typename SrcRow>
__device__ __forceinline__ void copy_rows_async(uint32_t* dst, int dst_stride, const char* src, int rows,
                                                int row_bytes, SrcRow src_row) {
  const int vectors = row_bytes / 16;
  for (int i = threadIdx.x; i < rows * vectors; i += THREADS) {
    const int r = i / vectors, v = i - r * vectors;
    cp_async16(dst + r * dst_stride + v * 4, src + src_row(r) * row_bytes + v * 16, true);
  }
}

// Launches a persistent pass kernel (arguments: the forward's args and tiles per batch) over
// `positions` positions per batch in tiles of tile_rows, `tiles_per_block` tiles in flight per
// block, as many blocks as there are SMs or tile groups.
template <auto Kernel>
cudaError_t launch_persistent(const ForwardArgs& args, int64_t positions, int tile_rows, int tiles_per_block,
                              int threads, int64_t smem_bytes) {
  const cudaError_t status = allow_smem<Kernel>(smem_bytes);
  if (status != cudaSuccess) return status;
  const int64_t tiles_per_batch = ceil_div(positions, tile_rows);
  const int64_t blocks = std::min<int64_t>(sm_count(), ceil_div(args.batch * tiles_per_batch, tiles_per_block));
  Kernel<<<static_cast<unsigned>(blocks), threads, smem_bytes, args.stream>>>(args, tiles_per_batch);
  return cudaGetLastError();
}

// Launches a contraction kernel (a, b, z, batch, m, n, k, lda, ldz) over BM x BN output tiles.
template <auto Kernel, typename Op, typename TOut, int BM, int BN>
cudaError_t launch_contraction(const ContractArgs& args, int threads, int64_t smem_bytes) {
  const cudaError_t status = allow_smem<Kernel>(smem_bytes);
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>(ceil_div(args.m, BM) * ceil_div(args.n, BN)), batch_grid(args.batch));
  Kernel<<<grid, threads, smem_bytes, args.stream>>>(static_cast<const Op*>(args.a), static_cast<const Op*>(args.b),
                                                     static_cast<TOut*>(args.z), args.batch, args.m, args.n, args.k,
                                                     args.lda, args.ldz);
  return cudaGetLastError();
}

}  // namespace fused
}  // namespace trimul

// Registers pass kernel NAME of ROLE (input or output), built for the modes MODES (a ModeSet), whose
// namespace NS defines, for each of those modes M and pair type TIn, applicable<M, TIn>(const
// ForwardArgs&) -> bool and launch<M, TIn>(const ForwardArgs&) -> cudaError_t (registry.cuh:
// Implementation). It takes no call in another mode, as an input kernel none with ForwardArgs::x_hat set
// (TRIMUL_REGISTER_INPUT_PASS_WRITING_X_HAT: its applicable() decides), and as an output kernel none with
// ForwardArgs::gate_rows set (TRIMUL_REGISTER_OUTPUT_PASS_READING_GATE_ROWS: likewise), and none on a block of
// rows (ForwardArgs::rows != N) unless registered with ROW_BLOCKS: a kernel that would ignore the field never sees
// it.
#define TRIMUL_REGISTER_PASS(ROLE, NAME, NS, MODES) TRIMUL_REGISTER_PASS_WITH(ROLE, NAME, NS, MODES, false, false)
#define TRIMUL_REGISTER_INPUT_PASS_WRITING_X_HAT(NAME, NS, MODES) \
  TRIMUL_REGISTER_PASS_WITH(input, NAME, NS, MODES, true, false)
#define TRIMUL_REGISTER_OUTPUT_PASS_READING_GATE_ROWS(NAME, NS, MODES) \
  TRIMUL_REGISTER_PASS_WITH(output, NAME, NS, MODES, true, false)
// ROLE_ROWS: an input kernel writes ForwardArgs::x_hat, an output kernel reads ForwardArgs::gate_rows.
// ROW_BLOCKS: it takes a block of pair's rows (ForwardArgs::rows).
#define TRIMUL_REGISTER_PASS_WITH(ROLE, NAME, NS, MODES, ROLE_ROWS, ROW_BLOCKS)                           \
  static const bool trimul_registered_##ROLE##_##NAME = ::trimul::register_implementation(               \
      {::trimul::Role::ROLE, #NAME,                                                                        \
       [](const ::trimul::ForwardArgs& args) {                                                             \
         if (!(ROLE_ROWS) && ::trimul::Role::ROLE == ::trimul::Role::input && args.x_hat != nullptr)       \
           return false;                                                                                   \
         if (!(ROLE_ROWS) && ::trimul::Role::ROLE == ::trimul::Role::output && args.gate_rows != nullptr)  \
           return false;                                                                                   \
         if (!(ROW_BLOCKS) && ::trimul::pair_rows(args) != args.n) return false;                           \
         return ::trimul::fused::dispatch_pass<MODES>(args, false, [&](auto mode, auto pair) {             \
           return NS::applicable<decltype(mode)::value, typename decltype(pair)::type>(args);              \
         });                                                                                               \
       },                                                                                                  \
       [](const ::trimul::ForwardArgs& args) {                                                             \
         return ::trimul::fused::dispatch_pass<MODES>(args, cudaErrorNotSupported, [&](auto mode, auto pair) { \
           return NS::launch<decltype(mode)::value, typename decltype(pair)::type>(args);                  \
         });                                                                                               \
       },                                                                                                  \
       nullptr, nullptr, false, nullptr, nullptr})
