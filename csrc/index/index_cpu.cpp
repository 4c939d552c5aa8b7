// CPU index gather (one memcpy or fill per output row) and CSR scatter-add (each output row
// owned by one task, so no atomics and a fixed summation order).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common/bytes_cpu.h"
#include "index/index.h"

namespace cpshard {

void index_gather_cpu(const IndexGeometry& g, const at::Tensor& src, const at::Tensor& index,
                      const at::Tensor& out, const at::Tensor& fill) {
  const int64_t elem = src.element_size();
  const int64_t rows = g.pre * g.idx_rows;
  if (rows == 0 || g.post == 0) return;
  const char* in = static_cast<const char*>(src.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  const char* pattern = static_cast<const char*>(fill.const_data_ptr());
  const int64_t row_bytes = g.post * elem;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / row_bytes);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / g.idx_rows;
      const int64_t j = idx[t % g.idx_rows];
      char* row = dst + t * row_bytes;
      if (j < 0) {
        fill_elements(row, pattern, g.post, elem);
      } else {
        copy_elements(row, in + (p * g.src_rows + j) * row_bytes, g.post, elem);
      }
    }
  });
}

void index_scatter_add_cpu(const IndexGeometry& g, const at::Tensor& grad, const at::Tensor& order,
                           const at::Tensor& row_start, const at::Tensor& out) {
  const int64_t rows = g.pre * g.src_rows;
  if (rows == 0 || g.post == 0) return;
  const int64_t* src_of = order.const_data_ptr<int64_t>();
  const int64_t* starts = row_start.const_data_ptr<int64_t>();
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "index_scatter_add_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* in = grad.const_data_ptr<scalar_t>();
        scalar_t* dst = out.data_ptr<scalar_t>();
        const int64_t grain = std::max<int64_t>(1, kGrainBytes / (g.post * grad.element_size()));
        at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
          std::vector<acc_t> acc(g.post);
          for (int64_t t = begin; t < end; ++t) {
            const int64_t p = t / g.src_rows;
            const int64_t j = t % g.src_rows;
            std::fill(acc.begin(), acc.end(), acc_t(0));
            for (int64_t k = starts[j]; k < starts[j + 1]; ++k) {
              const scalar_t* row = in + (p * g.idx_rows + src_of[k]) * g.post;
              for (int64_t q = 0; q < g.post; ++q) acc[q] += static_cast<acc_t>(row[q]);
            }
            scalar_t* o = dst + t * g.post;
            for (int64_t q = 0; q < g.post; ++q) o[q] = static_cast<scalar_t>(acc[q]);
          }
        });
      });
}

}  // namespace cpshard
