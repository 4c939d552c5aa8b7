// CUDA index gather with fill and CSR scatter-add.
// Gather: rows of at least kRowPathBytes move as vectorised byte runs, one group of threads per
// (output row, chunk); shorter rows go one thread per element. Scatter-add: one thread per output
// element sums its CSR sources in ascending order in at::opmath_type, so the result is
// deterministic and needs no atomics.
// Bounds: the index is not checked on the host (that would read it back, a sync per call). A
// gather row whose index is >= the source's rows fails a device-side assertion and is never
// read; the scatter-add's CSR walk only visits targets below dim_size, and its first thread
// asserts that every index did fall below it.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstring>

#include "common/bytes_cuda.cuh"
#include "common/geometry.h"
#include "index/index.h"

namespace cpshard {
namespace {

using cuda::FillPattern;
using cuda::kThreads;

constexpr int64_t kRowPathBytes = 64;

#define CPSHARD_GATHER_RANGE_MESSAGE "cpshard.index_gather: an index is >= src.shape[dim]"

// ---- gather, one group of kLanes threads per (output row, chunk) ------------------------------

struct GatherRowArgs {
  const char* src;
  const int64_t* index;
  char* out;
  int64_t src_rows, idx_rows;
  int64_t row_bytes;        // post * elem
  int64_t chunk_bytes;      // bytes per item (a multiple of 16 and of elem)
  int64_t chunks_per_row;
  int64_t items;            // pre * idx_rows * chunks_per_row
  FillPattern fill;
};

template <int kLanes>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const GatherRowArgs a) {
  constexpr int64_t kGroups = kThreads / kLanes;
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / kLanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroups;
  for (int64_t t = first; t < a.items; t += stride) {
    const int64_t row = t / a.chunks_per_row;  // p * idx_rows + i
    const int64_t lo = (t % a.chunks_per_row) * a.chunk_bytes;
    const int64_t n = cuda::min64(a.chunk_bytes, a.row_bytes - lo);
    const int64_t p = row / a.idx_rows;
    const int64_t j = a.index[row % a.idx_rows];
    CUDA_KERNEL_ASSERT_MSG(j < a.src_rows, CPSHARD_GATHER_RANGE_MESSAGE);
    char* dst = a.out + row * a.row_bytes + lo;
    if (j < 0 || j >= a.src_rows) {
      cuda::group_fill<kLanes>(dst, n, a.fill, lane);
    } else {
      cuda::group_copy<kLanes>(dst, a.src + (p * a.src_rows + j) * a.row_bytes + lo, n, lane);
    }
  }
}

// ---- gather, one thread per element -----------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gather_elements_kernel(const T* __restrict__ src, const int64_t* __restrict__ index,
                           T* __restrict__ out, const T fill, int64_t src_rows, int64_t idx_rows,
                           int64_t post, int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < numel;
       e += stride) {
    const int64_t row = e / post;  // p * idx_rows + i
    const int64_t q = e - row * post;
    const int64_t p = row / idx_rows;
    const int64_t j = index[row - p * idx_rows];
    CUDA_KERNEL_ASSERT_MSG(j < src_rows, CPSHARD_GATHER_RANGE_MESSAGE);
    out[e] = j < 0 || j >= src_rows ? fill : src[(p * src_rows + j) * post + q];
  }
}

template <typename T>
void launch_gather_elements(const IndexGeometry& g, const at::Tensor& src, const at::Tensor& index,
                            const at::Tensor& out, const at::Tensor& fill, cudaStream_t stream) {
  T value;
  std::memcpy(&value, fill.const_data_ptr(), sizeof(T));
  const int64_t numel = g.pre * g.idx_rows * g.post;
  const int64_t blocks = cuda::grid_blocks(numel, kThreads);
  gather_elements_kernel<T><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(src.const_data_ptr()), index.const_data_ptr<int64_t>(),
      static_cast<T*>(out.data_ptr()), value, g.src_rows, g.idx_rows, g.post, numel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Runs the per-element kernel when both data pointers allow T accesses; false otherwise.
template <typename T>
bool try_gather_elements(const IndexGeometry& g, const at::Tensor& src, const at::Tensor& index,
                         const at::Tensor& out, const at::Tensor& fill, cudaStream_t stream) {
  const bool src_ok = src.numel() == 0 || cuda::aligned_to(src.const_data_ptr(), alignof(T));
  if (!src_ok || !cuda::aligned_to(out.const_data_ptr(), alignof(T))) return false;
  launch_gather_elements<T>(g, src, index, out, fill, stream);
  return true;
}

// ---- scatter-add ------------------------------------------------------------------------------

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    scatter_add_kernel(const scalar_t* __restrict__ grad, const int64_t* __restrict__ order,
                       const int64_t* __restrict__ row_start, scalar_t* __restrict__ out,
                       int64_t src_rows, int64_t idx_rows, int64_t post, int64_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // row_start[src_rows] counts the indices below dim_size: all of them, or one was out of range.
    CUDA_KERNEL_ASSERT_MSG(row_start[src_rows] == idx_rows,
                           "cpshard.index_scatter_add: an index is >= dim_size");
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < numel;
       e += stride) {
    const int64_t row = e / post;  // p * src_rows + j
    const int64_t q = e - row * post;
    const int64_t p = row / src_rows;
    const int64_t j = row - p * src_rows;
    const scalar_t* base = grad + p * idx_rows * post + q;
    acc_t acc = acc_t(0);
    const int64_t stop = row_start[j + 1];
    for (int64_t k = row_start[j]; k < stop; ++k) {
      acc += static_cast<acc_t>(base[order[k] * post]);
    }
    out[e] = static_cast<scalar_t>(acc);
  }
}

}  // namespace

void index_gather_cuda(const IndexGeometry& g, const at::Tensor& src, const at::Tensor& index,
                       const at::Tensor& out, const at::Tensor& fill) {
  TORCH_CHECK(src.is_cuda() && index.device() == src.device() && out.device() == src.device(),
              "cpshard: internal error: index_gather_cuda needs src, index and out on one CUDA "
              "device");
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous() && index.is_contiguous() &&
                  index.scalar_type() == at::kLong && src.element_size() == out.element_size(),
              "cpshard: internal error: index_gather_cuda needs contiguous data and an int64 index");
  const int64_t elem = src.element_size();
  TORCH_CHECK(fill.defined() && fill.device().is_cpu() && fill.numel() == 1 &&
                  fill.element_size() == elem,
              "cpshard: internal error: index_gather_cuda needs the fill value as one CPU element");
  const int64_t rows = g.pre * g.idx_rows;
  if (rows == 0 || g.post == 0) return;
  TORCH_CHECK(out.numel() == rows * g.post && src.numel() == g.pre * g.src_rows * g.post &&
                  index.numel() == g.idx_rows,
              "cpshard: internal error: index_gather_cuda tensor sizes do not match the geometry");

  c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t row_bytes = checked_mul(g.post, elem, "cpshard.index_gather");

  if (row_bytes < kRowPathBytes) {
    bool done = false;
    switch (elem) {
      case 1: done = try_gather_elements<uint8_t>(g, src, index, out, fill, stream); break;
      case 2: done = try_gather_elements<uint16_t>(g, src, index, out, fill, stream); break;
      case 4: done = try_gather_elements<uint32_t>(g, src, index, out, fill, stream); break;
      case 8: done = try_gather_elements<uint64_t>(g, src, index, out, fill, stream); break;
      case 16: done = try_gather_elements<uint4>(g, src, index, out, fill, stream); break;
      default: break;
    }
    if (done) return;
  }

  const bool narrow = row_bytes <= 2048;
  const int64_t lanes = narrow ? 32 : kThreads;
  GatherRowArgs a{};
  a.src = static_cast<const char*>(src.const_data_ptr());
  a.index = index.const_data_ptr<int64_t>();
  a.out = static_cast<char*>(out.data_ptr());
  a.src_rows = g.src_rows;
  a.idx_rows = g.idx_rows;
  a.row_bytes = row_bytes;
  a.chunk_bytes = lanes * 16 * 4;  // a multiple of 16, so every chunk starts on an element
  a.chunks_per_row = (row_bytes + a.chunk_bytes - 1) / a.chunk_bytes;
  a.items = checked_mul(rows, a.chunks_per_row, "cpshard.index_gather");
  a.fill = cuda::make_fill_pattern(fill, elem);
  if (narrow) {
    const int64_t blocks = cuda::grid_blocks(a.items, kThreads / 32);
    gather_rows_kernel<32><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(a);
  } else {
    const int64_t blocks = cuda::grid_blocks(a.items, 1);
    gather_rows_kernel<kThreads><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void index_scatter_add_cuda(const IndexGeometry& g, const at::Tensor& grad,
                            const at::Tensor& order, const at::Tensor& row_start,
                            const at::Tensor& out) {
  TORCH_CHECK(grad.is_cuda() && order.device() == grad.device() &&
                  row_start.device() == grad.device() && out.device() == grad.device(),
              "cpshard: internal error: index_scatter_add_cuda needs every tensor on one CUDA "
              "device");
  TORCH_CHECK(grad.is_contiguous() && out.is_contiguous() && order.is_contiguous() &&
                  row_start.is_contiguous() && order.scalar_type() == at::kLong &&
                  row_start.scalar_type() == at::kLong &&
                  grad.scalar_type() == out.scalar_type(),
              "cpshard: internal error: index_scatter_add_cuda needs contiguous data and int64 "
              "CSR tensors");
  const int64_t numel = g.pre * g.src_rows * g.post;
  if (numel == 0) return;
  TORCH_CHECK(out.numel() == numel && grad.numel() == g.pre * g.idx_rows * g.post &&
                  order.numel() == g.idx_rows && row_start.numel() == g.src_rows + 1,
              "cpshard: internal error: index_scatter_add_cuda tensor sizes do not match the "
              "geometry");

  c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = cuda::grid_blocks(numel, kThreads);
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "index_scatter_add_cuda", [&] {
        scatter_add_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
            grad.const_data_ptr<scalar_t>(), order.const_data_ptr<int64_t>(),
            row_start.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>(), g.src_rows,
            g.idx_rows, g.post, numel);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace cpshard
