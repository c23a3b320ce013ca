// dispatch.cu — the registry on the C++ side (host code only): registry.def's entries matched to the
// kernels the kernel files register, each role's default order, a forward's plan (which kernel of each
// role, and the contraction operands' format) and the library's entry point, trimul_kernel_library().
#include "common.cuh"
#include "registry.cuh"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <vector>

namespace trimul {
namespace {

struct Entry {
  Role role;
  const char* name;
  int rank;
  bool torch;
  const char* applies;
  const char* summary;
};

constexpr Entry kRegistry[] = {
#define TRIMUL_KERNEL(ROLE, NAME, RANK, APPLIES, SUMMARY) {Role::ROLE, #NAME, RANK, false, APPLIES, SUMMARY},
#define TRIMUL_TORCH_KERNEL(ROLE, NAME, RANK, APPLIES, SUMMARY) {Role::ROLE, #NAME, RANK, true, APPLIES, SUMMARY},
#include "registry.def"
#undef TRIMUL_KERNEL
#undef TRIMUL_TORCH_KERNEL
};

const char* const kRoleNames[kRoles] = {"input",           "contract",          "output",
                                        "output_backward", "contract_backward", "input_backward",
                                        "position_gemm"};
const char* const kModeNames[] = {"bf16", "f16", "high", "highest"};

// The kernel files' registrations, in the order their static initialisers ran (construct on first
// use: they may run before this file's own).
std::vector<Implementation>& registered() {
  static std::vector<Implementation> table;
  return table;
}

// Every kernel the library knows: registry.def's entries in order, then registered kernels the
// registry does not name (which a test reports); each role's default order by rank.
struct Library {
  std::vector<KernelInfo> kernels;
  std::vector<const Implementation*> implementation;  // by kernel index; nullptr: none compiled
  std::vector<int> order[kRoles];
  KernelLibrary exported{};
};

int role_index(Role role) { return static_cast<int>(role); }

void say(char* message, int size, const char* format, ...) {
  if (message == nullptr || size <= 0) return;
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, static_cast<size_t>(size), format, args);
  va_end(args);
}

const Library& library();

int find_kernel(Role role, const char* name) {
  const Library& lib = library();
  for (size_t i = 0; i < lib.kernels.size(); ++i)
    if (lib.kernels[i].role == role && std::strcmp(lib.kernels[i].name, name) == 0) return static_cast<int>(i);
  return -1;
}

// The role's kernel names, comma-separated, for messages.
void role_names(Role role, char* out, int size) {
  int used = 0;
  out[0] = '\0';
  for (const KernelInfo& info : library().kernels)
    if (info.role == role && used < size)
      used += std::snprintf(out + used, static_cast<size_t>(size - used), "%s%s", used ? ", " : "", info.name);
}

// A chosen name per role: -1 for the default order; -2 (and a message) for a name the role lacks.
int chosen_kernel(Role role, const char* name, char* message, int size) {
  if (name == nullptr || name[0] == '\0') return -1;
  const int index = find_kernel(role, name);
  if (index >= 0) return index;
  char names[512];
  role_names(role, names, sizeof(names));
  say(message, size, "trimul_inline: no %s kernel named '%s' (the %s kernels: %s)", kRoleNames[role_index(role)], name,
      kRoleNames[role_index(role)], names);
  return -2;
}

// How the contraction's operands are stored: dtype, split into parts and remainders, fp16 scaled by
// 2^s_ab (ForwardArgs::ab_f16), fp32 rounded to TF32 already.
struct Format {
  Dtype ab;
  bool split, ab_f16;
};

// The operand formats of a mode, fastest first: the 16-bit modes their own dtype; "high" scaled fp16
// (half the bytes of TF32 and twice the tensor-core rate, where a bool mask keeps |a|, |b| within the
// scale the parameters bound) else TF32 values; "highest" split operands (scaled fp16 parts and
// remainders, else TF32 ones) else whole fp32 (for kernels that split on their own, 3xTF32).
int formats(const ForwardArgs& args, Format* out) {
  const bool scaled = args.mask_at_most_one && args.f16x3_scales != nullptr;
  int count = 0;
  switch (args.mode) {
    case Mode::bf16: out[count++] = {Dtype::bf16, false, false}; break;
    case Mode::f16: out[count++] = {Dtype::f16, false, false}; break;
    case Mode::high:
      if (scaled) out[count++] = {Dtype::f16, false, true};
      out[count++] = {Dtype::f32, false, false};
      break;
    case Mode::highest:
      if (scaled) out[count++] = {Dtype::f16, true, true};
      out[count++] = {Dtype::f32, true, false};
      out[count++] = {Dtype::f32, false, false};
      break;
  }
  return count;
}

// Whether the default order takes the torch.bmm baseline (cuBLAS writing z in place) for the contraction:
// bf16 products at 256 <= N <= 1024, where cuBLAS's tiles measured faster than wgmma_tma's (bench/NOTES.md).
// Past that range wgmma_tma's grouped raster keeps the planes' operands in L2; below it cuBLAS's host path
// is the call's time; fp16 products and TF32 are not measured there.
bool torch_contraction_by_default(const ForwardArgs& args, const Format& format) {
  return format.ab == Dtype::bf16 && !format.split && args.n >= 256 && args.n <= 1024;
}

// Whether the default order leaves a weight gradient (position_gemm's rows_grad) to the cuBLAS baseline: the
// kernels' grid is one block per position chunk and 128 x 128 output tile, and where it would fill under half
// the SMs (few positions, small outputs) cuBLAS's split over K measured faster (bench/NOTES.md).
bool torch_weight_gradient_by_default(const BackwardArgs& args) {
  if (args.pass != BackwardPass::rows_grad) return false;
  const int64_t blocks =
      position_gemm_grad_chunks(args.gemm_m) * ceil_div(args.gemm_n, 128) * ceil_div(args.gemm_k, 128);
  return 2 * blocks < sm_count();  // (0 where the device cannot be read: the kernel's launch then reports it)
}

Precision contraction_precision(Mode mode) {
  switch (mode) {
    case Mode::highest: return Precision::highest;
    case Mode::high: return Precision::high;
    default: return Precision::medium;
  }
}

// The fused forward's contraction of a_t and b_t in `ab` format into z.
ContractArgs contract_args(const ForwardArgs& args, Dtype ab, bool split) {
  ContractArgs c{};
  c.a = args.a_t;
  c.b = args.b_t;
  c.z = args.z;
  c.batch = args.batch * args.h;
  c.m = c.n = c.k = args.n;
  c.lda = args.ld;
  c.ldz = args.ldz;
  c.operand = ab;
  c.out = args.z_dtype;
  c.precision = contraction_precision(args.mode);
  c.tf32_rounded = args.mode == Mode::high;
  c.split = split;
  c.z_scale = args.ab_f16 ? args.f16x3_scales + kZDown : nullptr;
  c.fused = true;
  c.stream = args.stream;
  return c;
}

// The kernel of `role` for a call: the chosen one (pick >= 0) if takes(it), else the first of the role's
// default order that takes it. not_applies (a chosen kernel that does not) or no_kernel: the caller says why.
template <class Takes>
PlanStatus pick_in_order(Role role, int pick, Takes&& takes, int* kernel) {
  if (pick >= 0) {
    if (!takes(pick)) return PlanStatus::not_applies;
    *kernel = pick;
    return PlanStatus::ok;
  }
  for (int index : library().order[role_index(role)])
    if (takes(index)) {
      *kernel = index;
      return PlanStatus::ok;
    }
  return PlanStatus::no_kernel;
}

// The chosen kernel of a pass role if it takes args, else the first of its default order that does;
// -1 for none.
int pass_kernel(Role role, int chosen, const ForwardArgs& args) {
  const Library& lib = library();
  int kernel = -1;
  pick_in_order(role, chosen, [&](int index) {
    const Implementation* impl = lib.implementation[index];
    return impl != nullptr && impl->pass_applies(args);
  }, &kernel);
  return kernel;
}

// A placeholder for the z buffer while the forward is planned (applies() tests presence only).
void* const kPlannedBuffer = reinterpret_cast<void*>(uintptr_t(1) << 12);

// Whether input kernel `index` also writes ForwardArgs::x_hat for this call (its applies() with one set: only a
// kernel registered as writing it can say yes).
bool input_writes_x_hat(int index, const ForwardArgs& args) {
  const Implementation* impl = library().implementation[index];
  if (impl == nullptr) return false;
  ForwardArgs with = args;
  with.x_hat = kPlannedBuffer;
  return impl->pass_applies(with);
}

// Whether an output kernel of the default order takes this call with the gate on ForwardArgs::gate_rows (a raw
// gate on LayerNorm_in's rows: gate_normalized false; only a kernel registered as reading them can say yes).
bool output_reads_gate_rows(const ForwardArgs& args) {
  ForwardArgs with = args;
  with.gate_rows = kPlannedBuffer;
  with.gate_normalized = false;
  return pass_kernel(Role::output, -1, with) >= 0;
}

PlanStatus plan_forward(ForwardArgs* args, const char* const* chosen, ForwardPlan* plan, char* message, int size) {
  int pick[kForwardRoles];
  for (int r = 0; r < kForwardRoles; ++r) {
    pick[r] = chosen_kernel(static_cast<Role>(r), chosen != nullptr ? chosen[r] : nullptr, message, size);
    if (pick[r] == -2) return PlanStatus::invalid;
  }
  const int contract = role_index(Role::contract);
  if (args->batch < 0 || args->n < 0 || args->rows_ab % 128 != 0 || args->rows_ab < 2 * args->h) {
    say(message, size, "trimul_inline: inconsistent forward arguments (batch %lld, N %lld, hidden %lld, rows %lld)",
        static_cast<long long>(args->batch), static_cast<long long>(args->n), static_cast<long long>(args->h),
        static_cast<long long>(args->rows_ab));
    return PlanStatus::invalid;
  }
  // The layout every kernel shares: rows of a_t / b_t padded to 32 elements (the tensor-core kernels
  // read whole 64-byte k-slabs), 16-bit z rows to 16 bytes (the contraction's 16-byte stores); positions
  // of a plane in 32 bits (the kernels' position arithmetic).
  args->ld = (args->n + 31) / 32 * 32;
  args->z_dtype = z_dtype_for(args->mode);
  const int64_t z_align = args->z_dtype == Dtype::f32 ? 4 : 8;
  args->ldz = (args->n + z_align - 1) / z_align * z_align;
  const int64_t plane_limit = (int64_t(1) << 32) - 128, rows = pair_rows(*args);
  if (rows * args->ld >= plane_limit || rows * args->ldz >= plane_limit || args->n * args->ld >= plane_limit) {
    say(message, size, "trimul_inline: N = %lld is past the fused kernels' 32-bit position arithmetic",
        static_cast<long long>(args->n));
    return PlanStatus::no_kernel;
  }
  const Library& lib = library();
  // (the chosen contraction, else the default order; no copy: this runs on every forward)
  const int* contractions = pick[contract] >= 0 ? &pick[contract] : lib.order[contract].data();
  const size_t contraction_count = pick[contract] >= 0 ? 1 : lib.order[contract].size();
  Format options[3];
  const int option_count = formats(*args, options);
  bool found[kForwardRoles] = {false, false, false};
  for (size_t i = 0; i < contraction_count; ++i) {
    const int c = contractions[i];
    const KernelInfo& info = lib.kernels[c];
    const Implementation* impl = lib.implementation[c];
    if (!info.torch && impl == nullptr) continue;
    for (int f = 0; f < option_count; ++f) {
      const Format& format = options[f];
      args->ab_f16 = format.ab_f16;
      bool takes, z_buffer = true;
      if (info.torch) {  // (torch.bmm multiplies whole values; unchosen, only where cuBLAS measured faster)
        takes = !format.split && !format.ab_f16 && (pick[contract] >= 0 || torch_contraction_by_default(*args, format));
      } else {
        takes = impl->contract_applies(contract_args(*args, format.ab, format.split));
        z_buffer = !impl->contracts_in_output_pass;
      }
      if (!takes) continue;
      found[contract] = true;
      args->z = z_buffer ? kPlannedBuffer : nullptr;
      args->small_offset = format.split ? args->batch * args->h * rows * args->ld : 0;
      const int input = pass_kernel(Role::input, pick[role_index(Role::input)], *args);
      const int output = pass_kernel(Role::output, pick[role_index(Role::output)], *args);
      found[role_index(Role::input)] |= input >= 0;
      found[role_index(Role::output)] |= output >= 0;
      if (input < 0 || output < 0) continue;
      plan->kernels[role_index(Role::input)] = input;
      plan->kernels[contract] = c;
      plan->kernels[role_index(Role::output)] = output;
      for (int r = 0; r < kForwardRoles; ++r) plan->chosen[r] = pick[r] >= 0;
      plan->z_buffer = z_buffer;
      plan->torch_contraction = info.torch;
      plan->ab_dtype = format.ab;
      plan->split = format.split;
      plan->ab_planes = (format.split ? 2 : 1) * args->batch * args->h;
      plan->x_hat_rows = input_writes_x_hat(input, *args);
      plan->output_gate_rows = output_reads_gate_rows(*args);
      return PlanStatus::ok;
    }
  }
  // Nothing took the call: a kernel chosen by name that never applied, else the first role short of one.
  for (int r = 0; r < kForwardRoles; ++r) {
    if (pick[r] < 0 || found[r]) continue;
    const KernelInfo& info = lib.kernels[pick[r]];
    say(message, size,
        "trimul_inline: the %s kernel '%s' does not take this call (pair_dim %lld, hidden %lld, N %lld, mode %s); "
        "it applies when: %s",
        kRoleNames[r], info.name, static_cast<long long>(args->c), static_cast<long long>(args->h),
        static_cast<long long>(args->n), kModeNames[static_cast<int>(args->mode)], info.applies);
    return PlanStatus::not_applies;
  }
  const bool any_chosen = pick[0] >= 0 || pick[1] >= 0 || pick[2] >= 0;
  int short_role = 0;
  while (short_role < kForwardRoles - 1 && found[short_role]) ++short_role;
  say(message, size,
      any_chosen ? "trimul_inline: the kernels chosen do not take this call: no %s kernel goes with them (pair_dim "
                   "%lld, hidden %lld, N %lld, mode %s)"
                 : "trimul_inline: no %s kernel takes this call (pair_dim %lld, hidden %lld, N %lld, mode %s)",
      kRoleNames[short_role], static_cast<long long>(args->c), static_cast<long long>(args->h),
      static_cast<long long>(args->n), kModeNames[static_cast<int>(args->mode)]);
  return any_chosen ? PlanStatus::not_applies : PlanStatus::no_kernel;
}

// run(implementation, true) for the planned kernel `index` of `role` (its applies() held when planned);
// where that declines at launch (cudaErrorNotSupported: a tensor map the driver refuses) and was not chosen by
// name, run(implementation, false) for each later kernel of the role's default order in turn, which returns
// cudaErrorNotSupported for one that does not take the call.
template <class Run>
cudaError_t launch_in_order(Role role, int index, bool chosen, Run&& run) {
  const Library& lib = library();
  cudaError_t status = run(*lib.implementation[index], true);
  if (status != cudaErrorNotSupported || chosen) return status;
  const std::vector<int>& order = lib.order[role_index(role)];
  for (auto next = std::find(order.begin(), order.end(), index); next != order.end() && status == cudaErrorNotSupported;
       ++next)
    if (*next != index && lib.implementation[*next] != nullptr) status = run(*lib.implementation[*next], false);
  return status;
}

cudaError_t run_step(Role role, const ForwardPlan* plan, const ForwardArgs* args, char* message, int size) {
  const Library& lib = library();
  const int index = plan->kernels[role_index(role)];
  const bool chosen = plan->chosen[role_index(role)];
  cudaError_t status;
  if (role == Role::contract) {
    if (!plan->z_buffer) return cudaSuccess;  // (the output pass contracts)
    if (plan->torch_contraction || lib.implementation[index] == nullptr) {
      say(message, size, "trimul_inline: contraction '%s' is not a kernel of this library", lib.kernels[index].name);
      return cudaErrorInvalidValue;
    }
    // (a fallback takes operands of the same format)
    const ContractArgs contract = contract_args(*args, plan->ab_dtype, plan->split);
    status = launch_in_order(role, index, chosen, [&](const Implementation& impl, bool planned) {
      return planned || (impl.contract_launch != nullptr && impl.contract_applies(contract))
                 ? impl.contract_launch(contract)
                 : cudaErrorNotSupported;
    });
  } else {
    status = launch_in_order(role, index, chosen, [&](const Implementation& impl, bool planned) {
      return planned || impl.pass_applies(*args) ? impl.pass_launch(*args) : cudaErrorNotSupported;
    });
  }
  if (status == cudaErrorNotSupported)
    say(message, size, "trimul_inline: the %s kernel '%s' declined at launch", kRoleNames[role_index(role)],
        lib.kernels[index].name);
  return status;
}

PlanStatus plan_contraction(const ContractArgs* args, const char* chosen, int* kernel, char* message, int size) {
  const Library& lib = library();
  const int pick = chosen_kernel(Role::contract, chosen, message, size);
  if (pick == -2) return PlanStatus::invalid;
  const PlanStatus status = pick_in_order(Role::contract, pick, [&](int index) {
    const Implementation* impl = lib.implementation[index];
    return impl != nullptr && impl->contract_launch != nullptr && impl->contract_applies(*args);
  }, kernel);
  if (status == PlanStatus::not_applies)
    say(message, size, "trimul_inline: the contract kernel '%s' does not take this call; it applies when: %s",
        lib.kernels[pick].name, lib.kernels[pick].applies);
  if (status == PlanStatus::no_kernel)
    say(message, size, "trimul_inline: no contract kernel takes these operands on this GPU");
  return status;
}

cudaError_t run_contraction(int kernel, const ContractArgs* args) {
  const Library& lib = library();
  if (kernel < 0 || kernel >= static_cast<int>(lib.kernels.size()) || lib.implementation[kernel] == nullptr ||
      lib.implementation[kernel]->contract_launch == nullptr)
    return cudaErrorInvalidValue;
  return lib.implementation[kernel]->contract_launch(*args);
}

// Whether the default plan takes a call of these sizes: a probe with contiguous, aligned placeholder
// inputs and every weight the mode prepares (applies() reads no memory).
bool fused_takes(int64_t c, int64_t h, Mode mode, Dtype pair_dtype) {
  void* const placeholder = kPlannedBuffer;
  ForwardArgs args{};
  args.pair = placeholder;
  args.pair_dtype = pair_dtype;
  args.batch = 1;
  args.n = 256;
  args.c = c;
  args.h = h;
  args.pair_sc = c;
  args.pair_sr = args.n * c;
  args.pair_sb = args.n * args.n * c;
  args.mask = placeholder;
  args.mask_kind = MaskKind::u8;
  args.mask_sc = 1;
  args.mask_sr = args.n;
  args.mask_sb = args.n * args.n;
  args.mask_at_most_one = true;
  args.mode = mode;
  args.c_pad = (c + 31) / 32 * 32;
  args.h_pad = (h + 31) / 32 * 32;
  args.rows_ab = (2 * h + 127) / 128 * 128;
  args.ln_in_w = args.ln_in_b = args.b_in = args.b_gate = args.b_out = static_cast<const float*>(placeholder);
  args.w_in = args.w_gate = args.w_out = placeholder;
  const bool fp32 = mode == Mode::high || mode == Mode::highest;
  if (fp32) {
    args.w_in_f16x3 = args.w_gate_f16x3 = args.w_out_f16x3 = placeholder;
    args.f16x3_scales = static_cast<const float*>(placeholder);
  } else {
    args.w_in_rows = placeholder;
  }
  ForwardPlan plan{};
  return plan_forward(&args, nullptr, &plan, nullptr, 0) == PlanStatus::ok;
}

// A backward role's kernel: the chosen one if it takes the args, else the first of the default order that
// does; -1 where that is a torch baseline (the caller runs its PyTorch passes).
PlanStatus plan_backward(Role role, const BackwardArgs* args, const char* chosen, int* kernel, char* message,
                         int size) {
  const Library& lib = library();
  const int pick = chosen_kernel(role, chosen, message, size);
  if (pick == -2) return PlanStatus::invalid;
  const bool torch_first = pick < 0 && role == Role::position_gemm && torch_weight_gradient_by_default(*args);
  // A block of rows (a sharded rank's) runs the per-position roles' library kernels in the outgoing layout; the
  // contraction is the caller's, and the torch baselines take square planes only.
  const bool block = role != Role::position_gemm && pair_rows(*args) != args->n;
  const PlanStatus status = pick_in_order(role, pick, [&](int index) {
    const Implementation* impl = lib.implementation[index];
    if (block && (args->incoming || role == Role::contract_backward || lib.kernels[index].torch)) return false;
    return lib.kernels[index].torch ||
           (!torch_first && impl != nullptr && impl->backward_launch != nullptr && impl->backward_applies(*args));
  }, kernel);
  if (status == PlanStatus::ok && lib.kernels[*kernel].torch) *kernel = -1;
  if (status == PlanStatus::not_applies)  // (position_gemm's sizes are its product's K and N, in c and h)
    say(message, size, "trimul_inline: the %s kernel '%s' does not take this call (%s %lld, %s %lld); it "
        "applies when: %s", kRoleNames[role_index(role)], lib.kernels[pick].name,
        role == Role::position_gemm ? "K" : "pair_dim", static_cast<long long>(args->c),
        role == Role::position_gemm ? "N" : "hidden", static_cast<long long>(args->h), lib.kernels[pick].applies);
  if (status == PlanStatus::no_kernel)
    say(message, size, "trimul_inline: no %s kernel takes this call", kRoleNames[role_index(role)]);
  return status;
}

cudaError_t run_backward(int kernel, const BackwardArgs* args) {
  const Library& lib = library();
  if (kernel < 0 || kernel >= static_cast<int>(lib.kernels.size()) || lib.implementation[kernel] == nullptr ||
      lib.implementation[kernel]->backward_launch == nullptr)
    return cudaErrorInvalidValue;
  return lib.implementation[kernel]->backward_launch(*args);
}

Library build_library() {
  Library lib;
  const std::vector<Implementation>& impls = registered();
  std::vector<bool> matched(impls.size(), false);
  for (const Entry& entry : kRegistry) {
    const Implementation* impl = nullptr;
    for (size_t i = 0; i < impls.size(); ++i)
      if (impls[i].role == entry.role && std::strcmp(impls[i].name, entry.name) == 0) {
        impl = &impls[i];
        matched[i] = true;
      }
    lib.kernels.push_back({entry.role, entry.name, entry.rank, entry.torch, true, impl != nullptr, entry.applies,
                           entry.summary});
    lib.implementation.push_back(impl);
  }
  for (size_t i = 0; i < impls.size(); ++i)
    if (!matched[i]) {
      lib.kernels.push_back({impls[i].role, impls[i].name, 0, false, false, true, "", ""});
      lib.implementation.push_back(&impls[i]);
    }
  for (int r = 0; r < kRoles; ++r) {
    for (size_t i = 0; i < lib.kernels.size(); ++i)
      if (role_index(lib.kernels[i].role) == r && lib.kernels[i].rank > 0) lib.order[r].push_back(static_cast<int>(i));
    std::stable_sort(lib.order[r].begin(), lib.order[r].end(),
                     [&](int x, int y) { return lib.kernels[x].rank < lib.kernels[y].rank; });
  }
  KernelLibrary& e = lib.exported;
  e.abi = kKernelAbi;
  e.forward_args_bytes = sizeof(ForwardArgs);
  e.contract_args_bytes = sizeof(ContractArgs);
  e.forward_plan_bytes = sizeof(ForwardPlan);
  e.plan_forward = plan_forward;
  e.run_step = run_step;
  e.plan_contraction = plan_contraction;
  e.run_contraction = run_contraction;
  e.fused_takes = fused_takes;
  e.plan_backward = plan_backward;
  e.run_backward = run_backward;
  e.backward_args_bytes = sizeof(BackwardArgs);
  e.mask_scales = launch_mask_scales;
  e.param_grads = launch_param_grads;
  e.param_fold = launch_param_fold;
  e.weight_prep = launch_weight_prep;
  return lib;
}

// Built once, at the first call: after the library's static initialisers (the registrations) ran.
const Library& library() {
  static Library lib = build_library();
  static const bool exported = [] {
    lib.exported.kernels = lib.kernels.data();
    lib.exported.kernel_count = static_cast<int>(lib.kernels.size());
    return true;
  }();
  (void)exported;
  return lib;
}

}  // namespace

bool register_implementation(const Implementation& implementation) {
  registered().push_back(implementation);
  return true;
}

}  // namespace trimul

extern "C" const trimul::KernelLibrary* trimul_kernel_library() { return &trimul::library().exported; }
