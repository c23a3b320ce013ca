// naive — one thread per output element, fp32 accumulate; the seed's approach, kept as the baseline.
#include "common.cuh"

namespace trimul {
namespace naive {

template <typename T, typename TOut>
__global__ void contract_kernel(const T* __restrict__ a, const T* __restrict__ b, TOut* __restrict__ z,
                                int64_t batch, int64_t m, int64_t n, int64_t k, int64_t lda,
                                int64_t ldz) {
  const int64_t total = batch * m * n;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = idx % n;
    const int64_t i = (idx / n) % m;
    const int64_t bz = idx / (m * n);
    const T* a_row = a + (bz * m + i) * lda;
    const T* b_row = b + (bz * n + j) * lda;
    float acc = 0.f;
    for (int64_t kk = 0; kk < k; ++kk) acc = fmaf(to_float(a_row[kk]), to_float(b_row[kk]), acc);
    z[(bz * m + i) * ldz + j] = from_float<TOut>(acc);
  }
}

// Any operands stored whole (no split or scaled fp16 ones, which only wgmma_tma takes).
bool applies(const ContractArgs& args) { return !args.split && args.z_scale == nullptr; }

cudaError_t launch(const ContractArgs& args) {
  return dispatch_dtypes(args.operand, args.out, [&](auto op_tag, auto out_tag) {
    using T = typename decltype(op_tag)::type;
    using TOut = typename decltype(out_tag)::type;
    const int64_t total = args.batch * args.m * args.n;
    if (total == 0) return cudaSuccess;
    const int threads = 256;
    const int64_t blocks = ceil_div(total, threads) < 1048576 ? ceil_div(total, threads) : 1048576;
    contract_kernel<T, TOut><<<static_cast<unsigned>(blocks), threads, 0, args.stream>>>(
        static_cast<const T*>(args.a), static_cast<const T*>(args.b), static_cast<TOut*>(args.z),
        args.batch, args.m, args.n, args.k, args.lda, args.ldz);
    return cudaGetLastError();
  });
}

}  // namespace naive
}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(naive, trimul::naive::applies, trimul::naive::launch);
