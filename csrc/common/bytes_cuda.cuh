// Device-side byte moves shared by the CUDA kernels: a group of `kLanes` threads copies or fills
// one contiguous run of bytes, with 16/8/4/2-byte vector accesses wherever the source and the
// destination are congruent modulo the vector size (so any alignment is handled, and the common
// aligned case runs at full width), plus the host helpers that size launches on torch's current
// device. Only included by .cu files.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace cpshard {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of every kernel here

// The bytes of one fill element (1, 2, 4, 8 or 16 bytes), pre-rotated for 16-byte stores:
// rotated[k] holds the 16 bytes that start at byte k of the element repeated, so a 16-byte store
// whose first byte is byte k (mod elem) of an element is rotated[k % elem].
struct FillPattern {
  uint4 rotated[16];
  unsigned char bytes[16];  // the element's bytes, repeated to 16
  int64_t elem;
};

// Reads the one-element CPU tensor `fill` (the bytes of the fill value) on the host.
inline FillPattern make_fill_pattern(const at::Tensor& fill, int64_t elem) {
  TORCH_CHECK(fill.defined() && fill.device().is_cpu() && fill.numel() == 1 &&
                  fill.element_size() == elem,
              "cpshard: internal error: the fill value must be one CPU element of ", elem,
              " bytes");
  TORCH_CHECK(elem == 1 || elem == 2 || elem == 4 || elem == 8 || elem == 16,
              "cpshard: internal error: unsupported element size ", elem);
  const auto* src = static_cast<const unsigned char*>(fill.const_data_ptr());
  FillPattern p{};
  p.elem = elem;
  for (int64_t b = 0; b < 16; ++b) p.bytes[b] = src[b % elem];
  for (int64_t k = 0; k < 16; ++k) {
    unsigned char window[16];
    for (int64_t b = 0; b < 16; ++b) window[b] = src[(k + b) % elem];
    std::memcpy(&p.rotated[k], window, 16);
  }
  return p;
}

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a < b ? b : a; }

// Copies `nbytes` bytes between src and dst, which agree modulo sizeof(V): bytes up to the first
// V boundary, then whole V's, then the remaining bytes; lane `lane` of `kLanes` takes every
// kLanes-th access.
template <typename V, int kLanes>
__device__ __forceinline__ void copy_congruent(char* __restrict__ dst,
                                               const char* __restrict__ src, int64_t nbytes,
                                               int lane) {
  constexpr int64_t kV = static_cast<int64_t>(sizeof(V));
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) & (kV - 1));
  const int64_t head = mis == 0 ? 0 : (kV - mis < nbytes ? kV - mis : nbytes);
  for (int64_t b = lane; b < head; b += kLanes) dst[b] = src[b];
  const int64_t nvec = (nbytes - head) / kV;
  const V* vs = reinterpret_cast<const V*>(src + head);
  V* vd = reinterpret_cast<V*>(dst + head);
  for (int64_t v = lane; v < nvec; v += kLanes) vd[v] = vs[v];
  for (int64_t b = head + nvec * kV + lane; b < nbytes; b += kLanes) dst[b] = src[b];
}

// Copies nbytes from src to dst (non-overlapping) with the widest vector both allow.
template <int kLanes>
__device__ __forceinline__ void group_copy(char* dst, const char* src, int64_t nbytes, int lane) {
  if (nbytes <= 0) return;
  const uintptr_t diff = (reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src));
  if ((diff & 15) == 0) {
    copy_congruent<uint4, kLanes>(dst, src, nbytes, lane);
  } else if ((diff & 7) == 0) {
    copy_congruent<uint2, kLanes>(dst, src, nbytes, lane);
  } else if ((diff & 3) == 0) {
    copy_congruent<uint32_t, kLanes>(dst, src, nbytes, lane);
  } else if ((diff & 1) == 0) {
    copy_congruent<uint16_t, kLanes>(dst, src, nbytes, lane);
  } else {
    copy_congruent<unsigned char, kLanes>(dst, src, nbytes, lane);
  }
}

// Writes nbytes of repeated fill elements at dst, which is the start of an element (so byte b of
// the run is byte b % elem of the element): single bytes up to the first 16-byte boundary, then
// 16-byte stores, then single bytes.
template <int kLanes>
__device__ __forceinline__ void group_fill(char* dst, int64_t nbytes, const FillPattern& pat,
                                           int lane) {
  if (nbytes <= 0) return;
  const int64_t mask = pat.elem - 1;  // elem is a power of two <= 16
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & 15);
  const int64_t head = mis == 0 ? 0 : (16 - mis < nbytes ? 16 - mis : nbytes);
  for (int64_t b = lane; b < head; b += kLanes) dst[b] = pat.bytes[b & mask];
  const int64_t nvec = (nbytes - head) / 16;
  if (nvec > 0) {
    const uint4 value = pat.rotated[head & mask];
    uint4* vd = reinterpret_cast<uint4*>(dst + head);
    for (int64_t v = lane; v < nvec; v += kLanes) vd[v] = value;
  }
  for (int64_t b = head + nvec * 16 + lane; b < nbytes; b += kLanes) dst[b] = pat.bytes[b & mask];
}

// Blocks for a grid-stride kernel of kThreads threads that has `work` independent units of
// `units_per_block` per block: enough to fill the device, never more than the work needs.
inline int64_t grid_blocks(int64_t work, int64_t units_per_block) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t per_sm = std::max<int64_t>(1, prop->maxThreadsPerMultiProcessor / kThreads);
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(prop->multiProcessorCount) * per_sm);
  const int64_t need = (work + units_per_block - 1) / units_per_block;
  return std::max<int64_t>(1, std::min(need, cap));
}

// Whether `p` is aligned to `align` bytes.
inline bool aligned_to(const void* p, int64_t align) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(align) == 0;
}

}  // namespace cuda
}  // namespace cpshard
