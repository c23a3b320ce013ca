// wgmma_tma — Hopper (sm_90a): 128x256 tiles; one producer thread issues TMA loads (128-byte swizzle,
// zero fill past the edges) into a 4-stage mbarrier pipeline, two consumer warpgroups each run
// m64n256k16 (k8 for TF32) on their 64 rows and keep one k-tile of MMAs in flight. Also 3xTF32 or
// fp16x3 from split operands (ContractArgs::split): the k loop runs three times, over big.big,
// big.small, small.big (fp16x3: scaled operands, the products scaled back by z_scale, one factor or
// one per plane). A 16-bit z goes out through a per-warp shared-memory scratch as 16-byte row stores
// (store_accumulators_staged).
#include "tma.cuh"

namespace trimul {
namespace contract_wgmma_tma {

using namespace ::trimul::tma;

constexpr int BM = 128, BN = 256;
constexpr int kRowBytes = 128;  // bytes of k per tile row: one 128-byte swizzle span
constexpr int kStages = 4, kConsumers = 2;
constexpr int kThreads = 128 * (kConsumers + 1);  // warpgroup 0 produces
constexpr int kATile = BM * kRowBytes, kBTile = BN * kRowBytes, kStageBytes = kATile + kBTile;
constexpr int kSmemBytes = kStages * kStageBytes + 1024 + 2 * kStages * 8;  // + alignment slack, barriers
// 16-bit z: each consumer warp's store scratch after the barriers (store_accumulators_staged).
constexpr int kScratchOffset = kStages * kStageBytes + 128;
constexpr int kSmemBytes16 = kScratchOffset + 4 * kConsumers * kStoreScratchBytes + 1024;

// One 32-byte k-step of a 64x256 product. INSTR: the wgmma with its shape and types; TAIL: its
// scale/transpose immediates (16-bit operands take transpose flags, TF32 does not).
#define TRIMUL_WGMMA_64X256(INSTR, TAIL)                                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" INSTR                                   \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "\
               "%128, %129, p" TAIL ";\n}\n"                                                          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])\
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <typename Op>
__device__ __forceinline__ void wgmma_64x256_step(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef TRIMUL_SM90A
  TRIMUL_WGMMA_FOR_OP(TRIMUL_WGMMA_64X256, 256)
#endif
}
#undef TRIMUL_WGMMA_64X256

// Output tiles run in groups of kGroupRows tile rows, column by column within a group, so that the CTAs
// resident at once share their A rows and B columns in L2: row-major order has them span a few tile rows
// and every column, which streams a plane's whole B from memory once per few rows where a plane's B
// outgrows L2 (bf16 planes past N ~ 4096).
constexpr int kGroupRows = 16;

__device__ __forceinline__ void tile_origin(int64_t index, int64_t m, int64_t n, int* row0, int* col0) {
  const int64_t tiles_m = ceil_div(m, BM), tiles_n = ceil_div(n, BN);
  const int64_t first = index / (kGroupRows * tiles_n) * kGroupRows;
  const int64_t rows = tiles_m - first < kGroupRows ? tiles_m - first : kGroupRows;
  const int64_t within = index % (kGroupRows * tiles_n);
  *row0 = static_cast<int>((first + within % rows) * BM);
  *col0 = static_cast<int>(within / rows * BN);
}

// Stage s of the pipeline is used for the it-th k-tile when s = it % kStages, in round it / kStages:
// `full[s]` completes once per round when both TMA boxes have landed, `empty[s]` once per round
// when both consumer warpgroups are done reading it.
template <typename Op, typename TOut, bool kScaled = false>
__global__ void __launch_bounds__(kThreads, 1)
    kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b, TOut* __restrict__ z,
           int64_t batch, int64_t m, int64_t n, int64_t ldz, int k_tiles, int segments, const float* z_scale,
           int64_t z_scale_stride) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  init_ring(full, empty, kStages, kConsumers);

  int row0, col0;
  tile_origin(blockIdx.x, m, n, &row0, &col0);
  const int warpgroup = warp_index() / 4;
  constexpr int kElemsPerRow = kRowBytes / static_cast<int>(sizeof(Op));

  if (warpgroup == 0) {
    if (threadIdx.x == 0) {
      int it = 0;
      for (int64_t bz = blockIdx.y; bz < batch; bz += gridDim.y)
        for (int t = 0; t < segments * k_tiles; ++t, ++it)
          load_contraction_stage<kStages, kATile, kStageBytes>(smem, full, empty, it, &map_a, &map_b, t, k_tiles,
                                                               kElemsPerRow, bz, batch, row0, col0);
    }
    return;
  }

  const int consumer = warpgroup - 1;
  const bool leader = (threadIdx.x & 127) == 0;
  const bool paired_store = (ldz % 2) == 0;
  // (16-bit z: whole 16-byte-aligned rows of the tile's columns, through this warp's scratch)
  const bool staged_store = col0 + BN <= n && ldz % 8 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0;
  uint8_t* scratch = smem + kScratchOffset + (warp_index() - 4) * kStoreScratchBytes;
  int it = 0;
  for (int64_t bz = blockIdx.y; bz < batch; bz += gridDim.y) {
    float acc[128];
#pragma unroll
    for (int r = 0; r < 128; ++r) acc[r] = 0.f;
    for (int kt = 0; kt < segments * k_tiles; ++kt, ++it) {
      const int s = it % kStages;
      mbar_wait(&full[s], (it / kStages) & 1);
      const uint8_t* stage = smem + s * kStageBytes;
      const uint64_t desc_a = smem_descriptor(stage + consumer * 64 * kRowBytes);
      const uint64_t desc_b = smem_descriptor(stage + kATile);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 4; ++step)  // 32 bytes further along k: start address + 2
        wgmma_64x256_step<Op>(acc, desc_add(desc_a, 2 * step), desc_add(desc_b, 2 * step), 1);
      wgmma_commit();
      // The previous k-tile's MMAs are done once at most this one is in flight: free its stage.
      wgmma_wait<1>();
      if (kt > 0 && leader) mbar_arrive(&empty[(it - 1) % kStages]);
    }
    wgmma_wait<0>();
    if (k_tiles > 0 && leader) mbar_arrive(&empty[(it - 1) % kStages]);
    if constexpr (kScaled) {
      const float scale = z_scale[bz * z_scale_stride];
#pragma unroll
      for (int r = 0; r < 128; ++r) acc[r] *= scale;
    }

    if constexpr (sizeof(TOut) == 2) {
      if (staged_store && row0 + consumer * 64 + 64 <= m) {
        store_accumulators_staged<BN>(z + bz * m * ldz, acc, row0 + consumer * 64, col0, ldz, scratch);
        continue;
      }
    }
    store_accumulators<BN>(z + bz * m * ldz, acc, row0 + consumer * 64, col0, m, n, ldz, paired_store);
  }
}

template <typename Op, typename TOut, bool kScaled>
cudaError_t launch_kernel(const ContractArgs& args, const CUtensorMap& map_a, const CUtensorMap& map_b) {
  const dim3 grid(static_cast<unsigned>(ceil_div(args.m, BM) * ceil_div(args.n, BN)), batch_grid(args.batch));
  return launch_contraction_kernel<kernel<Op, TOut, kScaled>, Op, TOut>(args, map_a, map_b, grid, kThreads,
                                                                        sizeof(TOut) == 2 ? kSmemBytes16 : kSmemBytes);
}

bool applies(const ContractArgs& args) { return takes_tma_contraction(args); }

cudaError_t launch(const ContractArgs& args) {
  return launch_tma_contraction<BM, BN>(args, [&](auto op_tag, auto out_tag, auto scaled, const CUtensorMap& map_a,
                                                   const CUtensorMap& map_b) {
    return launch_kernel<typename decltype(op_tag)::type, typename decltype(out_tag)::type, decltype(scaled)::value>(
        args, map_a, map_b);
  });
}

}  // namespace contract_wgmma_tma


}  // namespace trimul

TRIMUL_REGISTER_CONTRACTION(wgmma_tma, trimul::contract_wgmma_tma::applies, trimul::contract_wgmma_tma::launch);
