// CUDA document segmentation, in four launches and one host sync:
//   1. mark: flag[t] = 1 where a segment begins at position t of the [B, end - start) window;
//   2. at::cumsum of the flags numbers the segments in row-major order (segment of t = csum[t]-1);
//      the total is read once to the host, to size the outputs;
//   3. straddle: per row, where the document at `start` begins (a backward scan from start,
//      which stops at the first position that holds another id; only the first segment of a row
//      can begin inside a document that started earlier);
//   4. write: each segment's begin position writes row, begin and doc_start, and its end position
//      writes the stop, turned into the length by one subtraction.
#include <c10/cuda/CUDAGuard.h>

#include "common/bytes_cuda.cuh"
#include "segment/segment.h"

namespace cpshard {
namespace {

using cuda::kThreads;

// Positions each thread of the straddle scan checks per step.
constexpr int64_t kScanPerThread = 16;

__device__ __forceinline__ bool begins_segment(const int64_t* row, int64_t i, int64_t start) {
  return row[i] != 0 && (i == start || row[i] != row[i - 1]);
}

__global__ void __launch_bounds__(kThreads)
    mark_kernel(const int64_t* __restrict__ ids, int64_t seq, int64_t start, int64_t len,
                int64_t n, int64_t* __restrict__ flags) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < n; t += stride) {
    const int64_t b = t / len;
    const int64_t i = start + (t - b * len);
    flags[t] = begins_segment(ids + b * seq, i, start) ? 1 : 0;
  }
}

// doc[b] = the first position of the maximal run of ids[b, start] that contains `start` (only
// meaningful where ids[b, start] != 0; `start` itself where it is 0). One block per row.
__global__ void __launch_bounds__(kThreads)
    straddle_kernel(const int64_t* __restrict__ ids, int64_t rows, int64_t seq, int64_t start,
                    int64_t* __restrict__ doc) {
  constexpr int64_t kStep = kThreads * kScanPerThread;
  __shared__ int64_t nearest;  // smallest distance back from `hi` to a different id in the step
  for (int64_t b = blockIdx.x; b < rows; b += gridDim.x) {
    const int64_t* row = ids + b * seq;
    const int64_t v = row[start];
    int64_t found = start;  // block-uniform
    if (v != 0 && start > 0) {
      found = 0;  // the whole prefix holds v unless a different id turns up
      int64_t hi = start;  // positions [0, hi) are still to be scanned, nearest first
      while (hi > 0) {
        if (threadIdx.x == 0) nearest = kStep;
        __syncthreads();
        int64_t mine = kStep;
        for (int64_t k = 0; k < kScanPerThread; ++k) {
          const int64_t d = k * kThreads + threadIdx.x;  // distance back from hi - 1
          const int64_t i = hi - 1 - d;
          if (i >= 0 && row[i] != v) {
            mine = d;
            break;
          }
        }
        if (mine < kStep) atomicMin(reinterpret_cast<unsigned long long*>(&nearest),
                                    static_cast<unsigned long long>(mine));
        __syncthreads();
        const int64_t d = nearest;
        __syncthreads();  // everyone has read `nearest` before it is reset
        if (d < kStep) {
          found = hi - d;  // position hi - 1 - d holds another id; the run starts after it
          break;
        }
        hi -= kStep;
      }
    }
    if (threadIdx.x == 0) doc[b] = found;
  }
}

__global__ void __launch_bounds__(kThreads)
    write_kernel(const int64_t* __restrict__ ids, int64_t seq, int64_t start, int64_t end,
                 int64_t n, const int64_t* __restrict__ csum, const int64_t* __restrict__ row_doc,
                 int64_t* __restrict__ out_row, int64_t* __restrict__ out_begin,
                 int64_t* __restrict__ out_stop, int64_t* __restrict__ out_doc) {
  const int64_t len = end - start;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < n; t += stride) {
    const int64_t b = t / len;
    const int64_t i = start + (t - b * len);
    const int64_t* row = ids + b * seq;
    const int64_t v = row[i];
    if (v == 0) continue;
    // A non-zero position lies in a segment that began at or before it in this row's window, so
    // csum[t] >= 1 and the segment's number is csum[t] - 1.
    const int64_t k = csum[t] - 1;
    if (i == start || row[i - 1] != v) {
      out_row[k] = b;
      out_begin[k] = i;
      out_doc[k] = i == start ? row_doc[b] : i;
    }
    if (i + 1 == end || row[i + 1] != v) out_stop[k] = i + 1;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_segments_cuda(
    const at::Tensor& ids, SegmentRange range) {
  TORCH_CHECK(ids.is_cuda() && ids.dim() == 2 && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "cpshard: internal error: document_segments_cuda needs contiguous int64 CUDA ids");
  const int64_t rows = ids.size(0);
  const int64_t seq = ids.size(1);
  TORCH_CHECK(0 <= range.start && range.start <= range.end && range.end <= seq,
              "cpshard: internal error: document_segments_cuda range out of bounds");
  const auto opts = ids.options().dtype(at::kLong);
  const int64_t len = range.end - range.start;
  const int64_t n = rows * len;  // <= ids.numel()
  if (n == 0) {
    return {at::empty({0}, opts), at::empty({0}, opts), at::empty({0}, opts), at::empty({0}, opts)};
  }

  c10::cuda::CUDAGuard guard(ids.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t* data = ids.const_data_ptr<int64_t>();

  auto flags = at::empty({n}, opts);
  const int64_t blocks = cuda::grid_blocks(n, kThreads);
  mark_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      data, seq, range.start, len, n, flags.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto csum = at::cumsum(flags, 0);

  auto row_doc = at::empty({rows}, opts);
  straddle_kernel<<<static_cast<unsigned int>(cuda::grid_blocks(rows, 1)), kThreads, 0, stream>>>(
      data, rows, seq, range.start, row_doc.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int64_t total = csum[n - 1].item<int64_t>();  // the one host sync: sizes the outputs
  auto seg_row = at::empty({total}, opts);
  auto seg_begin = at::empty({total}, opts);
  auto seg_len = at::empty({total}, opts);
  auto seg_doc = at::empty({total}, opts);
  if (total > 0) {
    write_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
        data, seq, range.start, range.end, n, csum.const_data_ptr<int64_t>(),
        row_doc.const_data_ptr<int64_t>(), seg_row.data_ptr<int64_t>(),
        seg_begin.data_ptr<int64_t>(), seg_len.data_ptr<int64_t>(), seg_doc.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    seg_len.sub_(seg_begin);  // stop - begin
  }
  return {seg_row, seg_begin, seg_len, seg_doc};
}

}  // namespace cpshard
