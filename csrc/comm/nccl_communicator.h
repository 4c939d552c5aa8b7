// A NCCL communicator for one torch process group (CUDA build only). Built from a unique id that
// rank 0 creates and broadcasts over the torch group; every call is enqueued on torch's current
// CUDA stream of the communicator's device. Knows nothing of autograd: tensors are flat and
// contiguous, sizes are in elements, parts are back to back in rank order (exact offsets).
#pragma once

#include <ATen/ATen.h>
#include <nccl.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace cpshard {

class NcclCommunicator : public torch::CustomClassHolder {
 public:
  // unique_id: the ncclUniqueId bytes from unique_id() on rank 0.
  NcclCommunicator(const at::Tensor& unique_id, int64_t rank, int64_t world, int64_t device);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // A fresh ncclUniqueId as a uint8 CPU tensor.
  static at::Tensor unique_id();
  // NCCL's version code (e.g. 23007).
  static int64_t version();

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }

  // out[world * n] <- every rank's local[n]; in place when local is this rank's slot of out.
  void all_gather(const at::Tensor& out, const at::Tensor& local);
  // out[sum sizes] <- every rank's local[sizes[r]], by one grouped broadcast per rank (no
  // padding on the wire).
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
  void check_tensor(const at::Tensor& t, const char* what, const char* arg) const;
  void check_sizes(const std::vector<int64_t>& sizes, const char* what) const;

  ncclComm_t comm_ = nullptr;
  int64_t rank_;
  int64_t world_;
  int64_t device_;
};

}  // namespace cpshard
