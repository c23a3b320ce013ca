// input_backward_rows.cuh — input_backward's memory passes (BackwardPass input_rows, gated_planes, d_proj,
// d_pair) around cuBLAS GEMMs (the four projections and their weight gradients): the rows kernel
// (input_backward_rows.cu) and the passes wgmma_rs (input_backward_wgmma_rs.cu) leaves to it.
// Statistics and arithmetic in fp32; rows and planes in the operand dtype; each lane takes V adjacent
// channels of a row.
#pragma once
#include "backward_rows.cuh"

namespace trimul {
namespace backward {
namespace {

// Mean and rstd of a row of `width` by one warp: two passes over the row (L1-resident the second time).
template <int V, typename TPair>
__device__ __forceinline__ void row_statistics(const TPair* __restrict__ row, int64_t width, float eps, float* mean,
                                               float* rstd) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int64_t c = lane * V; c < width; c += 32 * V) {
    float x[V];
    load_pack<V>(row + c, x);
#pragma unroll
    for (int i = 0; i < V; ++i) sum += x[i];
  }
  *mean = warp_sum(sum) / width;
  float squares = 0.f;
  for (int64_t c = lane * V; c < width; c += 32 * V) {
    float x[V];
    load_pack<V>(row + c, x);
#pragma unroll
    for (int i = 0; i < V; ++i) squares += (x[i] - *mean) * (x[i] - *mean);
  }
  *rstd = rsqrtf(warp_sum(squares) / width + eps);
}

// Channels h .. h + V - 1 of a position's proj row (pa | ga | pb | gb, H each).
template <int V, typename T>
__device__ __forceinline__ void load_proj(const T* __restrict__ proj, int64_t hidden, int64_t h, float* pa, float* ga,
                                          float* pb, float* gb) {
  load_pack<V>(proj + h, pa);
  load_pack<V>(proj + hidden + h, ga);
  load_pack<V>(proj + 2 * hidden + h, pb);
  load_pack<V>(proj + 3 * hidden + h, gb);
}

// pair -> x_hat rows (LayerNorm_in without affine), one warp per position.
template <typename T, typename TPair, int V>
__global__ void __launch_bounds__(kThreads) input_rows_kernel(const BackwardArgs args) {
  const int64_t positions = ::trimul::positions(args), width = args.c;
  const int lane = threadIdx.x % 32;
  for (int64_t p = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; p < positions; p += int64_t(gridDim.x) * kWarps) {
    const TPair* __restrict__ row = static_cast<const TPair*>(args.pair) + p * width;
    float mean, rstd;
    row_statistics<V>(row, width, args.eps, &mean, &rstd);
    T* __restrict__ out = static_cast<T*>(args.rows) + p * width;
    for (int64_t c = lane * V; c < width; c += 32 * V) {
      float x[V];
      load_pack<V>(row + c, x);
#pragma unroll
      for (int i = 0; i < V; ++i) x[i] = (x[i] - mean) * rstd;
      store_pack<V>(out + c, x);
    }
  }
}

// proj rows (pa | ga | pb | gb) and the mask -> a = pa sigmoid(ga) m and b planes.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) gated_planes_kernel(const BackwardArgs args) {
  extern __shared__ float tiles[];
  const int64_t hidden = args.h;
  float* tile_a = tiles;
  float* tile_b = tiles + hidden * kTileStride;
  const Tile t = tile_at(blockIdx.x, args);
  const int lane = threadIdx.x % 32;
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    const int64_t p = tile_position(t, q, args.incoming);
    const float m = load_mask(args.mask, args.mask_kind, p);
    const T* __restrict__ proj = static_cast<const T*>(args.proj) + p * 4 * hidden;
    for (int64_t h = lane * V; h < hidden; h += 32 * V) {
      float pa[V], ga[V], pb[V], gb[V];
      load_proj<V>(proj, hidden, h, pa, ga, pb, gb);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        tile_a[(h + i) * kTileStride + q] = pa[i] * sigmoid(ga[i]) * m;
        tile_b[(h + i) * kTileStride + q] = pb[i] * sigmoid(gb[i]) * m;
      }
    }
  }
  __syncthreads();
  tile_to_planes(tile_a, static_cast<T*>(args.a_planes), t, hidden);
  tile_to_planes(tile_b, static_cast<T*>(args.b_planes), t, hidden);
}

// da, db planes -> d proj rows, ld_rows apart where set (rows may be proj: in place): d pa = da s m,
// d ga = da pa m s (1 - s) (s = sigmoid(ga)), the same for b;
// d mask = sum over h of da pa s + db pb s_b where asked; the block's sums of d proj over its positions into
// sums (the projections' bias gradients). Blocks loop over the tiles.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) d_proj_kernel(const BackwardArgs args) {
  extern __shared__ float shared[];
  const int64_t hidden = args.h, tiles = tile_count(args), ld = args.ld_rows != 0 ? args.ld_rows : 4 * hidden;
  float* tile_a = shared;
  float* tile_b = shared + hidden * kTileStride;
  float* warp_sums = shared + 2 * hidden * kTileStride;  // [kWarps][4H]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  sum_rows_clear(warp_sums, 4 * hidden);
  float* own = warp_sums + warp * 4 * hidden;
  // A warp's sums of channel h of each quarter at h % V * (H / V) + h / V (V divides H): a lane's V adjacent
  // channels (h = V lane + i) land in 32 consecutive words per i, where h itself would put four lanes on each
  // bank (V = 4): 4-way conflicts on 16 read-modify-writes per position.
  const int64_t spread = hidden / V;
  for (int64_t index = blockIdx.x; index < tiles; index += gridDim.x) {
    const Tile t = tile_at(index, args);
    __syncthreads();  // (the previous tile's reads of tile_a / tile_b are done)
    planes_to_tile(static_cast<const T*>(args.a_planes), tile_a, t, hidden);
    planes_to_tile(static_cast<const T*>(args.b_planes), tile_b, t, hidden);
    __syncthreads();
    for (int q = warp; q < t.count; q += kWarps) {
      const int64_t p = tile_position(t, q, args.incoming);
      const float m = load_mask(args.mask, args.mask_kind, p);
      // (not __restrict__: rows may be proj itself, d proj written in place; a lane reads its channels of a
      // row before it writes them, and no other lane touches them)
      const T* proj = static_cast<const T*>(args.proj) + p * 4 * hidden;
      T* d_proj = static_cast<T*>(args.rows) + p * ld;
      float d_mask = 0.f;
      for (int64_t h = lane * V; h < hidden; h += 32 * V) {
        float pa[V], ga[V], pb[V], gb[V];
        load_proj<V>(proj, hidden, h, pa, ga, pb, gb);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float da = tile_a[(h + i) * kTileStride + q], db = tile_b[(h + i) * kTileStride + q];
          const float sa = sigmoid(ga[i]), sb = sigmoid(gb[i]);
          d_mask += da * pa[i] * sa + db * pb[i] * sb;
          ga[i] = da * pa[i] * m * sa * (1.f - sa);
          pa[i] = da * sa * m;
          gb[i] = db * pb[i] * m * sb * (1.f - sb);
          pb[i] = db * sb * m;
          const int64_t at = i * spread + (h + i) / V;
          own[at] += pa[i];
          own[hidden + at] += ga[i];
          own[2 * hidden + at] += pb[i];
          own[3 * hidden + at] += gb[i];
        }
        store_pack<V>(d_proj + h, pa);
        store_pack<V>(d_proj + hidden + h, ga);
        store_pack<V>(d_proj + 2 * hidden + h, pb);
        store_pack<V>(d_proj + 3 * hidden + h, gb);
      }
      if (args.d_mask != nullptr) {
        d_mask = warp_sum(d_mask);
        if (lane == 0) args.d_mask[p] = d_mask;
      }
    }
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < 4 * hidden; c += kThreads) {  // (sum_rows_out with the spread channels)
    const int64_t quarter = c / hidden, h = c % hidden, at = quarter * hidden + h % V * spread + h / V;
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w * 4 * hidden + at];
    args.sums[blockIdx.x * 4 * hidden + c] = total;
  }
}

// LayerNorm_in's backward: d pair = rstd (d x_hat - mean(d x_hat) - x_hat mean(d x_hat x_hat)) (+ d_rows_add),
// the statistics recomputed from pair; one warp per position; written in pair's dtype (a 16-bit pair's gradient
// rounded once here, not written in fp32 and converted by another pass).
template <typename TPair, int V>
__global__ void __launch_bounds__(kThreads) d_pair_kernel(const BackwardArgs args) {
  const int64_t positions = ::trimul::positions(args), width = args.c;
  const int lane = threadIdx.x % 32;
  for (int64_t p = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; p < positions; p += int64_t(gridDim.x) * kWarps) {
    const TPair* __restrict__ row = static_cast<const TPair*>(args.pair) + p * width;
    const float* __restrict__ d_row = args.d_rows + p * width;
    float mean, rstd;
    row_statistics<V>(row, width, args.eps, &mean, &rstd);
    float mean_d, mean_dot;
    layer_norm_grad_means<V, false>(d_row, row, width, mean, rstd, &mean_d, &mean_dot);
    TPair* __restrict__ out = static_cast<TPair*>(args.d_pair) + p * width;
    const float* __restrict__ add = args.d_rows_add != nullptr ? args.d_rows_add + p * width : nullptr;
    for (int64_t c = lane * V; c < width; c += 32 * V) {
      float x[V], d[V], extra[V] = {};
      load_pack<V>(row + c, x);
      load_pack<V>(d_row + c, d);
      if (add != nullptr) load_pack<V>(add + c, extra);
#pragma unroll
      for (int i = 0; i < V; ++i) d[i] = rstd * (d[i] - mean_d - (x[i] - mean) * rstd * mean_dot) + extra[i];
      store_pack<V>(out + c, d);
    }
  }
}

int64_t d_proj_bytes(const BackwardArgs& args) {
  return tile_bytes(args, 2) + kWarps * 4 * args.h * int64_t(sizeof(float));
}

// (d_proj here reads proj, d_pair d x_hat: a call that leaves proj, or d x_hat, to the pass is wgmma_rs's, as is
// d_proj_d_pair)
bool applies(const BackwardArgs& args) {
  return d_proj_bytes(args) <= max_smem_optin() && args.pass != BackwardPass::d_proj_d_pair &&
         !(args.pass == BackwardPass::d_proj && args.proj == nullptr) &&
         !(args.pass == BackwardPass::d_pair && args.d_rows == nullptr);
}

template <typename T, int V>
cudaError_t launch_typed(const BackwardArgs& args) {
  switch (args.pass) {
    case BackwardPass::gated_planes: return launch_tiles(gated_planes_kernel<T, V>, args, tile_bytes(args, 2));
    case BackwardPass::d_proj:
      if (args.sums == nullptr) return cudaErrorInvalidValue;
      return launch_tiles(d_proj_kernel<T, V>, args, d_proj_bytes(args), true);
    default: return cudaErrorInvalidValue;  // (an output_backward pass)
  }
}

cudaError_t launch(const BackwardArgs& args) {
  return dispatch_out(args.operand, [&](auto operand) {
    using T = typename decltype(operand)::type;
    if (args.pass == BackwardPass::input_rows || args.pass == BackwardPass::d_pair) {
      return dispatch_out(args.pair_dtype, [&](auto pair) {
        using TPair = typename decltype(pair)::type;
        return dispatch_vector(row_vector(args.c, {args.pair, args.rows, args.d_rows, args.d_rows_add, args.d_pair}),
                             [&](auto vector) {
          constexpr int V = decltype(vector)::value;
          return args.pass == BackwardPass::input_rows ? launch_rows(input_rows_kernel<T, TPair, V>, args)
                                                       : launch_rows(d_pair_kernel<TPair, V>, args);
        });
      });
    }
    return dispatch_vector(row_vector(args.h, {args.proj, args.rows}, args.ld_rows),
                           [&](auto vector) { return launch_typed<T, decltype(vector)::value>(args); });
  });
}

}  // namespace
}  // namespace backward
}  // namespace trimul
