// rows — input_backward: LayerNorm_in rows, a/b planes from the projections, their derivative, d pair_repr
// The passes live in input_backward_rows.cuh (wgmma_rs shares them); this file registers them.
#include "input_backward_rows.cuh"

TRIMUL_REGISTER_BACKWARD(input_backward, rows, ::trimul::backward::applies, ::trimul::backward::launch);
