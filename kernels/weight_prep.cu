// weight_prep — the forward's kernel-layout weights for the 16-bit modes (prepare_weights' list) in one launch.
// prepare_weights builds them with ~50 tensor ops (index tensors, scatters, fills, casts, fp64 products): every
// training step redoes them after the optimizer's update, and in a small step their launches are much of its GPU
// time (a graph replay still launches each). Every value is prepare_weights' bit for bit (the same fp32 products and
// round-to-nearest-even casts), except that its fp64 sums (the folded biases) add in this kernel's fixed order
// before their single rounding to fp32. One block per output row; the block sums in a fixed order: the same bits
// on every run.
#include "common.cuh"

namespace trimul {
namespace {

constexpr int kThreads = 128;

struct Source {
  const void* p;  // nullptr: a bias the module does not have (zeros)
  Dtype dtype;
  __device__ __forceinline__ float operator[](int64_t i) const { return p == nullptr ? 0.f : load_float(p, dtype, i); }
};

// (parameters picked with constant indices only: a dynamic index into the kernel's parameters would copy them all
// to local memory in every thread)
template <int kIndex>
__device__ __forceinline__ Source source(const WeightPrepArgs& a) {
  return Source{a.params[kIndex], a.dtypes[kIndex]};
}

__device__ __forceinline__ void store_operand(void* out, bool f16, int64_t at, float v) {
  if (f16) static_cast<__half*>(out)[at] = __float2half_rn(v);
  else static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(v);
}

// fp32 value rounded to `kept` mantissa bits, ties away from zero (prepare_weights' _round_mantissa: its int32
// arithmetic wraps as this uint32 arithmetic does).
__device__ __forceinline__ float round_mantissa(float v, int kept) {
  const uint32_t dropped = 23 - kept;
  return __uint_as_float((__float_as_uint(v) + (1u << (dropped - 1))) & ~((1u << dropped) - 1u));
}

// The block's sum of v in fp64, in a fixed order (lanes by xor shuffles, then warps in turn).
__device__ double block_sum64(double v) {
  __shared__ double scratch[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// b + W[row] . v in fp64 (the row's `cols` weights from w_at on), rounded once to fp32: prepare_weights'
// (b.double() + W.double() @ v.double()). Every thread of the block calls it (it synchronises the block).
__device__ float folded_bias(Source w, int64_t w_at, float b, Source v, int64_t cols) {
  double dot = 0.0;
  for (int64_t k = threadIdx.x; k < cols; k += kThreads) dot += double(w[w_at + k]) * double(v[k]);
  return static_cast<float>(double(b) + block_sum64(dot));
}

// The register-row input kernels' k order: k = 16s + 8hh + 2t + e holds channel 16s + 4t + 2hh + e
// (prepare_weights' _register_row_weights).
__device__ __forceinline__ int64_t register_row_channel(int64_t k) {
  const int64_t block = k / 16, within = k % 16;
  return 16 * block + 4 * ((within % 8) / 2) + 2 * (within / 8) + within % 2;
}

// Row r of w_in (proj/gate rows in groups of 16: rows 16g + e proj and 16g + 8 + e gate of h = 8g + e, a's
// rows_ab rows then b's), its bias, and the same row of the register-row weights: (w_in diag(ln_w))[k order],
// then the bias b + w_in . ln_b as a 16-bit part and its remainder in two more columns.
__device__ void in_row(const WeightPrepArgs& a, int64_t r) {
  const bool b_side = r >= a.rows_ab, gate = (r % 16) >= 8;
  const int64_t within = b_side ? r - a.rows_ab : r, h = 8 * (within / 16) + within % 8;
  const bool valid = h < a.h;
  const Source w = b_side ? (gate ? source<8>(a) : source<6>(a)) : (gate ? source<4>(a) : source<2>(a));
  const Source b = b_side ? (gate ? source<9>(a) : source<7>(a)) : (gate ? source<5>(a) : source<3>(a));
  const Source ln_w = source<0>(a), ln_b = source<1>(a);
  const auto weight = [&](int64_t k) { return valid && k < a.c ? w[h * a.c + k] : 0.f; };
  const int64_t width = a.c_pad + 64;
  for (int64_t k = threadIdx.x; k < a.c_pad; k += kThreads) {
    store_operand(a.w_in, a.f16, r * a.c_pad + k, weight(k));
    const int64_t ch = register_row_channel(k);
    // (a padding row's zero times ln_w keeps the product's sign, as the fp32 tensor product does)
    store_operand(a.w_rows, a.f16, r * width + k, weight(ch) * (ch < a.c ? ln_w[ch] : 0.f));
  }
  const float bias = valid ? folded_bias(w, h * a.c, b[h], ln_b, a.c) : 0.f;  // (valid: the same in the whole block)
  if (threadIdx.x == 0) {
    a.b_in[r] = valid ? b[h] : 0.f;
    const float part = round_mantissa(bias, a.f16 ? 10 : 7);
    store_operand(a.w_rows, a.f16, r * width + a.c_pad, part);
    store_operand(a.w_rows, a.f16, r * width + a.c_pad + 1, bias - part);
  }
  for (int64_t k = a.c_pad + 2 + threadIdx.x; k < width; k += kThreads) store_operand(a.w_rows, a.f16, r * width + k, 0.f);
}

// Row r of a [rows_c, cols_pad] operand matrix whose [C, cols] corner is W diag(ln) (W itself where not
// `folded`), and (b_out given, r < C) its bias b + W . ln_bias (b itself where not `folded`).
__device__ void folded_row(const WeightPrepArgs& a, int64_t r, bool folded, Source w, Source b, Source ln,
                           Source ln_bias, int64_t cols, int64_t cols_pad, void* w_out, float* b_out) {
  const bool valid = r < a.c;  // (the same in the whole block)
  for (int64_t k = threadIdx.x; k < cols_pad; k += kThreads) {
    float v = 0.f;
    if (valid && k < cols) v = folded ? w[r * cols + k] * ln[k] : w[r * cols + k];
    store_operand(w_out, a.f16, r * cols_pad + k, v);
  }
  if (b_out == nullptr || !valid) return;
  const float bias = folded ? folded_bias(w, r * cols, b[r], ln_bias, cols) : b[r];
  if (threadIdx.x == 0) b_out[r] = bias;
}

__global__ void __launch_bounds__(kThreads) prep_kernel(const WeightPrepArgs a) {
  int64_t block = blockIdx.x;
  if (block < 2 * a.rows_ab) return in_row(a, block);
  block -= 2 * a.rows_ab;
  const Source none{nullptr, Dtype::f32};
  if (block < a.rows_c)  // out_gate's weight as it is (its bias goes out with the vectors)
    return folded_row(a, block, false, source<14>(a), none, none, none, a.c, a.c_pad, a.w_gate, nullptr);
  block -= a.rows_c;
  if (block < a.rows_c)  // out_proj folded with LayerNorm_out
    return folded_row(a, block, true, source<12>(a), source<13>(a), source<10>(a), source<11>(a), a.h, a.h_pad,
                      a.w_out, a.b_out);
  block -= a.rows_c;
  if (a.x_hat_w_gate != nullptr) {
    if (block < a.rows_c)  // out_gate folded with LayerNorm_in (a raw gate on x_hat)
      return folded_row(a, block, true, source<14>(a), source<15>(a), source<0>(a), source<1>(a), a.c, a.c_pad,
                        a.x_hat_w_gate, a.x_hat_b_gate);
    block -= a.rows_c;
  }
  if (block == 0)  // (the vectors in fp32)
    for (int64_t i = threadIdx.x; i < a.c; i += kThreads) {
      a.ln_w[i] = source<0>(a)[i];
      a.ln_b[i] = source<1>(a)[i];
      a.b_gate[i] = source<15>(a)[i];
    }
}

}  // namespace

cudaError_t launch_weight_prep(const WeightPrepArgs& args) {
  const int64_t blocks = 2 * args.rows_ab + (args.x_hat_w_gate != nullptr ? 3 : 2) * args.rows_c + 1;
  prep_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, args.stream>>>(args);
  return cudaGetLastError();
}

}  // namespace trimul
