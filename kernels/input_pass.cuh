// input_pass.cuh — what the input-pass kernels share: locating a position's pair row and mask, and
// writing the gated values into the contraction's operand layout (a_t / b_t, [B*H, N, ld]) in the
// operand format the planned contraction takes (ForwardArgs::small_offset, ForwardArgs::ab_f16).
#pragma once
#include "tma.cuh"

namespace trimul {
namespace input_pass {

using namespace ::trimul::mma;
using namespace ::trimul::fused;


// Row f and column k of position p of a batch's flattened [rows, ld] operand plane (rows: pair_rows; f = p / ld,
// k = p % ld; k >= n and p >= plane are padding). plane < 2^32 (checked at launch): 32-bit division is a fraction
// of a 64-bit one's cost.
__device__ __forceinline__ void plane_fk(const ForwardArgs& args, int64_t p, uint32_t& f, uint32_t& k) {
  f = static_cast<uint32_t>(p) / static_cast<uint32_t>(args.ld);
  k = static_cast<uint32_t>(p) - f * static_cast<uint32_t>(args.ld);
}

// The position (b, i, j) of pair_repr, flattened, at row f, column k of a batch's operand plane (incoming planes
// are transposed): a row of ForwardArgs::x_hat, in pair_repr's order whatever pair's strides.
__device__ __forceinline__ int64_t plane_position(const ForwardArgs& args, int64_t batch, uint32_t f, uint32_t k) {
  const int64_t i = args.incoming ? k : f, j = args.incoming ? f : k;
  return (batch * pair_rows(args) + i) * args.n + j;
}
// The same at position p of the flattened plane.
__device__ __forceinline__ int64_t plane_position(const ForwardArgs& args, int64_t batch, int64_t p) {
  uint32_t f, k;
  plane_fk(args, p, f, k);
  return plane_position(args, batch, f, k);
}

// Pair-row element offset (-1: no position) and mask of the position at row f, column k of a batch's [N, ld]
// operand plane (valid: the position exists, not padding): the mask's value, or its bits as loaded
// (uint32_t: load_mask_bits, for a prefetch that converts them later with mask_value).
__device__ __forceinline__ void locate_fk(const ForwardArgs& args, int64_t batch, uint32_t f, uint32_t k, bool valid,
                                          int64_t& row_off, uint32_t& mask_bits) {
  const int64_t row = args.incoming ? k : f, col = args.incoming ? f : k;
  row_off = valid ? batch * args.pair_sb + row * args.pair_sr + col * args.pair_sc : -1;
  mask_bits = valid ? load_mask_bits(args.mask, args.mask_kind,
                                     batch * args.mask_sb + row * args.mask_sr + col * args.mask_sc)
                    : 0u;
}
__device__ __forceinline__ void locate_fk(const ForwardArgs& args, int64_t batch, uint32_t f, uint32_t k, bool valid,
                                          int64_t& row_off, float& mask) {
  uint32_t bits;
  locate_fk(args, batch, f, k, valid, row_off, bits);
  mask = mask_value(bits, args.mask_kind);
}
// The same for position p of the flattened plane (plane_fk).
template <typename MaskOut>
__device__ __forceinline__ void locate_position(const ForwardArgs& args, int64_t batch, int64_t p, int64_t plane,
                                                int64_t& row_off, MaskOut& mask) {
  uint32_t f, k;
  plane_fk(args, p, f, k);
  locate_fk(args, batch, f, k, p < plane && k < args.n, row_off, mask);
}

// Two adjacent operand values (the destination is aligned for both: positions are even).
// "highest" with small_offset != 0: the TF32 part here and the remainder small_offset further on,
// so the contraction needs no splitting of its own (ForwardArgs::small_offset).
template <Mode M>
__device__ __forceinline__ void store_operand_pair(op_t<M>* dst, float v0, float v1, int64_t small_offset = 0);

// The fp32 modes' contraction operands at element `index` of a_t / b_t (`base`): as op_t<M> (TF32
// values; "highest" with small_offset != 0 TF32 parts and remainders), or with `up` != 0
// (ForwardArgs::ab_f16) fp16 values of the values times `up` ("highest" with small_offset: parts
// and remainders).
template <Mode M>
__device__ __forceinline__ void store_contraction_pair(void* base, int64_t index, float v0, float v1,
                                                       int64_t small_offset, float up) {
  if (up == 0.f) {
    store_operand_pair<M>(static_cast<op_t<M>*>(base) + index, v0, v1, small_offset);
    return;
  }
  const __half2 hi = __floats2half2_rn(v0 * up, v1 * up);
  __half* dst = static_cast<__half*>(base) + index;
  *reinterpret_cast<__half2*>(dst) = hi;
  if constexpr (M == Mode::highest) {  // (ab_f16 at "highest" comes with small_offset: split operands)
    const float2 hf = __half22float2(hi);
    *reinterpret_cast<__half2*>(dst + small_offset) = __floats2half2_rn(v0 * up - hf.x, v1 * up - hf.y);
  }
}

template <Mode M>
__device__ __forceinline__ void store_operand_pair(op_t<M>* dst, float v0, float v1, int64_t small_offset) {
  if constexpr (M == Mode::bf16) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
  } else if constexpr (M == Mode::f16) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v0, v1);
  } else if constexpr (M == Mode::highest) {
    if (small_offset == 0) {
      *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    } else {
      const float big0 = to_operand<Mode::high>(v0), big1 = to_operand<Mode::high>(v1);
      *reinterpret_cast<float2*>(dst) = make_float2(big0, big1);
      *reinterpret_cast<float2*>(dst + small_offset) =
          make_float2(to_operand<Mode::high>(v0 - big0), to_operand<Mode::high>(v1 - big1));
    }
  } else {
    *reinterpret_cast<float2*>(dst) = make_float2(to_operand<M>(v0), to_operand<M>(v1));
  }
}


}  // namespace input_pass
}  // namespace trimul
