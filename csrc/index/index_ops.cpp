#include "index/index_ops.h"

#include <c10/core/WrapDimMinimal.h>

#include <vector>

#include "common/device.h"
#include "common/geometry.h"
#include "common/output.h"
#include "index/index.h"

namespace cpshard {
namespace {

// The index as contiguous int64, after checking its rank, dtype and device. On CPU its upper
// bound is checked here; on CUDA the kernels check it on the device (reading the maximum back
// would cost a device->host sync per call): an index >= `rows` is never dereferenced and fails a
// device-side assertion, which surfaces as a CUDA error at the next synchronizing call.
at::Tensor checked_index(const at::Tensor& index, const at::Tensor& data, int64_t rows,
                         const char* what, const char* bound_name) {
  TORCH_CHECK(index.defined(), what, ": index is undefined");
  TORCH_CHECK(index.dim() == 1, what, ": index must be 1-D, got shape ", index.sizes());
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, what,
              ": index must be int64 or int32, got ", index.scalar_type());
  TORCH_CHECK(index.device() == data.device(), what, ": index is on ", index.device(),
              " but the data is on ", data.device());
  auto idx = index.to(at::kLong).contiguous();
  if (idx.is_cpu() && idx.numel() > 0) {
    const int64_t top = idx.max().item<int64_t>();
    TORCH_CHECK(top < rows, what, ": index holds ", top, " but ", bound_name, " is ", rows);
  }
  return idx;
}

void check_data(const at::Tensor& t, const char* what, const char* arg) {
  TORCH_CHECK(t.defined(), what, ": ", arg, " is undefined");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), what, ": ", arg,
              " must be a CPU or CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() >= 1, what, ": ", arg, " must have at least one dimension");
  TORCH_CHECK(supported_element_size(t.element_size()), what, ": ", arg, " has unsupported dtype ",
              t.scalar_type());
}

}  // namespace

at::Tensor index_gather(const at::Tensor& src, const at::Tensor& index, int64_t dim,
                        const at::Scalar& fill) {
  constexpr const char* what = "cpshard.index_gather";
  check_data(src, what, "src");
  dim = c10::maybe_wrap_dim(dim, src.dim());
  const auto view = token_view(src.sizes(), dim, what);
  const auto idx = checked_index(index, src, view.tokens, what, "src.shape[dim]");
  const IndexGeometry g{view.pre, view.tokens, idx.numel(), view.post};
  std::vector<int64_t> shape(src.sizes().begin(), src.sizes().end());
  shape[dim] = idx.numel();
  auto out = empty_output(shape, src.options());
  const auto data = src.contiguous();
  const auto pattern = fill_bytes(fill, src.scalar_type(), what);
  CPSHARD_ON_DEVICE(src, index_gather_cpu(g, data, idx, out, pattern),
                    index_gather_cuda(g, data, idx, out, pattern));
  return out;
}

at::Tensor index_scatter_add(const at::Tensor& grad, const at::Tensor& index, int64_t dim,
                             int64_t dim_size) {
  constexpr const char* what = "cpshard.index_scatter_add";
  check_data(grad, what, "grad");
  TORCH_CHECK(grad.scalar_type() != at::kBool, what, ": grad must be numeric, got Bool");
  TORCH_CHECK(dim_size >= 0, what, ": dim_size must be >= 0, got ", dim_size);
  dim = c10::maybe_wrap_dim(dim, grad.dim());
  const auto view = token_view(grad.sizes(), dim, what);
  const auto idx = checked_index(index, grad, dim_size, what, "dim_size");
  TORCH_CHECK(idx.numel() == view.tokens, what, ": index has ", idx.numel(),
              " entries but grad.shape[", dim, "] is ", view.tokens);
  std::vector<int64_t> shape(grad.sizes().begin(), grad.sizes().end());
  shape[dim] = dim_size;
  if (checked_prod(shape, 0, static_cast<int64_t>(shape.size()), what) == 0) {
    return at::empty(shape, grad.options());  // nothing to add into, whatever dim_size is
  }
  auto out = empty_output(shape, grad.options());
  // CSR inverse: sources ordered by target (stable, so ascending source within a target);
  // negative targets sort first and fall before row_start[0].
  const auto [sorted, order] = idx.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto row_start =
      at::searchsorted(sorted, at::arange(dim_size + 1, idx.options())).contiguous();
  const IndexGeometry g{view.pre, dim_size, view.tokens, view.post};
  const auto data = grad.contiguous();
  const auto src_of = order.contiguous();
  CPSHARD_ON_DEVICE(grad, index_scatter_add_cpu(g, data, src_of, row_start, out),
                    index_scatter_add_cuda(g, data, src_of, row_start, out));
  return out;
}

}  // namespace cpshard
