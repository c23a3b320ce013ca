// wgmma — Hopper warpgroup MMA (sm_90a): 128x128 tiles, two warpgroups of 64 rows each issuing
// m64n128k16 (k8 for TF32) from 128-byte-swizzled shared memory, a 4-buffer cp.async pipeline two
// k-tiles ahead; bf16/fp16 operands, and TF32 ones that are already TF32 values; fp32 accumulation.
#include "fused.cuh"

namespace trimul {
namespace contract_wgmma {

constexpr int BM = 128, BN = 128;
constexpr int kRowBytes = 128;          // bytes of k per tile row: one 128-byte swizzle row
constexpr int kBuffers = 4, kAhead = 2;  // a buffer is refilled two iterations after its MMAs
constexpr int kThreads = 256;
constexpr int kTileBytes = BM * kRowBytes;  // A or B tile of one buffer (16 KB)
constexpr int kSmemBytes = kBuffers * 2 * kTileBytes + 1024;  // + slack for 1024-byte alignment

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TRIMUL_WGMMA 1
__device__ const int kBuiltWithWgmma = 1;
#else
__device__ const int kBuiltWithWgmma = 0;
#endif

// Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups
// 1024 bytes apart (the layout load_tile writes).
__device__ __forceinline__ uint64_t smem_descriptor(const void* tile) {
  const uint64_t addr = static_cast<uint64_t>(__cvta_generic_to_shared(tile));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// rows x 128 bytes of k of a K-major matrix into a swizzled tile: 16-byte chunk c of row r goes to
// chunk c ^ (r % 8) of that row, which is where the 128-byte swizzle mode reads it. Rows past
// `rows` and chunks past the row's padded length `ld` are zero-filled.
template <int ROWS>
__device__ __forceinline__ void load_tile(uint8_t* tile, const char* mat, int64_t ld_bytes, int64_t row0,
                                          int64_t rows, int64_t k_byte) {
#pragma unroll
  for (int it = 0; it < ROWS * 8 / kThreads; ++it) {
    const int chunk = threadIdx.x + it * kThreads;
    const int r = chunk >> 3, c = chunk & 7;
    const int64_t byte = k_byte + c * 16;
    const bool ok = row0 + r < rows && byte < ld_bytes;
    const char* src = ok ? mat + (row0 + r) * ld_bytes + byte : mat;
    mma::cp_async16(tile + r * 128 + ((c ^ (r & 7)) << 4), src, ok);
  }
}

// One 32-byte k-step of the tile: k16 for 16-bit operands, k8 for TF32. INSTR is the wgmma
// instruction with its shape and types; TAIL its scale/transpose immediates (16-bit operands take
// transpose flags, TF32 does not).
#define TRIMUL_WGMMA_64X128(INSTR, TAIL)                                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" INSTR                                    \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "\
               "%64, %65, p" TAIL ";\n}\n"                                                             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])\
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename Op>
__device__ __forceinline__ void wgmma_64x128_step(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef TRIMUL_WGMMA
  if constexpr (std::is_same<Op, __nv_bfloat16>::value)
    TRIMUL_WGMMA_64X128("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", ", 1, 1, 0, 0");
  else if constexpr (std::is_same<Op, float>::value)
    TRIMUL_WGMMA_64X128("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", ", 1, 1");
  else
    TRIMUL_WGMMA_64X128("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", ", 1, 1, 0, 0");
#endif
}
#undef TRIMUL_WGMMA_64X128

__device__ __forceinline__ void wgmma_fence() {
#ifdef TRIMUL_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef TRIMUL_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef TRIMUL_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// cp.async writes are generic-proxy writes; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef TRIMUL_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

template <typename Op, typename TOut>
__global__ void __launch_bounds__(kThreads, 1)
contract_kernel(const Op* __restrict__ a, const Op* __restrict__ b, TOut* __restrict__ z, int64_t batch,
                int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldz) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int64_t tiles_n = ceil_div(n, BN);
  const int64_t row0 = (blockIdx.x / tiles_n) * BM, col0 = (blockIdx.x % tiles_n) * BN;
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x & 31, warp4 = (threadIdx.x / 32) & 3;
  const int64_t ld_bytes = lda * static_cast<int64_t>(sizeof(Op));
  const int k_tiles = static_cast<int>(ceil_div(k * static_cast<int64_t>(sizeof(Op)), kRowBytes));
  const bool paired_store = (ldz % 2) == 0;

  for (int64_t bz = blockIdx.y; bz < batch; bz += gridDim.y) {
    const char* a_mat = reinterpret_cast<const char*>(a + bz * m * lda);
    const char* b_mat = reinterpret_cast<const char*>(b + bz * n * lda);
    auto fetch = [&](int kt) {
      if (kt < k_tiles) {
        uint8_t* buf = smem + (kt % kBuffers) * 2 * kTileBytes;
        load_tile<BM>(buf, a_mat, ld_bytes, row0, m, int64_t(kt) * kRowBytes);
        load_tile<BN>(buf + kTileBytes, b_mat, ld_bytes, col0, n, int64_t(kt) * kRowBytes);
      }
      mma::cp_async_commit();
    };
    float acc[64];
#pragma unroll
    for (int r = 0; r < 64; ++r) acc[r] = 0.f;
#pragma unroll
    for (int s = 0; s < kAhead; ++s) fetch(s);
    for (int kt = 0; kt < k_tiles; ++kt) {
      mma::cp_async_wait<kAhead - 1>();
      fence_proxy_async();
      __syncthreads();  // tile kt is in; every warpgroup finished the MMAs of tile kt - 2
      fetch(kt + kAhead);
      const uint8_t* buf = smem + (kt % kBuffers) * 2 * kTileBytes;
      const uint64_t desc_a = smem_descriptor(buf + warpgroup * 64 * 128);
      const uint64_t desc_b = smem_descriptor(buf + kTileBytes);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 4; ++step)  // 32 bytes further along k: start address + 2
        wgmma_64x128_step<Op>(acc, desc_a + 2 * step, desc_b + 2 * step, 1);
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
    mma::cp_async_wait<0>();
    __syncthreads();  // the next batch's prologue reuses the buffers

    // Accumulator layout: per n8 block j, regs 4j..4j+1 = row lane/4, cols 2(lane%4)+{0,1};
    // regs 4j+2..4j+3 = row lane/4 + 8 (rows of this warp's 16-row slice).
    TOut* z_mat = z + bz * m * ldz;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t i = row0 + warpgroup * 64 + warp4 * 16 + (lane >> 2) + half * 8;
      if (i >= m) continue;
#pragma unroll
      for (int j8 = 0; j8 < BN / 8; ++j8) {
        const int64_t j = col0 + j8 * 8 + 2 * (lane & 3);
        if (j >= n) continue;
        mma::store_pair(z_mat + i * ldz + j, acc[4 * j8 + 2 * half], acc[4 * j8 + 2 * half + 1], j + 1 < n,
                        paired_store);
      }
    }
  }
}

// Whether this build's device code has the wgmma instructions (sm_90a) and this GPU runs them.
inline bool available() {
  static int cached = -1;
  if (cached < 0) {
    int device = 0, major = 0, built = 0;
    cached = cudaGetDevice(&device) == cudaSuccess &&
                     cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                     major == 9 && cudaMemcpyFromSymbol(&built, kBuiltWithWgmma, sizeof(int)) == cudaSuccess &&
                     built == 1
                 ? 1
                 : 0;
  }
  return cached == 1;
}

template <typename Op, typename TOut>
cudaError_t launch_types(const ContractArgs& args) {
  return fused::launch_contraction<contract_kernel<Op, TOut>, Op, TOut, BM, BN>(args, kThreads, kSmemBytes);
}

// fp32 operands only as TF32 values already (the fused input pass rounds them; the tensor cores
// would truncate raw fp32) and only where TF32 is allowed.
cudaError_t launch(const ContractArgs& args) {
  const bool tf32 = args.operand == Dtype::f32;
  if (!available() || (tf32 && (!args.tf32_rounded || args.precision == Precision::highest)))
    return cudaErrorNotSupported;
  if (args.batch == 0 || args.m == 0 || args.n == 0) return cudaSuccess;
  if (args.lda < args.k) return cudaErrorNotSupported;  // rows are read up to their padded length
  return dispatch_out(args.out, [&](auto out_tag) -> cudaError_t {
    using TOut = typename decltype(out_tag)::type;
    switch (args.operand) {
      case Dtype::bf16: return launch_types<__nv_bfloat16, TOut>(args);
      case Dtype::f16: return launch_types<__half, TOut>(args);
      case Dtype::f32: return launch_types<float, TOut>(args);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace contract_wgmma
}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(wgmma, trimul::contract_wgmma::launch);
