// Element copies and fills on raw bytes, by element size: the data-movement kernels do not care
// about the dtype, only about how many bytes an element has.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpshard {

struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <int kSize>
struct ElementOf;
template <> struct ElementOf<1> { using type = uint8_t; };
template <> struct ElementOf<2> { using type = uint16_t; };
template <> struct ElementOf<4> { using type = uint32_t; };
template <> struct ElementOf<8> { using type = uint64_t; };
template <> struct ElementOf<16> { using type = Bytes16; };

// Copies n elements of `elem` bytes; a single element is copied as one load/store.
inline void copy_elements(char* dst, const char* src, int64_t n, int64_t elem) {
  if (n == 1) {
    switch (elem) {
      case 1: *dst = *src; return;
      case 2: std::memcpy(dst, src, 2); return;
      case 4: std::memcpy(dst, src, 4); return;
      case 8: std::memcpy(dst, src, 8); return;
      default: break;
    }
  }
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n * elem));
}

// Writes n copies of the element at `pattern` (elem bytes) to dst.
inline void fill_elements(char* dst, const char* pattern, int64_t n, int64_t elem) {
  if (n <= 0) return;
  bool zero = true;
  for (int64_t i = 0; i < elem; ++i) zero = zero && pattern[i] == 0;
  if (zero) {
    std::memset(dst, 0, static_cast<size_t>(n * elem));
    return;
  }
  auto fill_as = [&](auto tag) {
    using T = decltype(tag);
    T value;
    std::memcpy(&value, pattern, sizeof(T));
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * sizeof(T), &value, sizeof(T));
  };
  switch (elem) {
    case 1: std::memset(dst, static_cast<unsigned char>(pattern[0]), static_cast<size_t>(n)); break;
    case 2: fill_as(uint16_t{}); break;
    case 4: fill_as(uint32_t{}); break;
    case 8: fill_as(uint64_t{}); break;
    default: fill_as(Bytes16{}); break;
  }
}

// Tasks handed to at::parallel_for carry about this many bytes, so small moves stay serial.
constexpr int64_t kGrainBytes = 1 << 16;
// Long contiguous runs are cut into chunks of this many bytes to spread them over threads.
constexpr int64_t kChunkBytes = 1 << 18;

}  // namespace cpshard
