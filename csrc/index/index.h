// Index gather with fill and its adjoint scatter-add, along one dim of a tensor viewed as
// [pre, rows, post]: out[p, i, :] = src[p, index[i], :] (fill where index[i] < 0), and
// grad_src[p, j, :] = sum over i with index[i] == j of grad[p, i, :], summed in ascending i so the
// result is deterministic. The scatter-add walks a CSR inverse of the index (targets -> sources).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace cpshard {

struct IndexGeometry {
  int64_t pre = 1;
  int64_t src_rows = 0;  // rows of the gathered-from tensor (the scatter-add output)
  int64_t idx_rows = 0;  // entries of the index (rows of the gather output)
  int64_t post = 1;
};

// index: contiguous int64 [idx_rows]. The CPU kernels take it validated to lie in
// [-inf, src_rows); the CUDA kernels check that bound themselves (a device-side assertion, no
// out-of-range access).
void index_gather_cpu(const IndexGeometry& g, const at::Tensor& src, const at::Tensor& index,
                      const at::Tensor& out, const at::Tensor& fill);
// order: source rows sorted by target, row_start: [src_rows + 1] CSR offsets into order.
void index_scatter_add_cpu(const IndexGeometry& g, const at::Tensor& grad, const at::Tensor& order,
                           const at::Tensor& row_start, const at::Tensor& out);
#ifdef CPSHARD_WITH_CUDA
void index_gather_cuda(const IndexGeometry& g, const at::Tensor& src, const at::Tensor& index,
                       const at::Tensor& out, const at::Tensor& fill);
void index_scatter_add_cuda(const IndexGeometry& g, const at::Tensor& grad,
                            const at::Tensor& order, const at::Tensor& row_start,
                            const at::Tensor& out);
#endif

}  // namespace cpshard
