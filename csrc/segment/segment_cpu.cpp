// CPU document segmentation: rows in parallel, two passes (count, then write at each row's
// offset), so the output is allocated once at its exact size.
#include <ATen/Parallel.h>

#include <vector>

#include "segment/segment.h"

namespace cpshard {
namespace {

// Whether a segment begins at position i of a row (i in [start, end)).
inline bool begins_segment(const int64_t* row, int64_t i, int64_t start) {
  return row[i] != 0 && (i == start || row[i] != row[i - 1]);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_segments_cpu(
    const at::Tensor& ids, SegmentRange range) {
  const int64_t rows = ids.size(0);
  const int64_t seq = ids.size(1);
  const int64_t* data = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> first(rows + 1, 0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* row = data + b * seq;
      int64_t n = 0;
      for (int64_t i = range.start; i < range.end; ++i) n += begins_segment(row, i, range.start);
      first[b + 1] = n;
    }
  });
  for (int64_t b = 0; b < rows; ++b) first[b + 1] += first[b];
  const auto opts = ids.options().dtype(at::kLong);
  auto seg_row = at::empty({first[rows]}, opts);
  auto seg_begin = at::empty({first[rows]}, opts);
  auto seg_len = at::empty({first[rows]}, opts);
  auto seg_doc = at::empty({first[rows]}, opts);
  int64_t* out_row = seg_row.data_ptr<int64_t>();
  int64_t* out_begin = seg_begin.data_ptr<int64_t>();
  int64_t* out_len = seg_len.data_ptr<int64_t>();
  int64_t* out_doc = seg_doc.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* row = data + b * seq;
      int64_t k = first[b];
      for (int64_t i = range.start; i < range.end; ++i) {
        if (!begins_segment(row, i, range.start)) continue;
        int64_t stop = i + 1;
        while (stop < range.end && row[stop] == row[i]) ++stop;
        int64_t doc = i;
        while (doc > 0 && row[doc - 1] == row[i]) --doc;
        out_row[k] = b;
        out_begin[k] = i;
        out_len[k] = stop - i;
        out_doc[k] = doc;
        ++k;
        i = stop - 1;
      }
    }
  });
  return {seg_row, seg_begin, seg_len, seg_doc};
}

}  // namespace cpshard
