// Document segmentation: from per-token document ids [B, S] (0 = padding; a document is a maximal
// run of one non-zero id) and a rank's token range [start, end), the rank's segments in row-major
// order: row, global begin, length, and the global position where the segment's document starts
// (earlier than begin only for a first segment whose document straddles into earlier ranks).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace cpshard {

struct SegmentRange {
  int64_t start = 0;
  int64_t end = 0;
};

// ids: contiguous int64 [B, S]. Returns (row, begin, length, doc_start), int64 [n_segments].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_segments_cpu(
    const at::Tensor& ids, SegmentRange range);
#ifdef CPSHARD_WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_segments_cuda(
    const at::Tensor& ids, SegmentRange range);
#endif

}  // namespace cpshard
