#include "segment/segment_ops.h"

#include "common/device.h"
#include "segment/segment.h"

namespace cpshard {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_segments(
    const at::Tensor& doc_ids, int64_t start, int64_t end) {
  constexpr const char* what = "cpshard.document_segments";
  TORCH_CHECK(doc_ids.defined(), what, ": doc_ids is undefined");
  TORCH_CHECK(doc_ids.dim() == 2, what, ": doc_ids must be [B, S], got shape ", doc_ids.sizes());
  TORCH_CHECK(!at::isFloatingType(doc_ids.scalar_type()) &&
                  !at::isComplexType(doc_ids.scalar_type()),
              what, ": doc_ids must hold integers or bools, got ", doc_ids.scalar_type());
  TORCH_CHECK(doc_ids.device().is_cpu() || doc_ids.device().is_cuda(), what,
              ": doc_ids must be a CPU or CUDA tensor, got ", doc_ids.device());
  const int64_t seq = doc_ids.size(1);
  TORCH_CHECK(0 <= start && start <= end && end <= seq, what, ": need 0 <= start <= end <= S, got start=",
              start, ", end=", end, ", S=", seq);
  if (start == end || doc_ids.size(0) == 0) {  // no tokens in range: no segments
    const auto none = at::empty({0}, doc_ids.options().dtype(at::kLong));
    return {none, none.clone(), none.clone(), none.clone()};
  }
  const auto ids = doc_ids.to(at::kLong).contiguous();
  const SegmentRange range{start, end};
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> out;
  CPSHARD_ON_DEVICE(ids, out = document_segments_cpu(ids, range),
                    out = document_segments_cuda(ids, range));
  return out;
}

}  // namespace cpshard
