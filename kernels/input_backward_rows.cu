// rows — input_backward: LayerNorm_in rows, a/b planes from the projections, their derivative, d pair_repr
// The memory passes of the input side of the backward (BackwardPass input_rows, gated_planes, d_proj,
// d_pair); the GEMMs between them (the four projections and their weight gradients) are cuBLAS's.
// Statistics and arithmetic in fp32; rows and planes in the operand dtype.
#include "backward_rows.cuh"

#include <algorithm>

namespace trimul {
namespace backward {
namespace {

// Mean and rstd of a position's row of width `width` (pair rows), by one warp: two passes over the row.
template <typename TPair>
__device__ __forceinline__ void row_statistics(const TPair* row, int64_t width, float eps, float* mean, float* rstd) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int64_t c = lane; c < width; c += 32) sum += to_float(row[c]);
  *mean = warp_sum(sum) / width;
  float squares = 0.f;
  for (int64_t c = lane; c < width; c += 32) {
    const float d = to_float(row[c]) - *mean;
    squares += d * d;
  }
  *rstd = rsqrtf(warp_sum(squares) / width + eps);
}

// pair -> x_hat rows (LayerNorm_in without affine), one warp per position.
template <typename T, typename TPair>
__global__ void __launch_bounds__(kThreads) input_rows_kernel(const BackwardArgs args) {
  const int64_t positions = args.batch * args.n * args.n, width = args.c;
  const int lane = threadIdx.x % 32;
  for (int64_t p = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; p < positions; p += int64_t(gridDim.x) * kWarps) {
    const TPair* row = static_cast<const TPair*>(args.pair) + p * width;
    float mean, rstd;
    row_statistics(row, width, args.eps, &mean, &rstd);
    T* out = static_cast<T*>(args.rows) + p * width;
    for (int64_t c = lane; c < width; c += 32) out[c] = from_float<T>((to_float(row[c]) - mean) * rstd);
  }
}

// proj rows (pa | ga | pb | gb) and the mask -> a = pa sigmoid(ga) m and b planes.
template <typename T>
__global__ void __launch_bounds__(kThreads) gated_planes_kernel(const BackwardArgs args) {
  extern __shared__ float tiles[];
  const int64_t hidden = args.h;
  float* tile_a = tiles;
  float* tile_b = tiles + hidden * kTileStride;
  const Tile t = tile_at(blockIdx.x, args.n);
  const int lane = threadIdx.x % 32;
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    const int64_t p = tile_position(t, q, args.n, args.incoming);
    const float m = load_mask(args.mask, args.mask_kind, p);
    const T* proj = static_cast<const T*>(args.proj) + p * 4 * hidden;
    for (int64_t h = lane; h < hidden; h += 32) {
      tile_a[h * kTileStride + q] = to_float(proj[h]) * sigmoid(to_float(proj[hidden + h])) * m;
      tile_b[h * kTileStride + q] = to_float(proj[2 * hidden + h]) * sigmoid(to_float(proj[3 * hidden + h])) * m;
    }
  }
  __syncthreads();
  tile_to_planes(tile_a, static_cast<T*>(args.a_planes), t, args.n, hidden);
  tile_to_planes(tile_b, static_cast<T*>(args.b_planes), t, args.n, hidden);
}

// da, db planes -> d proj rows: d pa = da s m, d ga = da pa m s (1 - s) (s = sigmoid(ga)), the same for b;
// d mask = sum over h of da pa s + db pb s_b where asked.
template <typename T>
__global__ void __launch_bounds__(kThreads) d_proj_kernel(const BackwardArgs args) {
  extern __shared__ float tiles[];
  const int64_t hidden = args.h;
  float* tile_a = tiles;
  float* tile_b = tiles + hidden * kTileStride;
  const Tile t = tile_at(blockIdx.x, args.n);
  planes_to_tile(static_cast<const T*>(args.a_planes), tile_a, t, args.n, hidden);
  planes_to_tile(static_cast<const T*>(args.b_planes), tile_b, t, args.n, hidden);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    const int64_t p = tile_position(t, q, args.n, args.incoming);
    const float m = load_mask(args.mask, args.mask_kind, p);
    const T* proj = static_cast<const T*>(args.proj) + p * 4 * hidden;
    T* d_proj = static_cast<T*>(args.rows) + p * 4 * hidden;
    float d_mask = 0.f;
    for (int64_t h = lane; h < hidden; h += 32) {
      const float da = tile_a[h * kTileStride + q], db = tile_b[h * kTileStride + q];
      const float pa = to_float(proj[h]), sa = sigmoid(to_float(proj[hidden + h]));
      const float pb = to_float(proj[2 * hidden + h]), sb = sigmoid(to_float(proj[3 * hidden + h]));
      d_proj[h] = from_float<T>(da * sa * m);
      d_proj[hidden + h] = from_float<T>(da * pa * m * sa * (1.f - sa));
      d_proj[2 * hidden + h] = from_float<T>(db * sb * m);
      d_proj[3 * hidden + h] = from_float<T>(db * pb * m * sb * (1.f - sb));
      d_mask += da * pa * sa + db * pb * sb;
    }
    if (args.d_mask != nullptr) {
      d_mask = warp_sum(d_mask);
      if (lane == 0) args.d_mask[p] = d_mask;
    }
  }
}

// LayerNorm_in's backward: d pair = rstd (d x_hat - mean(d x_hat) - x_hat mean(d x_hat x_hat)) (+ d_rows_add),
// the statistics recomputed from pair; one warp per position.
template <typename TPair>
__global__ void __launch_bounds__(kThreads) d_pair_kernel(const BackwardArgs args) {
  const int64_t positions = args.batch * args.n * args.n, width = args.c;
  const int lane = threadIdx.x % 32;
  for (int64_t p = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; p < positions; p += int64_t(gridDim.x) * kWarps) {
    const TPair* row = static_cast<const TPair*>(args.pair) + p * width;
    const float* d_row = args.d_rows + p * width;
    float mean, rstd;
    row_statistics(row, width, args.eps, &mean, &rstd);
    float sum = 0.f, dot = 0.f;
    for (int64_t c = lane; c < width; c += 32) {
      const float d = d_row[c];
      sum += d;
      dot += d * (to_float(row[c]) - mean) * rstd;
    }
    const float mean_d = warp_sum(sum) / width, mean_dot = warp_sum(dot) / width;
    float* out = args.d_pair + p * width;
    const float* add = args.d_rows_add != nullptr ? args.d_rows_add + p * width : nullptr;
    for (int64_t c = lane; c < width; c += 32) {
      const float x_hat = (to_float(row[c]) - mean) * rstd;
      out[c] = rstd * (d_row[c] - mean_d - x_hat * mean_dot) + (add != nullptr ? add[c] : 0.f);
    }
  }
}

bool applies(const BackwardArgs& args) { return tile_bytes(args, 2) <= max_smem_optin(); }

template <typename T>
cudaError_t launch_typed(const BackwardArgs& args) {
  switch (args.pass) {
    case BackwardPass::input_rows:
      return dispatch_out(args.pair_dtype, [&](auto pair) {
        return launch_rows(input_rows_kernel<T, typename decltype(pair)::type>, args);
      });
    case BackwardPass::gated_planes: return launch_tiles(gated_planes_kernel<T>, args, tile_bytes(args, 2));
    case BackwardPass::d_proj: return launch_tiles(d_proj_kernel<T>, args, tile_bytes(args, 2));
    case BackwardPass::d_pair:
      return dispatch_out(args.pair_dtype, [&](auto pair) {
        return launch_rows(d_pair_kernel<typename decltype(pair)::type>, args);
      });
    default: return cudaErrorInvalidValue;  // (an output_backward pass)
  }
}

cudaError_t launch(const BackwardArgs& args) {
  return dispatch_out(args.operand, [&](auto operand) { return launch_typed<typename decltype(operand)::type>(args); });
}

}  // namespace
}  // namespace backward
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(input_backward, rows, ::trimul::backward::applies, ::trimul::backward::launch);
