// bindings.cpp — thin pybind functions: check tensors, pick the launcher, launch on PyTorch's
// current stream, check the launch. Ops are registered from Python (torch.library.custom_op),
// never with TORCH_LIBRARY here, so a rebuilt .so can be loaded into the same process.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <vector>

#include "api.cuh"

namespace {

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
  trimul::ContractArgs args{};
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.z = z.data_ptr();
  args.batch = a.size(0);
  args.m = a.size(1);
  args.n = b.size(1);
  args.k = a.size(2);
  args.operand = dtype_code(a, "a");
  args.out = dtype_code(z, "z");
  args.precision = static_cast<trimul::Precision>(precision);
  args.stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  const cudaError_t status = fn(args);
  TORCH_CHECK(status != cudaErrorNotSupported, "trimul_inline: variant '", variant,
              "' does not support these dtypes/precision on this GPU");
  C10_CUDA_CHECK(status);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<std::string> contraction_variants() {
  const char* names[64];
  const int count = trimul::list_contractions(names, 64);
  return std::vector<std::string>(names, names + (count < 64 ? count : 64));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("contract", &contract, "z = a @ b^T per batch, by the named kernel variant (writes z)");
  m.def("contraction_variants", &contraction_variants, "names of the contraction kernels built in");
}
