// The ragged-family operators (validation, allocation, device dispatch) behind the
// cpshard::pack_ragged / unpack_ragged / interleave_sequence / deinterleave_sequence schemas.
#pragma once

#include <ATen/ATen.h>

namespace cpshard {

// x: compact [pre, sum(counts), post] along dim. pad_to >= max(counts): [W, pre, pad_to, post]
// with padding rows set to fill; pad_to == -1: exact-offset blocks, flattened to 1-D.
at::Tensor pack_ragged(const at::Tensor& x, at::IntArrayRef counts, int64_t dim, int64_t pad_to,
                       const at::Scalar& fill);

// Inverse of pack_ragged: packed holds the blocks (any shape, contiguous numel as produced by
// pack_ragged); out_shape is the compact shape, out_shape[dim] == sum(counts).
at::Tensor unpack_ragged(const at::Tensor& packed, at::IntArrayRef counts, int64_t dim,
                         int64_t pad_to, at::IntArrayRef out_shape);

// [W, pre, L, post] -> [pre, W*L, post]; dim is the sequence dim of the output.
at::Tensor interleave_sequence(const at::Tensor& x, int64_t dim);

// [pre, W*L, post] -> [W, pre, L, post]; dim is the sequence dim of the input.
at::Tensor deinterleave_sequence(const at::Tensor& x, int64_t world, int64_t dim);

}  // namespace cpshard
