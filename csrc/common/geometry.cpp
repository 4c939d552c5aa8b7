#include "common/geometry.h"

namespace cpshard {

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  TORCH_CHECK(a >= 0 && b >= 0, what, ": negative size (", a, " x ", b, ")");
  int64_t out = 0;
  TORCH_CHECK(!c10::mul_overflows(a, b, &out), what, ": size ", a, " x ", b, " overflows int64");
  return out;
}

int64_t checked_prod(at::IntArrayRef sizes, int64_t begin, int64_t end, const char* what) {
  int64_t out = 1;
  for (int64_t i = begin; i < end; ++i) out = checked_mul(out, sizes[i], what);
  return out;
}

TokenView token_view(at::IntArrayRef sizes, int64_t dim, const char* what) {
  const auto rank = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(0 <= dim && dim < rank, what, ": dim ", dim, " out of range for a ", rank, "-d tensor");
  return TokenView{checked_prod(sizes, 0, dim, what), sizes[dim],
                   checked_prod(sizes, dim + 1, rank, what)};
}

at::Tensor fill_bytes(const at::Scalar& fill, at::ScalarType dtype) {
  // at::full checks that the value converts to dtype without overflow.
  return at::full({1}, fill, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace cpshard
