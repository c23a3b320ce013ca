// param_grads — the training backward's parameter gradients from its folded GEMMs: each Linear that reads
// LayerNorm(x) = x_hat ln_w + ln_b runs folded, as x_hat (W diag(ln_w))^T + (b + W ln_b), so its GEMM gives
// g = d(W diag(ln_w)) and the passes' sums give s = d bias; then d W = g diag(ln_w) + s ln_b^T,
// d ln_w = sum_r W[r] * g[r], d ln_b = s^T W, where s is the sum of the passes' per-block partials, taken here.
// Two launches (the segments' rows with their s, then the LayerNorms' columns, which read those s)
// write all sixteen gradients in the parameters' dtype, in place of ~30 tensor ops and casts on the host. Every
// sum runs in a fixed order (no atomics): the gradients are bitwise repeatable.
#include "common.cuh"

namespace trimul {
namespace {

constexpr int kThreads = 256;

// (Segments and norms are picked by unrolled loops with constant indices: a dynamic index into the kernel's
// parameters would copy them all to local memory in every thread.)

// One block per row of every segment: the row of d W and its d bias, in TOut (args.dtype).
template <typename TOut>
__global__ void __launch_bounds__(kThreads) rows_kernel(const ParamGradArgs args) {
  ParamGradArgs::Segment sg{};
  int64_t row = blockIdx.x;
  bool found = false;
#pragma unroll
  for (int i = 0; i < ParamGradArgs::kMaxSegments; ++i) {
    if (found || i >= args.segments) continue;
    if (row < args.seg[i].rows) {
      sg = args.seg[i];
      found = true;
    } else {
      row -= args.seg[i].rows;
    }
  }
  if (!found) return;
  float s;
  if (sg.partial_rows > 0) {  // (the passes' per-block partials, summed in a fixed order; kept for columns_kernel)
    __shared__ float scratch[kThreads / 32];
    float part = 0.f;
    for (int64_t k = threadIdx.x; k < sg.partial_rows; k += kThreads) part += sg.partials[k * sg.partial_stride + row];
    s = block_sum<kThreads>(part, scratch);
    if (threadIdx.x == 0) sg.s[row] = s;
  } else {
    s = sg.s[row];
  }
  if (threadIdx.x == 0) static_cast<TOut*>(sg.d_bias)[row] = from_float<TOut>(s);
  const float* ln_w = nullptr;
  const float* ln_b = nullptr;
#pragma unroll
  for (int k = 0; k < ParamGradArgs::kMaxNorms; ++k)
    if (sg.norm == k) {
      ln_w = args.norm[k].ln_w;
      ln_b = args.norm[k].ln_b;
    }
  for (int64_t i = threadIdx.x; i < sg.cols; i += kThreads) {
    const float g = sg.g[row * sg.cols + i];
    const float d_w = ln_w == nullptr ? g : g * ln_w[i] + s * ln_b[i];
    static_cast<TOut*>(sg.d_weight)[row * sg.cols + i] = from_float<TOut>(d_w);
  }
}

// One block per 32 columns of a LayerNorm: lane = column, warp w takes rows w, w + 32, ... of each of the
// norm's segments in order; the 32 warps' sums then added in warp order.
constexpr int kColumnThreads = 1024, kColumns = 32, kWarps = kColumnThreads / 32;

template <typename TOut>
__global__ void __launch_bounds__(kColumnThreads) columns_kernel(const ParamGradArgs args) {
  ParamGradArgs::Norm nm{};
  int norm_index = -1;
  int64_t first = int64_t(blockIdx.x) * kColumns;
#pragma unroll
  for (int k = 0; k < ParamGradArgs::kMaxNorms; ++k) {
    if (norm_index >= 0 || k >= args.norms) continue;
    const int64_t span = ceil_div(args.norm[k].cols, int64_t(kColumns)) * kColumns;
    if (first < span) {
      nm = args.norm[k];
      norm_index = k;
    } else {
      first -= span;
    }
  }
  if (norm_index < 0) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = first + lane;
  float dw = 0.f, db = 0.f;
  if (col < nm.cols) {
#pragma unroll
    for (int i = 0; i < ParamGradArgs::kMaxSegments; ++i) {
      if (i >= args.segments || args.seg[i].norm != norm_index) continue;
      const float* g = args.seg[i].g;
      const float* weight = args.seg[i].weight;
      const float* s = args.seg[i].s;
      const int64_t rows = args.seg[i].rows, cols = args.seg[i].cols;
      for (int64_t r = warp; r < rows; r += kWarps) {
        const float w = weight[r * cols + col];
        dw = fmaf(w, g[r * cols + col], dw);
        db = fmaf(s[r], w, db);
      }
    }
  }
  __shared__ float sums[2][kWarps][kColumns];
  sums[0][warp][lane] = dw;
  sums[1][warp][lane] = db;
  __syncthreads();
  if (warp != 0 || col >= nm.cols) return;
  float total_w = 0.f, total_b = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    total_w += sums[0][w][lane];
    total_b += sums[1][w][lane];
  }
  static_cast<TOut*>(nm.d_ln_w)[col] = from_float<TOut>(total_w);
  static_cast<TOut*>(nm.d_ln_b)[col] = from_float<TOut>(total_b);
}

}  // namespace

cudaError_t launch_param_grads(const ParamGradArgs& args) {
  int64_t rows = 0, column_blocks = 0;
  for (int i = 0; i < args.segments; ++i) rows += args.seg[i].rows;
  for (int i = 0; i < args.norms; ++i) column_blocks += ceil_div(args.norm[i].cols, int64_t(kColumns));
  return dispatch_out(args.dtype, [&](auto out_tag) {
    using TOut = typename decltype(out_tag)::type;
    if (rows > 0) {
      rows_kernel<TOut><<<static_cast<unsigned int>(rows), kThreads, 0, args.stream>>>(args);
      const cudaError_t status = cudaGetLastError();
      if (status != cudaSuccess) return status;
    }
    if (column_blocks > 0)
      columns_kernel<TOut><<<static_cast<unsigned int>(column_blocks), kColumnThreads, 0, args.stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace trimul
