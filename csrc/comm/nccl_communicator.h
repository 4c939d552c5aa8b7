// A NCCL communicator for one torch process group on one CUDA device (CUDA build only). Knows
// nothing of autograd or of torch.distributed: tensors are flat and contiguous, sizes are in
// elements, parts are back to back in rank order (exact offsets).
//
// Bootstrap (chosen by cpshard/comm/nccl.py, which explains why splitting is the default):
//   * split: ncclCommSplit of torch's own communicator for the group (its ncclComm_t address,
//     ProcessGroupNCCL._comm_ptr()). No unique id to exchange; the child shares the parent's
//     buffers, channels and proxy thread when the parent allows sharing (NCCL takes that choice
//     from the parent's config.splitShare; nccl.py explains the ordering against torch's own
//     collectives);
//   * unique id: ncclCommInitRankConfig from an id that rank 0 made with unique_id() and shared
//     over a host-side channel.
// Either way the communicator is ours: we poll it, abort it and end it; torch's is never touched
// after the split.
//
// Every verb checks all of its arguments before anything is enqueued (a failing check inside
// ncclGroupStart/End would launch a partial group on this rank only), then enqueues on the
// current CUDA stream of the communicator's device, marks every tensor as used on that stream
// for the caching allocator (a caller on a side stream must not see its buffers reused while the
// transfer runs), and records an event. A watchdog thread polls ncclCommGetAsyncError and the
// oldest unfinished call every 100 ms: an asynchronous error, or a call older than the process
// group's timeout, aborts the communicator (kernels blocked on a dead peer return) and every
// later call raises the reason.
//
// The host-side waits are bounded by the same timeout, which needs non-blocking communicators
// (NCCL launches each of their groups from a thread of its own and returns in progress; every
// call settles it, see settle.h). A unique-id communicator is created non-blocking. A split
// child is made non-blocking with torch's settings (the config torch made its communicator
// with), so its first ncclGroupEnd of each pattern (which connects the peers) returns in
// progress and is waited for within the timeout; the split itself follows the
// parent's mode in NCCL (a blocking parent makes it wait for every peer), so it runs on a
// thread of its own, given up after the timeout.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/custom_class.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace cpshard {

class NcclCommunicator : public torch::CustomClassHolder {
 public:
  // This process as `rank` of `world` on CUDA device `device`. parent: the address of a
  // communicator to split from (torch's for the group), or 0 to build one from unique_id (the
  // ncclUniqueId bytes made by unique_id() on rank 0; ignored when splitting). timeout_s: the
  // process group's timeout, after which an unfinished call aborts the communicator.
  // parent_config: the address of the ncclConfig_t torch made the parent with (its options'
  // config), whose settings the child takes, or 0 to inherit the parent's.
  NcclCommunicator(int64_t parent, int64_t parent_config, const at::Tensor& unique_id,
                   int64_t rank, int64_t world, int64_t device, double timeout_s);
  // Ends the communicator like close() if that was not called (cpshard/comm/nccl.py always
  // calls it, with the process group's end or at exit, never leaving it to garbage collection).
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // A fresh ncclUniqueId as a uint8 CPU tensor (needs no GPU).
  static at::Tensor unique_id();
  // NCCL's version code (e.g. 23007) of the library this extension runs against.
  static int64_t version();
  // What a split from a parent made with the config at `torch_config` passes NCCL: blocking,
  // cgaClusterSize, minCTAs, maxCTAs, splitShare and the network name ("" for none). Reads only
  // host memory (needs no GPU).
  static std::tuple<std::vector<int64_t>, std::string> split_config(int64_t torch_config);
  // Whether the communicator at address `parent` has `world` ranks, this process as `rank`, and
  // lives on `device`: what a split needs. (Checked on every rank before the collective split.)
  static bool parent_matches(int64_t parent, int64_t rank, int64_t world, int64_t device);

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t device() const { return device_; }
  // Why the communicator was aborted, or "" while it is usable.
  std::string error();
  // Ends the communicator: waits for the calls in flight (at most the timeout, and not past an
  // error), then destroys it when they all finished without error, else aborts it (a split
  // child shares its parent's abort flag when they share resources, so an abort also stops
  // torch's communicator: only done when something already went wrong). Idempotent; later
  // calls raise.
  void close();

  // out[world * n] <- every rank's local[n]; in place when local is this rank's slot of out.
  void all_gather(const at::Tensor& out, const at::Tensor& local);
  // out[sum sizes] <- every rank's local[sizes[r]], by one grouped broadcast per rank (no
  // padding on the wire: a 2-byte part after an odd-sized one starts unaligned, which NCCL
  // handles; aligning it would cost a copy of all of out, worth it only if NCCL's unaligned
  // path is slower by more, which cpshard.bench.nccl_world1 measures on a GPU).
  void all_gather_v(const at::Tensor& out, const at::Tensor& local, std::vector<int64_t> sizes);
  // out[n] <- sum over ranks of full[rank * n : (rank + 1) * n].
  void reduce_scatter(const at::Tensor& out, const at::Tensor& full);
  // out[sizes[rank]] <- sum over ranks of their full[offset(rank) : ...], by one grouped reduce
  // per rank.
  void reduce_scatter_v(const at::Tensor& out, const at::Tensor& full, std::vector<int64_t> sizes);
  // Grouped point-to-point: sends[i] to send_peers[i], recvs[j] from recv_peers[j].
  void send_recv(const std::vector<at::Tensor>& sends, std::vector<int64_t> send_peers,
                 const std::vector<at::Tensor>& recvs, std::vector<int64_t> recv_peers);

 private:
  class Call;  // one verb's enqueue: lock, stream, allocator bookkeeping, completion event
  using Clock = std::chrono::steady_clock;

  void check_tensor(const at::Tensor& t, const char* what, const char* arg) const;
  // out and `other` (named `arg`) both pass check_tensor and share one dtype.
  void check_pair(const at::Tensor& out, const at::Tensor& other, const char* what,
                  const char* arg) const;
  void check_sizes(const std::vector<int64_t>& sizes, const char* what) const;
  void watch();
  // With mu_ held: drops the events of finished calls; true when none is left.
  bool reap_locked();
  // With mu_ held (comm_ set): `status` of NCCL call `op` settled: returns on success; on
  // ncclInProgress (a non-blocking communicator) polls until the communicator is ready, and
  // aborts it (and raises) when that takes longer than the timeout; raises on any error.
  void settle_locked(ncclResult_t status, const char* op);
  // With mu_ held (comm_ set): no asynchronous error so far.
  bool healthy_locked();
  // With mu_ held: aborts the communicator for `reason` (kept for later calls).
  void abort_locked(const std::string& reason);
  void release_events_locked();

  const int64_t rank_;
  const int64_t world_;
  const int64_t device_;
  const std::chrono::milliseconds timeout_;

  std::mutex mu_;  // guards everything below; held while a call enqueues
  ncclComm_t comm_ = nullptr;
  std::string error_;
  bool closed_ = false;
  std::deque<std::pair<cudaEvent_t, Clock::time_point>> pending_;  // calls not known finished
  std::vector<cudaEvent_t> spare_;                                  // finished events to reuse
  std::condition_variable wake_;
  std::thread watchdog_;
};

}  // namespace cpshard
