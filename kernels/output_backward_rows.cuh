// output_backward_rows.cuh — output_backward's memory passes (BackwardPass z_rows, gate_grad, dz_planes) around
// cuBLAS GEMMs (out_proj, out_gate and their weight gradients): the rows kernel (output_backward_rows.cu) and the
// passes wgmma (output_backward_wgmma.cu) leaves to it. Statistics and arithmetic in fp32; rows and planes in the
// operand dtype; each lane takes V adjacent channels of a row.
#pragma once
#include "backward_rows.cuh"

namespace trimul {
namespace backward {
namespace {

// z planes -> z_hat rows (LayerNorm without affine over the H channels of each position) and rstd.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) z_rows_kernel(const BackwardArgs args) {
  extern __shared__ float tile[];
  const Tile t = tile_at(blockIdx.x, args);
  const int64_t hidden = args.h;
  planes_to_tile<true>(static_cast<const T*>(args.a_planes), tile, t, hidden);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  T* __restrict__ rows = static_cast<T*>(args.rows);
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    float sum = 0.f;
    for (int64_t h = lane * V; h < hidden; h += 32 * V)
#pragma unroll
      for (int i = 0; i < V; ++i) sum += tile[(h + i) * kTileStride + q];
    const float mean = warp_sum(sum) / hidden;
    float squares = 0.f;
    for (int64_t h = lane * V; h < hidden; h += 32 * V)
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = tile[(h + i) * kTileStride + q] - mean;
        squares += d * d;
      }
    const float rstd = rsqrtf(warp_sum(squares) / hidden + args.eps);
    const int64_t p = tile_position(t, q, false);
    for (int64_t h = lane * V; h < hidden; h += 32 * V) {
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = (tile[(h + i) * kTileStride + q] - mean) * rstd;
      store_pack<V>(rows + p * hidden + h, v);
    }
    if (lane == 0) args.rstd[p] = rstd;
  }
}

// out = sigmoid(gate_pre) * o: o := d o = d_out s, gate_pre := d gate_pre = d_out o s (1 - s) (or d gate_pre
// into gate_out's rows, ld_rows apart, where set); the block's sums of d o and d gate_pre over its positions
// into sums (the biases' gradients).
template <typename T, typename TOut, int V>
__global__ void __launch_bounds__(kThreads) gate_grad_kernel(const BackwardArgs args) {
  extern __shared__ float warp_sums[];  // [kWarps][2C]
  const int64_t positions = ::trimul::positions(args), width = args.c;
  const int64_t gate_ld = args.ld_rows != 0 ? args.ld_rows : width;  // (gate_out's rows)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  sum_rows_clear(warp_sums, 2 * width);
  __syncthreads();
  float* own = warp_sums + warp * 2 * width;
  for (int64_t p = blockIdx.x * int64_t(kWarps) + warp; p < positions; p += int64_t(gridDim.x) * kWarps) {
    const TOut* __restrict__ d_out = static_cast<const TOut*>(args.d_out) + p * width;
    T* __restrict__ o = static_cast<T*>(args.o) + p * width;
    const T* gate = static_cast<const T*>(args.gate_pre) + p * width;
    T* d_gate = args.gate_out != nullptr ? static_cast<T*>(args.gate_out) + p * gate_ld
                                         : static_cast<T*>(args.gate_pre) + p * width;
    for (int64_t c = lane * V; c < width; c += 32 * V) {
      float d[V], value[V], g[V];
      load_pack<V>(d_out + c, d);
      load_pack<V>(o + c, value);
      load_pack<V>(gate + c, g);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float s = sigmoid(g[i]);
        g[i] = d[i] * value[i] * s * (1.f - s);
        value[i] = d[i] * s;
        own[c + i] += value[i];
        own[width + c + i] += g[i];
      }
      store_pack<V>(o + c, value);
      store_pack<V>(d_gate + c, g);
    }
  }
  __syncthreads();
  sum_rows_out(warp_sums, 2 * width, args.sums);
}

// d z_hat rows (fp32), z_hat rows, rstd -> dz planes: dz = rstd (d z_hat - mean(d z_hat) - z_hat mean(d z_hat z_hat)).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) dz_planes_kernel(const BackwardArgs args) {
  extern __shared__ float tile[];
  const Tile t = tile_at(blockIdx.x, args);
  const int64_t hidden = args.h;
  const int lane = threadIdx.x % 32;
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    const int64_t p = tile_position(t, q, false);
    const float* __restrict__ d_row = args.d_rows + p * hidden;
    const T* __restrict__ z_row = static_cast<const T*>(args.rows) + p * hidden;
    float mean, mean_dot;
    layer_norm_grad_means<V, true>(d_row, z_row, hidden, 0.f, 1.f, &mean, &mean_dot);
    const float rstd = args.rstd[p];
    for (int64_t h = lane * V; h < hidden; h += 32 * V) {
      float d[V], z[V];
      load_pack<V>(d_row + h, d);
      load_pack<V>(z_row + h, z);
#pragma unroll
      for (int i = 0; i < V; ++i) tile[(h + i) * kTileStride + q] = rstd * (d[i] - mean - z[i] * mean_dot);
    }
  }
  __syncthreads();
  tile_to_planes(tile, static_cast<T*>(args.a_planes), t, hidden);
}

int64_t gate_grad_bytes(const BackwardArgs& args) { return kWarps * 2 * args.c * int64_t(sizeof(float)); }

// (dz_planes here reads d z_hat: a call that leaves d z_hat to the pass, args.d_rows null, is wgmma's, as are
// z_gate_grad and dz_planes_g_out)
bool applies(const BackwardArgs& args) {
  return tile_bytes(args, 1) <= max_smem_optin() && gate_grad_bytes(args) <= max_smem_optin() &&
         !(args.pass == BackwardPass::dz_planes && args.d_rows == nullptr) && args.pass != BackwardPass::z_gate_grad &&
         args.pass != BackwardPass::dz_planes_g_out;
}

template <typename T, int V>
cudaError_t launch_typed(const BackwardArgs& args) {
  switch (args.pass) {
    case BackwardPass::z_rows: return launch_tiles(z_rows_kernel<T, V>, args, tile_bytes(args, 1));
    case BackwardPass::dz_planes: return launch_tiles(dz_planes_kernel<T, V>, args, tile_bytes(args, 1));
    default: return cudaErrorInvalidValue;  // (an input_backward pass)
  }
}

cudaError_t launch(const BackwardArgs& args) {
  return dispatch_out(args.operand, [&](auto operand) {
    using T = typename decltype(operand)::type;
    if (args.pass == BackwardPass::gate_grad) {
      if (args.sums == nullptr) return cudaErrorInvalidValue;
      const int lanes = row_vector(args.c, {args.d_out, args.o, args.gate_pre, args.gate_out}, args.ld_rows);
      return dispatch_out(args.d_out_dtype, [&](auto out) {
        return dispatch_vector(lanes, [&](auto vector) {
          return launch_rows(gate_grad_kernel<T, typename decltype(out)::type, decltype(vector)::value>, args,
                             gate_grad_bytes(args), true);
        });
      });
    }
    return dispatch_vector(row_vector(args.h, {args.rows, args.d_rows}),
                           [&](auto vector) { return launch_typed<T, decltype(vector)::value>(args); });
  });
}

}  // namespace
}  // namespace backward
}  // namespace trimul
