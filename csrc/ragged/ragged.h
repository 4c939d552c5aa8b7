// Ragged block moves: per-rank blocks [pre, n_r, post] between a compact tensor
// [pre, sum n_r, post] and a block buffer, either padded ([W, pre, pad, post], padding rows set
// to a fill value) or exact-offset (block r starts at pre * post * sum_{q<r} n_q, no padding).
// The same move with equal counts is the sequence (de)interleave [W, pre, L, post] <->
// [pre, W*L, post].
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace cpshard {

// Where every rank's block lives on both sides of the move.
struct RaggedGeometry {
  std::vector<int64_t> counts;  // n_r per rank
  std::vector<int64_t> prefix;  // exclusive prefix sums of counts, size W + 1
  int64_t pre = 1;              // product of the sizes before the token dim
  int64_t post = 1;             // product of the sizes after the token dim
  int64_t pad = -1;             // padded block length, or -1 for the exact-offset layout

  int64_t world() const { return static_cast<int64_t>(counts.size()); }
  int64_t total() const { return prefix.back(); }
  // Elements from the block-buffer start to row p of rank r's block.
  int64_t block_offset(int64_t r, int64_t p) const {
    return pad >= 0 ? (r * pre + p) * pad * post : (pre * prefix[r] + p * counts[r]) * post;
  }
  // Elements from the compact tensor start to row p of rank r's tokens.
  int64_t compact_offset(int64_t r, int64_t p) const { return (p * total() + prefix[r]) * post; }
  // Elements of one block row (including padding) in the block buffer.
  int64_t slot_elems(int64_t r) const { return (pad >= 0 ? pad : counts[r]) * post; }
  // Elements of the block buffer.
  int64_t block_numel() const {
    return pad >= 0 ? world() * pre * pad * post : pre * total() * post;
  }
};

// Validates counts (non-negative, sum fits) and pad (-1 or >= every count); names `what`.
RaggedGeometry make_ragged_geometry(at::IntArrayRef counts, int64_t pre, int64_t post, int64_t pad,
                                    const char* what);

enum class RaggedDirection { kPack, kUnpack };  // compact -> blocks, blocks -> compact

// Moves every block between `compact` and `blocks` (both contiguous, same dtype and device).
// kPack writes `fill` into padding rows. The device kernels do no validation of their own.
void ragged_move_cpu(const RaggedGeometry& g, const at::Tensor& compact, const at::Tensor& blocks,
                     RaggedDirection dir, const at::Tensor& fill);
#ifdef CPSHARD_WITH_CUDA
void ragged_move_cuda(const RaggedGeometry& g, const at::Tensor& compact, const at::Tensor& blocks,
                      RaggedDirection dir, const at::Tensor& fill);
#endif

}  // namespace cpshard
