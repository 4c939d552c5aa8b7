// Shape helpers shared by every kernel family: a tensor viewed as [pre, tokens, post] around one
// token dimension, overflow-checked sizes, and the bytes of a fill value.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>

#include <cstdint>
#include <vector>

namespace cpshard {

// Product of sizes[begin, end), raising when it does not fit in int64.
int64_t checked_prod(at::IntArrayRef sizes, int64_t begin, int64_t end, const char* what);

// a * b, raising (naming `what`) on int64 overflow or a negative factor.
int64_t checked_mul(int64_t a, int64_t b, const char* what);

// A tensor of rank >= 1 viewed as [pre, tokens, post] around `dim` (already wrapped).
struct TokenView {
  int64_t pre;     // product of the sizes before dim
  int64_t tokens;  // size of dim
  int64_t post;    // product of the sizes after dim
};
TokenView token_view(at::IntArrayRef sizes, int64_t dim, const char* what);

// The element bytes of `fill` converted to `dtype`; raises (naming `what`) when the value is not
// representable: out of an integer type's range, fractional for an integer type, not 0/1 for
// bool, or finite but beyond a floating type's range.
at::Tensor fill_bytes(const at::Scalar& fill, at::ScalarType dtype, const char* what);

// Element sizes the byte-moving kernels handle (every ATen dtype has one of these).
inline bool supported_element_size(int64_t size) {
  return size == 1 || size == 2 || size == 4 || size == 8 || size == 16;
}

}  // namespace cpshard
