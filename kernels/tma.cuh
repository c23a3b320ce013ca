// tma.cuh — Hopper (sm_90a) building blocks shared by the TMA kernels: mbarriers, TMA box loads,
// 128-byte-swizzle shared-memory descriptors for wgmma, the wgmma fences, and the driver's
// tensor-map encoder. Without sm_90a device code the instructions compile away and
// tensor_map_encoder() returns nullptr, so the kernels decline at launch.
#pragma once
#include "fused.cuh"

#include <cuda.h>          // CUtensorMap and its enums (the encoder comes from the runtime, no -lcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

namespace trimul {
namespace tma {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TRIMUL_SM90A 1
__device__ const int kBuiltWithSm90a = 1;
#else
__device__ const int kBuiltWithSm90a = 0;
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// This thread's warp, broadcast from lane 0 so the compiler knows it is warp-uniform: what is
// computed from it (a warpgroup's shared-memory descriptors) then stays in uniform registers
// instead of moving there (R2UR) before every wgmma (as CUTLASS's canonical_warp_idx_sync does).
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0); }

// Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups 1024
// bytes apart (what TMA's 128-byte swizzle writes). leading_bytes: the leading byte offset (a multiple of 16
// below 256 KiB), which only an N-major operand wider than one 64-element block reads (imm-trans-b: the step
// between its 64-n halves).
__device__ __forceinline__ uint64_t smem_descriptor(const void* tile, uint32_t leading_bytes = 16) {
  const uint64_t addr = smem_u32(tile);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t((leading_bytes >> 4) & 0x3FFF) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
// The descriptor `units` x 16 bytes further on: an add to the start-address field (14 bits: shared
// memory addresses below 256 KB never carry out of it) in the low word only. (A 64-bit add costs
// an add with carry per wgmma k-step, in registers the wgmma then moves to uniform ones.)
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t units) {
  return (desc & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(desc) + units);
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#ifdef TRIMUL_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
#endif
}
__device__ __forceinline__ void mbar_init_fence() {
#ifdef TRIMUL_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
#ifdef TRIMUL_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef TRIMUL_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#endif
}
// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
#ifdef TRIMUL_SM90A
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#endif
}
// `count` full/empty barrier pairs with these arrival counts (by one thread, before the fence).
__device__ __forceinline__ void init_barrier_pairs(uint64_t* full, int full_arrivals, uint64_t* empty,
                                                   int empty_arrivals, int count) {
  for (int s = 0; s < count; ++s) {
    mbar_init(&full[s], full_arrivals);
    mbar_init(&empty[s], empty_arrivals);
  }
}

// A ring of `stages` buffers between one TMA-issuing thread and `consumers` consumer warpgroups:
// full[s] completes when stage s's boxes have landed (one arrival with the byte count), empty[s]
// when every consumer is done reading it. Initialised by thread 0; the whole block waits for it.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages, int consumers) {
  if (threadIdx.x == 0) {
    init_barrier_pairs(full, 1, empty, consumers, stages);
    mbar_init_fence();
  }
  __syncthreads();
}
// The barriers of a warp-specialized pass (the wgmma input and output passes): a weight ring of
// `stages` (full: one producer arrival with the byte count; empty: one per MMA warpgroup) and
// `buffers` row buffers (full: every stager thread; empty: every MMA thread). The whole block
// waits for them; the roles part after this.
__device__ __forceinline__ void init_pass_barriers(uint64_t* w_full, uint64_t* w_empty, int stages,
                                                   uint64_t* rows_full, uint64_t* rows_empty, int buffers,
                                                   int mma_groups, int stager_threads) {
  if (threadIdx.x == 0) {
    init_barrier_pairs(w_full, 1, w_empty, mma_groups, stages);
    init_barrier_pairs(rows_full, stager_threads, rows_empty, 128 * mma_groups, buffers);
    mbar_init_fence();
  }
  __syncthreads();
}

// The filling side of an mbarrier ring of `count` slots (the weight stages for the producer, the
// row buffers for the stagers): wait_free() until the consumers of slot `slot` arrived on
// empty[slot] in the last round (nothing to wait for in the first), fill it, then advance().
struct FillRing {
  uint64_t* empty;
  int count;
  int slot = 0, round = 0;
  __device__ __forceinline__ void wait_free() const {
    if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
  }
  __device__ __forceinline__ void advance() {
    if (++slot == count) {
      slot = 0;
      ++round;
    }
  }
};

// One box of a 3-D tensor map (k element, row, batch) into shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int k, int row, int batch, uint64_t* bar) {
#ifdef TRIMUL_SM90A
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(batch), "r"(smem_u32(bar))
      : "memory");
#endif
}

// One box of a 2-D tensor map (column element, row) into shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int col, int row, uint64_t* bar) {
#ifdef TRIMUL_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(smem_u32(bar))
      : "memory");
#endif
}
// One box of a 3-D tensor map (element, row, plane) from shared memory out to global memory, in this thread's
// bulk async-group (what of the box lies past the map's edges is not written).
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int col, int row, int plane) {
#ifdef TRIMUL_SM90A
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(col), "r"(row), "r"(plane)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef TRIMUL_SM90A
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Until at most N of this thread's bulk groups still read their shared-memory sources.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef TRIMUL_SM90A
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
// Until at most N of this thread's bulk groups are incomplete (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
#ifdef TRIMUL_SM90A
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory accesses (st.shared, ld.shared, ldmatrix) with the async
// proxy's (wgmma operands, TMA loads and stores) that follow.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef TRIMUL_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Barrier among `threads` threads of the block (a multiple of 32) on named barrier `id` (1..15).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The release of a stage that TMA refills once `threads` threads have read it by generic-proxy loads (ldmatrix,
// ld.shared): the barrier alone does not order those reads before the async proxy's writes, and without the fence a
// refill can land in a stage still being read (seen as a warp's rows taking the next tile's values).
__device__ __forceinline__ void release_stage_to_tma(int id, int threads) {
  fence_proxy_async();
  named_barrier(id, threads);
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef TRIMUL_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef TRIMUL_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef TRIMUL_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Pins the accumulators at this point of the instruction stream: after a wgmma_wait, so that no read of
// them is scheduled above the wait (ptxas then serializes every wgmma of the kernel: C7514; CUTLASS's
// warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The wgmma instruction of shape m64n<N> for operand type Op (k16 for 16-bit operands, k8 for
// TF32), through MACRO(INSTR, TAIL): TAIL holds the scale/transpose immediates (16-bit operands
// take transpose flags, TF32 does not).
#define TRIMUL_WGMMA_FOR_OP(MACRO, N)                                                      \
  if constexpr (std::is_same<Op, __nv_bfloat16>::value)                                    \
    MACRO("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16", ", 1, 1, 0, 0");     \
  else if constexpr (std::is_same<Op, float>::value)                                       \
    MACRO("wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32", ", 1, 1");            \
  else                                                                                     \
    MACRO("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16", ", 1, 1, 0, 0");

// One 32-byte k-step of a 64x128 product from shared memory (both operands K-major): k16 for
// 16-bit operands, k8 for TF32; 64 accumulators per thread, overwritten when accumulate is 0. INSTR is the wgmma
// instruction with its shape and types; TAIL its scale/transpose immediates (16-bit operands take
// transpose flags, TF32 does not).
#define TRIMUL_WGMMA_64X128(INSTR, TAIL)                                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" INSTR                                    \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "\
               "%64, %65, p" TAIL ";\n}\n"                                                             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])\
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename Op>
__device__ __forceinline__ void wgmma_64x128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef TRIMUL_SM90A
  TRIMUL_WGMMA_FOR_OP(TRIMUL_WGMMA_64X128, 128)
#endif
}
#undef TRIMUL_WGMMA_64X128

// The same for a 64x64 product: 32 accumulators per thread, in the same layout per n8 block.
#define TRIMUL_WGMMA_64X64(INSTR, TAIL)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" INSTR                                    \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
               "%32, %33, p" TAIL ";\n}\n"                                                             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename Op>
__device__ __forceinline__ void wgmma_64x64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef TRIMUL_SM90A
  TRIMUL_WGMMA_FOR_OP(TRIMUL_WGMMA_64X64, 64)
#endif
}

// The same m64n64 step with both operands MN-major in shared memory (imm-trans-a and imm-trans-b, 16-bit operands
// only): A's rows are k, 128-byte lines of its 64 m; B's rows are k, 128-byte lines of its 64 n; 8-row groups 1024
// bytes apart (smem_descriptor's SBO), so a k16 step is 2048 bytes further on in both (desc_add 128).
template <typename Op>
__device__ __forceinline__ void wgmma_64x64_mn_major(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(sizeof(Op) == 2, "transposed operands: 16-bit only");
#ifdef TRIMUL_SM90A
  if constexpr (std::is_same<Op, __nv_bfloat16>::value)
    TRIMUL_WGMMA_64X64("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", ", 1, 1, 1, 1");
  else
    TRIMUL_WGMMA_64X64("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", ", 1, 1, 1, 1");
#endif
}
#undef TRIMUL_WGMMA_64X64

// MACRO(instruction) for a 16-bit Op's register-A wgmma of shape m64nNk16 (bf16 or f16 operands).
#define TRIMUL_WGMMA_RS_FOR_OP(MACRO, N)                                                   \
  static_assert(sizeof(Op) == 2, "16-bit register operands");                              \
  if constexpr (std::is_same<Op, __nv_bfloat16>::value)                                    \
    MACRO("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16");                     \
  else                                                                                     \
    MACRO("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16");

// One k16 step of a 64x64 product whose A operand (64 x 16, 16-bit) comes from registers: `a` is this
// thread's fragment (mma.m16n8k16's A layout within its warp's 16 rows: a[0] row lane / 4, k 2 (lane % 4)
// + {0, 1}; a[1] the row 8 further; a[2], a[3] the same at k + 8), B from shared memory (K-major,
// desc_b); 32 accumulators per thread. The registers must stay unchanged until the group is waited for.
#define TRIMUL_WGMMA_RS_64X64(INSTR)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" INSTR                                        \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "\
               "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])\
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <typename Op>
__device__ __forceinline__ void wgmma_rs_64x64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                               int accumulate) {
#ifdef TRIMUL_SM90A
  TRIMUL_WGMMA_RS_FOR_OP(TRIMUL_WGMMA_RS_64X64, 64)
#endif
}
#undef TRIMUL_WGMMA_RS_64X64

// One k16 step of a 64x128 product, A from registers (wgmma_rs_64x64's fragment) and B N-major from shared memory
// (imm-trans-b: rows k, 128-byte lines of 64 n, 8-row groups SBO apart, the two 64-n halves LBO apart): 64
// accumulators per thread, wgmma_64x128's layout.
#define TRIMUL_WGMMA_RS_64X128_TRANS_B(INSTR)                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" INSTR                                        \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "\
               "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                              \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])\
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <typename Op>
__device__ __forceinline__ void wgmma_rs_64x128_trans_b(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                        int accumulate) {
#ifdef TRIMUL_SM90A
  TRIMUL_WGMMA_RS_FOR_OP(TRIMUL_WGMMA_RS_64X128_TRANS_B, 128)
#endif
}
#undef TRIMUL_WGMMA_RS_64X128_TRANS_B
#undef TRIMUL_WGMMA_RS_FOR_OP

// One 128-byte k-tile of a 64xN product, N = 2 x the accumulators per thread (64 or 128): four
// k-steps, 32 bytes further along k each (start address + 2 in the descriptors), committed as one
// wgmma group. kWideAdd: the k-steps' descriptors by 64-bit adds instead of desc_add, for the split
// input kernel: with desc_add ptxas allocated its registers so that it serialized every wgmma of that
// kernel (C7514, a note in the build log only; test_no_wgmma_kernel_is_serialized guards it), while the
// 64-bit adds cost it a 32-byte spill. overwrite: the first k-step replaces the
// accumulators instead of adding to them (a product's first k-tile: no accumulator start needed).
template <typename Op, bool kWideAdd = false, int kAcc>
__device__ __forceinline__ void wgmma_k_tile(float (&acc)[kAcc], uint64_t desc_a, uint64_t desc_b,
                                             bool overwrite = false) {
  static_assert(kAcc == 32 || kAcc == 64, "m64n64 or m64n128");
  const auto step_desc = [](uint64_t desc, int step) { return kWideAdd ? desc + 2 * step : desc_add(desc, 2 * step); };
  wgmma_fence();
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const int accumulate = step > 0 || !overwrite;
    if constexpr (kAcc == 64) wgmma_64x128<Op>(acc, step_desc(desc_a, step), step_desc(desc_b, step), accumulate);
    else wgmma_64x64<Op>(acc, step_desc(desc_a, step), step_desc(desc_b, step), accumulate);
  }
  wgmma_commit();
}

// Stores a warpgroup's 64 x BN accumulator tile into z (row pitch ldz) at rows row0.., cols col0..,
// skipping rows >= m and cols >= n. wgmma's layout: per n8 block j, regs 4j, 4j + 1 = row lane / 4
// of this warp's 16-row slice, cols 2 (lane % 4) + {0, 1}; regs 4j + 2, 4j + 3 = row lane / 4 + 8.
// (Index: the caller's tile-origin type, so the index arithmetic is the caller's own.)
template <int BN, typename Index, typename TOut>
__device__ __forceinline__ void store_accumulators(TOut* z_mat, const float (&acc)[BN / 2], Index row0, Index col0,
                                                   int64_t m, int64_t n, int64_t ldz, bool paired_store) {
  const int lane = threadIdx.x & 31, warp4 = (threadIdx.x / 32) & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = row0 + warp4 * 16 + (lane >> 2) + half * 8;
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

// fp32 values v0, v1 as one 32-bit pair of T (bf16 or fp16), v0 in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float v0, float v1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&p);
  } else {
    const __half2 p = __floats2half2_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
}

// pack_pair's inverse: the two 16-bit values of a pair as fp32, the low half first.
template <typename T>
__device__ __forceinline__ float2 unpack_pair(uint32_t pair) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&pair));
  }
}

// A warp's 8 rows x P 16-bit values, held as wgmma/mma accumulator pairs (lane: row lane / 4, values
// 8j + 2 (lane % 4) and + 1 of each 8-value block j, packed as pack_pair), go out through this warp's
// `scratch` (8 x 2P bytes, 16-byte aligned) in two steps: stage_row_pairs_x4 for blocks 4q .. 4q + 3
// (stmatrix: each block a 16-byte chunk of each row, XOR-swizzled by row), then store_staged_rows:
// P / 8 lanes store a row's 2P contiguous bytes with 16-byte stores, where a 16-bit pair per lane
// writes 4 bytes of each of 8 rows per instruction (which made wgmma_tma's 16-bit z slower than fp32 z).
// stmatrix x4: four 8x8 blocks of 16-bit pairs (p[k]: block k, row lane / 4, columns 2 (lane % 4) + {0, 1}),
// lane 8k + r giving the shared address of block k's row r; kTrans stores each block transposed.
template <bool kTrans = false>
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t p0, uint32_t p1, uint32_t p2, uint32_t p3) {
#ifdef TRIMUL_SM90A
  if constexpr (kTrans)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(p0),
                 "r"(p1), "r"(p2), "r"(p3)
                 : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(p0), "r"(p1),
                 "r"(p2), "r"(p3)
                 : "memory");
#endif
}

// ldmatrix x4 transposing: four 8x8 blocks of 16-bit values (lane 8k + r giving the shared address of block k's
// row r), r[k] this lane's pair of block k transposed: row lane / 4 of the stored columns, stored rows
// 2 (lane % 4) + {0, 1}. A [k][m]-stored tile reads as an mma / wgmma A fragment that way.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#ifdef TRIMUL_SM90A
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

template <int P>
__device__ __forceinline__ void stage_row_pairs_x4(uint8_t* scratch, int q, uint32_t p0, uint32_t p1, uint32_t p2,
                                                   uint32_t p3) {
  const int lane = threadIdx.x & 31, k = lane >> 3, r = lane & 7;  // (lane 8k + r: row r of block 4q + k)
  stmatrix_x4(smem_u32(scratch) + r * (2 * P) + (((4 * q + k) ^ r) << 4), p0, p1, p2, p3);
}

// The staged rows to row0, row0 + pitch, ... (the first `rows` of the 8; row0 and pitch 16-byte aligned).
template <int P, typename T>
__device__ __forceinline__ void store_staged_rows(T* row0, int64_t pitch, int rows, const uint8_t* scratch) {
  static_assert(sizeof(T) == 2 && P % 64 == 0, "16-bit values, whole stmatrix x4 groups of 8-row chunks");
  constexpr int kRowBytes = 2 * P, kChunks = kRowBytes / 16;
  const int lane = threadIdx.x & 31;
  __syncwarp();  // every lane's stmatrix is done
#pragma unroll
  for (int it = 0; it < kChunks / 4; ++it) {
    const int id = it * 32 + lane, row = id / kChunks, c = id % kChunks;
    const uint4 v = *reinterpret_cast<const uint4*>(scratch + row * kRowBytes + ((c ^ (row & 7)) << 4));
    if (row < rows) *reinterpret_cast<uint4*>(row0 + row * pitch + c * 8) = v;
  }
  __syncwarp();  // every lane's reads are done before the scratch is written again
}

// Shared memory store_accumulators_staged takes per warp: its 16 rows, as two 8-row groups of 64 columns.
constexpr int kStoreScratchBytes = 2 * 8 * 64 * 2;

// store_accumulators for a 16-bit z, 64 columns at a time, through this warp's `scratch`
// (kStoreScratchBytes, 16-byte aligned): each 8-row half of the warp's 16 rows as
// stage_row_pairs_x4 / store_staged_rows take a warp's 8 accumulator rows (the plain stores write 4
// bytes per lane across 8 rows, and bf16 z through them measured slower than fp32 z). Only
// for a warp tile wholly inside z with 16-byte-aligned rows (the caller checks; else store_accumulators).
template <int BN, typename TOut>
__device__ __forceinline__ void store_accumulators_staged(TOut* z_mat, const float (&acc)[BN / 2], int64_t row0,
                                                          int64_t col0, int64_t ldz, uint8_t* scratch) {
  static_assert(sizeof(TOut) == 2 && BN % 64 == 0, "16-bit z, whole 64-column rounds");
  constexpr int kHalfBytes = kStoreScratchBytes / 2;
  const int warp4 = (threadIdx.x / 32) & 3;
  TOut* dst = z_mat + (row0 + warp4 * 16) * ldz + col0;
  // acc[4 j + 2 half + e]: row lane / 4 + 8 half, column 8 j + 2 (lane % 4) + e
  const auto pair_at = [&](int j, int half) { return pack_pair<TOut>(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]); };
#pragma unroll
  for (int round = 0; round < BN / 64; ++round) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int j = round * 8 + 4 * q;
        stage_row_pairs_x4<64>(scratch + half * kHalfBytes, q, pair_at(j, half), pair_at(j + 1, half),
                               pair_at(j + 2, half), pair_at(j + 3, half));
      }
#pragma unroll
    for (int half = 0; half < 2; ++half)
      store_staged_rows<64>(dst + half * 8 * ldz + round * 64, ldz, 8, scratch + half * kHalfBytes);
  }
}

// Starts a 64 x N wgmma accumulator tile from per-row values: rows lane / 4 of the warp's slice
// (regs 4j, 4j + 1 of each n8 block j) get `row`, the rows 8 further (4j + 2, 4j + 3) `row8`.
template <int ACC>
__device__ __forceinline__ void start_accumulators(float (&acc)[ACC], float row, float row8) {
#pragma unroll
  for (int j = 0; j < ACC / 4; ++j) {
    acc[4 * j] = acc[4 * j + 1] = row;
    acc[4 * j + 2] = acc[4 * j + 3] = row8;
  }
}

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ uint32_t dynamic_smem_size() {
  uint32_t size;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(size));
  return size;
}

// Whether this build's device code has the sm_90a instructions (wgmma, TMA) and this GPU runs them.
inline bool sm90a_ready() {
  static int cached = -1;
  if (cached < 0) {
    int device = 0, major = 0, built = 0;
    cached = cudaGetDevice(&device) == cudaSuccess &&
                     cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                     major == 9 && cudaMemcpyFromSymbol(&built, kBuiltWithSm90a, sizeof(int)) == cudaSuccess &&
                     built == 1
                 ? 1
                 : 0;
  }
  return cached == 1;
}

// The driver's tensor-map encoder where sm90a_ready(), else nullptr. No -lcuda: the runtime hands
// out the entry point.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static int state = -1;  // -1 unknown, 0 unavailable, 1 available
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (state < 0) {
    cudaDriverEntryPointQueryResult found{};
    void* entry = nullptr;
    const bool ok = sm90a_ready() &&
                    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault,
                                                     &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess && entry != nullptr;
    fn = ok ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry) : nullptr;
    state = ok ? 1 : 0;
  }
  return fn;
}

// The layout the warp-specialized wgmma passes share: one block per SM of 16 warps (4 per
// scheduler, 128 registers each): two MMA warpgroups, 7 stager warps, one producer warp; weight
// stages of 128 rows x 128 bytes of k (64 rows per MMA warpgroup, the wgmma's M).
namespace ws {
constexpr int kKBytes = 128;     // bytes of k per k-tile (one swizzle row)
constexpr int kChunkRows = 128;  // weight rows per stage
constexpr int kMmaGroups = 2, kStagerWarps = 7;
constexpr int kMmaThreads = 128 * kMmaGroups, kStagerThreads = 32 * kStagerWarps;
constexpr int kThreads = kMmaThreads + kStagerThreads + 32;  // + the producer warp
constexpr int kStageBytes = kChunkRows * kKBytes;
constexpr int kGroupRowBytes = 64 * kKBytes;  // an MMA warpgroup's rows of a stage
constexpr int kMaxStages = 8;                 // resident weights: at most this many stages

// Whether a wgmma pass multiplies mode M in scaled fp16 (the fp32 modes: ForwardArgs::w_in_f16x3),
// the operand type in shared memory, the row planes and the weight k-segments per chunk of mode M
// ("highest": fp16x3, parts and remainders).
template <Mode M>
constexpr bool kF16Arith = M == Mode::high || M == Mode::highest;
template <Mode M, bool kF16 = kF16Arith<M>>
using pass_op_t = std::conditional_t<kF16, __half, mma::op_t<M>>;
template <Mode M>
constexpr int kRowPlanes = M == Mode::highest ? 2 : 1;
template <Mode M>
constexpr int kSegments = M == Mode::highest ? 2 : 1;  // (split: the weights' [hi | lo])

// 128-byte k-tiles in `cols` operands of op_bytes each.
__host__ __device__ inline int k_tiles(int64_t cols, int op_bytes) {
  return static_cast<int>(ceil_div(cols * op_bytes, kKBytes));
}

// Row pitch in elements of a prepared scaled-fp16 weight matrix of k_pad columns: [hi | lo], each
// whole 128-byte k-tiles (ForwardArgs::w_in_f16x3).
inline int64_t f16_weight_cols(int64_t k_pad) { return 2 * k_tiles(k_pad, 2) * (kKBytes / 2); }

}  // namespace ws

// Row buffers and weight stages of a warp-specialized pass, and the bytes to request.
struct PassPlan {
  int buffers = 0, stages = 0;
  int64_t bytes = 0;  // to request at launch; 0: the kernel does not take the problem
};

// The plan of `buffers` row buffers and `stages` weight stages, none where they do not fit: the
// request adds slack to realign the base to 1024 bytes where that fits too (bytes(buffers, stages)
// is the kernel's need from a 1024-byte boundary).
template <class Bytes>
PassPlan sized_plan(Bytes bytes, int buffers, int stages) {
  const int64_t need = bytes(buffers, stages), limit = max_smem_optin();
  return need <= limit ? PassPlan{buffers, stages, std::min(need + 1023, limit)} : PassPlan{};
}

// Two row buffers where they fit (staging overlaps the products), with all `w_tiles` weight
// stages resident where those fit too (at most max_stages), else a ring of 4 down to 2 stages;
// one buffer where two do not fit (sized_plan). (Which problem sizes a kernel takes is its own
// plan's business.)
template <class Bytes>
PassPlan plan_pass(Bytes bytes, int w_tiles, int max_stages) {
  const int64_t limit = max_smem_optin();
  for (int buffers = 2; buffers >= 1; --buffers) {
    int stages = 0;
    if (w_tiles <= max_stages && bytes(buffers, w_tiles) <= limit) stages = w_tiles;
    for (int s = 4; s >= 2 && stages == 0; --s)
      if (bytes(buffers, s) <= limit) stages = s;
    if (stages != 0) return sized_plan(bytes, buffers, stages);
  }
  return PassPlan{};
}

// The tensor-map element type of an operand type.
template <typename Op>
constexpr CUtensorMapDataType map_type() {
  if constexpr (std::is_same<Op, __nv_bfloat16>::value) return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  else if constexpr (std::is_same<Op, __half>::value) return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  else return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}


// A K-major operand [planes][rows][cols] (planes = 0: a 2-D map [rows][cols]) of row pitch
// `pitch` elements (0: cols), read as boxes of 128 bytes of k x box_rows (x 1 plane) into the 128-byte
// swizzle wgmma reads; zeros past the edges. False where the driver refuses it.
template <typename Op>
bool encode_kmajor_map(CUtensorMap* map, const void* base, int64_t planes, int64_t rows, int64_t cols,
                       int box_rows, int64_t pitch = 0) {
  if (pitch == 0) pitch = cols;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(planes)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(pitch * sizeof(Op)),
                                 static_cast<cuuint64_t>(rows * pitch * sizeof(Op))};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / sizeof(Op)), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return tensor_map_encoder()(map, map_type<Op>(), planes == 0 ? 2 : 3, const_cast<void*>(base), dims, strides,
                              box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The producer's side of a TMA contraction's ring (wgmma_tma, wgmma_pingpong): its `it`-th use of
// kStages stages (kStageBytes each: the A box of kATile bytes, then the B box) gets k-step `step` of
// segments * k_tiles of the operands at `plane`, rows row0 of A and col0 of B, once the stage's
// previous round has been read (split: segment 0 big.big, 1 big.small, 2 small.big; the small planes
// are `batch` further on). (Index: the caller's counter type, so its arithmetic stays the caller's.)
template <int kStages, int kATile, int kStageBytes, typename Index>
__device__ __forceinline__ void load_contraction_stage(uint8_t* smem, uint64_t* full, uint64_t* empty, Index it,
                                                       const CUtensorMap* map_a, const CUtensorMap* map_b, int step,
                                                       int k_tiles, int elems_per_row, int64_t plane, int64_t batch,
                                                       int row0, int col0) {
  const int s = static_cast<int>(it % kStages);
  const Index round = it / kStages;
  const int segment = step / k_tiles, kt = step - segment * k_tiles;
  const int a_plane = static_cast<int>(plane + (segment == 2 ? batch : 0));
  const int b_plane = static_cast<int>(plane + (segment == 1 ? batch : 0));
  if (round > 0) mbar_wait(&empty[s], static_cast<int>((round - 1) & 1));
  uint8_t* stage = smem + s * kStageBytes;
  mbar_expect_tx(&full[s], kStageBytes);
  tma_load(stage, map_a, kt * elems_per_row, row0, a_plane, &full[s]);
  tma_load(stage + kATile, map_b, kt * elems_per_row, col0, b_plane, &full[s]);
}

// Launches Kernel, a TMA contraction kernel (map_a, map_b, z, batch, m, n, ldz, k_tiles, segments,
// z_scale, z_scale_stride; 128-byte k-tiles), on `grid` blocks of `threads` with `smem_bytes` of shared memory.
template <auto Kernel, typename Op, typename TOut>
cudaError_t launch_contraction_kernel(const ContractArgs& args, const CUtensorMap& map_a, const CUtensorMap& map_b,
                                      dim3 grid, int threads, int smem_bytes) {
  const cudaError_t status = fused::allow_smem<Kernel>(smem_bytes);
  if (status != cudaSuccess) return status;
  const int k_tiles = static_cast<int>(ceil_div(args.k * static_cast<int64_t>(sizeof(Op)), ws::kKBytes));
  Kernel<<<grid, threads, smem_bytes, args.stream>>>(map_a, map_b, static_cast<TOut*>(args.z), args.batch, args.m,
                                                     args.n, args.ldz, k_tiles, args.split ? 3 : 1, args.z_scale,
                                                     args.z_scale_stride);
  return cudaGetLastError();
}

// What a TMA contraction kernel takes: 16-bit operands; fp32 ones only as TF32 values already, where
// TF32 is allowed, or as split operands (3xTF32, or fp16x3 scaled back by *z_scale); row pitches TMA
// can read (lda a multiple of 32) and coordinates that fit 32 bits.
inline bool takes_tma_contraction(const ContractArgs& args) {
  const bool tf32 = args.operand == Dtype::f32;
  // (split fp16 operands only scaled, as fp16x3; split bf16 ones are not made)
  return tensor_map_encoder() != nullptr && !(args.split && args.operand == Dtype::bf16) &&
         !(args.split && args.operand == Dtype::f16 && args.z_scale == nullptr) &&
         !(args.z_scale != nullptr && args.operand != Dtype::f16) &&
         !(tf32 && !args.split && (!args.tf32_rounded || args.precision == Precision::highest)) &&
         args.lda >= args.k && args.lda % 32 == 0 && args.m < (int64_t(1) << 31) && args.n < (int64_t(1) << 31) &&
         2 * args.batch < (int64_t(1) << 31);
}

// A TMA contraction kernel's launch: its operands' tensor maps (boxes of BM and BN rows, 16-byte-aligned
// operands), then launch(op_tag, out_tag, scaled, map_a, map_b); cudaErrorNotSupported where it does not
// take the call.
template <int BM, int BN, class Launch>
cudaError_t launch_tma_contraction(const ContractArgs& args, Launch&& launch) {
  if (!takes_tma_contraction(args)) return cudaErrorNotSupported;
  if (args.batch == 0 || args.m == 0 || args.n == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(args.a) % 16 != 0 || reinterpret_cast<uintptr_t>(args.b) % 16 != 0)
    return cudaErrorNotSupported;
  return dispatch_dtypes(args.operand, args.out, [&](auto op_tag, auto out_tag) -> cudaError_t {
    using Op = typename decltype(op_tag)::type;
    CUtensorMap map_a, map_b;
    const int64_t planes = args.split ? 2 * args.batch : args.batch;
    if (!encode_kmajor_map<Op>(&map_a, args.a, planes, args.m, args.lda, BM) ||
        !encode_kmajor_map<Op>(&map_b, args.b, planes, args.n, args.lda, BN))
      return cudaErrorNotSupported;
    if constexpr (std::is_same<Op, __half>::value)
      if (args.z_scale != nullptr) return launch(op_tag, out_tag, std::true_type{}, map_a, map_b);
    return launch(op_tag, out_tag, std::false_type{}, map_a, map_b);
  });
}

}  // namespace tma
}  // namespace trimul
