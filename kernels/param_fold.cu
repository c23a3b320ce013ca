// param_fold — the training backward's parameters in fp32 and its Linears folded with the LayerNorms they read:
// a Linear on LayerNorm(x) = x_hat ln_w + ln_b runs on x_hat as W_f = W diag(ln_w), b_f = b + W ln_b. One launch
// (a block per weight row, then the LayerNorms' vectors, then the zeroed span) in place of the host's casts,
// concatenations and fold ops, ~15 tensor ops that cost a small step more host time than GPU time. Each b_f sums
// in a fixed order: the same bits on every run.
#include "common.cuh"

namespace trimul {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kZeroPerBlock = int64_t(kThreads) * 16;

// (Linears and norms are picked by unrolled loops with constant indices: a dynamic index into the kernel's
// parameters would copy them all to local memory in every thread.)

// One weight row of a Linear: W[row] and b[row] in fp32, and folded where the Linear reads a LayerNorm.
__device__ void fold_row(const ParamFoldArgs& args, const ParamFoldArgs::Linear& lin, int64_t row) {
  const void* ln_w = nullptr;
  const void* ln_b = nullptr;
  Dtype ln_w_dtype = Dtype::f32, ln_b_dtype = Dtype::f32;
#pragma unroll
  for (int k = 0; k < ParamFoldArgs::kMaxNorms; ++k)
    if (lin.norm == k) {
      ln_w = args.norm[k].w;
      ln_b = args.norm[k].b;
      ln_w_dtype = args.norm[k].w_dtype;
      ln_b_dtype = args.norm[k].b_dtype;
    }
  float dot = 0.f;
  for (int64_t i = threadIdx.x; i < lin.cols; i += kThreads) {
    const int64_t at = row * lin.cols + i;
    const float w = load_float(lin.w, lin.w_dtype, at);
    lin.w_f32[at] = w;
    if (ln_w != nullptr) {
      lin.w_folded[at] = w * load_float(ln_w, ln_w_dtype, i);
      dot = fmaf(w, load_float(ln_b, ln_b_dtype, i), dot);
    }
  }
  const float b = load_float(lin.b, lin.b_dtype, row);
  if (threadIdx.x == 0) lin.b_f32[row] = b;
  if (ln_w == nullptr) return;
  __shared__ float scratch[kThreads / 32];
  const float total = block_sum<kThreads>(dot, scratch);
  if (threadIdx.x == 0) lin.b_folded[row] = b + total;
}

__global__ void __launch_bounds__(kThreads) fold_kernel(const ParamFoldArgs args) {
  int64_t block = blockIdx.x;
#pragma unroll
  for (int i = 0; i < ParamFoldArgs::kMaxLinears; ++i) {
    if (i >= args.linears) continue;
    if (block >= 0 && block < args.lin[i].rows) fold_row(args, args.lin[i], block);
    block -= args.lin[i].rows;
  }
  if (block < 0) return;
  if (block == 0) {  // (the LayerNorms' vectors: a few hundred elements)
#pragma unroll
    for (int k = 0; k < ParamFoldArgs::kMaxNorms; ++k) {
      if (k >= args.norms) continue;
      const ParamFoldArgs::Norm& nm = args.norm[k];
      for (int64_t i = threadIdx.x; i < nm.cols; i += kThreads) {
        nm.w_f32[i] = load_float(nm.w, nm.w_dtype, i);
        nm.b_f32[i] = load_float(nm.b, nm.b_dtype, i);
      }
    }
    return;
  }
  const int64_t first = (block - 1) * kZeroPerBlock, last = min(first + kZeroPerBlock, args.zero_count);
  for (int64_t i = first + threadIdx.x; i < last; i += kThreads) args.zero[i] = 0.f;
}

}  // namespace

cudaError_t launch_param_fold(const ParamFoldArgs& args) {
  int64_t blocks = 1 + ceil_div(args.zero_count, kZeroPerBlock);
  for (int i = 0; i < args.linears; ++i) blocks += args.lin[i].rows;
  fold_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, args.stream>>>(args);
  return cudaGetLastError();
}

}  // namespace trimul
