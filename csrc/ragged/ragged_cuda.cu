// CUDA ragged block moves. The work is cut like the CPU kernel's: one item per (rank, block row,
// chunk of the row); a group of kLanes threads moves one item (the real rows as one vectorised
// byte copy, then, when packing into a padded buffer, the padding rows as one vectorised fill),
// and groups stride over the items. The per-rank counts and offsets travel in the kernel
// arguments for up to kInlineRanks ranks and in a small device table beyond that, made once per
// distinct counts (once per step: a step's calls share their counts), complete before any stream
// reads it, and kept on the device (RankTables says how this is safe across streams and CUDA
// graphs).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "common/bytes_cuda.cuh"
#include "common/geometry.h"
#include "ragged/ragged.h"

namespace cpshard {
namespace {

using cuda::FillPattern;
using cuda::kThreads;

constexpr int64_t kInlineRanks = 64;

// Counts and exclusive prefix sums of up to kInlineRanks ranks, by value.
struct InlineRanks {
  int64_t count[kInlineRanks];
  int64_t prefix[kInlineRanks];
  __device__ __forceinline__ int64_t n(int64_t r) const { return count[r]; }
  __device__ __forceinline__ int64_t before(int64_t r) const { return prefix[r]; }
};

// Counts and exclusive prefix sums in device memory: table[r] = n_r, table[W + r] = prefix_r.
struct TableRanks {
  const int64_t* table;
  int64_t world;
  __device__ __forceinline__ int64_t n(int64_t r) const { return table[r]; }
  __device__ __forceinline__ int64_t before(int64_t r) const { return table[world + r]; }
};

struct RaggedArgs {
  char* dst;
  const char* src;
  int64_t elem;            // bytes per element
  int64_t pre, post, pad;  // pad = -1: exact-offset blocks
  int64_t total;           // sum of the counts
  int64_t chunk;           // elements per item
  int64_t chunks_per_row;  // items per (rank, row)
  int64_t items;           // world * pre * chunks_per_row
  bool pack;
  bool write_padding;
  FillPattern fill;
};

template <int kLanes, typename Ranks>
__global__ void __launch_bounds__(kThreads)
    ragged_move_kernel(const RaggedArgs a, const Ranks ranks) {
  constexpr int64_t kGroups = kThreads / kLanes;
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / kLanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroups;
  for (int64_t t = first; t < a.items; t += stride) {
    const int64_t c = t % a.chunks_per_row;
    const int64_t rp = t / a.chunks_per_row;  // r * pre + p
    const int64_t p = rp % a.pre;
    const int64_t r = rp / a.pre;
    const int64_t n = ranks.n(r);
    const int64_t slot = (a.pad >= 0 ? a.pad : n) * a.post;  // block-row elements
    const int64_t lo = c * a.chunk;
    if (lo >= slot) continue;
    const int64_t hi = cuda::min64(lo + a.chunk, slot);
    const int64_t real = n * a.post;
    const int64_t before = ranks.before(r);
    const int64_t block_at =
        a.pad >= 0 ? rp * a.pad * a.post : (a.pre * before + p * n) * a.post;
    const int64_t compact_at = (p * a.total + before) * a.post;
    const int64_t src_at = a.pack ? compact_at : block_at;
    const int64_t dst_at = a.pack ? block_at : compact_at;
    if (lo < real) {
      cuda::group_copy<kLanes>(a.dst + (dst_at + lo) * a.elem, a.src + (src_at + lo) * a.elem,
                               (cuda::min64(hi, real) - lo) * a.elem, lane);
    }
    if (a.write_padding && hi > real) {
      const int64_t from = cuda::max64(lo, real);
      cuda::group_fill<kLanes>(a.dst + (dst_at + from) * a.elem, (hi - from) * a.elem, a.fill,
                               lane);
    }
  }
}

template <int kLanes, typename Ranks>
void launch(const RaggedArgs& a, const Ranks& ranks, cudaStream_t stream) {
  const int64_t blocks = cuda::grid_blocks(a.items, kThreads / kLanes);
  ragged_move_kernel<kLanes, Ranks><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(a, ranks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Ranks>
void launch_lanes(const RaggedArgs& a, const Ranks& ranks, bool narrow, cudaStream_t stream) {
  if (narrow) {
    launch<32>(a, ranks, stream);
  } else {
    launch<kThreads>(a, ranks, stream);
  }
}

// The device tables of counts and prefixes beyond kInlineRanks ranks, one per (device, counts),
// built on first use and reused by every later call with the same counts: no host->device copy
// per call. A table is complete before any stream reads it: it is allocated and uploaded on a
// stream of its own (so the caching allocator orders the memory's reuse there, not on a caller's
// stream) and that stream is synchronised (tens of microseconds, once per distinct counts), so
// every stream, and every CUDA graph, may read it with no event to wait on. None is made while
// the caller's stream is capturing a CUDA graph (its upload would run only at replay, and an
// eager call reading the cached table before that would read garbage): such a call raises,
// asking for an eager warm-up. Entries used while a stream was capturing are never evicted (the
// graph may replay at any time); the others are evicted oldest first beyond kTableCacheSize
// (their device memory recorded on every stream that used it, so the caching allocator reuses it
// only once those uses are done).
class RankTables {
 public:
  static constexpr size_t kTableCacheSize = 64;

  // The device table for `g` on the device of `on`, made when new (never under capture); usable
  // on any stream of that device.
  const int64_t* get(const RaggedGeometry& g, const c10::cuda::CUDAStream& on) {
    const c10::DeviceIndex device = on.device_index();
    Key key{device, g.counts};
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(on.stream(), &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    std::lock_guard<std::mutex> lock(mu_);
    auto found = tables_.find(key);
    if (found == tables_.end()) {
      TORCH_CHECK(!capturing, "cpshard.ragged: counts of ", g.world(), " ranks (more than ",
                  kInlineRanks, ") travel in a device table, which cannot be made while a CUDA "
                  "graph is being captured: run the call once eagerly with the same counts "
                  "(a warm-up) before capturing it");
      found = tables_.emplace(key, make(g, device)).first;
      order_.push_back(key);
      evict_locked();
    }
    Entry& e = found->second;
    c10::cuda::CUDACachingAllocator::recordStream(e.device.storage().data_ptr(), on);
    e.captured |= capturing;
    return e.device.const_data_ptr<int64_t>();
  }

 private:
  using Key = std::pair<c10::DeviceIndex, std::vector<int64_t>>;
  struct Entry {
    at::Tensor device;  // counts then prefixes, 2 * W int64
    bool captured = false;
  };

  // The upload stream of `device`: non-blocking (it never waits for the legacy default stream),
  // made once and kept for the process's life (CUDA may be gone at exit).
  c10::cuda::CUDAStream upload_stream_locked(c10::DeviceIndex device) {
    auto found = streams_.find(device);
    if (found == streams_.end()) {
      c10::cuda::CUDAGuard guard(device);
      cudaStream_t stream = nullptr;
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      found = streams_.emplace(device, stream).first;
    }
    return c10::cuda::getStreamFromExternal(found->second, device);
  }

  Entry make(const RaggedGeometry& g, c10::DeviceIndex device) {
    const int64_t world = g.world();
    std::vector<int64_t> host(g.counts.begin(), g.counts.end());
    host.insert(host.end(), g.prefix.begin(), g.prefix.begin() + world);
    const c10::cuda::CUDAStream upload = upload_stream_locked(device);
    c10::cuda::CUDAStreamGuard on_upload(upload);  // the allocation belongs to the upload stream
    Entry e;
    e.device =
        at::empty({2 * world}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, device));
    C10_CUDA_CHECK(cudaMemcpyAsync(e.device.data_ptr(), host.data(), 2 * world * sizeof(int64_t),
                                   cudaMemcpyHostToDevice, upload.stream()));
    C10_CUDA_CHECK(cudaStreamSynchronize(upload.stream()));
    return e;
  }

  void evict_locked() {
    for (auto it = order_.begin(); tables_.size() > kTableCacheSize && it != order_.end();) {
      const auto found = tables_.find(*it);
      if (found->second.captured) {
        ++it;
        continue;
      }
      tables_.erase(found);
      it = order_.erase(it);
    }
  }

  std::mutex mu_;
  std::map<Key, Entry> tables_;
  std::deque<Key> order_;  // first-use order, for eviction
  std::map<c10::DeviceIndex, cudaStream_t> streams_;
};

RankTables& rank_tables() {
  static auto* tables = new RankTables();  // never destroyed: CUDA may be gone at exit
  return *tables;
}

}  // namespace

void ragged_move_cuda(const RaggedGeometry& g, const at::Tensor& compact, const at::Tensor& blocks,
                      RaggedDirection dir, const at::Tensor& fill) {
  TORCH_CHECK(compact.is_cuda() && blocks.is_cuda() && compact.device() == blocks.device(),
              "cpshard: internal error: ragged_move_cuda needs both tensors on one CUDA device");
  TORCH_CHECK(compact.is_contiguous() && blocks.is_contiguous() &&
                  compact.element_size() == blocks.element_size(),
              "cpshard: internal error: ragged_move_cuda needs contiguous tensors of one dtype");
  const int64_t world = g.world();
  const int64_t elem = compact.element_size();
  if (world == 0 || g.pre == 0 || g.post == 0) return;
  TORCH_CHECK(compact.numel() == g.pre * g.total() * g.post && blocks.numel() == g.block_numel(),
              "cpshard: internal error: ragged_move_cuda tensor sizes do not match the geometry");
  const bool pack = dir == RaggedDirection::kPack;
  const bool write_padding = pack && g.pad >= 0;
  if (g.total() == 0 && !write_padding) return;  // no real rows and no padding to write
  int64_t max_slot = 0;
  for (int64_t r = 0; r < world; ++r) max_slot = std::max(max_slot, g.slot_elems(r));
  if (max_slot == 0) return;

  c10::cuda::CUDAGuard guard(compact.device());
  const c10::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream();
  const cudaStream_t stream = current.stream();

  // Short rows go to a warp each, long rows to a whole block in chunks of 16 bytes x 4 per lane.
  const bool narrow = max_slot * elem <= 2048;
  const int64_t lanes = narrow ? 32 : kThreads;
  const int64_t chunk = std::max<int64_t>(1, lanes * 16 * 4 / elem);

  RaggedArgs a{};
  a.dst = static_cast<char*>(pack ? blocks.data_ptr() : compact.data_ptr());
  a.src = static_cast<const char*>(pack ? compact.const_data_ptr() : blocks.const_data_ptr());
  a.elem = elem;
  a.pre = g.pre;
  a.post = g.post;
  a.pad = g.pad;
  a.total = g.total();
  a.chunk = chunk;
  a.chunks_per_row = (max_slot + chunk - 1) / chunk;
  a.items = checked_mul(checked_mul(world, g.pre, "cpshard.ragged_move"), a.chunks_per_row,
                        "cpshard.ragged_move");
  a.pack = pack;
  a.write_padding = write_padding;  // max_slot > 0, so a padded row has pad * post > 0 elements
  if (a.write_padding) {
    a.fill = cuda::make_fill_pattern(fill, elem);
  } else {
    a.fill.elem = 1;
  }

  if (world <= kInlineRanks) {
    InlineRanks ranks{};
    for (int64_t r = 0; r < world; ++r) {
      ranks.count[r] = g.counts[r];
      ranks.prefix[r] = g.prefix[r];
    }
    launch_lanes(a, ranks, narrow, stream);
  } else {
    const int64_t* table = rank_tables().get(g, current);
    launch_lanes(a, TableRanks{table, world}, narrow, stream);
  }
}

}  // namespace cpshard
