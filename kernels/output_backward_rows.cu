// rows — output_backward: LayerNorm_out rows from the z planes, the output gate's derivative, dz planes
// The passes live in output_backward_rows.cuh (wgmma shares them); this file registers them.
#include "output_backward_rows.cuh"

TRIMUL_REGISTER_BACKWARD(output_backward, rows, ::trimul::backward::applies, ::trimul::backward::launch);
