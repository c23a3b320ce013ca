// api.cuh — the plain C++ contract between the kernels (compiled by nvcc) and bindings.cpp
// (compiled by the host compiler). No device code and no torch headers here, so both sides can
// include it and the kernel translation unit stays free of heavy torch headers.
#pragma once
#include <cstdint>
#include <cstring>
#include <cuda_runtime_api.h>

namespace trimul {

enum class Dtype : int { f32 = 0, bf16 = 1, f16 = 2 };

// How fp32 operands may be rounded inside a contraction (PyTorch's matmul precision names).
// bf16/fp16 operands are used as they are, whatever this says.
enum class Precision : int { highest = 0, high = 1, medium = 2 };

// z[batch, i, j] = sum_k a[batch, i, k] * b[batch, j, k], row-major with row strides lda (a and
// b) and ldz. The module lays a and b out as [B*H, N, ld] so both directions of the triangle
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
  // 3xTF32 from split operands: a and b hold `batch` planes of TF32 values ("big") followed by
  // `batch` planes of the remainders (value - big, TF32-rounded), and z = big.big + big.small +
  // small.big. Only wgmma_tma takes it (the fused forward asks no other kernel).
  bool split;
  // fp16 operands scaled by a power of two (ForwardArgs::ab_f16, split or not): the factor that
  // takes the products back. Only wgmma_tma takes them.
  const float* z_scale;
  cudaStream_t stream;
};

// How the fused passes multiply: the operand type in shared memory and the mma flavour.
enum class Mode : int { bf16 = 0, f16 = 1, tf32 = 2, tf32x3 = 3 };

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

// How the 16-bit wgmma input kernel's stagers take their rows (ForwardArgs::input_staging).
enum class InputStaging { kAuto, kRounds, kStream };

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
  int64_t batch, n, c, h;
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
  // The 16-bit modes' input kernel with the rows in registers (input_pass::wgmma_rs): w_in with
  // LayerNorm_in's weight folded in (W diag(w_ln)) and k permuted within each 16-channel block (k =
  // 16s + 8hh + 2t + e holds channel 16s + 4t + 2hh + e: a thread's register fragment is 4 adjacent
  // channels of a row per k-step), then 64 columns more: b_in + W b_ln (fp64) as a 16-bit part (column
  // c_pad) and remainder (c_pad + 1), zeros after; nullptr in the fp32 modes.
  const void* w_in_rows;   // [2 * rows_ab, c_pad + 64]
  const void* w_gate;     // [round_up(C, 128), c_pad] out_gate
  const float* b_gate;    // [C]
  const void* w_out;      // [round_up(C, 128), h_pad] out_proj
  const float* b_out;     // [C]
  int64_t c_pad, h_pad;   // round_up(C, 32), round_up(H, 32)
  // "highest" in the wgmma passes multiplies fp16x3: hi.hi + hi.lo + lo.hi of fp16 splits (about
  // 3xTF32's accuracy at the fp16 tensor-core rate). Each weight matrix, times a power of two 2^t,
  // as [rows, 2 * round_up(k_pad, 64)] fp16 with per row [hi | lo]: each hi k-tile multiplies the
  // rows' hi and lo k-tiles, each lo k-tile their hi; nullptr where not prepared (other modes:
  // the wgmma passes then decline "highest"). The rows are scaled by powers of two as well, so that
  // both operands' largest magnitudes sit near 2^12: no fp16 value overflows and remainders keep
  // their bits (F16x3Scale lists the factors; out_gate's rows are scaled per position).
  const void* w_in_f16x3;    // [2 * rows_ab, 2 * round_up(c_pad, 64)]
  const void* w_gate_f16x3;  // [round_up(C, 128), 2 * round_up(c_pad, 64)]
  const void* w_out_f16x3;   // [round_up(C, 128), 2 * round_up(h_pad, 64)]
  const float* f16x3_scales; // [kF16x3Scales]
  // Work buffers: a_t, b_t [B*H, N, ld] in the operand type; z [B*H, N, ldz] in z_dtype (z_dtype_for(mode)). With
  // z == nullptr the output pass computes z itself from a_t and b_t (small N: one launch fewer).
  void* a_t;
  void* b_t;
  int64_t ld;
  // tf32x3 with a separate split-operand contraction: elements from a value's TF32 part in a_t /
  // b_t to its remainder (the remainder planes follow the big ones). 0: values stored whole.
  int64_t small_offset;
  // fp32 modes: a_t / b_t hold fp16 values of a, b times 2^s_ab ("highest", with small_offset: fp16
  // parts and remainders) instead of TF32 ones, for an fp16 (x3) contraction (ContractArgs::z_scale).
  // (F16x3Scale: s_ab puts a bound on |a|, |b| from the parameters and a mask of at most 1 near 2^12.)
  bool ab_f16;
  // "high" in the wgmma passes as scaled fp16 (one plane, one product: TF32's 11-bit significand at
  // the fp16 rate), as "highest" does with two: the default on Hopper; TRIMUL_HIGH_ARITH=tf32 keeps the
  // native TF32 kernels (NOTES v14).
  bool high_f16;
  void* z;
  Dtype z_dtype;
  int64_t ldz;
  // Shared memory the output pass's in-pass contraction (z == nullptr) stages a/b rows in; set by
  // the launch code (0: it reads them straight from global memory).
  int64_t contract_stage_bytes;
  bool gate_rows_first;  // (set by the output pass's launch: the in-pass contraction's z has its own region)
  void* out;              // [B, N, N, C] contiguous, pair_dtype
  cudaStream_t stream;
  // Measuring knobs, read from the environment by the bindings at each forward (known_pass_kernel,
  // parse_pass_plan): the kernel each fused pass is pinned to (TRIMUL_INPUT_PASS / TRIMUL_OUTPUT_PASS;
  // nullptr: the default order), and the wgmma input kernel's row buffers, weight stages and
  // positions per tile (TRIMUL_INPUT_PLAN; 0: its own choice; where they do not fit it declines the
  // problem). dependent_output_launch (the default on Hopper and later; TRIMUL_PDL=0 turns it off): the
  // output pass with the in-pass contraction (N <= 64) is launched as a programmatic dependent of the
  // input pass, so its launch and its first weight loads overlap the input pass's tail (it waits for
  // the input pass before its first read of a_t / b_t).
  const char* input_pin;
  const char* output_pin;
  int input_plan_buffers, input_plan_stages, input_plan_positions;
  bool dependent_output_launch;
  // TRIMUL_INPUT_STAGING (InputStaging): how the 16-bit wgmma input kernel's stagers take their rows:
  // round-robin row groups across tiles, each lane locating its own rows, the next group's loads in
  // flight while the current one is LayerNormed (stream), or each tile's rows in load rounds between
  // named barriers (rounds). Auto: stream at pair_dim <= 128, where it measured faster (NOTES v21).
  InputStaging input_staging;
  // TRIMUL_AB_STORE=tma|threads: how the register-row input kernels (wgmma_rs, wgmma_rs_wide) write a_t / b_t
  // from their transposing scratch: one TMA box store per part (unset: tma, NOTES v30) or the warpgroup's own
  // 16-byte stores.
  bool ab_store_tma;
};

// A fused pass's kernels by their pinning names (wgmma_rs_wide in both, wgmma_rs in the input pass only).
inline bool known_pass_kernel(const char* name, bool input_pass) {
  if (std::strcmp(name, "wgmma_rs_wide") == 0 || (input_pass && std::strcmp(name, "wgmma_rs") == 0)) return true;
  for (const char* known : {"wgmma", "resident", "streamed"})
    if (std::strcmp(known, name) == 0) return true;
  return false;
}

// "buffers,stages" or "buffers,stages,positions" (buffers 1 or 2, stages 2..8, positions 64 or 128)
// into its numbers (positions 0 where not given); false for anything else.
inline bool parse_pass_plan(const char* text, int* buffers, int* stages, int* positions) {
  if (text[0] < '1' || text[0] > '2' || text[1] != ',' || text[2] < '2' || text[2] > '8') return false;
  const char* rest = text + 3;
  if (rest[0] == '\0') *positions = 0;
  else if (std::strcmp(rest, ",64") == 0) *positions = 64;
  else if (std::strcmp(rest, ",128") == 0) *positions = 128;
  else return false;
  *buffers = text[0] - '0';
  *stages = text[2] - '0';
  return true;
}

// The fused passes (kernels/forward_*.cu). Each returns cudaErrorNotSupported for a shape it
// cannot take (the module then runs its unfused path), else the launch status.
cudaError_t launch_input_pass(const ForwardArgs& args);
cudaError_t launch_output_pass(const ForwardArgs& args);
// Bytes of shared memory each pass would use for these sizes (0: unsupported), for the host to
// decide whether the fused path applies.
int64_t input_pass_smem(const ForwardArgs& args);
int64_t output_pass_smem(const ForwardArgs& args);
// Largest N for which the output pass computes z itself (z == nullptr).
constexpr int64_t kFusedContractionMaxN = 64;

using ContractFn = cudaError_t (*)(const ContractArgs&);

// Each contraction kernel file registers its launcher under its variant name with
// TRIMUL_REGISTER_CONTRACTION; bindings.cpp finds it by that name.
bool register_contraction(const char* name, ContractFn fn);
ContractFn find_contraction(const char* name);
// Writes up to `capacity` registered names into `names`; returns how many are registered.
int list_contractions(const char** names, int capacity);
// Whether the wgmma_tma kernel can run here (sm_90a build, Hopper GPU, tensor-map encoder): the
// fused forward then lays "highest" operands out split (ContractArgs::split) for it.
bool wgmma_tma_available();

}  // namespace trimul

#define TRIMUL_REGISTER_CONTRACTION(NAME, FN) \
  static const bool trimul_registered_contraction_##NAME = ::trimul::register_contraction(#NAME, FN)
