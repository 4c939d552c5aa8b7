// Output allocation for the kernels: a fresh tensor, backed by transparent huge pages when it is
// a large CPU buffer. First-touch page faults of a fresh 4 KiB-paged output cost more than the
// data movement itself (8 192 faults per 32 MiB); madvise(MADV_HUGEPAGE) on the 2 MiB-aligned
// interior cuts them ~500-fold where THP is in "madvise" or "always" mode, and changes nothing
// elsewhere. The Python transport does the same for its buffers (cpshard/hugepages.py).
#pragma once

#include <ATen/ATen.h>

namespace cpshard {

at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& options);

}  // namespace cpshard
