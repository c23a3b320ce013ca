// rows — output_backward: LayerNorm_out rows from the z planes, the output gate's derivative, dz planes
// The memory passes of the output side of the backward (BackwardPass z_rows, gate_grad, dz_planes); the
// GEMMs between them (out_proj, out_gate and their weight gradients) are cuBLAS's. Statistics and
// arithmetic in fp32; rows and planes in the operand dtype.
#include "backward_rows.cuh"

#include <algorithm>

namespace trimul {
namespace backward {
namespace {

// z planes -> z_hat rows (LayerNorm without affine over the H channels of each position) and rstd.
template <typename T>
__global__ void __launch_bounds__(kThreads) z_rows_kernel(const BackwardArgs args) {
  extern __shared__ float tile[];
  const Tile t = tile_at(blockIdx.x, args.n);
  const int64_t hidden = args.h;
  planes_to_tile(static_cast<const T*>(args.a_planes), tile, t, args.n, hidden);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  T* rows = static_cast<T*>(args.rows);
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    float sum = 0.f;
    for (int64_t h = lane; h < hidden; h += 32) sum += tile[h * kTileStride + q];
    const float mean = warp_sum(sum) / hidden;
    float squares = 0.f;
    for (int64_t h = lane; h < hidden; h += 32) {
      const float d = tile[h * kTileStride + q] - mean;
      squares += d * d;
    }
    const float rstd = rsqrtf(warp_sum(squares) / hidden + args.eps);
    const int64_t p = tile_position(t, q, args.n, false);
    for (int64_t h = lane; h < hidden; h += 32)
      rows[p * hidden + h] = from_float<T>((tile[h * kTileStride + q] - mean) * rstd);
    if (lane == 0) args.rstd[p] = rstd;
  }
}

// out = sigmoid(gate_pre) * o: o := d o = d_out * s, gate_pre := d gate_pre = d_out * o * s * (1 - s).
template <typename T, typename TOut>
__global__ void __launch_bounds__(kThreads) gate_grad_kernel(const BackwardArgs args) {
  const int64_t count = args.batch * args.n * args.n * args.c;
  const TOut* d_out = static_cast<const TOut*>(args.d_out);
  T* o = static_cast<T*>(args.o);
  T* gate = static_cast<T*>(args.gate_pre);
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < count; i += int64_t(gridDim.x) * kThreads) {
    const float d = to_float(d_out[i]), value = to_float(o[i]), s = sigmoid(to_float(gate[i]));
    o[i] = from_float<T>(d * s);
    gate[i] = from_float<T>(d * value * s * (1.f - s));
  }
}

// d z_hat rows (fp32), z_hat rows, rstd -> dz planes: dz = rstd (d z_hat - mean(d z_hat) - z_hat mean(d z_hat z_hat)).
template <typename T>
__global__ void __launch_bounds__(kThreads) dz_planes_kernel(const BackwardArgs args) {
  extern __shared__ float tile[];
  const Tile t = tile_at(blockIdx.x, args.n);
  const int64_t hidden = args.h;
  const int lane = threadIdx.x % 32;
  const T* z_hat = static_cast<const T*>(args.rows);
  for (int q = threadIdx.x / 32; q < t.count; q += kWarps) {
    const int64_t p = tile_position(t, q, args.n, false);
    const float* d_row = args.d_rows + p * hidden;
    const T* z_row = z_hat + p * hidden;
    float sum = 0.f, dot = 0.f;
    for (int64_t h = lane; h < hidden; h += 32) {
      const float d = d_row[h];
      sum += d;
      dot += d * to_float(z_row[h]);
    }
    const float mean = warp_sum(sum) / hidden, mean_dot = warp_sum(dot) / hidden, rstd = args.rstd[p];
    for (int64_t h = lane; h < hidden; h += 32)
      tile[h * kTileStride + q] = rstd * (d_row[h] - mean - to_float(z_row[h]) * mean_dot);
  }
  __syncthreads();
  tile_to_planes(tile, static_cast<T*>(args.a_planes), t, args.n, hidden);
}

bool applies(const BackwardArgs& args) { return tile_bytes(args, 1) <= max_smem_optin(); }

template <typename T>
cudaError_t launch_typed(const BackwardArgs& args) {
  switch (args.pass) {
    case BackwardPass::z_rows: return launch_tiles(z_rows_kernel<T>, args, tile_bytes(args, 1));
    case BackwardPass::dz_planes: return launch_tiles(dz_planes_kernel<T>, args, tile_bytes(args, 1));
    case BackwardPass::gate_grad:
      return dispatch_out(args.d_out_dtype, [&](auto out) {
        const int64_t count = args.batch * args.n * args.n * args.c;
        const int64_t blocks = std::min<int64_t>(ceil_div(count, kThreads), 32 * std::max<int64_t>(sm_count(), 1));
        gate_grad_kernel<T, typename decltype(out)::type><<<static_cast<unsigned>(blocks), kThreads, 0, args.stream>>>(
            args);
        return cudaGetLastError();
      });
    default: return cudaErrorInvalidValue;  // (an input_backward pass)
  }
}

cudaError_t launch(const BackwardArgs& args) {
  return dispatch_out(args.operand, [&](auto operand) { return launch_typed<typename decltype(operand)::type>(args); });
}

}  // namespace
}  // namespace backward
}  // namespace trimul

TRIMUL_REGISTER_BACKWARD(output_backward, rows, ::trimul::backward::applies, ::trimul::backward::launch);
