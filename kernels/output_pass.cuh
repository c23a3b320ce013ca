// output_pass.cuh — what the output-pass kernels share: LayerNorm_out over h of z (its affine folded
// into out_proj), out_proj and the output gate sigmoid(out_gate(pair or LayerNorm_in(pair))), the
// product written once in the input dtype.
#pragma once
#include "tma.cuh"

namespace trimul {
namespace output_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;

}  // namespace output_pass
}  // namespace trimul
