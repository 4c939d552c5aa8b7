// CPU ragged block moves: one task per (rank, row, chunk) of the block buffer; each task is one
// memcpy of real rows plus (when packing into a padded buffer) one fill of padding rows.
#include <ATen/Parallel.h>

#include <algorithm>

#include "common/bytes_cpu.h"
#include "ragged/ragged.h"

namespace cpshard {

void ragged_move_cpu(const RaggedGeometry& g, const at::Tensor& compact, const at::Tensor& blocks,
                     RaggedDirection dir, const at::Tensor& fill) {
  const int64_t elem = compact.element_size();
  const int64_t world = g.world();
  if (world == 0 || g.pre == 0 || g.post == 0) return;
  int64_t max_slot = 0;
  for (int64_t r = 0; r < world; ++r) max_slot = std::max(max_slot, g.slot_elems(r));
  if (max_slot == 0) return;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / elem);
  const int64_t chunks_per_row = (max_slot + chunk - 1) / chunk;
  const int64_t tasks = world * g.pre * chunks_per_row;
  const int64_t task_bytes = std::max<int64_t>(1, std::min(chunk, max_slot) * elem);
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / task_bytes);

  const bool pack = dir == RaggedDirection::kPack;
  const char* src = static_cast<const char*>(pack ? compact.const_data_ptr() : blocks.const_data_ptr());
  char* dst = static_cast<char*>(pack ? blocks.data_ptr() : compact.data_ptr());
  const bool write_padding = pack && g.pad >= 0;
  const char* pattern = write_padding ? static_cast<const char*>(fill.const_data_ptr()) : nullptr;

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / (g.pre * chunks_per_row);
      const int64_t p = (t / chunks_per_row) % g.pre;
      const int64_t lo = (t % chunks_per_row) * chunk;
      const int64_t slot = g.slot_elems(r);
      if (lo >= slot) continue;
      const int64_t hi = std::min(lo + chunk, slot);
      const int64_t real = g.counts[r] * g.post;
      const int64_t block_at = g.block_offset(r, p);
      const int64_t compact_at = g.compact_offset(r, p);
      const int64_t src_at = pack ? compact_at : block_at;
      const int64_t dst_at = pack ? block_at : compact_at;
      if (lo < real) {
        const int64_t n = std::min(hi, real) - lo;
        copy_elements(dst + (dst_at + lo) * elem, src + (src_at + lo) * elem, n, elem);
      }
      if (write_padding && hi > real) {
        const int64_t from = std::max(lo, real);
        fill_elements(dst + (dst_at + from) * elem, pattern, hi - from, elem);
      }
    }
  });
}

}  // namespace cpshard
