#include "ragged/ragged_ops.h"

#include <c10/core/WrapDimMinimal.h>

#include <algorithm>
#include <vector>

#include "common/device.h"
#include "common/geometry.h"
#include "common/output.h"
#include "ragged/ragged.h"

namespace cpshard {

RaggedGeometry make_ragged_geometry(at::IntArrayRef counts, int64_t pre, int64_t post, int64_t pad,
                                    const char* what) {
  TORCH_CHECK(!counts.empty(), what, ": counts must name at least one rank");
  RaggedGeometry g;
  g.counts.assign(counts.begin(), counts.end());
  g.prefix.assign(counts.size() + 1, 0);
  int64_t max_count = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    TORCH_CHECK(counts[r] >= 0, what, ": counts[", r, "] = ", counts[r], " is negative");
    TORCH_CHECK(!c10::add_overflows(g.prefix[r], counts[r], &g.prefix[r + 1]), what,
                ": counts overflow int64");
    max_count = std::max(max_count, counts[r]);
  }
  TORCH_CHECK(pad == -1 || pad >= max_count, what, ": pad_to = ", pad,
              " must be -1 (exact offsets) or at least the largest count ", max_count);
  g.pre = pre;
  g.post = post;
  g.pad = pad;
  // Every offset the kernels compute is bounded by the larger buffer; make sure it fits.
  const int64_t padded_rows =
      checked_mul(static_cast<int64_t>(counts.size()), std::max<int64_t>(pad, 0), what);
  checked_mul(checked_mul(pre, std::max(g.total(), padded_rows), what), post, what);
  return g;
}

namespace {

void check_movable(const at::Tensor& t, const char* what, const char* arg) {
  TORCH_CHECK(t.defined(), what, ": ", arg, " is undefined");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), what, ": ", arg,
              " must be a CPU or CUDA tensor, got ", t.device());
  TORCH_CHECK(supported_element_size(t.element_size()), what, ": ", arg, " has unsupported dtype ",
              t.scalar_type());
}

void ragged_move(const RaggedGeometry& g, const at::Tensor& compact, const at::Tensor& blocks,
                 RaggedDirection dir, const at::Tensor& fill) {
  CPSHARD_ON_DEVICE(compact, ragged_move_cpu(g, compact, blocks, dir, fill),
                    ragged_move_cuda(g, compact, blocks, dir, fill));
}

// Shape [W, sizes[:dim], pad, sizes[dim+1:]].
std::vector<int64_t> padded_shape(at::IntArrayRef sizes, int64_t dim, int64_t world, int64_t pad) {
  std::vector<int64_t> shape{world};
  shape.insert(shape.end(), sizes.begin(), sizes.end());
  shape[dim + 1] = pad;
  return shape;
}

at::Tensor pack_into_new(const at::Tensor& x, const RaggedGeometry& g, int64_t dim,
                         const at::Scalar& fill, const char* what) {
  const auto src = x.contiguous();
  const auto out = g.pad >= 0
                       ? empty_output(padded_shape(x.sizes(), dim, g.world(), g.pad), x.options())
                       : empty_output({g.block_numel()}, x.options());
  ragged_move(g, src, out, RaggedDirection::kPack, fill_bytes(fill, x.scalar_type(), what));
  return out;
}

at::Tensor unpack_into_new(const at::Tensor& packed, const RaggedGeometry& g,
                           at::IntArrayRef out_shape) {
  const auto src = packed.contiguous();
  const auto out = empty_output(out_shape, packed.options());
  ragged_move(g, out, src, RaggedDirection::kUnpack, at::Tensor());
  return out;
}

}  // namespace

at::Tensor pack_ragged(const at::Tensor& x, at::IntArrayRef counts, int64_t dim, int64_t pad_to,
                       const at::Scalar& fill) {
  constexpr const char* what = "cpshard.pack_ragged";
  check_movable(x, what, "x");
  TORCH_CHECK(x.dim() >= 1, what, ": x must have at least one dimension");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const auto view = token_view(x.sizes(), dim, what);
  const auto g = make_ragged_geometry(counts, view.pre, view.post, pad_to, what);
  TORCH_CHECK(g.total() == view.tokens, what, ": counts sum to ", g.total(), " but x.shape[", dim,
              "] is ", view.tokens);
  return pack_into_new(x, g, dim, fill, what);
}

at::Tensor unpack_ragged(const at::Tensor& packed, at::IntArrayRef counts, int64_t dim,
                         int64_t pad_to, at::IntArrayRef out_shape) {
  constexpr const char* what = "cpshard.unpack_ragged";
  check_movable(packed, what, "packed");
  TORCH_CHECK(!out_shape.empty(), what, ": out_shape must have at least one dimension");
  dim = c10::maybe_wrap_dim(dim, static_cast<int64_t>(out_shape.size()));
  const auto view = token_view(out_shape, dim, what);
  const auto g = make_ragged_geometry(counts, view.pre, view.post, pad_to, what);
  TORCH_CHECK(g.total() == view.tokens, what, ": counts sum to ", g.total(), " but out_shape[",
              dim, "] is ", view.tokens);
  TORCH_CHECK(packed.numel() == g.block_numel(), what, ": packed has ", packed.numel(),
              " elements but the counts, pad_to and out_shape describe ", g.block_numel());
  return unpack_into_new(packed, g, out_shape);
}

at::Tensor interleave_sequence(const at::Tensor& x, int64_t dim) {
  constexpr const char* what = "cpshard.interleave_sequence";
  check_movable(x, what, "x");
  TORCH_CHECK(x.dim() >= 2, what, ": x must be [W, ..., L, ...] with at least two dimensions");
  dim = c10::maybe_wrap_dim(dim, x.dim() - 1);
  const auto sizes = x.sizes();
  const auto view = token_view(sizes.slice(1), dim, what);
  const int64_t world = sizes[0];
  std::vector<int64_t> out_shape(sizes.begin() + 1, sizes.end());
  out_shape[dim] = checked_mul(world, view.tokens, what);
  if (x.numel() == 0) return at::empty(out_shape, x.options());
  const std::vector<int64_t> counts(world, view.tokens);
  const auto g = make_ragged_geometry(counts, view.pre, view.post, view.tokens, what);
  return unpack_into_new(x, g, out_shape);
}

at::Tensor deinterleave_sequence(const at::Tensor& x, int64_t world, int64_t dim) {
  constexpr const char* what = "cpshard.deinterleave_sequence";
  check_movable(x, what, "x");
  TORCH_CHECK(x.dim() >= 1, what, ": x must have at least one dimension");
  TORCH_CHECK(world >= 1, what, ": world must be >= 1, got ", world);
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const auto view = token_view(x.sizes(), dim, what);
  TORCH_CHECK(view.tokens % world == 0, what, ": x.shape[", dim, "] = ", view.tokens,
              " is not divisible by world = ", world);
  if (x.numel() == 0) {
    const auto shape = padded_shape(x.sizes(), dim, world, view.tokens / world);
    checked_prod(shape, 0, static_cast<int64_t>(shape.size()), what);
    return at::empty(shape, x.options());
  }
  const std::vector<int64_t> counts(world, view.tokens / world);
  const auto g = make_ragged_geometry(counts, view.pre, view.post, view.tokens / world, what);
  return pack_into_new(x, g, dim, at::Scalar(0), what);
}

}  // namespace cpshard
