#include "common/output.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdint>

namespace cpshard {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
constexpr int64_t kMinBytes = 2 * static_cast<int64_t>(kHugePage);

void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (!t.device().is_cpu() || bytes < kMinBytes) return;
  const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t lo = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t hi = (start + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
  // Advisory: a refusal (THP disabled) leaves ordinary pages, so the result is not checked.
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

}  // namespace

at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& options) {
  auto out = at::empty(shape, options);
  advise_huge_pages(out);
  return out;
}

}  // namespace cpshard
