// bindings.cpp — the torch extension: check tensors, lay out the forward's arguments and buffers, call
// the kernel library (api.cuh: loaded at run time by attach_kernels, so an edited kernel rebuilds only
// its own file and the library, never this) on PyTorch's current stream, and check every launch. Ops
// are registered from Python (torch.library.custom_op), never with TORCH_LIBRARY here, so a rebuilt
// extension can be loaded into the same process.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "api.cuh"

namespace {

// ---- the kernel library ------------------------------------------------------------------------
const trimul::KernelLibrary* g_library = nullptr;  // the one attach_kernels loaded last

// Loads a kernel library built from kernels/*.cu (trimul_inline.py builds it) and uses it from now on.
// Libraries stay loaded: work launched from an earlier one may still be in flight.
void attach_kernels(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "trimul_inline: cannot load the kernel library ", path, ": ", dlerror());
  using Entry = const trimul::KernelLibrary* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "trimul_kernel_library"));
  TORCH_CHECK(entry != nullptr, "trimul_inline: ", path, " has no trimul_kernel_library()");
  const trimul::KernelLibrary* library = entry();
  TORCH_CHECK(library != nullptr && library->abi == trimul::kKernelAbi &&
                  library->forward_args_bytes == sizeof(trimul::ForwardArgs) &&
                  library->contract_args_bytes == sizeof(trimul::ContractArgs) &&
                  library->forward_plan_bytes == sizeof(trimul::ForwardPlan) &&
                  library->backward_args_bytes == sizeof(trimul::BackwardArgs),
              "trimul_inline: the kernel library ", path, " was built from another api.cuh than this extension");
  g_library = library;
}

const trimul::KernelLibrary& library() {
  TORCH_CHECK(g_library != nullptr, "trimul_inline: no kernel library attached (trimul_inline.load_extension does it)");
  return *g_library;
}

const char* const kRoleNames[trimul::kRoles] = {"input",           "contract",          "output",
                                                "output_backward", "contract_backward", "input_backward",
                                                "position_gemm"};

// (role, name, rank, torch, in_registry, built, applies, summary) of every kernel the library knows.
std::vector<py::tuple> kernels() {
  const trimul::KernelLibrary& lib = library();
  std::vector<py::tuple> out;
  for (int i = 0; i < lib.kernel_count; ++i) {
    const trimul::KernelInfo& k = lib.kernels[i];
    out.push_back(py::make_tuple(kRoleNames[static_cast<int>(k.role)], k.name, k.rank, k.torch, k.in_registry,
                                 k.built, k.applies, k.summary));
  }
  return out;
}

const char* kernel_name(int index) { return library().kernels[index].name; }

// ---- checks --------------------------------------------------------------------------------------
// Messages format numbers with std::to_string, never through std::ostream: an extension built by the
// GPU machine's g++ crashed (SIGSEGV in ostream::_M_insert<long>) formatting an integer in a message.
std::string text(int64_t value) { return std::to_string(value); }
std::string text(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

trimul::Dtype dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return trimul::Dtype::f32;
    case at::kBFloat16: return trimul::Dtype::bf16;
    case at::kHalf: return trimul::Dtype::f16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "trimul_inline: ", what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

const char* dtype_name(trimul::Dtype dtype) {
  switch (dtype) {
    case trimul::Dtype::bf16: return "bfloat16";
    case trimul::Dtype::f16: return "float16";
    default: return "float32";
  }
}

at::ScalarType scalar_type(trimul::Dtype dtype) {
  switch (dtype) {
    case trimul::Dtype::bf16: return at::kBFloat16;
    case trimul::Dtype::f16: return at::kHalf;
    default: return at::kFloat;
  }
}

void check_launch(cudaError_t status, const std::string& what, const char* message = "") {
  TORCH_CHECK(status != cudaErrorNotSupported, "trimul_inline: ", what, " does not support these sizes/dtypes on this GPU",
              message[0] != '\0' ? " (" : "", message, message[0] != '\0' ? ")" : "");
  C10_CUDA_CHECK(status);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A plan that failed: a name or a chosen kernel that does not take the call is the caller's ValueError;
// nothing of the default order taking it is NotImplementedError (the module then runs its unfused path).
void check_plan(trimul::PlanStatus status, const char* message) {
  TORCH_CHECK_NOT_IMPLEMENTED(status != trimul::PlanStatus::no_kernel, message);
  TORCH_CHECK_VALUE(status == trimul::PlanStatus::ok, message);
}

void check_matrix_stack(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.is_cuda(), "trimul_inline: ", what, " must be a CUDA tensor");
  TORCH_CHECK_VALUE(t.dim() == 3, "trimul_inline: ", what, " must be 3-D [batch, rows, k], got ", text(t.dim()), "-D");
  TORCH_CHECK_VALUE(t.is_contiguous(), "trimul_inline: ", what, " must be contiguous");
}

// ---- the standalone contraction -----------------------------------------------------------------
// z[batch, i, j] = sum_k a[batch, i, k] * b[batch, j, k], written into z by the named kernel ("": the
// default order's first that takes these operands).
// z = a @ b^T per batch; split: a and b hold their batch's TF32 parts, then its remainders (2 x batch matrices,
// ContractArgs::split: z = part.part + part.rem + rem.part, 3xTF32 for fp32 operands).
void contract_operands(const std::string& name, const at::Tensor& a, const at::Tensor& b, at::Tensor& z,
                       int64_t precision, bool split) {
  check_matrix_stack(a, "a");
  check_matrix_stack(b, "b");
  check_matrix_stack(z, "z");
  TORCH_CHECK_VALUE(a.device() == b.device() && a.device() == z.device(),
                    "trimul_inline: a, b and z must be on one device");
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "trimul_inline: a and b dtypes differ (", a.scalar_type(),
                   " vs ", b.scalar_type(), ")");
  TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(2) == b.size(2), "trimul_inline: a ", text(a.sizes()), " and b ",
                    text(b.sizes()), " do not share batch and k");
  const int64_t batch = split ? a.size(0) / 2 : a.size(0);
  TORCH_CHECK_VALUE(!split || (a.size(0) % 2 == 0 && a.scalar_type() == at::kFloat),
                    "trimul_inline: split operands are float32 parts then remainders (an even count), got ",
                    a.scalar_type(), " ", text(a.sizes()));
  TORCH_CHECK_VALUE(z.size(0) == batch && z.size(1) == a.size(1) && z.size(2) == b.size(1), "trimul_inline: z ",
                    text(z.sizes()), " must be [batch, a rows, b rows]", split ? " (batch: half of a's count)" : "");
  TORCH_CHECK_VALUE(precision >= 0 && precision <= 2, "trimul_inline: precision code ", text(precision),
                    " is not 0 (highest), 1 (high) or 2 (medium)");
  const c10::cuda::CUDAGuard guard(a.device());
  // Kernels read whole 64-byte k-slabs: give them rows padded with zeros to a multiple of 32.
  const int64_t k = a.size(2), k_pad = round_up(std::max<int64_t>(k, 1), 32);
  auto padded = [&](const at::Tensor& t) {
    if (k_pad != k) return at::constant_pad_nd(t, {0, k_pad - k});
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
  };
  const at::Tensor a_pad = padded(a), b_pad = padded(b);
  trimul::ContractArgs args{};
  args.a = a_pad.data_ptr();
  args.b = b_pad.data_ptr();
  args.z = z.data_ptr();
  args.batch = batch;
  args.m = a.size(1);
  args.n = b.size(1);
  args.k = k;
  args.lda = k_pad;
  args.ldz = z.size(2);
  args.operand = dtype_code(a, "a");
  args.out = dtype_code(z, "z");
  args.precision = static_cast<trimul::Precision>(precision);
  args.split = split;
  args.stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  char message[1024] = "";
  int kernel = -1;
  check_plan(library().plan_contraction(&args, name.c_str(), &kernel, message, sizeof(message)), message);
  check_launch(library().run_contraction(kernel, &args), std::string("contraction kernel '") + kernel_name(kernel) + "'");
}

void contract(const std::string& name, const at::Tensor& a, const at::Tensor& b, at::Tensor& z, int64_t precision) {
  contract_operands(name, a, b, z, precision, false);
}

void contract_split(const std::string& name, const at::Tensor& a, const at::Tensor& b, at::Tensor& z,
                    int64_t precision) {
  contract_operands(name, a, b, z, precision, true);
}

// ---- the fused forward --------------------------------------------------------------------------
trimul::MaskKind mask_kind(const at::Tensor& mask) {
  switch (mask.scalar_type()) {
    case at::kBool:
    case at::kByte: return trimul::MaskKind::u8;
    case at::kInt: return trimul::MaskKind::i32;
    case at::kLong: return trimul::MaskKind::i64;
    case at::kFloat: return trimul::MaskKind::f32;
    case at::kBFloat16: return trimul::MaskKind::bf16;
    case at::kHalf: return trimul::MaskKind::f16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "trimul_inline: pair_mask dtype ", mask.scalar_type(),
                   " is not supported by the fused kernels (bool, uint8, int32, int64, float32, bfloat16, float16)");
}

// What a module's call fixes besides its tensors: the kernel chosen for each role ("": the default
// order), the compute mode (trimul::Mode), the options, the LayerNorms' eps and hidden_dim. Made once per
// planned signature in Python.
struct ForwardOptions {
  std::array<std::string, trimul::kForwardRoles> kernels;
  int64_t mode;
  bool incoming, gate_normalized;
  double eps_in, eps_out;
  int64_t hidden;

  std::array<const char*, trimul::kForwardRoles> chosen() const {
    return {kernels[0].c_str(), kernels[1].c_str(), kernels[2].c_str()};
  }
};

// The forward's arguments from its tensors, no buffers yet. `weights` are the host-prepared tensors
// (trimul_inline.prepare_weights): ln_in_w, ln_in_b, w_in, b_in, w_gate, b_gate, w_out, b_out, then in
// the 16-bit modes w_in_rows, in the fp32 modes w_in_f16x3, w_gate_f16x3, w_out_f16x3, f16x3_scales.
trimul::ForwardArgs forward_args(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                                 const ForwardOptions& options) {
  TORCH_CHECK_VALUE(pair.is_cuda() && pair.dim() == 4 && pair.size(1) <= pair.size(2),
                    "trimul_inline: pair must be a CUDA tensor (B, N, N, C), or a block of its rows (B, rows, N, C)");
  TORCH_CHECK_VALUE(pair.size(1) == pair.size(2) || !options.incoming,
                    "trimul_inline: a block of rows (B, rows, N, C) takes the passes in the outgoing layout (options "
                    "incoming false)");
  TORCH_CHECK_VALUE(pair.stride(3) == 1, "trimul_inline: pair's channel stride must be 1");
  TORCH_CHECK_VALUE(mask.device() == pair.device() && mask.dim() == 3 && mask.sizes().equals(pair.sizes().slice(0, 3)),
                    "trimul_inline: mask must be (B, N, N) on pair's device");
  TORCH_CHECK_VALUE(options.mode >= 0 && options.mode <= 3, "trimul_inline: mode code ", text(options.mode));
  const auto mode = static_cast<trimul::Mode>(options.mode);
  const bool fp32_mode = mode == trimul::Mode::high || mode == trimul::Mode::highest;
  TORCH_CHECK_VALUE(weights.size() == (fp32_mode ? 12u : 9u), "trimul_inline: forward takes ", fp32_mode ? "12" : "9",
                    " prepared weights in this mode, got ", text(static_cast<int64_t>(weights.size())));
  for (const auto& w : weights)
    TORCH_CHECK_VALUE(w.device() == pair.device() && w.is_contiguous() && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
                      "trimul_inline: prepared weights must be contiguous, 16-byte aligned, on pair's device");
  const int64_t c = pair.size(3), hidden = options.hidden;
  trimul::ForwardArgs args{};
  args.pair = pair.data_ptr();
  args.pair_dtype = dtype_code(pair, "pair");
  args.pair_sb = pair.stride(0);
  args.pair_sr = pair.stride(1);
  args.pair_sc = pair.stride(2);
  args.mask = mask.data_ptr();
  args.mask_kind = mask_kind(mask);
  args.mask_sb = mask.stride(0);
  args.mask_sr = mask.stride(1);
  args.mask_sc = mask.stride(2);
  args.mask_at_most_one = mask.scalar_type() == at::kBool;
  args.batch = pair.size(0);
  args.n = pair.size(2);
  args.rows = pair.size(1);
  args.c = c;
  args.h = hidden;
  args.incoming = options.incoming;
  args.gate_normalized = options.gate_normalized;
  args.mode = mode;
  args.eps_in = static_cast<float>(options.eps_in);
  args.eps_out = static_cast<float>(options.eps_out);
  args.ln_in_w = weights[0].data_ptr<float>();
  args.ln_in_b = weights[1].data_ptr<float>();
  args.w_in = weights[2].data_ptr();
  args.b_in = weights[3].data_ptr<float>();
  args.rows_ab = weights[2].size(0) / 2;
  args.w_gate = weights[4].data_ptr();
  args.b_gate = weights[5].data_ptr<float>();
  args.w_out = weights[6].data_ptr();
  args.b_out = weights[7].data_ptr<float>();
  args.c_pad = weights[2].size(1);
  args.h_pad = weights[6].size(1);
  TORCH_CHECK_VALUE(args.c_pad == round_up(c, 32) && args.h_pad == round_up(hidden, 32) &&
                        args.rows_ab == round_up(2 * hidden, 128) && weights[4].size(1) == args.c_pad,
                    "trimul_inline: prepared weights do not match pair_dim ", text(c), " / hidden ", text(hidden));
  if (!fp32_mode) {
    TORCH_CHECK_VALUE(weights[8].scalar_type() == weights[2].scalar_type() && weights[8].dim() == 2 &&
                          weights[8].size(0) == weights[2].size(0) && weights[8].size(1) == weights[2].size(1) + 64,
                      "trimul_inline: prepared register-row weights do not match pair_dim ", text(c), " / hidden ",
                      text(hidden));
    args.w_in_rows = weights[8].data_ptr();
  } else {
    const auto is_f16x3 = [](const at::Tensor& w, int64_t rows, int64_t k_pad) {
      return w.scalar_type() == at::kHalf && w.dim() == 2 && w.size(0) == rows && w.size(1) == 2 * round_up(k_pad, 64);
    };
    const int64_t rows_c = round_up(c, 128);
    TORCH_CHECK_VALUE(is_f16x3(weights[8], 2 * args.rows_ab, args.c_pad) && is_f16x3(weights[9], rows_c, args.c_pad) &&
                          is_f16x3(weights[10], rows_c, args.h_pad) && weights[11].scalar_type() == at::kFloat &&
                          weights[11].numel() == trimul::kF16x3Scales,
                      "trimul_inline: prepared fp16x3 weights do not match pair_dim ", text(c), " / hidden ",
                      text(hidden));
    args.w_in_f16x3 = weights[8].data_ptr();
    args.w_gate_f16x3 = weights[9].data_ptr();
    args.w_out_f16x3 = weights[10].data_ptr();
    args.f16x3_scales = weights[11].data_ptr<float>();
  }
  args.stream = c10::cuda::getCurrentCUDAStream(pair.device().index()).stream();
  return args;
}

// A call's arguments and plan: which kernel takes each role, and the buffers they need.
struct Planned {
  trimul::ForwardArgs args;
  trimul::ForwardPlan plan;
  at::Tensor mask_scales;  // the fp32 modes' scales with a non-bool mask's bound folded in (scales_for_mask)
};

// The fp32 modes' F16x3Scale factors for a mask that is not bool: |a| and |b| grow with max|mask| past 1, so
// the contraction operands' scale 2^s_ab (kAbUp) drops, and its way back (kZDown) grows, by the power of two at
// or above max(1, max|mask|). Computed on the device (no synchronisation, one launch: mask_bound.cu), so every
// mask takes the scaled fp16 operands a bool mask does, at the same accuracy. (The result holds two words of the
// kernel's scratch after the factors.)
at::Tensor scales_for_mask(const at::Tensor& scales, const at::Tensor& mask) {
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                        scales.numel() == trimul::kF16x3Scales,
                    "trimul_inline: the prepared weights' f16x3 scales must be ", trimul::kF16x3Scales, " fp32 values");
  const at::Tensor rows = mask.contiguous();
  at::Tensor out = at::empty({trimul::kF16x3Scales + 2}, scales.options());  // (+2 words: the kernel's scratch)
  float* factors = out.data_ptr<float>();
  check_launch(library().mask_scales(rows.data_ptr(), mask_kind(rows), rows.numel(), scales.data_ptr<float>(),
                                     factors, reinterpret_cast<unsigned int*>(factors + trimul::kF16x3Scales),
                                     c10::cuda::getCurrentCUDAStream(mask.device().index()).stream()),
               "the mask's bound (mask_scales)");
  return out;
}

// gate_rows: ForwardArgs::gate_rows (the output pass's; planned with it, only a kernel reading them takes the
// output role).
Planned plan_call(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                  const ForwardOptions& options, const void* gate_rows = nullptr) {
  Planned planned{forward_args(pair, mask, weights, options), {}, {}};
  planned.args.gate_rows = gate_rows;
  if (planned.args.f16x3_scales != nullptr && !planned.args.mask_at_most_one && mask.numel() > 0) {
    planned.mask_scales = scales_for_mask(weights[11], mask);
    planned.args.f16x3_scales = planned.mask_scales.data_ptr<float>();
    planned.args.mask_at_most_one = true;
  }
  char message[1024] = "";
  const auto chosen = options.chosen();
  check_plan(library().plan_forward(&planned.args, chosen.data(), &planned.plan, message, sizeof(message)), message);
  return planned;
}

// (arrays, not vectors: no heap allocation for a shape on every forward)
// (rows: pair_rows, N but for a block of rows)
std::array<int64_t, 4> ab_shape(const Planned& p) { return {2, p.plan.ab_planes, p.args.rows, p.args.ld}; }
std::array<int64_t, 3> z_shape(const Planned& p) { return {p.args.batch * p.args.h, p.args.rows, p.args.ldz}; }
std::array<int64_t, 2> x_hat_shape(const Planned& p) { return {p.args.batch * p.args.rows * p.args.n, p.args.c}; }

// The one-call forward and the contraction step multiply square planes: a block of rows takes the passes alone.
void check_square(const Planned& p, const char* what) {
  TORCH_CHECK_VALUE(p.args.rows == p.args.n, "trimul_inline: ", what, " takes the whole pair (B, N, N, C), not a "
                    "block of its rows (", text(p.args.rows), " of ", text(p.args.n), ")");
}

// A caller's buffer for a step: the plan's shape and dtype, contiguous, on pair's device, 16-byte aligned
// (the kernels' vector accesses and tensor maps).
void check_buffer(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, const at::Tensor& pair,
                  const char* what) {
  TORCH_CHECK_VALUE(t.device() == pair.device() && t.is_contiguous() && t.scalar_type() == dtype &&
                        t.sizes().equals(shape) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                    "trimul_inline: ", what, " must be a contiguous, 16-byte aligned ", dtype, " tensor of shape ",
                    text(shape), " on pair's device (forward_plan says), got ", t.scalar_type(), " ",
                    text(t.sizes()));
}

// The steps, each on the caller's buffers (forward_plan gives their shapes and dtypes): the input pass
// writes ab ([2, planes, N, ld]: a_t, then b_t), the contraction z from ab, the output pass `out` from z
// (or from ab where the output pass contracts: plan "z_shape" None).
void set_ab(Planned& p, const at::Tensor& ab) {
  p.args.a_t = ab.data_ptr();
  p.args.b_t = static_cast<char*>(ab.data_ptr()) + ab.stride(0) * ab.element_size();
}

void run(const Planned& p, trimul::Role role) {
  char message[512] = "";
  const cudaError_t status = library().run_step(role, &p.plan, &p.args, message, sizeof(message));
  check_launch(status, std::string("the ") + kRoleNames[static_cast<int>(role)] + " kernel '" +
                           kernel_name(p.plan.kernels[static_cast<int>(role)]) + "'",
               message);
}

// b: b's planes in a buffer of their own (ab then a's alone).
void run_input(Planned& p, const at::Tensor& ab, const c10::optional<at::Tensor>& b = c10::nullopt) {
  set_ab(p, ab);
  if (b.has_value()) p.args.b_t = b->data_ptr();
  run(p, trimul::Role::input);
}

// z = a b^T by torch.bmm written straight into z's rows (cuBLAS takes their row stride as its ldc). z has a's
// dtype, or fp32 for 16-bit a (z_dtype_for's fp16 mode): then bmm's out_dtype keeps cuBLAS's fp32 sums, as the
// kernels' fp32 z does.
void torch_contract_into(at::Tensor z, const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor b_t = b.transpose(1, 2);
  if (z.scalar_type() == a.scalar_type()) {
    at::bmm_out(z, a, b_t);
  } else {
    at::bmm_out(z, a, b_t, z.scalar_type());
  }
}

void run_contraction(Planned& p, const at::Tensor& ab, const at::Tensor& z) {
  if (!p.plan.z_buffer) return;
  set_ab(p, ab);
  if (p.plan.torch_contraction) {  // cuBLAS on the same buffers, a baseline
    torch_contract_into(z.narrow(2, 0, p.args.n), ab[0], ab[1]);
    return;
  }
  p.args.z = z.data_ptr();
  run(p, trimul::Role::contract);
}

void run_output(Planned& p, const at::Tensor& ab, const c10::optional<at::Tensor>& z, const at::Tensor& out) {
  p.args.z = p.plan.z_buffer ? z->data_ptr() : nullptr;
  if (!p.plan.z_buffer) set_ab(p, ab);
  p.args.out = out.data_ptr();
  run(p, trimul::Role::output);
}

at::Tensor new_out(const at::Tensor& pair) {
  return at::empty_like(pair, pair.options().memory_format(at::MemoryFormat::Contiguous));
}

// The output step's plan with the gate on x_hat as a raw gate (gate_weights: prepare_weights' list with out_gate
// folded with LayerNorm_in's affine, trimul_inline._x_hat_gate_weights), where forward() takes that path: the
// normalized gate, the output role not chosen by name, an input kernel that writes x_hat, a z buffer, and an
// output kernel of the default order that reads gate rows which is not the normalized gate's own (where one
// kernel does both, its in-register LayerNorm costs less than writing x_hat: bench/NOTES.md). Else none.
c10::optional<Planned> gate_rows_plan(const Planned& p, const at::Tensor& pair, const at::Tensor& mask,
                                      const std::vector<at::Tensor>& gate_weights, const ForwardOptions& options) {
  const int output = static_cast<int>(trimul::Role::output);
  if (!options.gate_normalized || p.plan.chosen[output] || !p.plan.x_hat_rows || !p.plan.output_gate_rows ||
      !p.plan.z_buffer)
    return c10::nullopt;
  ForwardOptions raw = options;
  raw.gate_normalized = false;
  // (a placeholder for the rows while planning: applies() tests presence and alignment only)
  Planned q = plan_call(pair, mask, gate_weights, raw, reinterpret_cast<const void*>(uintptr_t(1) << 12));
  if (q.plan.kernels[output] == p.plan.kernels[output] || !q.plan.z_buffer) return c10::nullopt;
  return q;
}

// The whole forward in one call: input pass -> contraction -> output pass. gate_weights (16-bit-product modes,
// the normalized gate): out_gate folded with LayerNorm_in's affine, for the gate on x_hat where gate_rows_plan
// takes it (x_hat then written by the input pass, [B*N*N, C] bf16 more memory until the output pass).
at::Tensor forward(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                   const ForwardOptions& options, const c10::optional<std::vector<at::Tensor>>& gate_weights) {
  const c10::cuda::CUDAGuard guard(pair.device());
  Planned p = plan_call(pair, mask, weights, options);
  check_square(p, "forward");
  if (p.args.batch == 0 || p.args.n == 0) return new_out(pair);
  c10::optional<Planned> gated =
      gate_weights.has_value() ? gate_rows_plan(p, pair, mask, *gate_weights, options) : c10::nullopt;
  p.args.output_follows_input = true;  // (one call: nothing runs between the passes)
  const auto options_for = [&](trimul::Dtype dtype) { return pair.options().dtype(scalar_type(dtype)); };
  // a_t and b_t in one allocation (a small forward's host time is mostly per-call work like each at::empty)
  at::Tensor ab = at::empty(ab_shape(p), options_for(p.plan.ab_dtype));
  at::Tensor x_hat;
  if (gated.has_value()) {
    x_hat = at::empty(x_hat_shape(p), pair.options().dtype(at::kBFloat16));
    p.args.x_hat = x_hat.data_ptr();
    gated->args.gate_rows = x_hat.data_ptr();
  }
  run_input(p, ab);
  if (!p.plan.z_buffer) {
    at::Tensor out = new_out(pair);
    run_output(p, ab, c10::nullopt, out);
    return out;
  }
  at::Tensor z = at::empty(z_shape(p), options_for(p.args.z_dtype));
  run_contraction(p, ab, z);
  ab.reset();  // back to the allocator, so `out` can reuse its memory (peak: z + max(a+b, out), + x_hat)
  at::Tensor out = new_out(pair);
  run_output(gated.has_value() ? *gated : p, at::Tensor(), z, out);
  return out;
}

// The plan of a call: each role's kernel and the buffers the steps take (dtypes by torch name).
py::dict forward_plan(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                      const ForwardOptions& options) {
  const c10::cuda::CUDAGuard guard(pair.device());
  const Planned p = plan_call(pair, mask, weights, options);
  py::dict d;
  for (int r = 0; r < trimul::kForwardRoles; ++r) d[kRoleNames[r]] = kernel_name(p.plan.kernels[r]);
  d["ab_shape"] = py::cast(ab_shape(p));
  d["ab_dtype"] = dtype_name(p.plan.ab_dtype);
  if (p.plan.z_buffer) {
    d["z_shape"] = py::cast(z_shape(p));
    d["z_dtype"] = dtype_name(p.args.z_dtype);
  } else {
    d["z_shape"] = py::none();
    d["z_dtype"] = py::none();
  }
  // (training: the input kernel can also write LayerNorm_in's rows for the backward, bf16 [B*N*N, C])
  d["x_hat_shape"] = p.plan.x_hat_rows ? py::cast(x_hat_shape(p)) : py::none();
  // (whether the output role's default order also takes the call with the gate on such rows: output_pass's
  // gate_rows, a raw gate with out_gate folded with LayerNorm_in's affine)
  d["gate_rows"] = p.plan.output_gate_rows;
  // (whether forward() given gate weights takes the gate on x_hat: gate_rows_plan; weights stand in for the
  // folded ones, whose shapes and dtypes they share)
  d["inference_gate_rows"] = gate_rows_plan(p, pair, mask, weights, options).has_value();
  return d;
}

Planned plan_step(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                  const ForwardOptions& options, const at::Tensor& ab) {
  Planned p = plan_call(pair, mask, weights, options);
  check_buffer(ab, ab_shape(p), scalar_type(p.plan.ab_dtype), pair, "ab");
  return p;
}

// x_hat: also LayerNorm_in's rows without the affine, where the plan's input kernel writes them (forward_plan's
// "x_hat_shape"): the training forward keeps them for the backward; x_hat_rstd (with x_hat): each position's
// LayerNorm_in rstd, [B*N*N] fp32. b: b's planes in a buffer of their own, ab then a's alone (each ab_shape less
// its first dimension), so that the caller can free one side before the other.
void input_pass(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                const ForwardOptions& options, const at::Tensor& ab, const c10::optional<at::Tensor>& x_hat,
                const c10::optional<at::Tensor>& x_hat_rstd, const c10::optional<at::Tensor>& b) {
  const c10::cuda::CUDAGuard guard(pair.device());
  Planned p = b.has_value() ? plan_call(pair, mask, weights, options) : plan_step(pair, mask, weights, options, ab);
  if (b.has_value()) {
    const auto shape = ab_shape(p);
    const std::array<int64_t, 3> side{shape[1], shape[2], shape[3]};
    check_buffer(ab, side, scalar_type(p.plan.ab_dtype), pair, "a (ab with b apart)");
    check_buffer(*b, side, scalar_type(p.plan.ab_dtype), pair, "b");
  }
  if (x_hat.has_value()) {
    TORCH_CHECK_VALUE(p.plan.x_hat_rows, "trimul_inline: the input kernel '",
                      kernel_name(p.plan.kernels[static_cast<int>(trimul::Role::input)]),
                      "' does not write x_hat for this call (forward_plan's x_hat_shape is None)");
    check_buffer(*x_hat, x_hat_shape(p), at::kBFloat16, pair, "x_hat");
    p.args.x_hat = x_hat->data_ptr();
  }
  if (x_hat_rstd.has_value()) {
    TORCH_CHECK_VALUE(x_hat.has_value(), "trimul_inline: the input pass writes x_hat_rstd only with x_hat");
    check_buffer(*x_hat_rstd, {x_hat_shape(p)[0]}, at::kFloat, pair, "x_hat_rstd");
    p.args.x_hat_rstd = x_hat_rstd->data_ptr<float>();
  }
  if (p.args.batch > 0 && p.args.rows > 0 && p.args.n > 0) run_input(p, ab, b);
}

void contraction(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                 const ForwardOptions& options, const at::Tensor& ab, const c10::optional<at::Tensor>& z) {
  const c10::cuda::CUDAGuard guard(pair.device());
  Planned p = plan_step(pair, mask, weights, options, ab);
  check_square(p, "the contraction step");
  if (!p.plan.z_buffer) {
    TORCH_CHECK_VALUE(!z.has_value(), "trimul_inline: this plan has no z buffer (the output pass contracts)");
    return;
  }
  TORCH_CHECK_VALUE(z.has_value(), "trimul_inline: this plan needs a z buffer");
  check_buffer(*z, z_shape(p), scalar_type(p.args.z_dtype), pair, "z");
  if (p.args.batch > 0 && p.args.n > 0) run_contraction(p, ab, *z);
}

// gate_rows: the rows the gate reads instead of pair's (ForwardArgs::gate_rows: bf16 [B*N*N, C], as x_hat; the
// options a raw gate, the weights' out_gate folded with LayerNorm_in's affine), where forward_plan says
// "gate_rows"; out keeps pair's dtype.
void output_pass(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                 const ForwardOptions& options, const c10::optional<at::Tensor>& ab, const c10::optional<at::Tensor>& z,
                 const at::Tensor& out, const c10::optional<at::Tensor>& gate_rows) {
  const c10::cuda::CUDAGuard guard(pair.device());
  if (gate_rows.has_value()) {
    TORCH_CHECK_VALUE(!options.gate_normalized, "trimul_inline: gate_rows are read as a raw gate (its LayerNorm "
                      "folded into the weights): call output_pass with gate_normalized false");
    check_buffer(*gate_rows, {pair.size(0) * pair.size(1) * pair.size(2), pair.size(3)}, at::kBFloat16, pair,
                 "gate_rows");
  }
  Planned p = plan_call(pair, mask, weights, options, gate_rows.has_value() ? gate_rows->data_ptr() : nullptr);
  check_buffer(out, pair.sizes(), pair.scalar_type(), pair, "out");
  if (p.plan.z_buffer) {
    TORCH_CHECK_VALUE(z.has_value(), "trimul_inline: this plan's output pass reads z");
    check_buffer(*z, z_shape(p), scalar_type(p.args.z_dtype), pair, "z");
  } else {
    TORCH_CHECK_VALUE(ab.has_value(), "trimul_inline: this plan's output pass contracts: it reads ab");
    check_buffer(*ab, ab_shape(p), scalar_type(p.plan.ab_dtype), pair, "ab");
  }
  if (p.args.batch > 0 && p.args.rows > 0 && p.args.n > 0) run_output(p, ab.value_or(at::Tensor()), z, out);
}

// Whether the fused passes take pair_dim / hidden in this mode for pairs of this dtype (trimul::Dtype code)
// on the current GPU.
bool fused_takes(int64_t c, int64_t hidden, int64_t mode, int64_t pair_dtype) {
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 3 && pair_dtype >= 0 && pair_dtype <= 2, "trimul_inline: mode ", text(mode),
                    " / dtype code ", text(pair_dtype));
  return library().fused_takes(c, hidden, static_cast<trimul::Mode>(mode), static_cast<trimul::Dtype>(pair_dtype));
}

// ---- the backward's memory passes ----------------------------------------------------------------
trimul::Role backward_role(const std::string& role) {
  for (int r = trimul::kForwardRoles; r < trimul::kRoles; ++r)
    if (role == kRoleNames[r]) return static_cast<trimul::Role>(r);
  TORCH_CHECK_VALUE(false, "trimul_inline: '", role, "' is not a backward role");
}

// The sizes every pass of a backward shares.
// block_rows: a block of pair's rows (BackwardArgs::block_rows; 0: N).
trimul::BackwardArgs backward_sizes(int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                                    const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  TORCH_CHECK_VALUE(precision >= 0 && precision <= 2, "trimul_inline: precision code ", text(precision),
                    " is not 0 (highest), 1 (high) or 2 (medium)");
  TORCH_CHECK_VALUE(batch >= 0 && n >= 0 && c > 0 && h > 0 && block_rows >= 0, "trimul_inline: backward sizes B ",
                    text(batch), ", N ", text(n), ", C ", text(c), ", H ", text(h), ", rows ", text(block_rows));
  trimul::BackwardArgs args{};
  args.batch = batch;
  args.n = n;
  args.block_rows = block_rows == n ? 0 : block_rows;
  args.c = c;
  args.h = h;
  args.incoming = incoming;
  args.precision = static_cast<trimul::Precision>(precision);
  args.operand = dtype_code(like, "the backward's operand");
  args.stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  return args;
}

int plan_backward_kernel(trimul::Role role, const std::string& chosen, const trimul::BackwardArgs& args) {
  char message[1024] = "";
  int kernel = -1;
  check_plan(library().plan_backward(role, &args, chosen.c_str(), &kernel, message, sizeof(message)), message);
  return kernel;
}

// The kernel a backward role runs for these sizes and operand dtype (chosen, else the default order's
// first that takes them): its name, or "" where that is a torch baseline (the caller's PyTorch passes).
std::string backward_kernel(const std::string& role, const std::string& chosen, int64_t batch, int64_t n, int64_t c,
                            int64_t h, bool incoming, const at::Tensor& like, int64_t precision,
                            int64_t block_rows = 0) {
  const int kernel = plan_backward_kernel(backward_role(role), chosen,
                                          backward_sizes(batch, n, c, h, incoming, like, precision, block_rows));
  return kernel < 0 ? std::string() : std::string(kernel_name(kernel));
}

// A tensor a pass reads or writes: present, on `like`'s device, contiguous, `numel` elements of one of `dtypes`.
void* pass_tensor(const std::unordered_map<std::string, at::Tensor>& tensors, const char* name, int64_t numel,
                  std::initializer_list<at::ScalarType> dtypes, const at::Tensor& like) {
  const auto found = tensors.find(name);
  TORCH_CHECK_VALUE(found != tensors.end(), "trimul_inline: this backward pass needs tensor '", name, "'");
  const at::Tensor& t = found->second;
  TORCH_CHECK_VALUE(t.device() == like.device() && t.is_contiguous() && t.numel() == numel,
                    "trimul_inline: backward tensor '", name, "' must be contiguous with ", text(numel),
                    " elements on ", like.device().str(), ", got ", text(t.sizes()));
  TORCH_CHECK_TYPE(std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(),
                   "trimul_inline: backward tensor '", name, "' has dtype ", t.scalar_type());
  return t.data_ptr();
}

// Rows a pass writes inside a wider buffer (BackwardArgs::ld_rows): [rows, width] of one of `dtypes` on `like`'s
// device, channels adjacent, rows *ld elements apart (0 where they are contiguous).
void* pass_rows(const std::unordered_map<std::string, at::Tensor>& tensors, const char* name, int64_t rows,
                int64_t width, std::initializer_list<at::ScalarType> dtypes, const at::Tensor& like, int64_t* ld) {
  const auto found = tensors.find(name);
  TORCH_CHECK_VALUE(found != tensors.end(), "trimul_inline: this backward pass needs tensor '", name, "'");
  const at::Tensor& t = found->second;
  TORCH_CHECK_VALUE(t.device() == like.device() && t.dim() == 2 && t.size(0) == rows && t.size(1) == width &&
                        t.stride(1) == 1 && (rows <= 1 || t.stride(0) >= width),
                    "trimul_inline: backward tensor '", name, "' must be [", text(rows), ", ", text(width),
                    "] rows with adjacent channels on ", like.device().str(), ", got ", text(t.sizes()), " strides ",
                    text(t.strides()));
  TORCH_CHECK_TYPE(std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(),
                   "trimul_inline: backward tensor '", name, "' has dtype ", t.scalar_type());
  *ld = rows <= 1 || t.stride(0) == width ? 0 : t.stride(0);
  return t.data_ptr();
}

// Runs backward pass `pass` (trimul::BackwardPass) of the named backward kernel (backward_kernel's) on the
// tensors named as BackwardArgs' fields; `like` fixes the device and the operand dtype.
void backward_pass(const std::string& role, const std::string& kernel, int64_t pass, int64_t batch, int64_t n,
                   int64_t c, int64_t h, bool incoming, int64_t precision, double eps, const at::Tensor& like,
                   const std::unordered_map<std::string, at::Tensor>& tensors, int64_t block_rows = 0) {
  TORCH_CHECK_VALUE(like.is_cuda(), "trimul_inline: the backward's kernels take CUDA tensors");
  TORCH_CHECK_VALUE((pass >= 0 && pass <= static_cast<int64_t>(trimul::BackwardPass::d_pair)) ||
                        pass == static_cast<int64_t>(trimul::BackwardPass::z_gate_grad) ||
                        pass == static_cast<int64_t>(trimul::BackwardPass::d_proj_d_pair) ||
                        pass == static_cast<int64_t>(trimul::BackwardPass::dz_planes_g_out),
                    "trimul_inline: backward pass code ", text(pass));
  const c10::cuda::CUDAGuard guard(like.device());
  trimul::BackwardArgs args = backward_sizes(batch, n, c, h, incoming, like, precision, block_rows);
  args.pass = static_cast<trimul::BackwardPass>(pass);
  args.eps = static_cast<float>(eps);
  at::Tensor aligned_d_out, aligned_x_hat;  // (z_gate_grad: d out and the gate rows copied where they are not 16-byte
                                            // aligned, for TMA; they live to the launch)
  const int64_t positions = trimul::positions(args);
  const at::ScalarType operand = scalar_type(args.operand);
  const auto any_float = {at::kFloat, at::kBFloat16, at::kHalf};
  const auto f32 = {at::kFloat};
  const auto op = {operand};
  const auto has = [&](const char* name) { return tensors.count(name) > 0; };
  const auto get = [&](const char* name) -> const at::Tensor& { return tensors.at(name); };
  // A pass that reads `name` by TMA takes its rows 16-byte aligned: p as given where it is, else a copy's, which
  // `copy` holds to the launch.
  const auto tma_aligned = [&](const void* p, const char* name, at::Tensor& copy) -> const void* {
    if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return p;
    copy = get(name).clone();
    return copy.data_ptr();
  };
  using P = trimul::BackwardPass;
  switch (args.pass) {
    case P::input_rows:
      args.pair = pass_tensor(tensors, "pair", positions * c, any_float, like);
      args.pair_dtype = dtype_code(get("pair"), "pair");
      args.rows = pass_tensor(tensors, "rows", positions * c, op, like);
      break;
    case P::gated_planes:
    case P::d_proj:
    case P::d_proj_d_pair:
      if (args.pass == P::d_proj_d_pair) {  // (d pair as well: d_pair_in_d_proj)
        args.rstd = static_cast<float*>(pass_tensor(tensors, "rstd", positions, f32, like));
        args.d_gate = pass_tensor(tensors, "d_gate", positions * c, op, like);
        args.w_gate_f = static_cast<const float*>(pass_tensor(tensors, "w_gate_f", c * c, f32, like));
        args.d_pair = pass_tensor(tensors, "d_pair", positions * c, any_float, like);
        args.pair_dtype = dtype_code(get("d_pair"), "d_pair");
      }
      if (args.pass != P::gated_planes && has("x_hat")) {  // (proj recomputed in the pass: d_proj_from_x_hat)
        args.x_hat = pass_tensor(tensors, "x_hat", positions * c, op, like);
        args.w_in_f = static_cast<const float*>(pass_tensor(tensors, "w_in_f", 4 * h * c, f32, like));
        args.b_in_f = static_cast<const float*>(pass_tensor(tensors, "b_in_f", 4 * h, f32, like));
      } else {
        args.proj = pass_tensor(tensors, "proj", positions * 4 * h, op, like);
      }
      args.mask = pass_tensor(tensors, "mask", positions, {at::kBool, at::kByte, at::kInt, at::kLong, at::kFloat,
                                                           at::kBFloat16, at::kHalf}, like);
      args.mask_kind = mask_kind(get("mask"));
      args.a_planes = pass_tensor(tensors, "a_planes", positions * h, op, like);
      args.b_planes = pass_tensor(tensors, "b_planes", positions * h, op, like);
      if (args.pass != P::gated_planes) {
        args.rows = pass_rows(tensors, "rows", positions, 4 * h, op, like, &args.ld_rows);
        TORCH_CHECK_VALUE(args.ld_rows == 0 || args.rows != args.proj,
                          "trimul_inline: d_proj writes over proj only as whole [P, 4H] rows");
        args.sums = static_cast<float*>(pass_tensor(tensors, "sums", trimul::kBackwardSumRows * 4 * h, f32, like));
        if (has("d_mask")) args.d_mask = static_cast<float*>(pass_tensor(tensors, "d_mask", positions, f32, like));
      }
      break;
    case P::z_rows:
    case P::dz_planes:
    case P::dz_planes_g_out:
      args.a_planes = pass_tensor(tensors, "a_planes", positions * h, op, like);
      args.rows = pass_tensor(tensors, "rows", positions * h, op, like);
      args.rstd = static_cast<float*>(pass_tensor(tensors, "rstd", positions, f32, like));
      // (d z_hat multiplied in the pass: dz_planes_from_d_o, and dz_planes_g_out with g_out's partials too)
      if (args.pass == P::dz_planes_g_out || (args.pass == P::dz_planes && has("d_o"))) {
        args.d_o = pass_tensor(tensors, "d_o", positions * c, op, like);
        args.w_out_f = static_cast<const float*>(pass_tensor(tensors, "w_out_f", c * h, f32, like));
      } else if (args.pass == P::dz_planes) {
        args.d_rows = static_cast<const float*>(pass_tensor(tensors, "d_rows", positions * h, f32, like));
      }
      if (args.pass == P::dz_planes_g_out) {
        TORCH_CHECK_VALUE(has("g_out") && get("g_out").dim() == 3 && get("g_out").size(0) >= 1,
                          "trimul_inline: dz_planes_g_out needs tensor 'g_out', partials [rows, C, H]");
        args.g_out_rows = get("g_out").size(0);
        args.g_out = static_cast<float*>(pass_tensor(tensors, "g_out", args.g_out_rows * c * h, f32, like));
      }
      break;
    case P::gate_grad:
      args.d_out = pass_tensor(tensors, "d_out", positions * c, any_float, like);
      args.d_out_dtype = dtype_code(get("d_out"), "d_out");
      args.o = pass_tensor(tensors, "o", positions * c, op, like);
      args.gate_pre = pass_tensor(tensors, "gate_pre", positions * c, op, like);
      args.sums = static_cast<float*>(pass_tensor(tensors, "sums", trimul::kBackwardSumRows * 2 * c, f32, like));
      if (has("gate_out"))  // (d gate into one part of a wider buffer: ld_rows)
        args.gate_out = pass_rows(tensors, "gate_out", positions, c, op, like, &args.ld_rows);
      break;
    case P::z_gate_grad:
      args.a_planes = pass_tensor(tensors, "a_planes", positions * h, op, like);
      args.x_hat = tma_aligned(pass_tensor(tensors, "x_hat", positions * c, op, like), "x_hat", aligned_x_hat);
      args.w_out_f = static_cast<const float*>(pass_tensor(tensors, "w_out_f", c * h, f32, like));
      args.b_out_f = static_cast<const float*>(pass_tensor(tensors, "b_out_f", c, f32, like));
      args.w_gate_f = static_cast<const float*>(pass_tensor(tensors, "w_gate_f", c * c, f32, like));
      args.b_gate_f = static_cast<const float*>(pass_tensor(tensors, "b_gate_f", c, f32, like));
      args.d_out = tma_aligned(pass_tensor(tensors, "d_out", positions * c, any_float, like), "d_out", aligned_d_out);
      args.d_out_dtype = dtype_code(get("d_out"), "d_out");
      args.o = pass_tensor(tensors, "o", positions * c, op, like);
      args.gate_pre = pass_tensor(tensors, "gate_pre", positions * c, op, like);
      args.rows = pass_tensor(tensors, "rows", positions * h, op, like);
      args.rstd = static_cast<float*>(pass_tensor(tensors, "rstd", positions, f32, like));
      args.sums = static_cast<float*>(pass_tensor(tensors, "sums", trimul::kBackwardSumRows * 2 * c, f32, like));
      break;
    case P::d_pair:
      args.pair = pass_tensor(tensors, "pair", positions * c, any_float, like);
      args.pair_dtype = dtype_code(get("pair"), "pair");
      if (has("rows")) {  // (d x_hat multiplied in the pass: d_pair_from_d_proj)
        args.rows = pass_tensor(tensors, "rows", positions * 4 * h, op, like);
        args.w_in_f = static_cast<const float*>(pass_tensor(tensors, "w_in_f", 4 * h * c, f32, like));
        if (has("d_gate")) {
          args.d_gate = pass_tensor(tensors, "d_gate", positions * c, op, like);
          args.w_gate_f = static_cast<const float*>(pass_tensor(tensors, "w_gate_f", c * c, f32, like));
        }
      } else {
        args.d_rows = static_cast<const float*>(pass_tensor(tensors, "d_rows", positions * c, f32, like));
      }
      if (has("d_rows_add"))
        args.d_rows_add = static_cast<const float*>(pass_tensor(tensors, "d_rows_add", positions * c, f32, like));
      args.d_pair = pass_tensor(tensors, "d_pair", positions * c, {get("pair").scalar_type()}, like);
      break;
  }
  if (positions == 0) return;
  const int index = plan_backward_kernel(backward_role(role), kernel, args);
  TORCH_CHECK_VALUE(index >= 0, "trimul_inline: '", kernel, "' is a torch baseline, not a kernel of the library");
  check_launch(library().run_backward(index, &args), std::string("the ") + role + " kernel '" + kernel + "'");
}

// Whether the backward role `role`'s kernel `kernel` takes `pass` with its inputs left to the pass (the sizes'
// args: every buffer null) at these sizes.
bool backward_takes(trimul::Role role, const std::string& kernel, trimul::BackwardPass pass, int64_t batch, int64_t n,
                    int64_t c, int64_t h, bool incoming, const at::Tensor& like, int64_t precision,
                    int64_t block_rows) {
  trimul::BackwardArgs args = backward_sizes(batch, n, c, h, incoming, like, precision, block_rows);
  args.pass = pass;
  int index = -1;
  char message[512] = "";
  return library().plan_backward(role, &args, kernel.c_str(), &index, message, sizeof(message)) ==
             trimul::PlanStatus::ok && index >= 0;
}

// Whether input_backward's kernel `kernel` takes d_proj from x_hat (BackwardArgs::x_hat: proj recomputed in the
// pass, no proj GEMM before it) at these sizes.
bool d_proj_from_x_hat(const std::string& kernel, int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                       const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  return backward_takes(trimul::Role::input_backward, kernel, trimul::BackwardPass::d_proj, batch, n, c, h, incoming,
                        like, precision, block_rows);
}

// Whether input_backward's kernel `kernel` takes d_pair from d proj (d x_hat = d proj W_in_f + d gate W_gate_f
// multiplied in the pass, BackwardArgs::d_gate: no d x_hat GEMMs before it) at these sizes.
bool d_pair_from_d_proj(const std::string& kernel, int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                        const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  return backward_takes(trimul::Role::input_backward, kernel, trimul::BackwardPass::d_pair, batch, n, c, h, incoming,
                        like, precision, block_rows);
}

// Whether input_backward's kernel `kernel` takes d_proj_d_pair (d_proj from x_hat writing d pair too, from
// LayerNorm_in's rstd kept by the forward: no d_pair pass after it) at these sizes.
bool d_pair_in_d_proj(const std::string& kernel, int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                      const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  return backward_takes(trimul::Role::input_backward, kernel, trimul::BackwardPass::d_proj_d_pair, batch, n, c, h,
                        incoming, like, precision, block_rows);
}

// Whether output_backward's kernel `kernel` takes dz_planes from d o (d z_hat = d o W_out_f multiplied in the pass,
// BackwardArgs::d_o: no d z_hat GEMM before it) at these sizes.
bool dz_planes_from_d_o(const std::string& kernel, int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                        const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  return backward_takes(trimul::Role::output_backward, kernel, trimul::BackwardPass::dz_planes, batch, n, c, h,
                        incoming, like, precision, block_rows);
}

// Whether output_backward's kernel `kernel` takes dz_planes_g_out (dz_planes from d o with g_out = d o^T z_hat as
// per-block partials: no g_out GEMM) at these sizes.
bool dz_planes_g_out(const std::string& kernel, int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                     const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  return backward_takes(trimul::Role::output_backward, kernel, trimul::BackwardPass::dz_planes_g_out, batch, n, c, h,
                        incoming, like, precision, block_rows);
}

// The rows of dz_planes_g_out's partials: a block per row, one per SM (persistent), at most kBackwardSumRows.
int64_t g_out_partial_rows(const at::Tensor& like) {
  const int64_t sms = at::cuda::getDeviceProperties(like.device().index())->multiProcessorCount;
  return std::max<int64_t>(1, std::min<int64_t>(sms, trimul::kBackwardSumRows));
}

// Whether output_backward's kernel `kernel` takes z_gate_grad (z_rows, the o and gate_pre GEMMs and gate_grad as
// one pass: o and gate_pre never written) at these sizes.
bool gate_grad_from_z(const std::string& kernel, int64_t batch, int64_t n, int64_t c, int64_t h, bool incoming,
                      const at::Tensor& like, int64_t precision, int64_t block_rows = 0) {
  return backward_takes(trimul::Role::output_backward, kernel, trimul::BackwardPass::z_gate_grad, batch, n, c, h,
                        incoming, like, precision, block_rows);
}

// ---- the backward's GEMMs over positions (the position_gemm role) ------------------------------------
// The BackwardArgs of a position_gemm call: fp32 rows [m, K] (K = rows' columns) against n output channels.
trimul::BackwardArgs position_gemm_args(trimul::BackwardPass pass, const at::Tensor& rows, int64_t m, int64_t n,
                                        int64_t precision) {
  trimul::BackwardArgs args{};
  args.pass = pass;
  args.batch = 1;
  args.n = 1;
  args.c = rows.size(1);  // (plan_backward's messages name them K and N for this role)
  args.h = n;
  args.operand = trimul::Dtype::f32;
  args.precision = static_cast<trimul::Precision>(precision);
  args.gemm_rows = rows.data_ptr<float>();
  args.gemm_ld = rows.stride(1) == 1 ? rows.stride(0) : 0;  // (0: rows not contiguous in k, which no kernel takes)
  args.gemm_m = m;
  args.gemm_k = rows.size(1);
  args.gemm_n = n;
  args.stream = c10::cuda::getCurrentCUDAStream(rows.device().index()).stream();
  return args;
}

// rows [M, K] @ weight^T (+ bias) in fp32: weight [N, K] fp32 with any strides (a transposed view multiplies
// by W itself), bias [N] or none. By the role's kernel for this call (chosen, else the default order's first
// that takes it), or cuBLAS's addmm / mm where that is the torch baseline (the same call the backward made
// before the role existed). The Python and the C++ backward both call this: the same bits either way.
at::Tensor position_gemm(const std::string& chosen, const at::Tensor& rows, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, int64_t precision) {
  TORCH_CHECK_VALUE(rows.is_cuda() && rows.dim() == 2 && weight.dim() == 2 && weight.device() == rows.device() &&
                        weight.size(1) == rows.size(1),
                    "trimul_inline: position_gemm takes CUDA rows [M, K] and a weight [N, K] on their device, got ",
                    text(rows.sizes()), " and ", text(weight.sizes()));
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
                   "trimul_inline: position_gemm multiplies fp32 rows and weights, got ", rows.scalar_type(), " and ",
                   weight.scalar_type());
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                                          bias->scalar_type() == at::kFloat && bias->device() == rows.device()),
                    "trimul_inline: position_gemm's bias must be fp32 [N] on the rows' device");
  TORCH_CHECK_VALUE(precision >= 0 && precision <= 2, "trimul_inline: precision code ", text(precision));
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t m = rows.size(0), k = rows.size(1), n = weight.size(0);
  trimul::BackwardArgs args = position_gemm_args(trimul::BackwardPass::rows_gemm, rows, m, n, precision);
  const int kernel = plan_backward_kernel(trimul::Role::position_gemm, chosen, args);
  if (kernel < 0 || m == 0 || n == 0) {
    return bias.has_value() ? at::addmm(*bias, rows, weight.t()) : at::mm(rows, weight.t());
  }
  const at::Tensor split = at::empty({trimul::position_gemm_split_floats(n, k)}, rows.options());
  const at::Tensor out = at::empty({m, n}, rows.options());
  args.pass = trimul::BackwardPass::split_weight;
  args.gemm_w = weight.data_ptr<float>();
  args.gemm_w_sn = weight.stride(0);
  args.gemm_w_sk = weight.stride(1);
  args.gemm_w_split = split.data_ptr<float>();
  args.gemm_w_split_floats = split.numel();
  check_launch(library().run_backward(kernel, &args), "position_gemm's weight split");
  const at::Tensor bias_rows = bias.has_value() ? bias->contiguous() : at::Tensor();  // (alive to the launch)
  args.pass = trimul::BackwardPass::rows_gemm;
  args.gemm_bias = bias_rows.defined() ? bias_rows.data_ptr<float>() : nullptr;
  args.gemm_out = out.data_ptr<float>();
  args.gemm_ld_out = n;
  check_launch(library().run_backward(kernel, &args), "position_gemm");
  return out;
}

// d_rows^T @ rows in fp32, summed over the positions (a weight gradient): d_rows [P, N], rows [P, K], both fp32 with
// adjacent channels, -> [N, K]. By the position_gemm role's kernel (chosen, else the default order's first that
// takes it), or cuBLAS's mm where that is the torch baseline. Both backward paths call this: the same bits.
at::Tensor position_gemm_grad(const std::string& chosen, const at::Tensor& d_rows, const at::Tensor& rows,
                              int64_t precision) {
  TORCH_CHECK_VALUE(rows.is_cuda() && rows.dim() == 2 && d_rows.dim() == 2 && d_rows.device() == rows.device() &&
                        d_rows.size(0) == rows.size(0),
                    "trimul_inline: position_gemm_grad takes CUDA d_rows [P, N] and rows [P, K] on one device, got ",
                    text(d_rows.sizes()), " and ", text(rows.sizes()));
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kFloat && d_rows.scalar_type() == at::kFloat,
                   "trimul_inline: position_gemm_grad multiplies fp32 rows, got ", d_rows.scalar_type(), " and ",
                   rows.scalar_type());
  TORCH_CHECK_VALUE(precision >= 0 && precision <= 2, "trimul_inline: precision code ", text(precision));
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t positions = rows.size(0), k = rows.size(1), n = d_rows.size(1);
  trimul::BackwardArgs args = position_gemm_args(trimul::BackwardPass::rows_grad, rows, positions, n, precision);
  args.gemm_d = d_rows.data_ptr<float>();
  args.gemm_ld_d = d_rows.stride(1) == 1 ? d_rows.stride(0) : 0;
  const int kernel = plan_backward_kernel(trimul::Role::position_gemm, chosen, args);  // (dispatch.cu's rules)
  if (kernel < 0 || positions == 0 || n == 0 || k == 0) return at::mm(d_rows.t(), rows);
  const at::Tensor partials = at::empty({trimul::position_gemm_grad_partial_floats(positions, n, k)}, rows.options());
  const at::Tensor out = at::empty({n, k}, rows.options());
  args.gemm_partials = partials.data_ptr<float>();
  args.gemm_partial_floats = partials.numel();
  args.gemm_out = out.data_ptr<float>();
  args.gemm_ld_out = k;
  check_launch(library().run_backward(kernel, &args), "position_gemm_grad");
  return out;
}

// ---- the training backward's host path ----------------------------------------------------------
// trimul_inline._training_backward for a call whose output_backward and input_backward roles both run
// library kernels: the same GEMMs and passes in the same order on the same operands (equal gradients, bit
// for bit), in one call from Python instead of about a hundred (a small step's cost is its host time).
namespace host_backward {

bool is_16bit(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// t in `type`: t itself where it already is (no call into the dispatcher: each costs microseconds of host time,
// and a small step's time is its host time).
at::Tensor in_type(const at::Tensor& t, at::ScalarType type) { return t.scalar_type() == type ? t : t.to(type); }

// _Products.mm: x @ y with fp32 accumulation, the result in out_dtype.
at::Tensor mm_to(const at::Tensor& x, const at::Tensor& y, at::ScalarType out_dtype) {
  if (is_16bit(x) && out_dtype != x.scalar_type()) return at::mm(x, y, out_dtype);
  return in_type(at::mm(x, y), out_dtype);
}

// _Products.add_mm_: total += x @ y in total's dtype, in place (no copy of total).
void add_mm_(at::Tensor& total, const at::Tensor& x, const at::Tensor& y) {
  if (is_16bit(x) && total.scalar_type() != x.scalar_type()) {
    at::addmm_out(total, total, x, y, total.scalar_type());
  } else {
    total.addmm_(in_type(x, total.scalar_type()), in_type(y, total.scalar_type()));
  }
}

// _Products.linear: rows @ weight^T + bias in the rows' dtype.
at::Tensor linear(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& bias) {
  return at::addmm(in_type(bias, rows.scalar_type()), rows, in_type(weight, rows.scalar_type()).t());
}

// One backward role's passes on its library kernel, for one call's sizes.
struct Passes {
  std::string role, kernel;
  int64_t batch, n, c, h;
  bool incoming;
  at::Tensor like;    // empty, the operand dtype on the device
  int64_t precision;  // the fp32 products' (trimul::Precision)
  int64_t rows;       // the planes' rows (BackwardArgs::block_rows)

  void run(trimul::BackwardPass pass, double eps, const std::unordered_map<std::string, at::Tensor>& tensors) const {
    backward_pass(role, kernel, static_cast<int64_t>(pass), batch, n, c, h, incoming, precision, eps, like, tensors,
                  rows);
  }

  // Whether the kernel takes `pass` with its inputs left to the pass (backward_takes: d_proj_from_x_hat and the
  // other queries, at these sizes).
  bool takes(trimul::BackwardPass pass) const {
    return backward_takes(backward_role(role), kernel, pass, batch, n, c, h, incoming, like, precision, rows);
  }
};

// The role's kernel for this call (chosen, else the default order's first that takes it); "" for a
// torch baseline.
std::string role_kernel(const char* role, const std::string& chosen, const Passes& sizes) {
  return backward_kernel(role, chosen, sizes.batch, sizes.n, sizes.c, sizes.h, sizes.incoming, sizes.like,
                         sizes.precision, sizes.rows);
}

}  // namespace host_backward

// ---- contract_backward's products on a library kernel (wgmma_f16x3) -----------------------------------
namespace split_products {

// The contraction that multiplies the split parts: the forward's fp16x3 path.
constexpr const char* kContraction = "wgmma_tma";

// Plane stacks [planes, N, >= N], fp32, rows contiguous (the saved a/b planes are such views).
void check_planes(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == like.device() && t.dim() == 3 && t.size(0) == like.size(0) &&
                        t.size(1) == like.size(1) && t.size(2) == like.size(1) && t.stride(2) == 1 &&
                        (t.size(1) <= 1 || t.stride(1) >= t.size(2)) &&
                        (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.stride(1)),
                    "trimul_inline: contract_backward's ", name, " must be [planes, N, N] planes on one device with "
                    "rows contiguous, like a ", text(like.sizes()), ", got ", text(t.sizes()));
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "trimul_inline: contract_backward's split products take float32 ",
                   name, ", got ", t.scalar_type());
}

struct Split {
  int kernel;                       // the library's contract_backward kernel
  trimul::BackwardArgs sizes;       // planes, N; precision highest
  int64_t ld;                       // the parts' row length (k of the products, padded to 32)

  // The parts of `planes`, each plane scaled by its bound: as they are (rows) and/or transposed, [2, planes, N,
  // ld] fp16. unscale (with other_bound): where the product's 2^-(s + s_other) per plane goes.
  void run(const at::Tensor& planes, const at::Tensor& bound, at::Tensor* parts, at::Tensor* parts_t,
           const at::Tensor* other_bound = nullptr, at::Tensor* unscale = nullptr) const {
    const auto make = [&]() { return at::empty({2, sizes.batch, sizes.n, ld}, planes.options().dtype(at::kHalf)); };
    trimul::BackwardArgs args = sizes;
    args.pass = trimul::BackwardPass::split_f16x3;
    args.a_planes = planes.data_ptr();
    args.plane_stride = planes.stride(0);
    args.row_stride = planes.stride(1);
    args.ld = ld;
    args.bound = bound.data_ptr<float>();
    if (parts != nullptr) args.parts = (*parts = make()).data_ptr();
    if (parts_t != nullptr) args.parts_t = (*parts_t = make()).data_ptr();
    if (unscale != nullptr) {
      args.bound_other = other_bound->data_ptr<float>();
      args.unscale = unscale->data_ptr<float>();
    }
    check_launch(library().run_backward(kernel, &args), "the contract_backward kernel's split pass");
  }

  // out = x y^T per plane from split parts (k-major both), plane p times unscale[p].
  void product(const at::Tensor& x, const at::Tensor& y, const at::Tensor& unscale, at::Tensor& out) const {
    trimul::ContractArgs args{};
    args.a = x.data_ptr();
    args.b = y.data_ptr();
    args.z = out.data_ptr();
    args.batch = sizes.batch;
    args.m = args.n = args.k = sizes.n;
    args.lda = ld;
    args.ldz = sizes.n;
    args.operand = trimul::Dtype::f16;
    args.out = trimul::Dtype::f32;
    args.precision = trimul::Precision::highest;
    args.split = true;
    args.z_scale = unscale.data_ptr<float>();
    args.z_scale_stride = 1;
    args.stream = sizes.stream;
    char message[1024] = "";
    int contraction = -1;
    check_plan(library().plan_contraction(&args, kContraction, &contraction, message, sizeof(message)), message);
    check_launch(library().run_contraction(contraction, &args), std::string("contraction kernel '") + kContraction + "'");
  }
};

// Planes per product call: each call's split parts (at most three operands alive, hi and lo, fp16: 12 N ld bytes
// per plane) within kGroupBytes, so that they stay small beside the backward's fp32 plane stacks, but at least
// enough planes for kGroupWaves waves of the contraction's 128 x 256 tiles (one CTA per SM) on this GPU. The
// same bits for any grouping: planes are split and multiplied independently.
constexpr int64_t kGroupBytes = int64_t(384) << 20, kGroupWaves = 2;

int64_t planes_per_group(int64_t planes, int64_t n, int64_t ld) {
  const int64_t by_bytes = kGroupBytes / std::max<int64_t>(12 * n * ld, 1);
  const int64_t tiles = kGroupWaves * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t tiles_per_plane = round_up(n, 128) / 128 * (round_up(n, 256) / 256);
  const int64_t by_tiles = round_up(tiles, tiles_per_plane) / tiles_per_plane;
  return std::min(planes, std::max<int64_t>({by_bytes, by_tiles, 1}));
}

// The largest |element| of each plane, on the device ([planes] fp32): the split pass's scales.
at::Tensor bound(const at::Tensor& planes) {
  return at::linalg_vector_norm(planes, std::numeric_limits<double>::infinity(), at::IntArrayRef({1, 2}), false,
                                c10::nullopt);
}

}  // namespace split_products

// contract_backward on the library's kernel `kernel` (wgmma_f16x3), per plane of fp32 [planes, N, N] stacks
// (a and b may have their rows strided): without dz [z = a b^T]; with dz [da = dz b, db = dz^T a]. Each operand
// is split into scaled fp16 parts (transposed where its product reads it so; dz both ways in one pass),
// multiplied as fp16x3 by the forward's split-operand contraction; a part is freed once its last product ran,
// and the planes go planes_per_call at a time (None: planes_per_group's rule).
std::vector<at::Tensor> contract_backward_products(const std::string& kernel, const at::Tensor& a, const at::Tensor& b,
                                                   const c10::optional<at::Tensor>& dz,
                                                   c10::optional<int64_t> planes_per_call = c10::nullopt) {
  using namespace split_products;
  TORCH_CHECK_VALUE(a.is_cuda() && a.dim() == 3, "trimul_inline: contract_backward's a must be CUDA [planes, N, N]");
  check_planes(a, "a", a);
  check_planes(b, "b", a);
  if (dz.has_value()) {
    check_planes(*dz, "dz", a);
    TORCH_CHECK_VALUE(dz->is_contiguous(), "trimul_inline: contract_backward's dz must be contiguous");
  }
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t planes = a.size(0), n = a.size(1);
  const auto planes_out = [&]() { return at::empty({planes, n, n}, a.options()); };
  if (planes == 0 || n == 0) return dz.has_value() ? std::vector<at::Tensor>{planes_out(), planes_out()}
                                                   : std::vector<at::Tensor>{planes_out()};
  const at::Tensor like = at::empty({0}, a.options());
  Split split{-1, backward_sizes(planes, n, 1, 1, false, like, 0), round_up(std::max<int64_t>(n, 1), 32)};
  split.kernel = plan_backward_kernel(trimul::Role::contract_backward, kernel, split.sizes);
  TORCH_CHECK_VALUE(split.kernel >= 0, "trimul_inline: '", kernel, "' is a torch baseline, not a kernel of the library");
  const at::Tensor unscale = at::empty({2, planes}, a.options());
  const at::Tensor a_bound = bound(a), b_bound = bound(b);
  const at::Tensor dz_bound = dz.has_value() ? bound(*dz) : at::Tensor();
  at::Tensor z, da, db;
  if (dz.has_value()) {
    da = planes_out();
    db = planes_out();
  } else {
    z = planes_out();
  }
  TORCH_CHECK_VALUE(!planes_per_call.has_value() || *planes_per_call > 0,
                    "trimul_inline: planes_per_call must be positive");
  const int64_t group = planes_per_call.has_value() ? std::min(*planes_per_call, planes)
                                                    : planes_per_group(planes, n, split.ld);
  for (int64_t first = 0; first < planes; first += group) {
    const int64_t count = std::min(group, planes - first);
    Split part = split;
    part.sizes.batch = count;
    const auto slice = [&](const at::Tensor& t) { return t.narrow(0, first, count); };
    at::Tensor x, y, unscale_0 = slice(unscale[0]), unscale_1 = slice(unscale[1]);
    const at::Tensor a_part = slice(a), b_part = slice(b), a_b = slice(a_bound), b_b = slice(b_bound);
    if (!dz.has_value()) {
      at::Tensor z_part = slice(z);
      part.run(a_part, a_b, &x, nullptr);
      part.run(b_part, b_b, &y, nullptr, &a_b, &unscale_0);
      part.product(x, y, unscale_0, z_part);
      continue;
    }
    const at::Tensor dz_b = slice(dz_bound);
    at::Tensor da_part = slice(da), db_part = slice(db), x_t;
    part.run(slice(*dz), dz_b, &x, &x_t);  // (dz read once, both layouts)
    part.run(b_part, b_b, nullptr, &y, &dz_b, &unscale_0);
    part.product(x, y, unscale_0, da_part);  // da[i, k] = sum_j dz[i, j] b[j, k]: dz's rows by b^T's rows
    x.reset();
    y.reset();
    part.run(a_part, a_b, nullptr, &y, &dz_b, &unscale_1);
    part.product(x_t, y, unscale_1, db_part);  // db[j, k] = sum_i dz[i, j] a[i, k]: dz^T's rows by a^T's rows
  }
  if (!dz.has_value()) return {z};
  return {da, db};
}

// The 16 parameters' shapes in _PARAM_PATHS order, for hidden h and pair_dim c.
std::vector<std::vector<int64_t>> param_shapes(int64_t h, int64_t c) {
  return {{c}, {c}, {h, c}, {h}, {h, c}, {h}, {h, c}, {h}, {h, c}, {h}, {h}, {h}, {c, h}, {c}, {c, c}, {c}};
}

// Parameter i of the 16 that a host path (`what`, named in the message) reads: float32, bfloat16 or float16, shaped
// as `shape`, on `device` (the first parameter's); contiguous (a copy only where it is not).
at::Tensor checked_param(const at::Tensor& t, int i, at::IntArrayRef shape, const at::Device& device,
                         const char* what) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == device && t.sizes() == shape &&
                        (t.scalar_type() == at::kFloat || host_backward::is_16bit(t)),
                    "trimul_inline: ", what, "'s parameter ", text(i), " must be float32, bfloat16 or float16 ",
                    text(shape), " on the first one's CUDA device, got ", t.scalar_type(), " ", text(t.sizes()),
                    " on ", t.device().str());
  return t.contiguous();
}

// The backward's parameters in fp32 and its folded Linears (param_fold.cu: one launch), as views of one fp32
// allocation: f32 the 16 parameters (_PARAM_PATHS order); w_in_f [4H, C], b_in_f [4H] the four in-projections
// folded with LayerNorm_in (concatenated in _PARAM_PATHS order); w_out_f [C, H], b_out_f [C] out_proj folded with
// LayerNorm_out; w_gate_f [C, C], b_gate_f [C] out_gate folded with LayerNorm_in where it reads it, else out_gate
// itself; zeroed: zero_count fp32 zeros (the passes' partial-sum rows). In place of ~15 tensor ops on the host
// (casts, concatenations, products, mv) with the same values but for b_f's summation order.
struct FoldedParams {
  std::vector<at::Tensor> f32;
  at::Tensor w_in_f, b_in_f, w_out_f, b_out_f, w_gate_f, b_gate_f, zeroed;
};

FoldedParams fold_params(const std::vector<at::Tensor>& given, bool gate_normalized, int64_t zero_count) {
  TORCH_CHECK_VALUE(given.size() == 16 && given[2].dim() == 2, "trimul_inline: param_fold takes the 16 parameters");
  const int64_t h = given[2].size(0), c = given[2].size(1);
  const std::vector<std::vector<int64_t>> sizes = param_shapes(h, c);
  std::vector<at::Tensor> params;  // (contiguous: held until the launch)
  for (int i = 0; i < 16; ++i) params.push_back(checked_param(given[i], i, sizes[i], given[0].device(), "param_fold"));
  const c10::cuda::CUDAGuard guard(params[0].device());
  // (each view starts 64 floats aligned, for the kernels' vector loads)
  int64_t total = 0;
  const auto place = [&](int64_t numel) { const int64_t at = total; total += round_up(numel, 64); return at; };
  std::vector<int64_t> param_at;
  for (const at::Tensor& t : params) param_at.push_back(place(t.numel()));
  const int64_t w_in_at = place(4 * h * c), b_in_at = place(4 * h), w_out_at = place(c * h), b_out_at = place(c);
  const int64_t w_gate_at = gate_normalized ? place(c * c) : param_at[14];
  const int64_t b_gate_at = gate_normalized ? place(c) : param_at[15];
  const int64_t zero_at = place(zero_count);
  const at::Tensor buffer = at::empty({total}, params[0].options().dtype(at::kFloat));
  float* base = buffer.data_ptr<float>();
  const auto view = [&](int64_t at, at::IntArrayRef shape) {
    return shape.size() == 1 ? buffer.as_strided(shape, {1}, at) : buffer.as_strided(shape, {shape[1], 1}, at);
  };
  FoldedParams out;
  for (int i = 0; i < 16; ++i) out.f32.push_back(view(param_at[i], sizes[i]));
  out.w_in_f = view(w_in_at, {4 * h, c});
  out.b_in_f = view(b_in_at, {4 * h});
  out.w_out_f = view(w_out_at, {c, h});
  out.b_out_f = view(b_out_at, {c});
  out.w_gate_f = view(w_gate_at, {c, c});
  out.b_gate_f = view(b_gate_at, {c});
  out.zeroed = view(zero_at, {zero_count});
  trimul::ParamFoldArgs args{};
  const auto linear = [&](int w, int64_t w_f_at, int64_t b_f_at, int norm) {
    trimul::ParamFoldArgs::Linear& lin = args.lin[args.linears++];
    lin.w = params[w].data_ptr();
    lin.b = params[w + 1].data_ptr();
    lin.w_dtype = dtype_code(params[w], "a parameter");
    lin.b_dtype = dtype_code(params[w + 1], "a parameter");
    lin.w_f32 = base + param_at[w];
    lin.b_f32 = base + param_at[w + 1];
    lin.w_folded = base + w_f_at;
    lin.b_folded = base + b_f_at;
    lin.rows = params[w].size(0);
    lin.cols = params[w].size(1);
    lin.norm = norm;
  };
  for (int k = 0; k < 4; ++k) linear(2 + 2 * k, w_in_at + k * h * c, b_in_at + k * h, 0);
  linear(12, w_out_at, b_out_at, 1);
  linear(14, w_gate_at, b_gate_at, gate_normalized ? 0 : -1);
  for (int k = 0; k < 2; ++k) {
    trimul::ParamFoldArgs::Norm& nm = args.norm[args.norms++];
    nm.w = params[10 * k].data_ptr();
    nm.b = params[10 * k + 1].data_ptr();
    nm.w_dtype = dtype_code(params[10 * k], "a parameter");
    nm.b_dtype = dtype_code(params[10 * k + 1], "a parameter");
    nm.w_f32 = base + param_at[10 * k];
    nm.b_f32 = base + param_at[10 * k + 1];
    nm.cols = params[10 * k].size(0);
  }
  args.zero = base + zero_at;
  args.zero_count = zero_count;
  args.stream = at::cuda::getCurrentCUDAStream();
  check_launch(library().param_fold(args), "the folded parameters (param_fold)");
  return out;
}

// param_fold's Python binding: [the 16 parameters in fp32, w_in_f, b_in_f, w_out_f, b_out_f, w_gate_f, b_gate_f].
std::vector<at::Tensor> param_fold(const std::vector<at::Tensor>& params, bool gate_normalized) {
  FoldedParams f = fold_params(params, gate_normalized, 0);
  std::vector<at::Tensor> out = std::move(f.f32);
  for (at::Tensor* t : {&f.w_in_f, &f.b_in_f, &f.w_out_f, &f.b_out_f, &f.w_gate_f, &f.b_gate_f}) out.push_back(*t);
  return out;
}

// prepare_weights' list for the 16-bit modes in one launch (weight_prep.cu): [ln_in_w, ln_in_b, w_in, b_in, w_gate,
// b_gate, w_out, b_out, w_rows], then, with x_hat_gate, [w_gate, b_gate] of out_gate folded with LayerNorm_in (a raw
// gate on x_hat). params: the 16 parameters in _PARAM_PATHS order, None for a Linear's absent bias.
std::vector<at::Tensor> weight_prep(const std::vector<c10::optional<at::Tensor>>& given, bool f16, bool x_hat_gate) {
  TORCH_CHECK_VALUE(given.size() == 16, "trimul_inline: weight_prep takes the 16 parameters");
  TORCH_CHECK_VALUE(given[0].has_value() && given[2].has_value() && given[2]->dim() == 2,
                    "trimul_inline: weight_prep's parameter 0 (LayerNorm_in's weight) and parameter 2 (proj_a's "
                    "weight, a matrix) are needed");
  const int64_t h = given[2]->size(0), c = given[2]->size(1);
  const std::vector<std::vector<int64_t>> sizes = param_shapes(h, c);
  const bool bias[16] = {false, false, false, true, false, true, false, true, false, true,
                         false, false, false, true, false, true};
  const at::Device device = given[0]->device();
  std::vector<at::Tensor> params(16);  // (contiguous: held until the launch)
  trimul::WeightPrepArgs args{};
  for (int i = 0; i < 16; ++i) {
    if (!given[i].has_value()) {
      TORCH_CHECK_VALUE(bias[i], "trimul_inline: weight_prep's parameter ", text(i), " may not be None (only a bias)");
      continue;
    }
    params[i] = checked_param(*given[i], i, sizes[i], device, "weight_prep");
    args.params[i] = params[i].data_ptr();
    args.dtypes[i] = dtype_code(params[i], "a parameter");
  }
  const c10::cuda::CUDAGuard guard(device);
  args.c = c;
  args.h = h;
  args.c_pad = round_up(c, 32);
  args.h_pad = round_up(h, 32);
  args.rows_ab = round_up(2 * h, 128);
  args.rows_c = round_up(c, 128);
  args.f16 = f16;
  const at::TensorOptions f32 = at::TensorOptions().device(device).dtype(at::kFloat);
  const at::TensorOptions operand = f32.dtype(f16 ? at::kHalf : at::kBFloat16);
  std::vector<at::Tensor> out{at::empty({c}, f32), at::empty({c}, f32),
                              at::empty({2 * args.rows_ab, args.c_pad}, operand), at::empty({2 * args.rows_ab}, f32),
                              at::empty({args.rows_c, args.c_pad}, operand), at::empty({c}, f32),
                              at::empty({args.rows_c, args.h_pad}, operand), at::empty({c}, f32),
                              at::empty({2 * args.rows_ab, args.c_pad + 64}, operand)};
  if (x_hat_gate) {
    out.push_back(at::empty({args.rows_c, args.c_pad}, operand));
    out.push_back(at::empty({c}, f32));
    args.x_hat_w_gate = out[9].data_ptr();
    args.x_hat_b_gate = out[10].data_ptr<float>();
  }
  args.ln_w = out[0].data_ptr<float>();
  args.ln_b = out[1].data_ptr<float>();
  args.w_in = out[2].data_ptr();
  args.b_in = out[3].data_ptr<float>();
  args.w_gate = out[4].data_ptr();
  args.b_gate = out[5].data_ptr<float>();
  args.w_out = out[6].data_ptr();
  args.b_out = out[7].data_ptr<float>();
  args.w_rows = out[8].data_ptr();
  args.stream = at::cuda::getCurrentCUDAStream();
  check_launch(library().weight_prep(args), "the kernel-layout weights (weight_prep)");
  return out;
}

// The 16 parameters' gradients (_PARAM_PATHS order, each in its parameter's dtype, each its own memory) from
// the folded GEMMs' g and the bias sums s, fp32: g_in [4H, C], s_in [4H] of the four input projections (folded
// with LayerNorm_in), g_out [C, H], s_out [C] (folded with LayerNorm_out), g_gate [C, C], s_gate [C] (folded
// with LayerNorm_in where the gate reads it). Each s is its sum, or the passes' per-block partials [k, width]
// (rows of unit stride) that the call sums. params_f32: the parameters in fp32 (the caller has them: the
// backward multiplies in fp32). One library call
// (param_grads.cu: two launches) in place of ~30 tensor ops; written in the parameters' dtype where they share
// one, else in fp32 and then cast.
std::vector<at::Tensor> parameter_grads(const std::vector<at::Tensor>& params,
                                        const std::vector<at::Tensor>& params_f32, const at::Tensor& g_in,
                                        const at::Tensor& s_in, const at::Tensor& g_out, const at::Tensor& s_out,
                                        const at::Tensor& g_gate, const at::Tensor& s_gate, bool gate_normalized) {
  TORCH_CHECK_VALUE(params.size() == 16 && params_f32.size() == 16, "trimul_inline: param_grads takes 16 parameters");
  const int64_t h = params[2].size(0), c = params[2].size(1);
  const auto on_device = [&](const at::Tensor& t) {
    return t.is_cuda() && t.device() == params[0].device() && t.scalar_type() == at::kFloat;
  };
  const auto check = [&](const at::Tensor& t, std::initializer_list<int64_t> sizes, const char* name) {
    TORCH_CHECK_VALUE(on_device(t) && t.sizes() == at::IntArrayRef(sizes),
                      "trimul_inline: param_grads' ", name, " must be float32 ", text(at::IntArrayRef(sizes)),
                      " on the parameters' device, got ", t.scalar_type(), " ", text(t.sizes()));
  };
  const auto check_sums = [&](const at::Tensor& t, int64_t width, const char* name) {
    TORCH_CHECK_VALUE(on_device(t) && ((t.dim() == 1 && t.size(0) == width) ||
                                       (t.dim() == 2 && t.size(0) > 0 && t.size(1) == width && t.stride(1) == 1)),
                      "trimul_inline: param_grads' ", name, " must be float32 [", text(width),
                      "] or per-block partials [k, ", text(width), "] with rows of unit stride on the parameters' "
                      "device, got ", t.scalar_type(), " ", text(t.sizes()));
  };
  check(g_in, {4 * h, c}, "g_in");
  check_sums(s_in, 4 * h, "s_in");
  check(g_out, {c, h}, "g_out");
  check_sums(s_out, c, "s_out");
  check(g_gate, {c, c}, "g_gate");
  check_sums(s_gate, c, "s_gate");
  for (int i = 0; i < 16; ++i)
    TORCH_CHECK_VALUE(params[i].is_cuda() && params[i].device() == params[0].device() &&
                          params_f32[i].scalar_type() == at::kFloat && params_f32[i].sizes() == params[i].sizes(),
                      "trimul_inline: param_grads' parameters must be on one CUDA device (parameter ", text(i), ")");
  const c10::cuda::CUDAGuard guard(params[0].device());
  at::ScalarType dtype = params[0].scalar_type();
  for (const at::Tensor& t : params)
    if (t.scalar_type() != dtype) dtype = at::kFloat;
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) dtype = at::kFloat;
  std::vector<at::Tensor> grads, inputs;  // (inputs: the contiguous fp32 tensors the launch reads, held until it ran)
  for (const at::Tensor& t : params) grads.push_back(at::empty(t.sizes(), t.options().dtype(dtype)));
  const auto rows = [&](const at::Tensor& t) { return inputs.emplace_back(t.contiguous()).data_ptr<float>(); };
  // (the summed s of partials, where given: written by the launch, read by its second kernel)
  const bool partials = s_in.dim() == 2 || s_out.dim() == 2 || s_gate.dim() == 2;
  const at::Tensor summed = partials ? at::empty({4 * h + 2 * c}, g_in.options()) : at::Tensor();
  int64_t summed_at = 0;
  trimul::ParamGradArgs args{};
  const auto segment = [&](const at::Tensor& g, const at::Tensor& s, int param, int norm) {
    trimul::ParamGradArgs::Segment& sg = args.seg[args.segments++];
    sg.g = rows(g);
    if (s.dim() == 2) {
      sg.partials = s.data_ptr<float>();
      sg.partial_rows = s.size(0);
      sg.partial_stride = s.stride(0);
      sg.s = summed.data_ptr<float>() + summed_at;
      summed_at += s.size(1);
    } else {
      sg.s = rows(s);
    }
    sg.weight = rows(params_f32[param]);
    sg.d_weight = grads[param].data_ptr();
    sg.d_bias = grads[param + 1].data_ptr();
    sg.rows = g.size(0);
    sg.cols = g.size(1);
    sg.norm = norm;
  };
  for (int k = 0; k < 4; ++k) segment(g_in.narrow(0, k * h, h), s_in.narrow(-1, k * h, h), 2 + 2 * k, 0);
  segment(g_out, s_out, 12, 1);
  segment(g_gate, s_gate, 14, gate_normalized ? 0 : -1);
  for (int k = 0; k < 2; ++k) {
    trimul::ParamGradArgs::Norm& nm = args.norm[args.norms++];
    nm.ln_w = rows(params_f32[10 * k]);
    nm.ln_b = rows(params_f32[10 * k + 1]);
    nm.d_ln_w = grads[10 * k].data_ptr();
    nm.d_ln_b = grads[10 * k + 1].data_ptr();
    nm.cols = k == 0 ? c : h;
  }
  args.dtype = dtype_code(grads[0], "the parameter gradients");
  args.stream = at::cuda::getCurrentCUDAStream();
  check_launch(library().param_grads(args), "the parameter gradients (param_grads)");
  for (int i = 0; i < 16; ++i) grads[i] = host_backward::in_type(grads[i], params[i].scalar_type());
  return grads;
}

// The gradients of sum(grad_out * forward(pair, mask)) as trimul_inline.training_backward returns them
// ([d pair, d mask or None, the 16 parameters' in _PARAM_PATHS order], each in its tensor's dtype, no two
// sharing memory), or an empty list where a backward role's kernel is a torch baseline (Python's path
// then runs it; contract_backward's torch baseline, bmm, runs here). precision: the fp32 products'
// (trimul::Precision: contract_backward's kernel applies per precision); operand_f32: the operands are fp32
// (else bf16); the caller sets the matmul precision. saved_z: the forward's z planes [B*H, N, >= N] in the
// operand dtype (not recomputed); lean: proj is not kept across the output side and the contraction's backward
// (recomputed, the same GEMM, before d_proj, whose d proj overwrites it): the step's peak loses the [P, 4H] proj
// buffer, one GEMM more. saved_ab: the forward's
// a/b planes [2, B*H, N, >= N] in the operand dtype (with saved_z): gated_planes (and, lean, the first proj GEMM)
// of the recompute are skipped, the products read the planes in place (rows strided). saved_x_hat: the forward's
// LayerNorm_in rows [P, C] in the operand dtype (ForwardArgs::x_hat): no input_rows pass; saved_x_hat_rstd (with
// them): their rstd [P] fp32 (ForwardArgs::x_hat_rstd), with which d_proj can write d pair too (d_proj_d_pair).
// `saved` is None or the list [saved_z or None, saved_ab or None, saved_x_hat or None, saved_x_hat_rstd or None],
// which this call empties (once it knows it runs
// the backward), so that each buffer is freed as soon as its last use is done rather than when the caller
// returns. pair_grad / params_grad: whether d pair / the 16 parameters' gradients are wanted; an unwanted one is
// returned undefined and its work skipped (params: the three weight-gradient GEMMs, g_out's partials and
// param_grads; pair: d x_hat and the d_pair pass), which is what a frozen layer or a first layer saves.
std::vector<at::Tensor> training_backward(const at::Tensor& grad_out, const at::Tensor& pair, const at::Tensor& mask,
                                          const std::vector<at::Tensor>& params, const std::string& output_kernel,
                                          const std::string& input_kernel, const std::string& contract_kernel,
                                          const std::string& gemm_kernel, int64_t precision, bool operand_f32,
                                          bool incoming,
                                          bool gate_normalized, double eps_in, double eps_out, bool mask_grad,
                                          bool pair_grad, bool params_grad, const py::object& saved, bool lean,
                                          const py::object& contract_hook) {
  using namespace host_backward;
  using P = trimul::BackwardPass;
  TORCH_CHECK_VALUE(pair.is_cuda() && pair.dim() == 4 && params.size() == 16 && grad_out.sizes().equals(pair.sizes()),
                    "trimul_inline: training_backward takes CUDA pair [B, N, N, C], a grad_out like it and 16 "
                    "parameters");
  const c10::cuda::CUDAGuard guard(pair.device());
  const at::ScalarType acc = at::kFloat, dtype = operand_f32 ? at::kFloat : at::kBFloat16;
  // rows: pair's rows, N but for a block of them [B, rows, N, C] (a sharded rank's), whose contraction backward is
  // contract_hook's: hook(dz planes [B*H, rows, N]) -> (da, db) like it, the block's own rows of both gradients
  // (the caller's exchange); the block's planes are in the outgoing layout and its z is the caller's (saved).
  const bool hooked = !contract_hook.is_none();
  const int64_t batch = pair.size(0), rows = pair.size(1), n = pair.size(2), c = pair.size(3), h = params[2].size(0);
  TORCH_CHECK_VALUE(rows == n || hooked, "trimul_inline: training_backward takes a block of pair's rows [B, rows, N, "
                    "C] only with a contract_hook, got ", text(pair.sizes()));
  TORCH_CHECK_VALUE(!hooked || !incoming, "trimul_inline: training_backward's contract_hook takes the outgoing "
                    "layout's planes (incoming false)");
  const int64_t positions = batch * rows * n;
  const at::Tensor like = at::empty({0}, pair.options().dtype(dtype));
  Passes inputs{"input_backward", "", batch, n, c, h, incoming, like, precision, rows};
  Passes outputs{"output_backward", "", batch, n, c, h, incoming, like, precision, rows};
  inputs.kernel = role_kernel("input_backward", input_kernel, inputs);
  outputs.kernel = role_kernel("output_backward", output_kernel, outputs);
  if (inputs.kernel.empty() || outputs.kernel.empty()) return {};
  const std::string contracts =  // ("": cuBLAS's bmm; none where the hook contracts)
      hooked ? std::string() : role_kernel("contract_backward", contract_kernel, inputs);
  // The GEMMs over positions: fp32 rows at "highest" by the position_gemm role (position_gemm), the others
  // cuBLAS's at the mode's operand dtype.
  const bool rows_by_role = operand_f32 && precision == static_cast<int64_t>(trimul::Precision::highest);
  const auto rows_linear = [&](const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& bias) {
    return rows_by_role ? position_gemm(gemm_kernel, rows, weight, bias, precision) : linear(rows, weight, bias);
  };
  const auto rows_times = [&](const at::Tensor& rows, const at::Tensor& weight_kn) {  // rows @ weight_kn, fp32
    return rows_by_role ? position_gemm(gemm_kernel, rows, weight_kn.t(), c10::nullopt, precision)
                        : mm_to(rows, in_type(weight_kn, dtype), acc);
  };
  const auto rows_grad = [&](const at::Tensor& d_rows, const at::Tensor& rows) {  // d_rows^T @ rows, fp32
    return rows_by_role ? position_gemm_grad(gemm_kernel, d_rows, rows, precision) : mm_to(d_rows.t(), rows, acc);
  };
  c10::optional<at::Tensor> saved_z, saved_ab, saved_x_hat, saved_rstd;
  if (!saved.is_none()) {
    const py::list kept = saved.cast<py::list>();
    TORCH_CHECK_VALUE(kept.size() == 4,
                      "trimul_inline: training_backward's saved list is [z or None, a/b or None, x_hat or None, "
                      "x_hat's rstd or None]");
    if (!kept[0].is_none()) saved_z = kept[0].cast<at::Tensor>();
    if (!kept[1].is_none()) saved_ab = kept[1].cast<at::Tensor>();
    if (!kept[2].is_none()) saved_x_hat = kept[2].cast<at::Tensor>();
    if (!kept[3].is_none()) saved_rstd = kept[3].cast<at::Tensor>();
    kept.attr("clear")();
  }
  const auto rows_of = [&](int64_t width, at::ScalarType type) { return at::empty({positions, width}, like.options().dtype(type)); };
  const auto planes = [&]() { return at::empty({batch * h, rows, n}, like.options()); };
  const at::Tensor pair_rows = pair.reshape({positions, c}).contiguous();
  const at::Tensor mask_rows = mask.reshape({positions}).contiguous();

  // The parameters in fp32 and folded (param_fold), with the passes' partial-sum rows zeroed in the same launch.
  const int64_t out_sum_count = trimul::kBackwardSumRows * 2 * c, in_sum_count = trimul::kBackwardSumRows * 4 * h;
  const FoldedParams folded = fold_params(params, gate_normalized, out_sum_count + in_sum_count);
  const std::vector<at::Tensor>& p = folded.f32;
  const at::Tensor &w_in_f = folded.w_in_f, &b_in_f = folded.b_in_f;

  // The forward again, up to z: x_hat, proj = [pa | ga | pb | gb], a and b planes.
  at::Tensor x_hat, rstd_in;
  if (saved_rstd.has_value()) {
    TORCH_CHECK_VALUE(saved_x_hat.has_value(), "trimul_inline: training_backward's saved x_hat rstd comes with a "
                                               "saved x_hat");
    check_buffer(*saved_rstd, {positions}, at::kFloat, pair, "training_backward's saved x_hat rstd");
    rstd_in = *saved_rstd;
    saved_rstd.reset();
  }
  if (saved_x_hat.has_value()) {  // (the forward's input pass wrote them: the same rows, no pass here)
    check_buffer(*saved_x_hat, {positions, c}, dtype, pair, "training_backward's saved x_hat");
    x_hat = *saved_x_hat;
    saved_x_hat.reset();
  } else {
    x_hat = rows_of(c, dtype);
    inputs.run(P::input_rows, eps_in, {{"pair", pair_rows}, {"rows", x_hat}});
  }
  // proj_in_pass: d_proj recomputes proj from x_hat itself (the kernel's choice), so proj lives only until
  // gated_planes, where the recompute needs it.
  const bool proj_in_pass = inputs.takes(P::d_proj);
  // d_pair_in_proj: d_proj writes d pair too (d x_hat from its d proj tiles and d gate, LayerNorm_in's backward on
  // the kept x_hat with the kept rstd), so d proj is read once after it (d W_in's GEMM) and pair not at all;
  // where the gate reads LayerNorm_in's rows (the raw gate's share is outside LayerNorm_in's backward).
  const bool d_pair_in_proj = pair_grad && rstd_in.defined() && gate_normalized && proj_in_pass &&
                              inputs.takes(P::d_proj_d_pair);
  // d_x_hat_in_pass: d_pair multiplies d proj (and d gate) by the weights itself, so d x_hat is never written.
  const bool d_x_hat_in_pass = !d_pair_in_proj && inputs.takes(P::d_pair);
  at::Tensor proj, a_planes, b_planes;
  if (hooked) {  // (no a/b planes here: the hook's exchange keeps its own)
    TORCH_CHECK_VALUE(saved_z.has_value() && !saved_ab.has_value(), "trimul_inline: training_backward with a "
                      "contract_hook takes a saved z and no saved a/b");
    if (!lean && !proj_in_pass) proj = rows_linear(x_hat, w_in_f, b_in_f);  // (for d_proj; lean makes it there)
  } else if (saved_ab.has_value()) {
    TORCH_CHECK_VALUE(saved_z.has_value() && saved_ab->dim() == 4 && saved_ab->size(0) == 2 &&
                          saved_ab->size(1) == batch * h && saved_ab->size(2) == n && saved_ab->size(3) >= n &&
                          saved_ab->stride(3) == 1 && saved_ab->scalar_type() == dtype,
                      "trimul_inline: training_backward's saved a/b must be [2, B*H, N, >= N] in the operand dtype, "
                      "with a saved z");
    a_planes = saved_ab->select(0, 0).narrow(2, 0, n);
    b_planes = saved_ab->select(0, 1).narrow(2, 0, n);
    saved_ab.reset();  // (the two views hold it: freed with the later of them)
    if (!lean && !proj_in_pass) proj = rows_linear(x_hat, w_in_f, b_in_f);  // (for d_proj; lean makes it there)
  } else {
    proj = rows_linear(x_hat, w_in_f, b_in_f);
    a_planes = planes();
    b_planes = planes();
    inputs.run(P::gated_planes, 0.0, {{"proj", proj}, {"mask", mask_rows}, {"a_planes", a_planes}, {"b_planes", b_planes}});
    if (lean || proj_in_pass) proj.reset();
  }
  at::Tensor z_planes;
  if (saved_z.has_value()) {
    TORCH_CHECK_VALUE(saved_z->dim() == 3 && saved_z->size(0) == batch * h && saved_z->size(1) == rows &&
                          saved_z->size(2) >= n && saved_z->scalar_type() == dtype,
                      "trimul_inline: training_backward's saved z must be [B*H, rows, >= N] in the operand dtype");
    z_planes = saved_z->narrow(2, 0, n).contiguous();
    saved_z.reset();  // (z_planes holds it, or a copy of its rows: freed with z_planes)
  } else {
    z_planes = contracts.empty() ? at::bmm(a_planes, b_planes.transpose(1, 2))
                                 : contract_backward_products(contracts, a_planes, b_planes, c10::nullopt)[0];
  }

  // output_backward: out = sigmoid(gate_rows W_g^T + b_g) * (z_hat W_out_f^T + b_out_f).
  at::Tensor z_hat = rows_of(h, dtype), rstd_out = rows_of(1, acc);
  const at::Tensor &w_out_f = folded.w_out_f, &b_out_f = folded.b_out_f, &w_gate = folded.w_gate_f,
                   &b_gate = folded.b_gate_f;
  at::Tensor gate_rows = gate_normalized ? x_hat : in_type(pair_rows, dtype);
  const at::Tensor out_sums = folded.zeroed.narrow(0, 0, out_sum_count).view({trimul::kBackwardSumRows, 2 * c});
  const at::Tensor d_out_rows = grad_out.reshape({positions, c}).contiguous();
  at::Tensor d_o, d_gate;
  const bool gate_from_z = outputs.takes(P::z_gate_grad);
  // joined: d proj and d gate as the two parts of one [P, 4H + C] buffer (gate_grad and d_proj write their rows
  // ld_rows apart), so that d x_hat is one GEMM against [W_in_f; W_gate_f], not a second GEMM adding d gate
  // W_gate_f into the first's fp32 result (a read and a write of [P, C] fp32 more). Where d x_hat is a GEMM here
  // and the gate reads x_hat.
  const bool joined = pair_grad && gate_normalized && !d_x_hat_in_pass && !proj_in_pass && !lean && !gate_from_z;
  at::Tensor d_rows;  // (joined: [d proj | d gate])
  if (gate_from_z) {
    // (z_rows, both products and gate_grad in one pass: o and gate_pre never written)
    d_o = rows_of(c, dtype);
    d_gate = rows_of(c, dtype);
    outputs.run(P::z_gate_grad, eps_out, {{"a_planes", z_planes}, {"x_hat", gate_rows}, {"w_out_f", w_out_f.contiguous()},
                                          {"b_out_f", b_out_f.contiguous()}, {"w_gate_f", w_gate.contiguous()},
                                          {"b_gate_f", b_gate.contiguous()}, {"d_out", d_out_rows}, {"o", d_o},
                                          {"gate_pre", d_gate}, {"rows", z_hat}, {"rstd", rstd_out},
                                          {"sums", out_sums}});
    z_planes.reset();
  } else {
    outputs.run(P::z_rows, eps_out, {{"a_planes", z_planes}, {"rows", z_hat}, {"rstd", rstd_out}});
    z_planes.reset();
    d_o = rows_linear(z_hat, w_out_f, b_out_f);
    d_gate = rows_linear(gate_rows, w_gate, b_gate);
    // (o and gate_pre become d o and d gate; joined, d gate goes to its part of d_rows)
    std::unordered_map<std::string, at::Tensor> gate_tensors{{"d_out", d_out_rows}, {"o", d_o}, {"gate_pre", d_gate},
                                                             {"sums", out_sums}};
    if (joined) {
      d_rows = rows_of(4 * h + c, dtype);
      gate_tensors["gate_out"] = d_rows.narrow(1, 4 * h, c);
    }
    outputs.run(P::gate_grad, 0.0, gate_tensors);
    gate_tensors.clear();
    if (joined) d_gate = d_rows.narrow(1, 4 * h, c);
  }
  const at::Tensor g_gate = params_grad ? rows_grad(d_gate, gate_rows) : at::Tensor();
  gate_rows.reset();
  std::unordered_map<std::string, at::Tensor> dz_tensors{{"rows", z_hat}, {"rstd", rstd_out}};
  // g_out_in_pass: g_out = d o^T z_hat as the dz pass's per-block partials, summed here (no GEMM reading both again)
  const bool g_out_in_pass = params_grad && outputs.takes(P::dz_planes_g_out);
  at::Tensor g_out, g_out_partials;
  if (g_out_in_pass) {
    g_out_partials = at::empty({g_out_partial_rows(like), c, h}, like.options().dtype(acc));
    dz_tensors["g_out"] = g_out_partials;
  } else if (params_grad) {
    g_out = rows_grad(d_o, z_hat);
  }
  if (g_out_in_pass || outputs.takes(P::dz_planes)) {
    dz_tensors["d_o"] = d_o;  // (d z_hat multiplied in the pass, never written)
    dz_tensors["w_out_f"] = w_out_f.contiguous();
  } else {
    dz_tensors["d_rows"] = rows_times(d_o, w_out_f);
  }
  d_o.reset();
  at::Tensor dz = dz_tensors["a_planes"] = planes();
  outputs.run(g_out_in_pass ? P::dz_planes_g_out : P::dz_planes, 0.0, dz_tensors);
  dz_tensors.clear();
  if (g_out_in_pass) g_out = g_out_partials.sum(0);
  z_hat.reset();

  // contract_backward
  at::Tensor da, db;
  if (hooked) {
    const py::tuple grads = contract_hook(dz);
    TORCH_CHECK_VALUE(grads.size() == 2, "trimul_inline: training_backward's contract_hook returns (da, db)");
    da = grads[0].cast<at::Tensor>().contiguous();
    db = grads[1].cast<at::Tensor>().contiguous();
    TORCH_CHECK_VALUE(da.sizes().equals(dz.sizes()) && db.sizes().equals(dz.sizes()) && da.scalar_type() == dtype &&
                          db.scalar_type() == dtype && da.device() == dz.device() && db.device() == dz.device(),
                      "trimul_inline: training_backward's contract_hook returns da and db like dz ",
                      text(dz.sizes()), " in the operand dtype");
  } else if (contracts.empty()) {
    da = at::bmm(dz, b_planes);
    db = at::bmm(dz.transpose(1, 2), a_planes);
  } else {
    const std::vector<at::Tensor> grads = contract_backward_products(contracts, a_planes, b_planes, dz);
    da = grads[0];
    db = grads[1];
  }
  a_planes.reset();
  b_planes.reset();
  dz.reset();

  // input_backward
  if (lean && !proj_in_pass) proj = rows_linear(x_hat, w_in_f, b_in_f);
  // (lean: in place, d_proj reads a row before it writes it)
  at::Tensor d_proj = proj_in_pass ? rows_of(4 * h, dtype)
                     : lean       ? proj
                     : joined     ? d_rows.narrow(1, 0, 4 * h)
                                  : at::empty_like(proj);
  const at::Tensor in_sums =
      folded.zeroed.narrow(0, out_sum_count, in_sum_count).view({trimul::kBackwardSumRows, 4 * h});
  std::unordered_map<std::string, at::Tensor> tensors{{"a_planes", da}, {"b_planes", db}, {"mask", mask_rows},
                                                      {"rows", d_proj}, {"sums", in_sums}};
  if (proj_in_pass) {
    tensors["x_hat"] = x_hat;
    tensors["w_in_f"] = w_in_f.contiguous();
    tensors["b_in_f"] = b_in_f.contiguous();
  } else {
    tensors["proj"] = proj;
  }
  at::Tensor d_mask;
  if (mask_grad) tensors["d_mask"] = d_mask = at::empty({positions}, like.options().dtype(acc));
  // (d pair in pair's dtype: the pass rounds a 16-bit gradient once; made here only where d_proj writes it, so
  // that elsewhere it is not live beside da, db and d proj)
  at::Tensor d_pair;
  if (d_pair_in_proj) {
    tensors["d_pair"] = d_pair = at::empty_like(pair_rows);
    tensors["rstd"] = rstd_in;
    tensors["d_gate"] = d_gate;
    tensors["w_gate_f"] = w_gate.contiguous();
  }
  inputs.run(d_pair_in_proj ? P::d_proj_d_pair : P::d_proj, eps_in, tensors);
  tensors.clear();
  proj.reset();
  da.reset();
  db.reset();
  rstd_in.reset();
  const at::Tensor g_in = params_grad ? rows_grad(d_proj, x_hat) : at::Tensor();
  if (pair_grad && !d_pair_in_proj) {  // (else d_proj_d_pair wrote d pair, or none is wanted)
    std::unordered_map<std::string, at::Tensor> pair_tensors{{"pair", pair_rows}};
    if (d_x_hat_in_pass) {
      pair_tensors["rows"] = d_proj;
      pair_tensors["w_in_f"] = w_in_f.contiguous();
      if (gate_normalized) {
        pair_tensors["d_gate"] = d_gate;
        pair_tensors["w_gate_f"] = w_gate.contiguous();
      }
    } else if (joined) {
      pair_tensors["d_rows"] = rows_times(d_rows, at::cat({w_in_f, w_gate}));
      d_rows.reset();
      d_proj.reset();
      d_gate.reset();
    } else {
      at::Tensor d_x_hat = rows_times(d_proj, w_in_f);
      d_proj.reset();
      if (gate_normalized) add_mm_(d_x_hat, d_gate, in_type(w_gate, dtype));
      pair_tensors["d_rows"] = d_x_hat;
    }
    // (the raw gate's w_gate is out_gate's own weight)
    if (!gate_normalized) pair_tensors["d_rows_add"] = rows_times(d_gate, w_gate);
    pair_tensors["d_pair"] = d_pair = at::empty_like(pair_rows);
    inputs.run(P::d_pair, eps_in, pair_tensors);
  }
  d_proj.reset();
  d_gate.reset();

  std::vector<at::Tensor> grads{pair_grad ? d_pair.view(pair.sizes()) : at::Tensor(),  // (the pass wrote pair's dtype)
                                mask_grad ? in_type(d_mask.view(mask.sizes()), mask.is_floating_point() ? mask.scalar_type() : acc)
                                          : at::Tensor()};
  if (!params_grad) {
    grads.resize(2 + params.size());
    return grads;
  }
  for (at::Tensor& g : parameter_grads(params, p, g_in, in_sums, g_out, out_sums.narrow(1, 0, c), g_gate,
                                       out_sums.narrow(1, c, c), gate_normalized))
    grads.push_back(std::move(g));
  return grads;
}

// A checked eager call's decisions, kept so the next no-grad call with the same signature goes from
// Python straight to forward(): the Python around a small forward (its signature, the parameters'
// freshness, module.__call__) costs more than the GPU work at the seed shapes. run() returns None, and
// the caller takes its full path, unless all of these still hold:
// - the signature: pair's and mask's sizes, dtypes and devices, pair's channel stride, the resolved
//   float32 matmul precision (passed in), grad mode and CUDA autocast off;
// - the same objects under each (dict, key) of `entries` (the module's submodules, their parameters)
//   and under each attribute of `attributes` (owner, name; owner None: the module run() is given);
// - each parameter's data pointer, dtype and version counter (in-place updates, `.data =`).
// It holds references to the submodules and parameters, never to the module itself (which holds it).
class PlannedForward {
 public:
  PlannedForward(py::list entries, py::list attributes, std::vector<at::Tensor> params, const at::Tensor& pair,
                 const at::Tensor& mask, py::str precision, std::vector<at::Tensor> weights, ForwardOptions options,
                 c10::optional<std::vector<at::Tensor>> gate_weights)
      : params_(std::move(params)),
        pair_sizes_(pair.sizes().vec()),
        mask_sizes_(mask.sizes().vec()),
        pair_dtype_(pair.scalar_type()),
        mask_dtype_(mask.scalar_type()),
        device_(pair.device()),
        pair_channel_stride_(pair.stride(-1)),
        precision_(std::move(precision)),
        weights_(std::move(weights)),
        options_(std::move(options)),
        gate_weights_(std::move(gate_weights)) {
    // (raw pointers into tuples that held_ keeps alive: the per-call checks skip pybind's accessors)
    for (const auto& entry : entries) {
      const auto t = entry.cast<py::tuple>();
      TORCH_CHECK_VALUE(t.size() == 3 && PyDict_Check(t[0].ptr()), "trimul_inline: entries are (dict, key, object)");
      entries_.push_back({t[0].ptr(), t[1].ptr(), t[2].ptr()});
      held_.push_back(t);
    }
    for (const auto& attribute : attributes) {
      const auto t = attribute.cast<py::tuple>();
      TORCH_CHECK_VALUE(t.size() == 3, "trimul_inline: attributes are (owner or None, name, object)");
      attributes_.push_back({t[0].is_none() ? nullptr : t[0].ptr(), t[1].ptr(), t[2].ptr()});
      held_.push_back(t);
    }
    for (const auto& p : params_) param_state_.emplace_back(p.data_ptr(), p.scalar_type(), p._version());
  }

  bool matches(py::handle module, py::handle pair, py::handle mask, py::handle precision) const {
    if (at::GradMode::is_enabled() || at::autocast::is_autocast_enabled(at::kCUDA)) return false;
    if (!THPVariable_Check(pair.ptr()) || !THPVariable_Check(mask.ptr())) return false;
    const at::Tensor& p = THPVariable_Unpack(pair.ptr());
    const at::Tensor& m = THPVariable_Unpack(mask.ptr());
    if (!p.sizes().equals(pair_sizes_) || p.scalar_type() != pair_dtype_ || p.device() != device_ ||
        p.stride(-1) != pair_channel_stride_ || !m.sizes().equals(mask_sizes_) || m.scalar_type() != mask_dtype_ ||
        m.device() != device_)
      return false;
    const int same_precision = PyObject_RichCompareBool(precision.ptr(), precision_.ptr(), Py_EQ);
    if (same_precision != 1) {
      if (same_precision < 0) PyErr_Clear();
      return false;
    }
    for (const Held& entry : entries_)
      if (PyDict_GetItemWithError(entry.owner, entry.key) != entry.expected) {
        PyErr_Clear();
        return false;
      }
    for (const Held& attribute : attributes_) {
      PyObject* value = PyObject_GetAttr(attribute.owner != nullptr ? attribute.owner : module.ptr(), attribute.key);
      if (value == nullptr) PyErr_Clear();
      Py_XDECREF(value);  // (only its identity is compared, and the attribute still holds it)
      if (value != attribute.expected) return false;
    }
    for (size_t i = 0; i < params_.size(); ++i)
      if (param_state_[i] != std::make_tuple(params_[i].data_ptr(), params_[i].scalar_type(), params_[i]._version()))
        return false;
    return true;
  }

  py::object run(py::handle module, py::handle pair, py::handle mask, py::handle precision) const {
    if (!matches(module, pair, mask, precision)) return py::none();
    return py::cast(
        forward(THPVariable_Unpack(pair.ptr()), THPVariable_Unpack(mask.ptr()), weights_, options_, gate_weights_));
  }

 private:
  struct Held {
    PyObject* owner;  // a dict (entries) or an attribute's owner (nullptr: the module run() is given)
    PyObject* key;
    PyObject* expected;
  };
  std::vector<py::tuple> held_;
  std::vector<Held> entries_, attributes_;
  std::vector<at::Tensor> params_;
  std::vector<std::tuple<void*, at::ScalarType, int64_t>> param_state_;
  std::vector<int64_t> pair_sizes_, mask_sizes_;
  at::ScalarType pair_dtype_, mask_dtype_;
  at::Device device_;
  int64_t pair_channel_stride_;
  py::str precision_;
  std::vector<at::Tensor> weights_;
  ForwardOptions options_;
  c10::optional<std::vector<at::Tensor>> gate_weights_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The backward's "does the kernel take this pass" queries: (kernel, sizes, like, precision, block_rows = 0).
  const auto def_takes = [&m](const char* name, auto function, const char* doc) {
    m.def(name, function, doc, py::arg("kernel"), py::arg("batch"), py::arg("n"), py::arg("c"), py::arg("h"),
          py::arg("incoming"), py::arg("like"), py::arg("precision"), py::arg("block_rows") = 0);
  };
  m.def("attach_kernels", &attach_kernels, "load a kernel library (kernels/*.cu) and use it from now on");
  m.def("kernels", &kernels, "(role, name, rank, torch, in_registry, built, applies, summary) of every kernel");
  m.def("contract", &contract, "z = a @ b^T per batch, by the named contraction kernel ('': the default order)");
  m.def("contract_split", &contract_split,
        "z = a @ b^T per batch from split fp32 operands (each batch's TF32 parts, then its remainders: 3xTF32)");
  py::class_<ForwardOptions>(m, "ForwardOptions", "a module's choices for the fused forward")
      .def(py::init([](std::array<std::string, trimul::kForwardRoles> kernels, int64_t mode, bool incoming,
                       bool gate_normalized, double eps_in, double eps_out, int64_t hidden) {
             return ForwardOptions{std::move(kernels), mode, incoming, gate_normalized, eps_in, eps_out, hidden};
           }),
           py::arg("kernels"), py::arg("mode"), py::arg("incoming"), py::arg("gate_normalized"), py::arg("eps_in"),
           py::arg("eps_out"), py::arg("hidden"));
  m.def("forward", &forward, "the fused forward: input pass, contraction, output pass (the gate on x_hat where "
        "gate weights are given and forward_plan says inference_gate_rows)", py::arg("pair"), py::arg("mask"),
        py::arg("weights"), py::arg("options"), py::arg("gate_weights") = py::none());
  m.def("forward_plan", &forward_plan, "each role's kernel and the buffers of the steps, for a call");
  m.def("input_pass", &input_pass, "the input pass into ab (and x_hat, where given; b apart, where given)",
        py::arg("pair"), py::arg("mask"), py::arg("weights"), py::arg("options"), py::arg("ab"),
        py::arg("x_hat") = py::none(), py::arg("x_hat_rstd") = py::none(), py::arg("b") = py::none());
  m.def("contraction", &contraction, "the contraction of ab into z (nothing where the output pass contracts)");
  m.def("output_pass", &output_pass, "the output pass from z (or ab) into out (the gate on gate_rows, where given)",
        py::arg("pair"), py::arg("mask"), py::arg("weights"), py::arg("options"), py::arg("ab"), py::arg("z"),
        py::arg("out"), py::arg("gate_rows") = py::none());
  m.def("fused_takes", &fused_takes, "whether the fused passes take these sizes in this mode");
  // (block_rows: a block of pair's rows, BackwardArgs::block_rows; 0: N)
  m.def("backward_kernel", &backward_kernel, "the kernel a backward role runs ('': a torch baseline's passes)",
        py::arg("role"), py::arg("chosen"), py::arg("batch"), py::arg("n"), py::arg("c"), py::arg("h"),
        py::arg("incoming"), py::arg("like"), py::arg("precision"), py::arg("block_rows") = 0);
  m.def("backward_pass", &backward_pass, "one memory pass of the backward (trimul::BackwardPass) on given tensors",
        py::arg("role"), py::arg("kernel"), py::arg("pass"), py::arg("batch"), py::arg("n"), py::arg("c"), py::arg("h"),
        py::arg("incoming"), py::arg("precision"), py::arg("eps"), py::arg("like"), py::arg("tensors"),
        py::arg("block_rows") = 0);
  m.def("position_gemm_grad", &position_gemm_grad, "d_rows^T @ rows over positions, fp32, by the position_gemm role's kernel",
        py::arg("kernel"), py::arg("d_rows"), py::arg("rows"), py::arg("precision"));
  m.def("position_gemm", &position_gemm, "rows [M, K] @ weight^T (+ bias), fp32, by the position_gemm role's kernel",
        py::arg("kernel"), py::arg("rows"), py::arg("weight"), py::arg("bias"), py::arg("precision"));
  m.def("contract_backward_products", &contract_backward_products,
        "contract_backward on a library kernel: [z = a b^T] without dz, else [da = dz b, db = dz^T a]",
        py::arg("kernel"), py::arg("a"), py::arg("b"), py::arg("dz"), py::arg("planes_per_call") = py::none());
  m.def("param_grads", &parameter_grads, "the 16 parameters' gradients from the folded GEMMs' g and bias sums");
  m.def("param_fold", &param_fold, "the 16 parameters in fp32 and the folded Linears' weights and biases");
  m.def("weight_prep", &weight_prep, "prepare_weights' list for the 16-bit modes in one launch",
        py::arg("params"), py::arg("f16"), py::arg("x_hat_gate"));
  def_takes("d_pair_in_d_proj", &d_pair_in_d_proj, "whether an input_backward kernel takes d_proj_d_pair");
  def_takes("d_proj_from_x_hat", &d_proj_from_x_hat, "whether an input_backward kernel takes d_proj from x_hat");
  def_takes("d_pair_from_d_proj", &d_pair_from_d_proj, "whether an input_backward kernel takes d_pair from d proj");
  def_takes("dz_planes_g_out", &dz_planes_g_out, "whether an output_backward kernel takes dz_planes_g_out (g_out in the pass)");
  m.def("g_out_partial_rows", &g_out_partial_rows, "rows of dz_planes_g_out's per-block g_out partials on like's device");
  def_takes("dz_planes_from_d_o", &dz_planes_from_d_o, "whether an output_backward kernel takes dz_planes from d o");
  def_takes("gate_grad_from_z", &gate_grad_from_z, "whether an output_backward kernel takes z_gate_grad (gate_grad from z)");
  m.def("training_backward", &training_backward,
        "the whole backward on the library's backward kernels and cuBLAS ([] where a role is a torch baseline)",
        py::arg("grad_out"), py::arg("pair"), py::arg("mask"), py::arg("params"), py::arg("output_kernel"),
        py::arg("input_kernel"), py::arg("contract_kernel"), py::arg("gemm_kernel"), py::arg("precision"),
        py::arg("operand_f32"), py::arg("incoming"), py::arg("gate_normalized"), py::arg("eps_in"), py::arg("eps_out"),
        py::arg("mask_grad"), py::arg("pair_grad"), py::arg("params_grad"), py::arg("saved"), py::arg("lean"),
        py::arg("contract_hook") = py::none());
  py::class_<PlannedForward>(m, "PlannedForward", "a checked eager call's decisions (ModelNew._fast)")
      .def(py::init<py::list, py::list, std::vector<at::Tensor>, const at::Tensor&, const at::Tensor&, py::str,
                    std::vector<at::Tensor>, ForwardOptions, c10::optional<std::vector<at::Tensor>>>())
      .def("matches", &PlannedForward::matches, "whether run() would take this call")
      .def("run", &PlannedForward::run, "forward() for a call that matches, else None");
}
