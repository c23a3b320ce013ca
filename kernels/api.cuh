// api.cuh — the plain C++ contract between the kernel library (every kernels/*.cu, compiled by nvcc
// file by file and linked into one shared library) and the torch extension (bindings.cpp, compiled
// by the host compiler), which loads the library at run time through trimul_kernel_library(). No
// device code and no torch headers here: both sides include it.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace trimul {

enum class Dtype : int { f32 = 0, bf16 = 1, f16 = 2 };

// How fp32 operands may be rounded inside a contraction (PyTorch's matmul precision names).
// bf16/fp16 operands are used as they are, whatever this says.
enum class Precision : int { highest = 0, high = 1, medium = 2 };

// The kernel roles of the registry (registry.def), in the order a training step runs them: the
// forward's three, then the backward's.
enum class Role : int {
  input = 0,
  contract = 1,
  output = 2,
  output_backward = 3,
  contract_backward = 4,
  input_backward = 5,
  position_gemm = 6  // the backward's GEMMs over positions: rows [P, K] times a weight [N, K]^T
};
constexpr int kForwardRoles = 3;
constexpr int kRoles = 7;

// z[batch, i, j] = sum_k a[batch, i, k] * b[batch, j, k], row-major with row strides lda (a and
// b) and ldz. The forward lays a and b out as [B*H, N, ld] so both directions of the triangle
// update are this one "A times B-transposed" product. Elements [k, round_up(k, 32)) of every a/b
// row exist and are zero (tensor-core kernels read whole 64-byte k-slabs); lda is a multiple of 32.
struct ContractArgs {
  const void* a;
  const void* b;
  void* z;
  int64_t batch, m, n, k;
  int64_t lda, ldz;
  Dtype operand;  // dtype of a and b
  Dtype out;      // dtype of z
  Precision precision;
  bool tf32_rounded;  // fp32 a and b hold TF32 values already (the fused input pass writes them so)
  // Split operands: a and b hold `batch` planes of parts followed by `batch` planes of remainders,
  // and z = part.part + part.rem + rem.part (TF32 parts: 3xTF32; fp16 ones with z_scale: fp16x3).
  bool split;
  // fp16 operands scaled by a power of two (ForwardArgs::ab_f16): the factor that takes the
  // products back; nullptr otherwise.
  const float* z_scale;
  int64_t z_scale_stride;  // z_scale per plane: plane p's factor at z_scale[p * stride] (0: one for all)
  bool fused;  // inside the fused forward (the output pass may contract there: in_output_pass)
  cudaStream_t stream;
};

// How the fused passes multiply: bf16 / f16 operands ("medium", 16-bit inputs), or fp32 inputs at
// "high" (TF32-level: TF32 on mma.sync, scaled fp16 in the wgmma passes) or "highest"
// (fp32-accurate: 3xTF32 on mma.sync, fp16x3 in the wgmma passes).
enum class Mode : int { bf16 = 0, f16 = 1, high = 2, highest = 3 };

// z's dtype where a separate contraction writes it for the output pass: bf16 in the bf16 mode (as
// PyTorch's own bf16 einsum keeps it: half z's bytes in the contraction's stores and the output
// pass's loads; one bf16 rounding, ~2e-3 relative, inside "medium"'s 1e-2), fp32 in the others.
constexpr Dtype z_dtype_for(Mode mode) { return mode == Mode::bf16 ? Dtype::bf16 : Dtype::f32; }

// Mask element types the kernels read directly (no conversion pass on the host).
enum class MaskKind : int { u8 = 0, i32 = 1, i64 = 2, f32 = 3, bf16 = 4, f16 = 5 };

// The factors in ForwardArgs::f16x3_scales: s_in, t_in, t_gate, s_z, t_out are the exponents of
// the input rows (LayerNorm_in(pair)), w_in, w_gate, the z rows (LayerNorm_out(z)) and w_out.
enum F16x3Scale : int {
  kInRows = 0,   // 2^s_in
  kInUp,         // 2^(s_in + t_in): the input pass's biases into the accumulators' scale
  kInDown,       // 2^-(s_in + t_in): the accumulators back
  kGateDown,     // 2^-t_gate (times each position's own 2^-s: F16ScaledRows)
  kZRows,        // 2^s_z
  kOutUp,        // 2^(s_z + t_out)
  kOutDown,      // 2^-(s_z + t_out) (the wgmma output pass folds it into the sigmoid: 1 / kOutUp)
  kAbUp,         // 2^s_ab: the contraction's fp16 operands (ForwardArgs::ab_f16) scaled
  kZDown,        // 2^-2s_ab: its products back
  kF16x3Scales
};

// Everything the fused forward reads and writes. Weights are prepared on the host: in the
// operand type of `mode`, rows padded to a multiple of 128 and k padded to a multiple of 32 (both
// zero-filled), so the kernels stream them with no bounds checks.
struct ForwardArgs {
  // pair_repr [B, N, N, C] with element strides (channel stride 1), and the mask [B, N, N].
  const void* pair;
  Dtype pair_dtype;
  int64_t pair_sb, pair_sr, pair_sc;
  const void* mask;
  MaskKind mask_kind;
  int64_t mask_sb, mask_sr, mask_sc;
  bool mask_at_most_one;  // |mask| <= 1, or its bound folded into f16x3_scales: the contraction may take scaled
                          // fp16 operands (ab_f16)
  int64_t batch, n, c, h;
  // A block of pair's rows instead of the square pair (a sharded rank's: its ring multiplies): pair and the mask
  // [B, rows, N, ·], the planes [B*H, rows, ld], z [B*H, rows, ldz], out [B, rows, N, C]; planes in the outgoing
  // layout, and no contraction step. 0: rows = N (pair_rows). Only pass kernels registered for row blocks take
  // rows != N (fused.cuh, TRIMUL_REGISTER_PASS_WITH's ROW_BLOCKS).
  int64_t rows;
  bool incoming;          // contract over the first index (bkih,bkjh->bijh)
  bool gate_normalized;   // out_gate reads LayerNorm_in(pair) instead of pair
  Mode mode;
  float eps_in, eps_out;
  const float* ln_in_w;   // [C]
  const float* ln_in_b;
  // (LayerNorm_out's weight and bias are folded into w_out / b_out: the kernels only normalize z)
  const void* w_in;       // [2 * rows_ab, c_pad]: per half, rows 16g+e / 16g+8+e = proj / gate of h = 8g+e
  const float* b_in;      // [2 * rows_ab] in the same order
  int64_t rows_ab;        // round_up(2H, 128)
  // The 16-bit modes' register-row input kernels (wgmma_rs, wgmma_rs_384): w_in with LayerNorm_in's
  // weight folded in (W diag(w_ln)) and k permuted within each 16-channel block (k = 16s + 8hh + 2t + e
  // holds channel 16s + 4t + 2hh + e: a thread's register fragment is 4 adjacent channels of a row per
  // k-step), then 64 columns more: b_in + W b_ln (fp64) as a 16-bit part (column c_pad) and remainder
  // (c_pad + 1), zeros after; nullptr in the fp32 modes.
  const void* w_in_rows;   // [2 * rows_ab, c_pad + 64]
  const void* w_gate;     // [round_up(C, 128), c_pad] out_gate
  const float* b_gate;    // [C]
  const void* w_out;      // [round_up(C, 128), h_pad] out_proj
  const float* b_out;     // [C]
  int64_t c_pad, h_pad;   // round_up(C, 32), round_up(H, 32)
  // The fp32 modes in the wgmma passes multiply scaled fp16: at "highest" fp16x3, hi.hi + hi.lo +
  // lo.hi of fp16 splits (about 3xTF32's accuracy at the fp16 tensor-core rate), at "high" one part
  // (TF32's 11-bit significand). Each weight matrix, times a power of two 2^t, as
  // [rows, 2 * round_up(k_pad, 64)] fp16 with per row [hi | lo]: each hi k-tile multiplies the rows'
  // hi and lo k-tiles, each lo k-tile their hi; nullptr in the 16-bit modes. The rows are scaled by
  // powers of two as well, so that both operands' largest magnitudes sit near 2^12: no fp16 value
  // overflows and remainders keep their bits (F16x3Scale lists the factors; out_gate's rows are
  // scaled per position).
  const void* w_in_f16x3;    // [2 * rows_ab, 2 * round_up(c_pad, 64)]
  const void* w_gate_f16x3;  // [round_up(C, 128), 2 * round_up(c_pad, 64)]
  const void* w_out_f16x3;   // [round_up(C, 128), 2 * round_up(h_pad, 64)]
  const float* f16x3_scales; // [kF16x3Scales]
  // Work buffers: a_t, b_t [B*H, N, ld] in the contraction's operand type; z [B*H, N, ldz] in z_dtype
  // (z_dtype_for(mode)). With z == nullptr the output pass computes z itself from a_t and b_t
  // (in_output_pass: small N, one launch fewer).
  void* a_t;
  void* b_t;
  int64_t ld;
  // Split contraction operands ("highest"): elements from a value's part in a_t / b_t to its
  // remainder (the remainder planes follow the parts' planes). 0: values stored whole.
  int64_t small_offset;
  // fp32 modes: a_t / b_t hold fp16 values of a, b times 2^s_ab (with small_offset: fp16 parts and
  // remainders) instead of TF32 ones, for an fp16 (x3) contraction (ContractArgs::z_scale). s_ab bounds
  // |a|, |b| from the parameters and a mask of at most 1 (a bool mask) near 2^12 (F16x3Scale).
  bool ab_f16;
  void* z;
  Dtype z_dtype;
  int64_t ldz;
  // Shared memory the output pass's in-pass contraction (z == nullptr) stages a/b rows in; set by
  // the launch code (0: it reads them straight from global memory).
  int64_t contract_stage_bytes;
  bool gate_rows_first;  // (set by the output pass's launch: the in-pass contraction's z has its own region)
  void* out;              // [B, N, N, C] contiguous, pair_dtype
  // Training: LayerNorm_in(pair) without its affine, [B*N*N, C] bf16 in pair_repr's position order, written by
  // the input pass where ForwardPlan::x_hat_rows says its kernel can (the backward's operand, kept instead of
  // recomputed); nullptr: not written. An input kernel not registered as writing it does not take a call
  // with it set.
  void* x_hat;
  // With x_hat: LayerNorm_in's rstd of each position, [B*N*N] fp32 (the backward's LayerNorm from the kept rows,
  // BackwardPass::d_proj_d_pair), or nullptr.
  float* x_hat_rstd;
  // The rows the output gate reads instead of pair's, [B*N*N, C] bf16 in pair_repr's position order (the
  // training forward's x_hat, with out_gate folded with LayerNorm_in's affine and gate_normalized false: the
  // same gate with no LayerNorm in the pass), or nullptr: the gate reads pair. out keeps pair's dtype. An
  // output kernel not registered as reading them does not take a call with them set.
  const void* gate_rows;
  cudaStream_t stream;
  // The output pass is launched right after the input pass on `stream` (the one-call forward): where
  // it contracts itself it may then be launched as the input pass's programmatic dependent, and read
  // what no kernel writes (pair, weights) before it waits for that grid. Steps called one by one leave
  // it false: the kernel before the output pass is then the caller's.
  bool output_follows_input;
};

// The rows of a batch element's pair, planes, z and out (ForwardArgs::rows). (constexpr: device code calls it too)
constexpr int64_t pair_rows(const ForwardArgs& args) { return args.rows > 0 ? args.rows : args.n; }

// Largest N for which the output pass computes z itself (z == nullptr).
constexpr int64_t kFusedContractionMaxN = 64;

// A forward's plan (plan_forward): the kernel of each role and the buffers it needs.
struct ForwardPlan {
  int kernels[kForwardRoles];  // indices into KernelLibrary::kernels, by Role
  bool chosen[kForwardRoles];  // chosen by name (else the default order's)
  bool z_buffer;           // false: the output kernel computes z from a_t and b_t itself
  bool torch_contraction;  // the contraction is a torch baseline (bmm) that the caller runs on the buffers
  Dtype ab_dtype;          // a_t / b_t element type
  bool split;              // a_t / b_t hold parts and remainders (ForwardArgs::small_offset)
  int64_t ab_planes;       // [N, ld] planes per side: B*H, twice that for split operands
  bool x_hat_rows;         // the input kernel also writes ForwardArgs::x_hat when given one
  // An output kernel of the default order takes this call with the gate on ForwardArgs::gate_rows (raw gate)
  bool output_gate_rows;
};

// The backward's memory passes (training). Between them the extension runs cuBLAS GEMMs over positions.
// Rows: one per position (b, i, j) in pair_repr's order, [P = B*N*N, width] row-major. Planes: the
// contraction's layout [B*H, N, N] (a block of rows: [B*H, block_rows, N], BackwardArgs::block_rows); a/b
// planes of the incoming direction hold position (b, k, r) at plane element (r, k), z and dz planes position
// (b, r, k) in both directions. "operand": BackwardArgs::operand.
enum class BackwardPass : int {
  input_rows = 0,  // pair -> rows: x_hat [P, C] operand (LayerNorm_in without affine)         input_backward
  gated_planes,    // proj [P, 4H] (pa | ga | pb | gb), mask -> a_planes, b_planes              input_backward
  z_rows,          // a_planes (z) -> rows: z_hat [P, H] operand, rstd [P]                      output_backward
  gate_grad,       // d_out, o, gate_pre [P, C] -> o := d o, gate_pre := d gate_pre (in place), sums output_backward
  dz_planes,       // d_rows (d z_hat, fp32 [P, H]), rows (z_hat), rstd -> a_planes (dz)        output_backward
                   // (or, d_rows null: d z_hat from d_o, below)
  d_proj,          // proj, a_planes (da), b_planes (db), mask -> rows: d proj [P, 4H], d_mask, sums input_backward
  d_pair,          // pair, d_rows (d x_hat, fp32 [P, C]) + d_rows_add -> d_pair (pair's dtype) input_backward
                   // (or, d_rows null: d x_hat from rows = d proj and d_gate, below)
  split_f16x3,     // a_planes (fp32, strided) -> parts and/or parts_t, scaled fp16; unscale     contract_backward
  z_gate_grad,     // a_planes (z), x_hat (the gate rows), d_out -> rows (z_hat), rstd, o := d o,  output_backward
                   // gate_pre := d gate_pre, sums: z_rows, the o / gate_pre GEMMs and gate_grad in one (below)
  d_proj_d_pair,   // d_proj from x_hat (below), and d_pair from the same tile: d x_hat = d proj     input_backward
                   // W_in_f + d_gate W_gate_f, LayerNorm_in's backward on x_hat with rstd (LayerNorm_in's,
                   // ForwardArgs::x_hat_rstd): the pair rows are not read (the gate on LayerNorm_in's rows)
  dz_planes_g_out, // dz_planes from d_o (d_rows null), and g_out = d o^T z_hat as per-block partials  output_backward
                   // (g_out, below): out_proj's weight-gradient GEMM in the same pass
  split_weight,    // gemm_w -> gemm_w_split: a position GEMM's weight as its kernel multiplies it   position_gemm
  rows_gemm,       // gemm_rows, gemm_w_split, gemm_bias -> gemm_out                                position_gemm
  rows_grad,       // gemm_d, gemm_rows -> gemm_out = gemm_d^T gemm_rows (via gemm_partials)          position_gemm
};

// One backward pass's arguments: sizes, then the buffers each pass reads and writes (BackwardPass says
// which; the others are not read). All contiguous, on the current device.
struct BackwardArgs {
  BackwardPass pass;
  int64_t batch, n, c, h;
  // The planes' rows (pair_rows): 0 = N (square planes); else a block of pair's rows [B, block_rows, N, C], its
  // planes [B*H, block_rows, N] (a sharded rank's rows, P = B*block_rows*N): the outgoing layout only (incoming
  // false), the contraction being the caller's. plan_backward refuses a block to the roles that would contract.
  int64_t block_rows;
  bool incoming;
  Dtype operand;  // rows and planes: bf16 / f16 (the 16-bit modes) or f32
  float eps;      // LayerNorm_in's (input_rows, d_pair) or LayerNorm_out's (z_rows)
  const void* pair;
  Dtype pair_dtype;
  const void* mask;  // [P]
  MaskKind mask_kind;
  const void* proj;  // [P, 4H] operand (d_proj: null where the kernel recomputes proj from x_hat, below)
  // d_proj without proj (input_backward wgmma_rs): proj = x_hat W_in_f^T + b_in_f on the tensor cores, never
  // written. x_hat [P, C] operand rows (LayerNorm_in without affine); w_in_f [4H, C] fp32 (LayerNorm_in's weight
  // folded in; rows pa | ga | pb | gb), b_in_f [4H] fp32: the kernel lays them out as it multiplies them.
  const void* x_hat;
  const float* w_in_f;
  const float* b_in_f;
  void* a_planes;    // [B*H, N, N] operand
  void* b_planes;
  void* rows;               // operand rows (x_hat, z_hat or d proj)
  float* rstd;              // [P]: LayerNorm_out's (z_rows, dz_planes), LayerNorm_in's (d_proj_d_pair)
  const float* d_rows;      // fp32 rows (d z_hat or d x_hat)
  const float* d_rows_add;  // d_pair: fp32 [P, C] added to the result, or nullptr
  // d_pair without d_rows (input_backward wgmma_rs): d x_hat = d proj W_in_f + d gate W_gate_f multiplied in the
  // pass, never written: rows = d proj [P, 4H] operand, w_in_f as d_proj's; d_gate [P, C] operand and w_gate_f
  // [C, C] fp32 (out_gate's weight with LayerNorm_in's folded in), both or neither (the gate on the raw input:
  // its share comes in d_rows_add).
  const void* d_gate;
  const float* w_gate_f;
  // dz_planes without d_rows (output_backward wgmma): d z_hat = d o W_out_f multiplied in the pass, never written:
  // d_o [P, C] operand (gate_grad's d o), w_out_f [C, H] fp32 (out_proj's weight with LayerNorm_out's folded in).
  const void* d_o;
  const float* w_out_f;
  // dz_planes_g_out: per-block partials of g_out = d o^T z_hat, [g_out_rows, C, H] fp32, every row written (a
  // block per row: the caller sums the rows in a fixed order).
  float* g_out;
  int64_t g_out_rows;
  // z_gate_grad (output_backward wgmma): o = z_hat w_out_f^T + b_out_f and gate_pre = x_hat w_gate_f^T + b_gate_f
  // multiplied in the pass, never written (x_hat: the gate's rows, LayerNorm_in's or the raw pair's in the operand
  // dtype, with w_gate_f / b_gate_f the gate's weight and bias as they multiply those rows; both fp32).
  const float* b_out_f;
  const float* b_gate_f;
  float* d_mask;            // d_proj: [P], or nullptr (no mask gradient)
  // [d proj | d gate] as one [P, 4H + C] buffer, so that d x_hat is one GEMM against [W_in_f; W_gate_f] (the gate
  // on LayerNorm_in's rows): d_proj writes its rows ld_rows elements apart, and gate_grad writes d gate to
  // gate_out, ld_rows apart, instead of over gate_pre. 0 and nullptr: each pass's own contiguous rows.
  int64_t ld_rows;
  void* gate_out;
  const void* d_out;        // gate_grad: [P, C] in d_out_dtype
  Dtype d_out_dtype;
  void* o;         // gate_grad: [P, C] operand
  void* gate_pre;  // gate_grad: [P, C] operand
  void* d_pair;    // d_pair: [P, C] in pair_dtype (a 16-bit pair's gradient rounded once, in the pass)
  // Per-block partial sums over positions, [kBackwardSumRows, width] fp32 (rows of blocks that did not run
  // stay as the caller left them, zero): d_proj of d proj (width 4H), gate_grad of d o then d gate_pre
  // (width 2C); the caller adds the rows up. nullptr: not wanted.
  float* sums;
  // split_f16x3: a_planes holds `batch` fp32 N x N planes at plane_stride, rows at row_stride (elements). It
  // writes plane p times 2^s_p (s_p from bound[p], the plane's largest |element|, which lands in [2^11, 2^12))
  // as fp16 parts hi = fp16(x 2^s), lo = fp16(x 2^s - hi): `parts` [2, batch, N, ld] as they are, `parts_t`
  // the same transposed (either may be nullptr), columns N .. ld zero: the split operands of ContractArgs.
  // Where unscale is not null it also writes unscale[p] = 2^-s_p 2^-s'_p, s'_p from bound_other[p]: the
  // products' z_scale per plane.
  int64_t plane_stride, row_stride, ld;
  const float* bound;
  const float* bound_other;
  float* unscale;
  void* parts;
  void* parts_t;
  Precision precision;  // of the backward's fp32 products (contract_backward's kernels apply per precision)
  // position_gemm: gemm_out [gemm_m, gemm_n] fp32 (row pitch gemm_ld_out) = gemm_rows [gemm_m, gemm_k] fp32 (row
  // pitch gemm_ld, contiguous in k) x W^T + gemm_bias ([gemm_n] fp32, or nullptr). split_weight reads W
  // [gemm_n, gemm_k] fp32 at gemm_w with strides gemm_w_sn, gemm_w_sk and writes gemm_w_split, the kernel's own
  // layout of gemm_w_split_floats floats (position_gemm_split_floats); rows_gemm reads gemm_w_split.
  const float* gemm_rows;
  int64_t gemm_ld, gemm_m, gemm_k, gemm_n;
  const float* gemm_w;
  int64_t gemm_w_sn, gemm_w_sk;
  float* gemm_w_split;
  int64_t gemm_w_split_floats;
  const float* gemm_bias;
  float* gemm_out;
  int64_t gemm_ld_out;
  // rows_grad: gemm_out [gemm_n, gemm_k] = gemm_d^T gemm_rows summed over the gemm_m positions: gemm_d [gemm_m,
  // gemm_n] fp32 (row pitch gemm_ld_d, contiguous in n); gemm_partials, gemm_partial_floats floats of scratch
  // (position_gemm_grad_partial_floats), the kernel's per-chunk sums.
  const float* gemm_d;
  int64_t gemm_ld_d;
  float* gemm_partials;
  int64_t gemm_partial_floats;
  cudaStream_t stream;
};

// The rows of a batch element's planes and of its positions (BackwardArgs::block_rows), a plane's positions
// (rows x N), and the positions P.
constexpr int64_t pair_rows(const BackwardArgs& args) { return args.block_rows > 0 ? args.block_rows : args.n; }
constexpr int64_t plane_positions(const BackwardArgs& args) { return pair_rows(args) * args.n; }
constexpr int64_t positions(const BackwardArgs& args) { return args.batch * plane_positions(args); }

// The floats a position_gemm kernel's split weight takes for a weight [n, k] (BackwardArgs::gemm_w_split): its
// hi and lo tf32 parts, n padded to 128 rows and k to 64 columns (zeros).
inline int64_t position_gemm_split_floats(int64_t n, int64_t k) { return 2 * ((n + 127) / 128 * 128) * ((k + 63) / 64 * 64); }
// Positions per chunk of a position_gemm kernel's rows_grad: each chunk's sums are a partial, added in chunk order.
constexpr int64_t kPositionGemmGradChunk = 8192;
// The chunks of rows_grad over `positions`.
inline int64_t position_gemm_grad_chunks(int64_t positions) {
  return (positions + kPositionGemmGradChunk - 1) / kPositionGemmGradChunk;
}
// The scratch floats a position_gemm kernel's rows_grad takes for out [n, k] over `positions` (BackwardArgs::
// gemm_partials): [chunk][n][k] per-chunk sums.
inline int64_t position_gemm_grad_partial_floats(int64_t positions, int64_t n, int64_t k) {
  return position_gemm_grad_chunks(positions) * n * k;
}

// Rows of the partial sums of the backward passes that sum over positions (BackwardArgs::sums): the most
// blocks such a pass runs (the rows passes: 512 blocks, the same bits on every GPU; the persistent wgmma passes:
// one block per SM, persistent_sum_blocks, the same bits on every GPU of one SM count).
constexpr int64_t kBackwardSumRows = 512;

// One kernel of the registry (registry.def), or a compiled kernel the registry does not name.
struct KernelInfo {
  Role role;
  const char* name;
  int rank;             // place in the role's default order (1 first); 0: only when chosen by name
  bool torch;           // a PyTorch baseline, run by the caller (no kernel of ours)
  bool in_registry;     // false: compiled and registered by a kernel file, but not in registry.def
  bool built;           // a kernel file of this library implements it (torch baselines: false)
  const char* applies;  // when it applies (registry.def's words)
  const char* summary;  // what it is
};

enum class PlanStatus : int {
  ok = 0,
  no_kernel = 1,      // nothing in a role's default order takes the call
  not_applies = 2,    // a kernel chosen by name does not take the call
  invalid = 3,        // bad arguments (an unknown name, inconsistent sizes)
};

// The training backward's parameters in fp32 and its Linears folded with their LayerNorms (launch_param_fold,
// param_fold.cu): per Linear (one of the in-projection's four, out_proj, out_gate: [rows, cols], weight W and
// bias b each in its own dtype) W and b in fp32, and where it reads a LayerNorm (norm >= 0) W_f = W diag(ln_w)
// and b_f = b + W ln_b; per LayerNorm its weight and bias in fp32. The same launch zeroes `zero` (the passes'
// partial-sum rows). Outputs contiguous fp32; each b_f's sum in a fixed order.
struct ParamFoldArgs {
  static constexpr int kMaxLinears = 6, kMaxNorms = 2;
  struct Linear {
    const void* w;  // [rows, cols], w_dtype
    const void* b;  // [rows], b_dtype
    Dtype w_dtype, b_dtype;
    float* w_f32;     // [rows, cols]
    float* b_f32;     // [rows]
    float* w_folded;  // [rows, cols] (written where norm >= 0)
    float* b_folded;  // [rows] (likewise)
    int64_t rows, cols;
    int norm;  // the LayerNorm it reads (an index into norm), or -1
  };
  struct Norm {
    const void* w;
    const void* b;
    Dtype w_dtype, b_dtype;
    float* w_f32;
    float* b_f32;
    int64_t cols;
  };
  Linear lin[kMaxLinears];
  Norm norm[kMaxNorms];
  int linears, norms;
  float* zero;
  int64_t zero_count;
  cudaStream_t stream;
};
cudaError_t launch_param_fold(const ParamFoldArgs& args);

// The forward's kernel-layout weights for the 16-bit modes (launch_weight_prep, weight_prep.cu): trimul_inline's
// prepare_weights list from the 16 parameters (_PARAM_PATHS order, each in its own dtype; nullptr: a Linear's
// absent bias, zeros) in one launch. Outputs contiguous: the LayerNorm_in vectors and out_gate's bias in fp32 [C];
// w_in [2 rows_ab, c_pad] and b_in (fp32) [2 rows_ab], a's then b's proj/gate rows in groups of 16; w_gate
// [rows_c, c_pad]; w_out [rows_c, h_pad] (out_proj diag(LayerNorm_out's weight)) and b_out (fp32) [C]; w_rows
// [2 rows_ab, c_pad + 64] (the register-row input kernels' weights); optionally (x_hat_w_gate not null) out_gate
// folded with LayerNorm_in, [rows_c, c_pad] and its bias (fp32) [C]. Matrices in the operand type (f16, else
// bf16). The folded biases sum in fp64 in a fixed order.
struct WeightPrepArgs {
  const void* params[16];
  Dtype dtypes[16];
  int64_t c, h, c_pad, h_pad, rows_ab, rows_c;
  bool f16;
  float *ln_w, *ln_b, *b_in, *b_gate, *b_out, *x_hat_b_gate;
  void *w_in, *w_gate, *w_out, *w_rows, *x_hat_w_gate;
  cudaStream_t stream;
};
cudaError_t launch_weight_prep(const WeightPrepArgs& args);

// The training backward's parameter gradients from its folded GEMMs (launch_param_grads, param_grads.cu): per
// segment (a Linear, or one of the in-projection's four, [rows, cols]) with g the gradient of its folded weight
// and s its bias gradient, d W = g diag(ln_w) + s ln_b^T (g itself where no LayerNorm is folded in) and
// d bias = s; per LayerNorm d ln_w = sum_r W[r] * g[r] and d ln_b = s^T W over the segments folded with it.
// s is given, or (partial_rows > 0) summed here from the passes' per-block partials and written to s.
// Every tensor contiguous but the partials (row stride partial_stride); the inputs fp32, the gradients written
// in `dtype`; sums in a fixed order.
struct ParamGradArgs {
  static constexpr int kMaxSegments = 6, kMaxNorms = 2;
  struct Segment {
    const float* g;          // [rows, cols]
    float* s;                // [rows]: read, or written where partial_rows > 0
    const float* partials;   // [partial_rows, >= rows], row stride partial_stride
    int64_t partial_rows, partial_stride;
    const float* weight;  // [rows, cols]: the parameter (read where norm >= 0)
    void* d_weight;       // [rows, cols]
    void* d_bias;         // [rows]
    int64_t rows, cols;
    int norm;             // the LayerNorm folded into it (an index into norm), or -1
  };
  struct Norm {
    const float* ln_w;
    const float* ln_b;
    void* d_ln_w;
    void* d_ln_b;
    int64_t cols;
  };
  Segment seg[kMaxSegments];
  Norm norm[kMaxNorms];
  int segments, norms;
  Dtype dtype;
  cudaStream_t stream;
};
cudaError_t launch_param_grads(const ParamGradArgs& args);

// What the kernel library exports (trimul_kernel_library). kernels: the registry's entries in
// registry.def order, then any compiled kernel the registry lacks. `chosen` names one kernel per Role
// (nullptr or "": that role's default order). Messages go into message[0, size).
struct KernelLibrary {
  uint32_t abi;  // kKernelAbi
  uint32_t forward_args_bytes, contract_args_bytes, forward_plan_bytes;
  int kernel_count;
  const KernelInfo* kernels;
  // Chooses each role's kernel and the contraction's operand format for these args (pointers to
  // the work buffers are not read), filling plan and args' planned fields (ld, ldz, z_dtype,
  // small_offset, ab_f16; z a placeholder where plan->z_buffer).
  PlanStatus (*plan_forward)(ForwardArgs* args, const char* const* chosen, ForwardPlan* plan, char* message,
                             int size);
  // Launches the planned kernel of `role` on args' buffers (a contraction of plan->z_buffer false:
  // nothing, the output pass contracts).
  cudaError_t (*run_step)(Role role, const ForwardPlan* plan, const ForwardArgs* args, char* message, int size);
  // A standalone contraction's kernel (chosen, else the default order).
  PlanStatus (*plan_contraction)(const ContractArgs* args, const char* chosen, int* kernel, char* message,
                                 int size);
  cudaError_t (*run_contraction)(int kernel, const ContractArgs* args);
  // Whether the fused passes take pair_dim c and hidden h in this mode for pairs of this dtype on the
  // current GPU (some kernel of each pass role's default order applies).
  bool (*fused_takes)(int64_t c, int64_t h, Mode mode, Dtype pair_dtype);
  // A backward role's kernel for these args (chosen, else the role's default order): its index, or -1
  // where the first that takes them is a torch baseline (the caller's PyTorch passes).
  PlanStatus (*plan_backward)(Role role, const BackwardArgs* args, const char* chosen, int* kernel, char* message,
                              int size);
  cudaError_t (*run_backward)(int kernel, const BackwardArgs* args);
  uint32_t backward_args_bytes;
  // The fp32 modes' F16x3Scale factors for a mask that is not bool (launch_mask_scales).
  cudaError_t (*mask_scales)(const void* mask, MaskKind kind, int64_t count, const float* scales, float* out,
                             unsigned int* work, cudaStream_t stream);
  // The training backward's parameter gradients (launch_param_grads).
  cudaError_t (*param_grads)(const ParamGradArgs& args);
  // The training backward's fp32 parameters and folded Linears (launch_param_fold).
  cudaError_t (*param_fold)(const ParamFoldArgs& args);
  // The forward's kernel-layout weights for the 16-bit modes (launch_weight_prep).
  cudaError_t (*weight_prep)(const WeightPrepArgs& args);
};

// out = the kF16x3Scales factors `scales` with max(1, max|mask|) folded in: its power of two at or above
// (shift) divides kAbUp and shift^2 multiplies kZDown (|a| and |b| grow with the mask). One launch, no host
// synchronisation; `work` is two words of device scratch (zeroed by the call, on `stream`).
cudaError_t launch_mask_scales(const void* mask, MaskKind kind, int64_t count, const float* scales, float* out,
                               unsigned int* work, cudaStream_t stream);

// Changes whenever a struct above changes, so a library and an extension built from different
// versions of this file refuse each other.
constexpr uint32_t kKernelAbi = 18;

}  // namespace trimul

extern "C" const trimul::KernelLibrary* trimul_kernel_library();
