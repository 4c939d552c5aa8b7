#include "comm/nccl_communicator.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <exception>
#include <numeric>

namespace cpshard {
namespace {

#define CPSHARD_NCCL_CHECK(comm, call)                                                       \
  do {                                                                                       \
    const ncclResult_t status_ = (call);                                                     \
    TORCH_CHECK(status_ == ncclSuccess, "cpshard NCCL: ", #call, " failed: ",                \
                ncclGetErrorString(status_), ((comm) ? ". " : ""),                           \
                ((comm) ? ncclGetLastError(comm) : ""));                                     \
  } while (0)

// Reductions need the element type; pure data movement goes as bytes.
ncclDataType_t reduce_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: TORCH_CHECK(false, "cpshard NCCL: no NCCL reduction for dtype ", t);
  }
}

// (type, element count) for a reduction: complex numbers reduce as pairs of reals.
std::pair<ncclDataType_t, int64_t> reduce_args(at::ScalarType t, int64_t n) {
  if (t == at::kComplexFloat) return {ncclFloat32, 2 * n};
  if (t == at::kComplexDouble) return {ncclFloat64, 2 * n};
  return {reduce_type(t), n};
}

char* bytes(const at::Tensor& t, int64_t element_offset = 0) {
  return static_cast<char*>(t.data_ptr()) + element_offset * t.element_size();
}

class Group {
 public:
  explicit Group(ncclComm_t comm) : comm_(comm) { CPSHARD_NCCL_CHECK(comm_, ncclGroupStart()); }
  // Ends the group; an error is raised unless another exception is already unwinding.
  ~Group() noexcept(false) {
    const ncclResult_t status = ncclGroupEnd();
    if (std::uncaught_exceptions() == 0) CPSHARD_NCCL_CHECK(comm_, status);
  }

 private:
  ncclComm_t comm_;
};

}  // namespace

NcclCommunicator::NcclCommunicator(const at::Tensor& unique_id, int64_t rank, int64_t world,
                                   int64_t device)
    : rank_(rank), world_(world), device_(device) {
  TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte &&
                  unique_id.numel() == static_cast<int64_t>(sizeof(ncclUniqueId)),
              "NcclCommunicator: unique_id must be a uint8 CPU tensor of ", sizeof(ncclUniqueId),
              " bytes");
  TORCH_CHECK(world >= 1 && 0 <= rank && rank < world, "NcclCommunicator: rank ", rank,
              " out of range for world ", world);
  ncclUniqueId id;
  std::memcpy(&id, unique_id.contiguous().data_ptr(), sizeof(id));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  CPSHARD_NCCL_CHECK(nullptr, ncclCommInitRank(&comm_, static_cast<int>(world), id,
                                               static_cast<int>(rank)));
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) ncclCommDestroy(comm_);
}

at::Tensor NcclCommunicator::unique_id() {
  ncclUniqueId id;
  CPSHARD_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
  auto out = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  std::memcpy(out.data_ptr(), &id, sizeof(id));
  return out;
}

int64_t NcclCommunicator::version() {
  int v = 0;
  CPSHARD_NCCL_CHECK(nullptr, ncclGetVersion(&v));
  return v;
}

void NcclCommunicator::check_tensor(const at::Tensor& t, const char* what, const char* arg) const {
  TORCH_CHECK(t.is_cuda() && t.device().index() == device_, what, ": ", arg,
              " must be on cuda:", device_, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, ": ", arg, " must be contiguous");
}

void NcclCommunicator::check_sizes(const std::vector<int64_t>& sizes, const char* what) const {
  TORCH_CHECK(static_cast<int64_t>(sizes.size()) == world_, what, ": sizes has ", sizes.size(),
              " entries for a world of ", world_);
  for (size_t r = 0; r < sizes.size(); ++r) {
    TORCH_CHECK(sizes[r] >= 0, what, ": sizes[", r, "] = ", sizes[r], " is negative");
  }
}

void NcclCommunicator::all_gather(const at::Tensor& out, const at::Tensor& local) {
  constexpr const char* what = "NcclCommunicator.all_gather";
  check_tensor(out, what, "out");
  check_tensor(local, what, "local");
  TORCH_CHECK(out.scalar_type() == local.scalar_type(), what, ": dtypes differ");
  TORCH_CHECK(out.numel() == local.numel() * world_, what, ": out has ", out.numel(),
              " elements, expected world * local = ", local.numel() * world_);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  CPSHARD_NCCL_CHECK(comm_, ncclAllGather(local.data_ptr(), out.data_ptr(),
                                          local.numel() * local.element_size(), ncclUint8, comm_,
                                          stream));
}

void NcclCommunicator::all_gather_v(const at::Tensor& out, const at::Tensor& local,
                                    std::vector<int64_t> sizes) {
  constexpr const char* what = "NcclCommunicator.all_gather_v";
  check_tensor(out, what, "out");
  check_tensor(local, what, "local");
  check_sizes(sizes, what);
  TORCH_CHECK(out.scalar_type() == local.scalar_type(), what, ": dtypes differ");
  TORCH_CHECK(local.numel() == sizes[rank_], what, ": local has ", local.numel(),
              " elements but sizes[", rank_, "] = ", sizes[rank_]);
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TORCH_CHECK(out.numel() == total, what, ": out has ", out.numel(), " elements, sizes sum to ",
              total);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  const int64_t elem = out.element_size();
  Group group(comm_);
  int64_t offset = 0;
  for (int64_t r = 0; r < world_; ++r) {
    if (sizes[r] > 0) {
      const void* send = r == rank_ ? local.data_ptr() : bytes(out, offset);
      CPSHARD_NCCL_CHECK(comm_, ncclBroadcast(send, bytes(out, offset), sizes[r] * elem, ncclUint8,
                                              static_cast<int>(r), comm_, stream));
    }
    offset += sizes[r];
  }
}

void NcclCommunicator::reduce_scatter(const at::Tensor& out, const at::Tensor& full) {
  constexpr const char* what = "NcclCommunicator.reduce_scatter";
  check_tensor(out, what, "out");
  check_tensor(full, what, "full");
  TORCH_CHECK(out.scalar_type() == full.scalar_type(), what, ": dtypes differ");
  TORCH_CHECK(full.numel() == out.numel() * world_, what, ": full has ", full.numel(),
              " elements, expected world * out = ", out.numel() * world_);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  const auto [type, count] = reduce_args(out.scalar_type(), out.numel());
  CPSHARD_NCCL_CHECK(comm_, ncclReduceScatter(full.data_ptr(), out.data_ptr(), count, type, ncclSum,
                                              comm_, stream));
}

void NcclCommunicator::reduce_scatter_v(const at::Tensor& out, const at::Tensor& full,
                                        std::vector<int64_t> sizes) {
  constexpr const char* what = "NcclCommunicator.reduce_scatter_v";
  check_tensor(out, what, "out");
  check_tensor(full, what, "full");
  check_sizes(sizes, what);
  TORCH_CHECK(out.scalar_type() == full.scalar_type(), what, ": dtypes differ");
  TORCH_CHECK(out.numel() == sizes[rank_], what, ": out has ", out.numel(), " elements but sizes[",
              rank_, "] = ", sizes[rank_]);
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TORCH_CHECK(full.numel() == total, what, ": full has ", full.numel(), " elements, sizes sum to ",
              total);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  Group group(comm_);
  int64_t offset = 0;
  for (int64_t r = 0; r < world_; ++r) {
    if (sizes[r] > 0) {
      const auto [type, count] = reduce_args(full.scalar_type(), sizes[r]);
      void* recv = r == rank_ ? out.data_ptr() : bytes(full, offset);  // used on the root only
      CPSHARD_NCCL_CHECK(comm_, ncclReduce(bytes(full, offset), recv, count, type, ncclSum,
                                           static_cast<int>(r), comm_, stream));
    }
    offset += sizes[r];
  }
}

void NcclCommunicator::send_recv(const std::vector<at::Tensor>& sends,
                                 std::vector<int64_t> send_peers,
                                 const std::vector<at::Tensor>& recvs,
                                 std::vector<int64_t> recv_peers) {
  constexpr const char* what = "NcclCommunicator.send_recv";
  TORCH_CHECK(sends.size() == send_peers.size(), what, ": sends and send_peers differ in length");
  TORCH_CHECK(recvs.size() == recv_peers.size(), what, ": recvs and recv_peers differ in length");
  for (const auto& t : sends) check_tensor(t, what, "sends[i]");
  for (const auto& t : recvs) check_tensor(t, what, "recvs[i]");
  for (const auto p : send_peers) {
    TORCH_CHECK(0 <= p && p < world_ && p != rank_, what, ": bad send peer ", p);
  }
  for (const auto p : recv_peers) {
    TORCH_CHECK(0 <= p && p < world_ && p != rank_, what, ": bad recv peer ", p);
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  Group group(comm_);
  for (size_t i = 0; i < sends.size(); ++i) {
    CPSHARD_NCCL_CHECK(comm_, ncclSend(sends[i].data_ptr(), sends[i].numel() * sends[i].element_size(),
                                       ncclUint8, static_cast<int>(send_peers[i]), comm_, stream));
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    CPSHARD_NCCL_CHECK(comm_, ncclRecv(recvs[i].data_ptr(), recvs[i].numel() * recvs[i].element_size(),
                                       ncclUint8, static_cast<int>(recv_peers[i]), comm_, stream));
  }
}

}  // namespace cpshard
