// The index-family operators behind cpshard::index_gather / index_scatter_add.
#pragma once

#include <ATen/ATen.h>

namespace cpshard {

// out = src with dim replaced by index rows: out[.., i, ..] = src[.., index[i], ..], fill where
// index[i] < 0. index: 1-D int32/int64 on src's device, every entry < src.shape[dim].
at::Tensor index_gather(const at::Tensor& src, const at::Tensor& index, int64_t dim,
                        const at::Scalar& fill);

// Adjoint of index_gather: out.shape[dim] = dim_size, out[.., j, ..] = sum of grad rows i with
// index[i] == j (deterministic order); rows with index < 0 are dropped.
at::Tensor index_scatter_add(const at::Tensor& grad, const at::Tensor& index, int64_t dim,
                             int64_t dim_size);

}  // namespace cpshard
