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
// transfer runs), and records an event; a verb captured into a CUDA graph records none and is
// counted instead (the graph holds the communicator: close then leaves it to the process rather
// than wait for the graph, comm/life.h).
//
// The communicator is blocking (the split child takes torch's settings with blocking = 1; a
// unique-id one is made blocking): a verb enqueues its kernels on the caller's thread and
// returns, with no thread of NCCL's per call and no polling. Hangs are bounded the way torch
// bounds them for its own blocking communicators, by the watchdog of comm/life.h: an
// asynchronous error, a call unfinished on the device after the process group's timeout, or a
// host call stuck inside NCCL (a first connect to a peer that never comes) past the timeout
// aborts the communicator, which releases what waits, and every later call raises the reason
// (published only once the abort has returned).
// Creation runs where a hang is bounded: a unique-id creation and a split from a blocking
// parent (NCCL takes the split's mode from the parent) on a thread of their own, given up after
// the timeout (comm/within.h); a split from a non-blocking parent returns at once while NCCL's
// thread still makes the child, which is waited for by polling its publication and then the
// child's asynchronous state, never the parent's (CommLife::await_child: polling torch's
// communicator outside torch's lock races torch's watchdog). A split that returned an error
// aborts the child NCCL may have published all the same. NCCL_COMM_BLOCKING=0 in the
// environment (which overrides blocking = 1) is refused at creation.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "comm/life.h"

namespace cpshard {

class NcclLibrary;  // NCCL and CUDA events behind comm/library.h

class NcclCommunicator : public torch::CustomClassHolder {
 public:
  // This process as `rank` of `world` on CUDA device `device`. parent: the address of a
  // communicator to split from (torch's for the group), or 0 to build one from unique_id (the
  // ncclUniqueId bytes made by unique_id() on rank 0; ignored when splitting). timeout_s: the
  // process group's timeout, after which an unfinished call aborts the communicator.
  // parent_config: the address of the ncclConfig_t torch made the parent with (its options'
  // config), whose settings the child takes (made blocking), or 0 for NCCL's defaults (made
  // blocking: never the parent's mode, which may be non-blocking).
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
  // What a split from a parent made with the config at `torch_config` passes NCCL: blocking (1),
  // cgaClusterSize, minCTAs, maxCTAs, splitShare and the network name ("" for none). Reads only
  // host memory (needs no GPU).
  static std::tuple<std::vector<int64_t>, std::string> split_config(int64_t torch_config);
  // Whether the communicator at address `parent` has `world` ranks, this process as `rank`, and
  // lives on `device`: what a split needs. (Checked on every rank before the collective split.)
  static bool parent_matches(int64_t parent, int64_t rank, int64_t world, int64_t device);

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t device() const { return device_; }
  // Why the communicator was aborted, once the abort has returned; "" while it is usable or the
  // abort is still under way (CommLife::error).
  std::string error();
  // Ends the communicator: waits for the calls in flight for at most `grace_s` (negative: the
  // process group's timeout; not past an error), then destroys it when they all finished
  // without error, else aborts it (a split child shares its parent's abort flag when they share
  // resources, so an abort also stops torch's communicator: only done when something already
  // went wrong, or at exit). Idempotent; later calls raise.
  void close(double grace_s);

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
  class Call;  // one verb's enqueue: CommLife's call, stream, allocator bookkeeping, event

  void check_tensor(const at::Tensor& t, const char* what, const char* arg) const;
  // out and `other` (named `arg`) both pass check_tensor and share one dtype.
  void check_pair(const at::Tensor& out, const at::Tensor& other, const char* what,
                  const char* arg) const;
  void check_sizes(const std::vector<int64_t>& sizes, const char* what) const;

  const int64_t rank_;
  const int64_t world_;
  const int64_t device_;
  std::shared_ptr<NcclLibrary> library_;
  std::unique_ptr<CommLife> life_;  // ended before library_ goes (it holds it too)
};

}  // namespace cpshard
