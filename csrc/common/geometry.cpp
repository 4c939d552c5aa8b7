#include "common/geometry.h"

#include <ATen/Dispatch_v2.h>

#include <cmath>
#include <limits>
#include <type_traits>

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

namespace {

template <typename T>
bool integer_fits(int64_t v) {
  if constexpr (std::is_unsigned_v<T>) {
    return v >= 0 && (sizeof(T) >= sizeof(int64_t) ||
                      v <= static_cast<int64_t>(std::numeric_limits<T>::max()));
  } else {
    return v >= static_cast<int64_t>(std::numeric_limits<T>::lowest()) &&
           v <= static_cast<int64_t>(std::numeric_limits<T>::max());
  }
}

bool representable(const at::Scalar& fill, at::ScalarType dtype) {
  if (fill.isComplex()) return at::isComplexType(dtype);
  if (at::isComplexType(dtype) || fill.isBoolean()) return true;
  const double value = fill.toDouble();
  if (dtype == at::kBool) return value == 0.0 || value == 1.0;
  if (at::isIntegralType(dtype, /*includeBool=*/false)) {
    if (fill.isFloatingPoint() && (value != std::floor(value) || std::abs(value) > 9.2e18)) {
      return false;
    }
    const int64_t v = fill.isFloatingPoint() ? static_cast<int64_t>(value) : fill.toLong();
    bool fits = true;
    AT_DISPATCH_V2(dtype, "fill_range", AT_WRAP([&] { fits = integer_fits<scalar_t>(v); }),
                   AT_EXPAND(AT_INTEGRAL_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
    return fits;
  }
  // Floating types: NaN and inf are kept as given; a finite value must stay finite.
  if (!std::isfinite(value)) return true;
  double max = 0;
  AT_DISPATCH_V2(dtype, "fill_range",
                 AT_WRAP([&] { max = static_cast<double>(std::numeric_limits<scalar_t>::max()); }),
                 AT_EXPAND(AT_FLOATING_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_FLOAT8_TYPES));
  return std::abs(value) <= max;
}

}  // namespace

at::Tensor fill_bytes(const at::Scalar& fill, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(representable(fill, dtype), what, ": fill=", fill, " is not representable in ", dtype);
  return at::full({1}, fill, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace cpshard
