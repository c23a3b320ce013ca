// bindings.cpp — thin pybind functions: check tensors, pick the launcher, launch on PyTorch's
// current stream, check the launch. Ops are registered from Python (torch.library.custom_op),
// never with TORCH_LIBRARY here, so a rebuilt .so can be loaded into the same process.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "api.cuh"

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

trimul::Dtype dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return trimul::Dtype::f32;
    case at::kBFloat16: return trimul::Dtype::bf16;
    case at::kHalf: return trimul::Dtype::f16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "trimul_inline: ", what, " must be float32, bfloat16 or float16, got ",
                   t.scalar_type());
}

void check_launch(cudaError_t status, const char* what) {
  TORCH_CHECK(status != cudaErrorNotSupported, "trimul_inline: ", what,
              " does not support these sizes/dtypes on this GPU");
  C10_CUDA_CHECK(status);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_matrix_stack(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.is_cuda(), "trimul_inline: ", what, " must be a CUDA tensor");
  TORCH_CHECK_VALUE(t.dim() == 3, "trimul_inline: ", what, " must be 3-D [batch, rows, k], got ",
                    t.dim(), "-D");
  TORCH_CHECK_VALUE(t.is_contiguous(), "trimul_inline: ", what, " must be contiguous");
}

// z[batch, i, j] = sum_k a[batch, i, k] * b[batch, j, k], written into z by the named variant.
void contract(const std::string& variant, const at::Tensor& a, const at::Tensor& b, at::Tensor& z,
              int64_t precision) {
  check_matrix_stack(a, "a");
  check_matrix_stack(b, "b");
  check_matrix_stack(z, "z");
  TORCH_CHECK_VALUE(a.device() == b.device() && a.device() == z.device(),
                    "trimul_inline: a, b and z must be on one device");
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "trimul_inline: a and b dtypes differ (",
                   a.scalar_type(), " vs ", b.scalar_type(), ")");
  TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(2) == b.size(2),
                    "trimul_inline: a ", a.sizes(), " and b ", b.sizes(), " do not share batch and k");
  TORCH_CHECK_VALUE(z.size(0) == a.size(0) && z.size(1) == a.size(1) && z.size(2) == b.size(1),
                    "trimul_inline: z ", z.sizes(), " must be [batch, a rows, b rows]");
  TORCH_CHECK_VALUE(precision >= 0 && precision <= 2, "trimul_inline: precision code ", precision,
                    " is not 0 (highest), 1 (high) or 2 (medium)");
  const trimul::ContractFn fn = trimul::find_contraction(variant.c_str());
  TORCH_CHECK_VALUE(fn != nullptr, "trimul_inline: no contraction kernel named '", variant,
                    "' in this build");

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
  args.batch = a.size(0);
  args.m = a.size(1);
  args.n = b.size(1);
  args.k = k;
  args.lda = k_pad;
  args.ldz = z.size(2);
  args.operand = dtype_code(a, "a");
  args.out = dtype_code(z, "z");
  args.precision = static_cast<trimul::Precision>(precision);
  args.stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  check_launch(fn(args), ("contraction kernel '" + variant + "'").c_str());
}

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
                   " is not supported by the fused kernels (bool, uint8, int32, int64, float32, "
                   "bfloat16, float16)");
}

// A fused pass's pinned kernel from `variable` (nullptr when unset or empty): a name that is no
// kernel raises rather than silently measuring the default order.
const char* pass_pin(const char* variable) {
  const char* pin = std::getenv(variable);
  if (pin == nullptr || pin[0] == '\0') return nullptr;
  const bool input = std::strcmp(variable, "TRIMUL_INPUT_PASS") == 0;
  TORCH_CHECK_VALUE(trimul::known_pass_kernel(pin, input), "trimul_inline: ", variable, " must be ",
                    input ? "wgmma_rs, " : "", "wgmma_rs_wide, wgmma, resident or streamed, not '", pin, "'");
  return pin;
}

// A two-valued measuring knob (README): -1 where it is unset or empty, else the index of its value in
// {first, second}; any other value raises a ValueError that names both.
int env_choice(const char* variable, const char* first, const char* second) {
  const char* value = std::getenv(variable);
  if (value == nullptr || value[0] == '\0') return -1;
  const bool is_second = std::strcmp(value, second) == 0;
  TORCH_CHECK_VALUE(is_second || std::strcmp(value, first) == 0, "trimul_inline: ", variable, " must be ", first,
                    " or ", second, ", not '", value, "'");
  return is_second ? 1 : 0;
}

trimul::Precision contraction_precision(trimul::Mode mode) {
  switch (mode) {
    case trimul::Mode::tf32x3: return trimul::Precision::highest;
    case trimul::Mode::tf32: return trimul::Precision::high;
    default: return trimul::Precision::medium;
  }
}

// The whole forward: input pass -> contraction (the named variant, or "auto") -> output pass.
// `weights` are the host-prepared tensors (see ForwardArgs): ln_in_w, ln_in_b, ln_out_w, ln_out_b,
// w_in, b_in, w_gate, b_gate, w_out, b_out (ln_out_* are folded into w_out / b_out already and only
// give hidden's size here), and in the "highest" mode w_in_f16x3, w_gate_f16x3, w_out_f16x3 and
// f16x3_scales (ForwardArgs).
// Sizes must pass fused_fits.
at::Tensor forward(const at::Tensor& pair, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                   const std::string& variant, int64_t mode_code, bool incoming, bool gate_normalized,
                   double eps_in, double eps_out) {
  TORCH_CHECK_VALUE(pair.is_cuda() && pair.dim() == 4 && pair.size(1) == pair.size(2),
                    "trimul_inline: pair must be a CUDA tensor (B, N, N, C)");
  TORCH_CHECK_VALUE(pair.stride(3) == 1, "trimul_inline: pair's channel stride must be 1");
  TORCH_CHECK_VALUE(mask.device() == pair.device() && mask.dim() == 3 &&
                        mask.sizes().equals(pair.sizes().slice(0, 3)),
                    "trimul_inline: mask must be (B, N, N) on pair's device");
  TORCH_CHECK_VALUE(mode_code >= 0 && mode_code <= 3, "trimul_inline: mode code ", mode_code);
  // (the fp32 modes' wgmma passes may multiply scaled fp16: ForwardArgs::w_in_f16x3)
  const bool f16x3_weights = static_cast<trimul::Mode>(mode_code) == trimul::Mode::tf32x3 ||
                             static_cast<trimul::Mode>(mode_code) == trimul::Mode::tf32;
  TORCH_CHECK_VALUE(weights.size() == (f16x3_weights ? 14u : 11u), "trimul_inline: forward takes ",
                    f16x3_weights ? 14 : 11, " prepared weights in this mode, got ", weights.size());
  for (const auto& w : weights)
    TORCH_CHECK_VALUE(w.device() == pair.device() && w.is_contiguous() &&
                          reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
                      "trimul_inline: prepared weights must be contiguous, 16-byte aligned, on pair's device");
  // "auto": wgmma_tma or wgmma (sm_90a; 16-bit or TF32 operands) or mma, or for N <= kFusedContractionMaxN the output
  // pass contracts itself.
  const bool fuse_contraction = variant == "auto" && pair.size(1) <= trimul::kFusedContractionMaxN;
  std::vector<std::string> kernels{variant};
  if (variant == "auto") {
    kernels = {"wgmma_tma", "wgmma", "mma"};  // each declines what it does not take (3xTF32, pre-Hopper)
  }
  for (const auto& name : kernels)
    TORCH_CHECK_VALUE(name == "bmm" || fuse_contraction || trimul::find_contraction(name.c_str()) != nullptr,
                      "trimul_inline: no contraction kernel '", name, "' in this build");
  const c10::cuda::CUDAGuard guard(pair.device());
  const auto mode = static_cast<trimul::Mode>(mode_code);
  const at::ScalarType op_type = weights[4].scalar_type();
  const int64_t batch = pair.size(0), n = pair.size(1), c = pair.size(3);
  const int64_t hidden = weights[2].size(0);

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
  args.batch = batch;
  args.n = n;
  args.c = c;
  args.h = hidden;
  args.incoming = incoming;
  args.gate_normalized = gate_normalized;
  args.mode = mode;
  args.eps_in = static_cast<float>(eps_in);
  args.eps_out = static_cast<float>(eps_out);
  args.ln_in_w = weights[0].data_ptr<float>();
  args.ln_in_b = weights[1].data_ptr<float>();
  args.w_in = weights[4].data_ptr();
  args.b_in = weights[5].data_ptr<float>();
  args.rows_ab = weights[4].size(0) / 2;
  args.w_gate = weights[6].data_ptr();
  args.b_gate = weights[7].data_ptr<float>();
  args.w_out = weights[8].data_ptr();
  args.b_out = weights[9].data_ptr<float>();
  args.c_pad = weights[4].size(1);
  args.h_pad = weights[8].size(1);
  TORCH_CHECK_VALUE(args.c_pad == round_up(c, 32) && args.h_pad == round_up(hidden, 32) &&
                        args.rows_ab == round_up(2 * hidden, 128) && weights[6].size(1) == args.c_pad,
                    "trimul_inline: prepared weights do not match pair_dim ", c, " / hidden ", hidden);
  if (!f16x3_weights) {
    TORCH_CHECK_VALUE(weights[10].scalar_type() == op_type && weights[10].dim() == 2 &&
                          weights[10].size(0) == weights[4].size(0) && weights[10].size(1) == weights[4].size(1) + 64,
                      "trimul_inline: prepared register-row weights do not match pair_dim ", c, " / hidden ", hidden);
    args.w_in_rows = weights[10].data_ptr();
  } else {
    const auto is_f16x3 = [](const at::Tensor& w, int64_t rows, int64_t k_pad) {
      return w.scalar_type() == at::kHalf && w.dim() == 2 && w.size(0) == rows && w.size(1) == 2 * round_up(k_pad, 64);
    };
    const int64_t rows_c = round_up(c, 128);
    TORCH_CHECK_VALUE(is_f16x3(weights[10], 2 * args.rows_ab, args.c_pad) && is_f16x3(weights[11], rows_c, args.c_pad) &&
                          is_f16x3(weights[12], rows_c, args.h_pad) && weights[13].scalar_type() == at::kFloat &&
                          weights[13].numel() == trimul::kF16x3Scales,
                      "trimul_inline: prepared fp16x3 weights do not match pair_dim ", c, " / hidden ", hidden);
    args.w_in_f16x3 = weights[10].data_ptr();
    args.w_gate_f16x3 = weights[11].data_ptr();
    args.w_out_f16x3 = weights[12].data_ptr();
    args.f16x3_scales = weights[13].data_ptr<float>();
  }
  args.ld = round_up(n, 32);
  args.z_dtype = trimul::z_dtype_for(mode);
  // (16-bit z rows 16-byte aligned, for the contraction's 16-byte stores)
  args.ldz = round_up(n, args.z_dtype == trimul::Dtype::f32 ? 4 : 8);
  args.stream = c10::cuda::getCurrentCUDAStream(pair.device().index()).stream();
  // The measuring knobs (ForwardArgs::input_pin ..), read at each forward so a running process can switch.
  args.input_pin = pass_pin("TRIMUL_INPUT_PASS");
  args.output_pin = pass_pin("TRIMUL_OUTPUT_PASS");
  // (unset: on, on GPUs that have it: launch_tiles)
  args.dependent_output_launch = env_choice("TRIMUL_PDL", "0", "1") != 0;
  const int staging = env_choice("TRIMUL_INPUT_STAGING", "rounds", "stream");
  args.input_staging = staging < 0    ? trimul::InputStaging::kAuto
                       : staging == 0 ? trimul::InputStaging::kRounds
                                      : trimul::InputStaging::kStream;
  args.ab_store_tma = env_choice("TRIMUL_AB_STORE", "threads", "tma") != 0;
  if (const char* plan = std::getenv("TRIMUL_INPUT_PLAN"); plan != nullptr && plan[0] != '\0')
    TORCH_CHECK_VALUE(trimul::parse_pass_plan(plan, &args.input_plan_buffers, &args.input_plan_stages,
                                              &args.input_plan_positions),
                      "trimul_inline: TRIMUL_INPUT_PLAN must be 'buffers,stages' or 'buffers,stages,positions' with "
                      "buffers 1 or 2, stages 2 to 8 and positions 64 or 128, not '", plan, "'");
  TORCH_CHECK(trimul::input_pass_smem(args) > 0 && trimul::output_pass_smem(args) > 0,
              "trimul_inline: pair_dim ", c, " / hidden ", hidden,
              " do not fit the fused kernels' shared memory (check fused_fits first)");

  const auto options = pair.options();
  const auto new_out = [&] { return at::empty_like(pair, options.memory_format(at::MemoryFormat::Contiguous)); };
  if (batch == 0 || n == 0) return new_out();
  // "highest" with a separate contraction on Hopper: the input pass splits each operand into its
  // TF32 part and remainder (twice the planes), so wgmma_tma runs 3xTF32 as three TF32 GEMMs.
  const bool split = mode == trimul::Mode::tf32x3 && !fuse_contraction &&
                     (variant == "auto" || variant == "wgmma_tma") && trimul::wgmma_tma_available();
  // "high" as scaled fp16 in the wgmma passes and the contraction (NOTES v14: high geomean 1742 -> 1196 µs
  // on an H200); TRIMUL_HIGH_ARITH=tf32 keeps the native TF32 kernels, for comparing the two.
  if (mode == trimul::Mode::tf32) {
    const char* high_arith = std::getenv("TRIMUL_HIGH_ARITH");
    const bool f16 = high_arith == nullptr || std::strcmp(high_arith, "f16") == 0;
    TORCH_CHECK_VALUE(f16 || std::strcmp(high_arith, "tf32") == 0,
                      "trimul_inline: TRIMUL_HIGH_ARITH must be f16 or tf32, not '", high_arith, "'");
    args.high_f16 = f16 && trimul::wgmma_tma_available();
  }
  // The contraction's operands as fp16 (split: parts and remainders; half the bytes of TF32 ones,
  // twice the tensor-core rate) where the scale from the parameters bounds them: a mask of at most 1
  // (bool); other masks keep TF32 operands. Only wgmma_tma scales the products back.
  args.ab_f16 = (split || (args.high_f16 && !fuse_contraction && (variant == "auto" || variant == "wgmma_tma"))) &&
                mask.scalar_type() == at::kBool;
  if (split || args.ab_f16) kernels = {"wgmma_tma"};
  const at::ScalarType ab_type = args.ab_f16 ? at::kHalf : op_type;
  // a_t and b_t [B*H, N, ld] each (split: [2, B*H, N, ld]), filled by the input pass: one allocation
  // [2, planes, N, ld] (a small forward's host time is mostly per-call work like each at::empty).
  const auto input_pass = [&] {
    const int64_t planes = (split ? 2 : 1) * batch * hidden;
    at::Tensor ab = at::empty({2, planes, n, args.ld}, options.dtype(ab_type));
    args.a_t = ab.data_ptr();
    args.b_t = static_cast<char*>(ab.data_ptr()) + planes * n * args.ld * ab.element_size();
    args.small_offset = split ? batch * hidden * n * args.ld : 0;
    check_launch(trimul::launch_input_pass(args), "the input pass");
    return ab;
  };
  if (fuse_contraction) {
    const auto ab = input_pass();
    at::Tensor out = new_out();
    args.z = nullptr;
    args.out = out.data_ptr();
    check_launch(trimul::launch_output_pass(args), "the output pass");
    return out;
  }
  at::Tensor z = at::empty({batch * hidden, n, args.ldz},
                           options.dtype(args.z_dtype == trimul::Dtype::bf16 ? at::kBFloat16 : at::kFloat));
  {
    const auto ab = input_pass();
    if (variant == "bmm") {  // cuBLAS on the same buffers, a baseline
      at::Tensor product = at::bmm(ab[0], ab[1].transpose(1, 2)).to(z.scalar_type());
      z.narrow(2, 0, n).copy_(product);
    } else {
      trimul::ContractArgs contract{};
      contract.a = args.a_t;
      contract.b = args.b_t;
      contract.z = z.data_ptr();
      contract.batch = batch * hidden;
      contract.m = n;
      contract.n = n;
      contract.k = n;
      contract.lda = args.ld;
      contract.ldz = args.ldz;
      contract.operand = dtype_code(ab, "a_t");
      contract.out = args.z_dtype;
      contract.precision = contraction_precision(mode);
      contract.tf32_rounded = mode == trimul::Mode::tf32;
      contract.split = split;
      contract.z_scale = args.ab_f16 ? args.f16x3_scales + trimul::kZDown : nullptr;
      contract.stream = args.stream;
      // The first kernel that takes these operands on this GPU (auto lists the fastest first).
      cudaError_t status = cudaErrorNotSupported;
      std::string used = kernels.back();
      for (const auto& name : kernels) {
        status = trimul::find_contraction(name.c_str())(contract);
        used = name;
        if (status != cudaErrorNotSupported) break;
      }
      check_launch(status, ("contraction kernel '" + used + "'").c_str());
    }
  }  // a_t and b_t go back to the allocator, so `out` can reuse their memory (peak: z + max(a+b, out))
  at::Tensor out = new_out();
  args.z = z.data_ptr();
  args.out = out.data_ptr();
  check_launch(trimul::launch_output_pass(args), "the output pass");
  return out;
}

// Whether the fused passes take this pair_dim / hidden_dim in this mode on the current GPU.
bool fused_fits(int64_t c, int64_t hidden, int64_t mode_code) {
  TORCH_CHECK_VALUE(mode_code >= 0 && mode_code <= 3, "trimul_inline: mode code ", mode_code);
  trimul::ForwardArgs args{};
  args.c = c;
  args.h = hidden;
  args.c_pad = round_up(c, 32);
  args.h_pad = round_up(hidden, 32);
  args.mode = static_cast<trimul::Mode>(mode_code);
  return trimul::input_pass_smem(args) > 0 && trimul::output_pass_smem(args) > 0;
}

// A checked eager call's decisions, kept so the next no-grad call with the same signature goes from
// Python straight to forward(): the Python around a small forward (its signature, the parameters'
// freshness, module.__call__) cost more than the GPU work at the seed shapes (NOTES v19). run()
// returns None, and the caller takes its full path, unless all of these still hold:
// - the signature: pair's and mask's sizes, dtypes and devices, pair's channel stride, the resolved
//   float32 matmul precision (passed in), grad mode and CUDA autocast off;
// - the same objects under each (dict, key) of `entries` (the module's submodules, their parameters)
//   and under each attribute of `attributes` (owner, name; owner None: the module run() is given);
// - each parameter's data pointer, dtype and version counter (in-place updates, `.data =`).
// It holds references to the submodules and parameters, never to the module itself (which holds it).
class PlannedForward {
 public:
  PlannedForward(py::list entries, py::list attributes, std::vector<at::Tensor> params, const at::Tensor& pair,
                 const at::Tensor& mask, py::str precision, std::vector<at::Tensor> weights, std::string variant,
                 int64_t mode_code, bool incoming, bool gate_normalized, double eps_in, double eps_out)
      : params_(std::move(params)),
        pair_sizes_(pair.sizes().vec()),
        mask_sizes_(mask.sizes().vec()),
        pair_dtype_(pair.scalar_type()),
        mask_dtype_(mask.scalar_type()),
        device_(pair.device()),
        pair_channel_stride_(pair.stride(-1)),
        precision_(std::move(precision)),
        weights_(std::move(weights)),
        variant_(std::move(variant)),
        mode_code_(mode_code),
        incoming_(incoming),
        gate_normalized_(gate_normalized),
        eps_in_(eps_in),
        eps_out_(eps_out) {
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
    return py::cast(forward(THPVariable_Unpack(pair.ptr()), THPVariable_Unpack(mask.ptr()), weights_, variant_,
                            mode_code_, incoming_, gate_normalized_, eps_in_, eps_out_));
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
  std::string variant_;
  int64_t mode_code_;
  bool incoming_, gate_normalized_;
  double eps_in_, eps_out_;
};

std::vector<std::string> contraction_variants() {
  const char* names[64];
  const int count = trimul::list_contractions(names, 64);
  return std::vector<std::string>(names, names + (count < 64 ? count : 64));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("contract", &contract, "z = a @ b^T per batch, by the named kernel variant (writes z)");
  m.def("fused_fits", &fused_fits, "whether the fused passes take these sizes in this mode");
  m.def("forward", &forward, "the fused forward: input pass, contraction, output pass");
  m.def("contraction_variants", &contraction_variants, "names of the contraction kernels built in");
  py::class_<PlannedForward>(m, "PlannedForward", "a checked eager call's decisions (ModelNew._fast)")
      .def(py::init<py::list, py::list, std::vector<at::Tensor>, const at::Tensor&, const at::Tensor&, py::str,
                    std::vector<at::Tensor>, std::string, int64_t, bool, bool, double, double>())
      .def("matches", &PlannedForward::matches, "whether run() would take this call")
      .def("run", &PlannedForward::run, "forward() for a call that matches, else None");
}
