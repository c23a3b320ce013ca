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
struct Operand<Mode::high> { using type = float; };
template <>
struct Operand<Mode::highest> { using type = float; };

template <Mode M>
using op_t = typename Operand<M>::type;

template <Mode M>
using z_t = std::conditional_t<M == Mode::bf16, __nv_bfloat16, float>;  // (z_dtype_for)

// Shared memory holds operands in k-slabs of 64 bytes per row (32 bf16/f16 or 16 fp32 values,
// two mma k-steps). Streamed slabs use rows of kSlabStride words: 16 data words + 4 pad words,
// which makes the per-lane fragment loads conflict-free (row stride = 4 mod 8 words).
constexpr int kSlabBytes = 64;
constexpr int kSlabWords = 16;
constexpr int kSlabStride = kSlabWords + 4;

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

// The same product with the operands' roles swapped: the streamed rows are the mma's A operand (m16
// tiles) and the resident rows its B (n8 tiles), so a thread's accumulators hold two adjacent
// resident rows (positions) of one streamed row: WS x WR warps, each MT m16 tiles of streamed rows
// and NT n8 tiles of resident rows. BM / BN keep their meaning (resident / streamed rows).
template <int WS_, int WR_, int MT_, int NT_>
struct SwappedTiling {
  static constexpr int WS = WS_, WR = WR_, MT = MT_, NT = NT_;
  static constexpr int kWarps = WS * WR, kThreads = 32 * kWarps;
  static constexpr int BM = WR * NT * 8, BN = WS * MT * 16;
};

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// INSTR: the mma.sync instruction with its shape and types (the fragment registers are the same).
#define TRIMUL_MMA_16X8(INSTR)                                                                    \
  asm volatile(INSTR " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                   \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <Mode M>
__device__ __forceinline__ void mma_16x8(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (M == Mode::bf16)
    TRIMUL_MMA_16X8("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32");
  else if constexpr (M == Mode::f16)
    TRIMUL_MMA_16X8("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32");
  else
    TRIMUL_MMA_16X8("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32");
}
#undef TRIMUL_MMA_16X8

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint32_t* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// acc += A[16*MT rows, slab] * B[8*NT rows, slab]^T for one warp. `a` and `b` point at the warp's
// first row and the slab's first word; strides are in 32-bit words (16-byte aligned rows). The
// fragment layouts of m16n8k16 (2 x 16-bit per word) and m16n8k8 tf32 (1 x 32-bit per word)
// coincide in words: a = {(g, t), (g+8, t), (g, t+4), (g+8, t+4)}, b = {(n g, t), (n g, t+4)},
// per 8-word k-step, which is what ldmatrix's four 8x(4-word) matrices hand each lane, so one
// ldmatrix.x4 loads an A fragment or the B fragments of two n8 tiles (a quarter of the
// instructions of per-word loads: these kernels are issue-bound).
template <Mode M, int MT, int NT, bool PreRounded = false>
__device__ __forceinline__ void warp_slab(float (&acc)[MT][NT][4], const uint32_t* a, int a_stride,
                                          const uint32_t* b, int b_stride, int lane) {
  static_assert(NT % 2 == 0, "B fragments load two n8 tiles at a time");
  const int quad = lane >> 3, row = lane & 7;
  // Lane's row address: A matrices (rows +0/+8, words +0/+4) = quads 0..3 as (q&1, q>>1);
  // B matrices (words +0/+4, n rows +0/+8) = quads 0..3 as (q&1, q>>1).
  const uint32_t* a_lane = a + ((quad & 1) * 8 + row) * a_stride + (quad >> 1) * 4;
  const uint32_t* b_lane = b + ((quad >> 1) * 8 + row) * b_stride + (quad & 1) * 4;
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    uint32_t af[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) ldmatrix_x4(af[mi], a_lane + mi * 16 * a_stride + step * 8);
    uint32_t bf[NT][2];
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t r[4];
      ldmatrix_x4(r, b_lane + np * 16 * b_stride + step * 8);
      bf[2 * np][0] = r[0];
      bf[2 * np][1] = r[1];
      bf[2 * np + 1][0] = r[2];
      bf[2 * np + 1][1] = r[3];
    }
    if constexpr (M == Mode::highest) {
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
        const float x0 = __uint_as_float(bf[ni][0]), x1 = __uint_as_float(bf[ni][1]);
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
      if constexpr (M == Mode::high && !PreRounded) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int r = 0; r < 4; ++r) af[mi][r] = to_tf32(__uint_as_float(af[mi][r]));
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int r = 0; r < 2; ++r) bf[ni][r] = to_tf32(__uint_as_float(bf[ni][r]));
      }
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) mma_16x8<M>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
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

// One 64-byte k-slab of BN weight rows in global memory.
struct Slab {
  const char* rows;  // the slab's first row
  int64_t pitch;     // bytes from one row to the next
};

// Chunk after chunk of BN weight rows, k_slabs slabs each; called once per slab, in order
// (kept incremental: a division per slab costs more than the slab's copy instructions).
struct ChunkedSlabs {
  const char* chunk;    // the current chunk's first row
  int64_t pitch;        // bytes per weight row
  int64_t chunk_bytes;  // BN * pitch
  int k_slabs;
  int slab = 0;
  __device__ ChunkedSlabs(const char* first, int64_t pitch_, int64_t rows_per_chunk, int k_slabs_)
      : chunk(first), pitch(pitch_), chunk_bytes(rows_per_chunk * pitch_), k_slabs(k_slabs_) {}
  __device__ Slab operator()() {
    const Slab s{chunk + slab * kSlabBytes, pitch};
    if (++slab == k_slabs) {
      slab = 0;
      chunk += chunk_bytes;
    }
    return s;
  }
};

// Per output chunk: all slabs of one weight matrix's chunk, then all of the other's.
struct AlternatingSlabs {
  ChunkedSlabs first, second;
  int pos = 0;
  __device__ AlternatingSlabs(ChunkedSlabs a, ChunkedSlabs b) : first(a), second(b) {}
  __device__ Slab operator()() {
    const bool from_first = pos < first.k_slabs;
    if (++pos == first.k_slabs + second.k_slabs) pos = 0;
    return from_first ? first() : second();
  }
};

// One slab of ROWS weight rows into a stage buffer (ROWS x kSlabStride words); no bounds: the
// host pads weights.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_rows_async(uint32_t* stage, const Slab& slab) {
  static_assert((ROWS * 4) % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int it = 0; it < ROWS * 4 / THREADS; ++it) {
    const int chunk = threadIdx.x + it * THREADS;
    const int r = chunk >> 2, q = chunk & 3;
    cp_async16(stage + r * kSlabStride + q * 4, slab.rows + r * slab.pitch + q * 16, true);
  }
}

// Streams weight slabs (BN rows x 64 bytes each) through kStages stage buffers as one continuous
// cp.async pipeline over a whole block's sequence of GEMMs, so the next GEMM's first slabs are in
// flight during an epilogue (and the first ones during the row staging) instead of each short
// K = C or H product paying the load latency again. `source()` gives the slabs in order.
template <class T, class Source>
struct SlabStream {
  uint32_t* stages;
  int remaining;
  Source source;
  int fill = 0, read = 0;  // stage buffers being filled / read next

  __device__ SlabStream(uint32_t* stages_, int total, Source source_)
      : stages(stages_), remaining(total), source(source_) {}

  __device__ void issue() {
    if (remaining > 0) {
      --remaining;
      load_rows_async<T::BN, T::kThreads>(stages + fill * T::BN * kSlabStride, source());
    }
    cp_async_commit();  // empty groups keep the wait counts uniform
    fill = fill + 1 == kStages ? 0 : fill + 1;
  }
  // Puts the first kStages - 1 slabs in flight.
  __device__ void prime() {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue();
  }
  // The next slab in shared memory, for all threads; refills the buffer freed by the last one.
  __device__ const uint32_t* next() {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    issue();
    const uint32_t* stage = stages + read * T::BN * kSlabStride;
    read = read + 1 == kStages ? 0 : read + 1;
    return stage;
  }
  // Waits out the (empty) groups still counted, so other cp.async users start from zero.
  __device__ void drain() { cp_async_wait<0>(); }
};

template <class T, class Source>
__device__ SlabStream<T, Source> make_slab_stream(uint32_t* stages, int total, Source source) {
  return SlabStream<T, Source>(stages, total, source);
}

// acc = A_res[BM, k_slabs slabs] * (the stream's next k_slabs slabs)^T. A_res: resident smem,
// a_stride words per row.
template <Mode M, class T, bool PreRounded, class Stream>
__device__ __forceinline__ void gemm_streamed(float (&acc)[T::MT][T::NT][4], const uint32_t* a_res,
                                              int a_stride, int k_slabs, Stream& stream) {
  zero<T>(acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const uint32_t* a_warp = a_res + (wm * T::MT * 16) * a_stride;
  for (int slab = 0; slab < k_slabs; ++slab) {
    const uint32_t* b_warp = stream.next() + (wn * T::NT * 8) * kSlabStride;
    warp_slab<M, T::MT, T::NT, PreRounded>(acc, a_warp + slab * kSlabWords, a_stride, b_warp, kSlabStride,
                                           lane);
  }
}

// acc += (the stream's next k_slabs slabs) * Res[BM, k_slabs slabs]^T for a SwappedTiling T: the
// caller initialises acc (e.g. with the streamed rows' biases).
template <Mode M, class T, bool PreRounded, class Stream>
__device__ __forceinline__ void gemm_streamed_swapped(float (&acc)[T::MT][T::NT][4], const uint32_t* res,
                                                      int res_stride, int k_slabs, Stream& stream) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ws = warp / T::WR, wr = warp % T::WR;
  const uint32_t* b_warp = res + (wr * T::NT * 8) * res_stride;
  for (int slab = 0; slab < k_slabs; ++slab) {
    const uint32_t* a_warp = stream.next() + (ws * T::MT * 16) * kSlabStride;
    warp_slab<M, T::MT, T::NT, PreRounded>(acc, a_warp, kSlabStride, b_warp + slab * kSlabWords, res_stride, lane);
  }
}

// Stores v0 (and v1 at dst + 1 when `both`) to global memory, as one 8- or 4-byte store when `paired`
// says the destination is aligned for it. (The fp32 pair as st.global.v2.f32 written out: from a float2
// store NVVM emitted two st.global.f32 in the output passes, each warp store instruction half-filling 8
// sectors, and ncu found the resident output pass L1-bound on the excess sectors.)
template <typename TOut>
__device__ __forceinline__ void store_pair(TOut* dst, float v0, float v1, bool both, bool paired) {
  if (both && paired) {
    if constexpr (std::is_same<TOut, float>::value) {
      asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(v0), "f"(v1) : "memory");
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
    case Mode::high: return f(std::integral_constant<Mode, Mode::high>{});
    case Mode::highest: return f(std::integral_constant<Mode, Mode::highest>{});
  }
  return cudaErrorInvalidValue;
}

// Rounds to what the operand type of M holds; TF32 operands are rounded once where they are
// written (PreRounded products then feed their bits to the mma as they are).
template <Mode M>
__device__ __forceinline__ op_t<M> to_operand(float v) {
  if constexpr (M == Mode::high) return __uint_as_float(to_tf32(v));
  else return from_float<op_t<M>>(v);
}

// sigmoid(x) / up, for `up` a power of two (folding a scale back into the reciprocal), from
// ex2.approx and rcp.approx: each within ~2 ulp (relative error ~2^-21), far inside even the
// fp32-accurate budget, in two MUFU ops and two FP ops (__expf / __fdividef add range fix-ups:
// ncu counted their ~4 extra instructions per gate in the output pass). For very negative x the
// reciprocal of the overflowing denominator goes to 0 as it should.
__device__ __forceinline__ float sigmoid_over(float x, float up) {
  float t, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(-1.4426950408889634f * x));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(t, up, up)));
  return r;
}
__device__ __forceinline__ float sigmoid(float x) { return sigmoid_over(x, 1.f); }

// The gates' sigmoid: one tanh.approx (one MUFU op instead of two; abs error ~2^-11, below bf16
// and fp16 rounding) on the 16-bit paths, the accurate one for TF32 and fp32-accurate work.
__device__ __forceinline__ float tanh_approx(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
  return t;
}

template <Mode M>
__device__ __forceinline__ float gate_sigmoid(float x) {
  if constexpr (M == Mode::bf16 || M == Mode::f16) {
    return fmaf(0.5f, tanh_approx(0.5f * x), 0.5f);
  } else {
    return sigmoid(x);
  }
}

// proj * sigmoid(gate) * (2 * half_scale) on the 16-bit paths, as ps + ps * tanh(gate / 2) with
// ps = proj * half_scale: one multiply fewer per output than gate_sigmoid's form.
// gated_16bit_half takes half the gate (callers that add a bias to it fold the halving into that FFMA).
__device__ __forceinline__ float gated_16bit_half(float proj, float half_gate, float half_scale) {
  const float ps = proj * half_scale;
  return fmaf(ps, tanh_approx(half_gate), ps);
}
__device__ __forceinline__ float gated_16bit(float proj, float gate, float half_scale) {
  return gated_16bit_half(proj, 0.5f * gate, half_scale);
}

}  // namespace mma
}  // namespace trimul
