// mma.cuh — tensor-core building blocks shared by the fused passes and the mma contraction:
// mma.sync wrappers (bf16/f16 m16n8k16, tf32 m16n8k8, split 3xTF32), cp.async staging, the warp
// tile product over one 64-byte k-slab of shared memory, and a GEMM loop whose A operand stays
// resident in shared memory while B (weights) streams through a cp.async pipeline.
#pragma once
#include "common.cuh"

#include <type_traits>

namespace trimul {
namespace mma {

template <Mode M>
struct Operand;  // element type of the operands in shared memory
template <>
struct Operand<Mode::bf16> { using type = __nv_bfloat16; };
template <>
struct Operand<Mode::f16> { using type = __half; };
template <>
struct Operand<Mode::tf32> { using type = float; };
template <>
struct Operand<Mode::tf32x3> { using type = float; };

template <Mode M>
using op_t = typename Operand<M>::type;

// Shared memory holds operands in k-slabs of 64 bytes per row (32 bf16/f16 or 16 fp32 values,
// two mma k-steps). Streamed slabs use rows of kSlabStride words: 16 data words + 4 pad words,
// which makes the per-lane fragment loads conflict-free (row stride = 4 mod 8 words).
constexpr int kSlabBytes = 64;
constexpr int kSlabWords = 16;
constexpr int kSlabStride = kSlabWords + 4;

template <Mode M>
constexpr int slab_elems() { return kSlabBytes / static_cast<int>(sizeof(op_t<M>)); }

// Row stride in words of a resident operand holding k_pad (a multiple of 32) values per row.
template <Mode M>
__host__ __device__ constexpr int resident_stride(int64_t k_pad) {
  return static_cast<int>(k_pad * static_cast<int64_t>(sizeof(op_t<M>)) / 4) + 4;
}

// Warp layout of a block: WM x WN warps, each owning MT m16 tiles and NT n8 tiles.
template <int WM_, int WN_, int MT_, int NT_>
struct Tiling {
  static constexpr int WM = WM_, WN = WN_, MT = MT_, NT = NT_;
  static constexpr int kWarps = WM * WN, kThreads = 32 * kWarps;
  static constexpr int BM = WM * MT * 16, BN = WN * NT * 8;
};

template <class T>
using Accum = float[T::MT][T::NT][4];

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

template <Mode M>
__device__ __forceinline__ void mma_16x8(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (M == Mode::bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (M == Mode::f16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// acc += A[16*MT rows, slab] * B[8*NT rows, slab]^T for one warp. `a` and `b` point at the warp's
// first row and the slab's first word; strides are in 32-bit words. The fragment layouts of
// m16n8k16 (2 x 16-bit per word) and m16n8k8 tf32 (1 x 32-bit per word) coincide in words:
// a = {(g, t), (g+8, t), (g, t+4), (g+8, t+4)}, b = {(n g, t), (n g, t+4)}, per 8-word k-step.
template <Mode M, int MT, int NT>
__device__ __forceinline__ void warp_slab(float (&acc)[MT][NT][4], const uint32_t* a, int a_stride,
                                          const uint32_t* b, int b_stride, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    const int kw = step * 8 + t;
    uint32_t af[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      const uint32_t* p = a + (mi * 16 + g) * a_stride + kw;
      af[mi][0] = p[0];
      af[mi][1] = p[8 * a_stride];
      af[mi][2] = p[4];
      af[mi][3] = p[8 * a_stride + 4];
    }
    if constexpr (M == Mode::tf32x3) {
      // x = big + small, both tf32; acc += a_big*b_small + a_small*b_big + a_big*b_big keeps
      // about fp32 accuracy (the small*small term is below fp32 rounding).
      uint32_t a_small[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float x = __uint_as_float(af[mi][r]);
          af[mi][r] = to_tf32(x);
          a_small[mi][r] = to_tf32(x - __uint_as_float(af[mi][r]));
        }
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const uint32_t* q = b + (ni * 8 + g) * b_stride + kw;
        const float x0 = __uint_as_float(q[0]), x1 = __uint_as_float(q[4]);
        const uint32_t b0 = to_tf32(x0), b1 = to_tf32(x1);
        const uint32_t s0 = to_tf32(x0 - __uint_as_float(b0)), s1 = to_tf32(x1 - __uint_as_float(b1));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_16x8<M>(acc[mi][ni], af[mi], s0, s1);
          mma_16x8<M>(acc[mi][ni], a_small[mi], b0, b1);
          mma_16x8<M>(acc[mi][ni], af[mi], b0, b1);
        }
      }
    } else {
      if constexpr (M == Mode::tf32) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int r = 0; r < 4; ++r) af[mi][r] = to_tf32(__uint_as_float(af[mi][r]));
      }
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const uint32_t* q = b + (ni * 8 + g) * b_stride + kw;
        uint32_t b0 = q[0], b1 = q[4];
        if constexpr (M == Mode::tf32) {
          b0 = to_tf32(__uint_as_float(b0));
          b1 = to_tf32(__uint_as_float(b1));
        }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) mma_16x8<M>(acc[mi][ni], af[mi], b0, b1);
      }
    }
  }
}

// ---- cp.async ---------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: fill with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Stages one 64-byte k-slab of ROWS rows into smem (ROWS x kSlabStride words). Rows at or past
// rows_valid are zero-filled.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_slab_async(uint32_t* stage, const char* base, int64_t ld_bytes,
                                                int64_t row0, int64_t rows_valid, int64_t k_byte) {
  static_assert((ROWS * 4) % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int it = 0; it < ROWS * 4 / THREADS; ++it) {
    const int chunk = threadIdx.x + it * THREADS;
    const int r = chunk >> 2, q = chunk & 3;
    const bool ok = row0 + r < rows_valid;
    const char* src = base + (ok ? (row0 + r) * ld_bytes + k_byte + q * 16 : 0);
    cp_async16(stage + r * kSlabStride + q * 4, src, ok);
  }
}

template <class T>
__device__ __forceinline__ void zero(float (&acc)[T::MT][T::NT][4]) {
#pragma unroll
  for (int mi = 0; mi < T::MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::NT; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.f;
}

constexpr int kStages = 3;

// acc = A_res[BM, k] * W[BN rows, k]^T. A_res: resident smem, a_stride words per row. W: global,
// BN rows from `w` with ld_bytes per row, k_slabs 64-byte slabs per row, all valid (the host pads
// weights). `stages` is kStages * BN * kSlabStride words. Ends with all threads synchronised and
// the stage buffers free.
template <Mode M, class T>
__device__ void gemm_resident_a(float (&acc)[T::MT][T::NT][4], const uint32_t* a_res, int a_stride,
                                const void* w, int64_t ld_bytes, int k_slabs, uint32_t* stages) {
  zero<T>(acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const uint32_t* a_warp = a_res + (wm * T::MT * 16) * a_stride;
  const char* w_bytes = static_cast<const char*>(w);
  auto fetch = [&](int slab) {
    if (slab < k_slabs)
      load_slab_async<T::BN, T::kThreads>(stages + (slab % kStages) * T::BN * kSlabStride, w_bytes,
                                          ld_bytes, 0, T::BN, static_cast<int64_t>(slab) * kSlabBytes);
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) fetch(s);
  for (int slab = 0; slab < k_slabs; ++slab) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    fetch(slab + kStages - 1);
    const uint32_t* b_warp =
        stages + (slab % kStages) * T::BN * kSlabStride + (wn * T::NT * 8) * kSlabStride;
    warp_slab<M, T::MT, T::NT>(acc, a_warp + slab * kSlabWords, a_stride, b_warp, kSlabStride, lane);
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Stores v0 (and v1 at dst + 1 when `both`), as one 8- or 4-byte store when `paired` says the
// destination is aligned for it.
template <typename TOut>
__device__ __forceinline__ void store_pair(TOut* dst, float v0, float v1, bool both, bool paired) {
  if (both && paired) {
    if constexpr (std::is_same<TOut, float>::value) {
      *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    } else {
      TOut pair[2] = {from_float<TOut>(v0), from_float<TOut>(v1)};
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(pair);
    }
  } else {
    dst[0] = from_float<TOut>(v0);
    if (both) dst[1] = from_float<TOut>(v1);
  }
}


// Calls f(std::integral_constant<Mode, M>{}) for the run-time mode.
template <typename F>
cudaError_t dispatch_mode(Mode mode, F&& f) {
  switch (mode) {
    case Mode::bf16: return f(std::integral_constant<Mode, Mode::bf16>{});
    case Mode::f16: return f(std::integral_constant<Mode, Mode::f16>{});
    case Mode::tf32: return f(std::integral_constant<Mode, Mode::tf32>{});
    case Mode::tf32x3: return f(std::integral_constant<Mode, Mode::tf32x3>{});
  }
  return cudaErrorInvalidValue;
}

// __expf is within a few ulp (relative error ~2^-21), far inside even the fp32-accurate budget;
// for very negative x the quotient goes to 0 as it should.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

}  // namespace mma
}  // namespace trimul
