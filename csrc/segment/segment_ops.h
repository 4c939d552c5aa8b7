// The operator behind cpshard::document_segments.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace cpshard {

// doc_ids: integer or bool [B, S]; 0 <= start <= end <= S. See segment/segment.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_segments(
    const at::Tensor& doc_ids, int64_t start, int64_t end);

}  // namespace cpshard
