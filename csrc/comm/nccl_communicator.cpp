#include "comm/nccl_communicator.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>

#include "comm/teardown.h"
#include "comm/within.h"
#include "common/geometry.h"

namespace cpshard {
namespace {

#define CPSHARD_NCCL_CHECK(comm, call)                                                       \
  do {                                                                                       \
    const ncclResult_t status_ = (call);                                                     \
    TORCH_CHECK(status_ == ncclSuccess, "cpshard NCCL: ", #call, " failed: ",                \
                ncclGetErrorString(status_), ((comm) ? ". " : ""),                           \
                ((comm) ? ncclGetLastError(comm) : ""));                                     \
  } while (0)

// How a reduction sees a dtype: NCCL's element type, and NCCL elements per tensor element
// (complex numbers reduce as pairs of reals). Pure data movement goes as bytes instead.
struct ReduceType {
  ncclDataType_t type;
  int64_t per_element;
  ncclRedOp_t op;
};

ReduceType reduce_type(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return {ncclFloat32, 1, ncclSum};
    case at::kDouble: return {ncclFloat64, 1, ncclSum};
    case at::kHalf: return {ncclFloat16, 1, ncclSum};
    case at::kBFloat16: return {ncclBfloat16, 1, ncclSum};
    case at::kInt: return {ncclInt32, 1, ncclSum};
    case at::kLong: return {ncclInt64, 1, ncclSum};
    case at::kByte: return {ncclUint8, 1, ncclSum};
    case at::kChar: return {ncclInt8, 1, ncclSum};
    // A bool "sum" is a logical or (what torch's bool sum and its NCCL backend, which maps a
    // bool SUM to MAX, both give): the max of 0/1 bytes.
    case at::kBool: return {ncclUint8, 1, ncclMax};
    case at::kComplexFloat: return {ncclFloat32, 2, ncclSum};
    case at::kComplexDouble: return {ncclFloat64, 2, ncclSum};
    default: TORCH_CHECK(false, what, ": NCCL cannot sum dtype ", t);
  }
}

size_t nbytes(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * static_cast<size_t>(t.element_size());
}

char* bytes(const at::Tensor& t, int64_t element_offset = 0) {
  return static_cast<char*>(t.data_ptr()) + element_offset * t.element_size();
}

// The sum of the (already checked non-negative) sizes, raising on int64 overflow.
int64_t total_of(const std::vector<int64_t>& sizes, const char* what) {
  int64_t total = 0;
  for (const int64_t s : sizes) {
    TORCH_CHECK(!__builtin_add_overflow(total, s, &total), what, ": sizes overflow int64");
  }
  return total;
}

// The config a split child is made with: a copy of the one torch made its communicator with
// (its ProcessGroupNCCL options' config, at address `torch_config`), made blocking. NCCL
// resolves the fields torch left undefined from the environment, as it did for the parent, so
// the child gets the parent's settings (CTAs, network, traffic class, ...; resource sharing is
// taken from the parent's own config either way). 0: no config of torch's; the split then
// passes a default config made blocking.
ncclConfig_t child_config(int64_t torch_config, const char* what) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  if (torch_config != 0) {
    const auto* from = reinterpret_cast<const ncclConfig_t*>(torch_config);
    // size, magic and version lead every version of the struct.
    TORCH_CHECK(from->magic == config.magic, what, ": torch's NCCL config at ", torch_config,
                " is not an initialised ncclConfig_t (magic ", from->magic, ")");
    TORCH_CHECK(from->size >= offsetof(ncclConfig_t, blocking) + sizeof(int), what,
                ": torch's NCCL config at ", torch_config, " is too small (", from->size,
                " bytes)");
    std::memcpy(&config, from, std::min(from->size, sizeof(ncclConfig_t)));
    config.size = sizeof(ncclConfig_t);  // fields beyond torch's keep the initialiser's values
  }
  config.blocking = 1;
  return config;
}

// A status of a blocking NCCL call: success, or an error raised naming the call.
void check_status(ncclResult_t status, const char* op, ncclComm_t comm) {
  TORCH_CHECK(status == ncclSuccess, "cpshard NCCL: ", op, " failed: ",
              ncclGetErrorString(status), ". ", ncclGetLastError(comm));
}

std::string who(int64_t rank, int64_t world, int64_t device) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world) + ", cuda:" +
         std::to_string(device);
}

// A creation that may block for ever (a blocking split, a blocking unique-id init) run on a
// thread of its own (within.h), writing the communicator into a heap cell: the status, or
// nullopt when it has not returned within `timeout` (the late handler then aborts whatever it
// made, unless the process's teardown has begun, and frees the cell).
std::optional<ncclResult_t> create_within(std::function<ncclResult_t(ncclComm_t*)> create,
                                          ncclComm_t* cell, int64_t device,
                                          std::chrono::milliseconds timeout) {
  return run_within<ncclResult_t>(
      [create = std::move(create), cell, device] {
        if (cudaSetDevice(static_cast<int>(device)) != cudaSuccess) {
          (void)cudaGetLastError();
          return ncclUnhandledCudaError;
        }
        return create(cell);
      },
      timeout,
      [cell](ncclResult_t late) {  // a creation that completed after we gave up on it
        if (late == ncclInProgress) return;  // NCCL is still to write the cell: left to it
        if (const ncclComm_t made = __atomic_load_n(cell, __ATOMIC_ACQUIRE); made != nullptr) {
          unless_tearing_down([made] { (void)ncclCommAbort(made); });
        }
        delete cell;
      });
}

}  // namespace

class NcclLibrary final : public CommLibrary {
 public:
  explicit NcclLibrary(int64_t device) : device_(device) {}
  ~NcclLibrary() override {
    for (const auto event : spare_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
    (void)cudaGetLastError();
  }

  void prepare_watchdog_thread() override {
    (void)cudaSetDevice(static_cast<int>(device_));  // for the event queries
    // Relaxed: this thread's event queries must not invalidate a CUDA graph another thread is
    // capturing in global mode (the default of torch.cuda.graph).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
  }

  CommState state(Handle comm, std::string* why) override {
    const auto c = static_cast<ncclComm_t>(comm);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t polled = ncclCommGetAsyncError(c, &async);
    const ncclResult_t seen = polled != ncclSuccess ? polled : async;
    if (seen == ncclSuccess) return CommState::kReady;
    if (seen == ncclInProgress) return CommState::kInProgress;
    *why = std::string(ncclGetErrorString(seen)) + ". " + ncclGetLastError(c);
    return CommState::kFailed;
  }
  void abort(Handle comm) override { (void)ncclCommAbort(static_cast<ncclComm_t>(comm)); }
  std::string destroy(Handle comm) override {
    const ncclResult_t status = ncclCommDestroy(static_cast<ncclComm_t>(comm));
    return status == ncclSuccess ? std::string() : ncclGetErrorString(status);
  }
  bool done(Marker marker) override {
    const cudaError_t state = cudaEventQuery(static_cast<cudaEvent_t>(marker));
    if (state == cudaErrorNotReady) return false;
    // Finished, or its stream failed (that error surfaces on the stream's own next check).
    if (state != cudaSuccess) (void)cudaGetLastError();
    return true;
  }
  void release(Marker marker) override {
    std::lock_guard<std::mutex> lock(mu_);
    spare_.push_back(marker);
  }

  // Whether `stream` is capturing a CUDA graph; a stream CUDA cannot tell about counts as
  // capturing (no event is recorded on it, and close never waits for a graph).
  static bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
      (void)cudaGetLastError();
      return true;
    }
    return capture != cudaStreamCaptureStatusNone;
  }

  // An event recorded on a stream that is not capturing, after a call; null when CUDA refused
  // the event (the async-error poll still covers that call).
  Marker mark(cudaStream_t stream) {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!spare_.empty()) {
        event = static_cast<cudaEvent_t>(spare_.back());
        spare_.pop_back();
      }
    }
    if (event == nullptr && cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    if (cudaEventRecord(event, stream) != cudaSuccess) {
      (void)cudaGetLastError();
      release(event);
      return nullptr;
    }
    return event;
  }

 private:
  const int64_t device_;
  std::mutex mu_;  // guards spare_ (the watchdog releases, callers take)
  std::vector<Marker> spare_;
};

// One verb's enqueue, after its argument checks: CommLife's call (the communicator's call lock,
// raising if it is closed or aborted, the host time inside NCCL watched), the device and its
// current stream, the caching allocator told about every tensor used on that stream, and on
// exit an event the watchdog times.
class NcclCommunicator::Call {
 public:
  Call(NcclCommunicator& c, const char* what)
      : c_(c),
        call_(*c.life_, what),
        guard_(static_cast<c10::DeviceIndex>(c.device_)),
        stream_(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.device_))) {}
  // A call captured into a CUDA graph runs at each replay: it is counted, not timed.
  ~Call() {
    if (NcclLibrary::capturing(stream_.stream())) {
      call_.captured();
    } else {
      call_.enqueued(library(c_).mark(stream_.stream()));
    }
  }

  // `t` is used on this call's stream: the caching allocator must not hand its memory out again
  // until the transfer is done there (a no-op when that is the stream t was allocated on).
  void use(const at::Tensor& t) const {
    if (t.numel() > 0) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
  }
  cudaStream_t stream() const { return stream_.stream(); }
  ncclComm_t comm() const { return static_cast<ncclComm_t>(call_.handle()); }
  void check(ncclResult_t status, const char* op) const { check_status(status, op, comm()); }

  // ncclGroupStart/End around a verb's calls; only entered once every argument is checked. An
  // error inside makes ncclGroupEnd drop the whole group rather than launch part of it. The
  // first ncclGroupEnd of a pattern connects the peers (the watchdog bounds how long it may).
  class Scope {
   public:
    explicit Scope(Call& call) : call_(call) { call_.check(ncclGroupStart(), "ncclGroupStart"); }
    // Ends the group; an error is raised unless another exception is already unwinding.
    ~Scope() noexcept(false) {
      const ncclResult_t status = ncclGroupEnd();
      if (std::uncaught_exceptions() == 0) call_.check(status, "ncclGroupEnd");
    }

   private:
    Call& call_;
  };

 private:
  static NcclLibrary& library(NcclCommunicator& c) { return *c.library_; }

  NcclCommunicator& c_;
  CommLife::Call call_;
  c10::cuda::CUDAGuard guard_;
  c10::cuda::CUDAStream stream_;
};

NcclCommunicator::NcclCommunicator(int64_t parent, int64_t parent_config,
                                   const at::Tensor& unique_id, int64_t rank, int64_t world,
                                   int64_t device, double timeout_s)
    : rank_(rank), world_(world), device_(device) {
  constexpr const char* what = "NcclCommunicator";
  TORCH_CHECK(world >= 1 && 0 <= rank && rank < world, what, ": rank ", rank,
              " out of range for world ", world);
  TORCH_CHECK(0 <= device && device < c10::cuda::device_count(), what, " (rank ", rank,
              "): device ", device, " is not a visible CUDA device (",
              static_cast<int>(c10::cuda::device_count()), " visible)");
  const auto timeout = to_milliseconds(timeout_s);
  TORCH_CHECK(timeout.count() > 0, what, " (rank ", rank,
              "): timeout_s must be positive and finite, got ", timeout_s);
  const std::string name = who(rank, world, device);
  CommLife::check_blocking_environment(what, name);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  library_ = std::make_shared<NcclLibrary>(device);
  // The cell NCCL writes the communicator into lives on the heap: it is freed only once NCCL
  // has written it (by await_child, or by the late handler of a creation given up on).
  auto* cell = new ncclComm_t(nullptr);
  ncclComm_t comm = nullptr;
  if (parent != 0) {
    TORCH_CHECK(parent_matches(parent, rank, world, device), what, " (", name,
                "): the parent communicator is not this group's on cuda:", device);
    const auto from = reinterpret_cast<ncclComm_t>(parent);
    // Always a config (never the parent's, which may be non-blocking): torch's made blocking,
    // or without one of torch's the defaults made blocking.
    ncclConfig_t config = child_config(parent_config, what);
    // From a blocking parent the split waits inside NCCL for every peer (bounded by running
    // it on a thread of its own); from a non-blocking one it returns (ncclSuccess or
    // ncclInProgress) while NCCL's thread still makes the child.
    const std::optional<ncclResult_t> split = create_within(
        [from, rank, config](ncclComm_t* out) mutable {
          return ncclCommSplit(from, /*color=*/0, /*key=*/static_cast<int>(rank), out, &config);
        },
        cell, device, timeout);
    TORCH_CHECK(split.has_value(), what, " (", name, "): ncclCommSplit has not returned within "
                "the process group's timeout of ", timeout.count(), " ms: a rank of the group "
                "never joined it. The group's NCCL communicators are unusable now.");
    if (*split != ncclSuccess && *split != ncclInProgress) {
      // Nothing runs in the background any more, but a child whose initialisation failed was
      // published all the same: aborted, not leaked.
      CommLife::discard_split(library_, reinterpret_cast<CommLibrary::Handle*>(cell));
      TORCH_CHECK(false, what, " (", name, "): ncclCommSplit failed: ",
                  ncclGetErrorString(*split), ". ", ncclGetLastError(from));
    }
    comm = static_cast<ncclComm_t>(CommLife::await_child(
        library_, reinterpret_cast<CommLibrary::Handle*>(cell), timeout, what, name));
  } else {
    TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte &&
                    unique_id.numel() == static_cast<int64_t>(sizeof(ncclUniqueId)),
                what, " (", name, "): unique_id must be a uint8 CPU tensor of ",
                sizeof(ncclUniqueId), " bytes");
    ncclUniqueId id;
    std::memcpy(&id, unique_id.contiguous().const_data_ptr(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    const std::optional<ncclResult_t> made = create_within(
        [id, world, rank, config](ncclComm_t* out) mutable {
          return ncclCommInitRankConfig(out, static_cast<int>(world), id, static_cast<int>(rank),
                                        &config);
        },
        cell, device, timeout);
    TORCH_CHECK(made.has_value(), what, " (", name, "): ncclCommInitRankConfig has not returned "
                "within the process group's timeout of ", timeout.count(), " ms: a rank of the "
                "group never joined it.");
    comm = __atomic_load_n(cell, __ATOMIC_ACQUIRE);
    delete cell;
    if (*made != ncclSuccess && comm != nullptr) (void)ncclCommAbort(comm);
    TORCH_CHECK(*made == ncclSuccess, what, " (", name, "): ncclCommInitRankConfig failed: ",
                ncclGetErrorString(*made), ". ", ncclGetLastError(nullptr));
  }
  life_ = std::make_unique<CommLife>(library_, name, timeout);
  life_->start(comm);
}

NcclCommunicator::~NcclCommunicator() = default;  // CommLife's end closes the communicator

at::Tensor NcclCommunicator::unique_id() {
  ncclUniqueId id;
  CPSHARD_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
  auto out = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  std::memcpy(out.data_ptr(), &id, sizeof(id));
  return out;
}

std::tuple<std::vector<int64_t>, std::string> NcclCommunicator::split_config(
    int64_t torch_config) {
  const ncclConfig_t c = child_config(torch_config, "NcclCommunicator.split_config");
  return {{c.blocking, c.cgaClusterSize, c.minCTAs, c.maxCTAs, c.splitShare},
          c.netName == nullptr ? std::string() : std::string(c.netName)};
}

int64_t NcclCommunicator::version() {
  int v = 0;
  CPSHARD_NCCL_CHECK(nullptr, ncclGetVersion(&v));
  return v;
}

bool NcclCommunicator::parent_matches(int64_t parent, int64_t rank, int64_t world,
                                      int64_t device) {
  if (parent == 0) return false;
  const auto comm = reinterpret_cast<ncclComm_t>(parent);
  int count = 0, user_rank = 0, dev = 0;
  return ncclCommCount(comm, &count) == ncclSuccess && count == world &&
         ncclCommUserRank(comm, &user_rank) == ncclSuccess && user_rank == rank &&
         ncclCommCuDevice(comm, &dev) == ncclSuccess && dev == device;
}

std::string NcclCommunicator::error() { return life_->error(); }

void NcclCommunicator::close(double grace_s) {
  life_->close(grace_s < 0 ? life_->timeout() : to_milliseconds(grace_s));
}

void NcclCommunicator::check_tensor(const at::Tensor& t, const char* what, const char* arg) const {
  TORCH_CHECK(t.defined(), what, ": ", arg, " is undefined");
  TORCH_CHECK(t.is_cuda() && t.device().index() == device_, what, ": ", arg,
              " must be on cuda:", device_, " (the communicator's device), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, ": ", arg, " must be contiguous");
}

void NcclCommunicator::check_pair(const at::Tensor& out, const at::Tensor& other,
                                  const char* what, const char* arg) const {
  check_tensor(out, what, "out");
  check_tensor(other, what, arg);
  TORCH_CHECK(out.scalar_type() == other.scalar_type(), what, ": out is ", out.scalar_type(),
              " but ", arg, " is ", other.scalar_type());
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
  check_pair(out, local, what, "local");
  const int64_t expected = checked_mul(local.numel(), world_, what);
  TORCH_CHECK(out.numel() == expected, what, ": out has ", out.numel(),
              " elements, expected world * local = ", expected);
  if (local.numel() == 0) return;
  Call call(*this, what);
  call.use(out);
  call.use(local);
  call.check(ncclAllGather(local.data_ptr(), out.data_ptr(), nbytes(local),
                                                ncclUint8, call.comm(), call.stream()), "ncclAllGather");
}

void NcclCommunicator::all_gather_v(const at::Tensor& out, const at::Tensor& local,
                                    std::vector<int64_t> sizes) {
  constexpr const char* what = "NcclCommunicator.all_gather_v";
  check_pair(out, local, what, "local");
  check_sizes(sizes, what);
  TORCH_CHECK(local.numel() == sizes[rank_], what, ": local has ", local.numel(),
              " elements but sizes[", rank_, "] = ", sizes[rank_]);
  const int64_t total = total_of(sizes, what);
  TORCH_CHECK(out.numel() == total, what, ": out has ", out.numel(), " elements, sizes sum to ",
              total);
  if (total == 0) return;
  Call call(*this, what);
  call.use(out);
  call.use(local);
  const int64_t elem = out.element_size();
  Call::Scope group(call);
  int64_t offset = 0;
  for (int64_t r = 0; r < world_; ++r) {
    if (sizes[r] > 0) {
      const void* send = r == rank_ ? local.data_ptr() : bytes(out, offset);
      call.check(ncclBroadcast(send, bytes(out, offset), sizes[r] * elem,
                                                    ncclUint8, static_cast<int>(r), call.comm(),
                                                    call.stream()), "ncclBroadcast");
    }
    offset += sizes[r];
  }
}

void NcclCommunicator::reduce_scatter(const at::Tensor& out, const at::Tensor& full) {
  constexpr const char* what = "NcclCommunicator.reduce_scatter";
  check_pair(out, full, what, "full");
  const ReduceType type = reduce_type(out.scalar_type(), what);
  const int64_t expected = checked_mul(out.numel(), world_, what);
  TORCH_CHECK(full.numel() == expected, what, ": full has ", full.numel(),
              " elements, expected world * out = ", expected);
  if (out.numel() == 0) return;
  Call call(*this, what);
  call.use(out);
  call.use(full);
  call.check(ncclReduceScatter(full.data_ptr(), out.data_ptr(),
                                       out.numel() * type.per_element, type.type, type.op,
                                       call.comm(), call.stream()), "ncclReduceScatter");
}

void NcclCommunicator::reduce_scatter_v(const at::Tensor& out, const at::Tensor& full,
                                        std::vector<int64_t> sizes) {
  constexpr const char* what = "NcclCommunicator.reduce_scatter_v";
  check_pair(out, full, what, "full");
  check_sizes(sizes, what);
  const ReduceType type = reduce_type(out.scalar_type(), what);
  TORCH_CHECK(out.numel() == sizes[rank_], what, ": out has ", out.numel(), " elements but sizes[",
              rank_, "] = ", sizes[rank_]);
  const int64_t total = total_of(sizes, what);
  TORCH_CHECK(full.numel() == total, what, ": full has ", full.numel(), " elements, sizes sum to ",
              total);
  if (total == 0) return;
  Call call(*this, what);
  call.use(out);
  call.use(full);
  Call::Scope group(call);
  int64_t offset = 0;
  for (int64_t r = 0; r < world_; ++r) {
    if (sizes[r] > 0) {
      void* recv = r == rank_ ? out.data_ptr() : bytes(full, offset);  // used on the root only
      call.check(ncclReduce(bytes(full, offset), recv, sizes[r] * type.per_element,
                                    type.type, type.op, static_cast<int>(r), call.comm(),
                                    call.stream()), "ncclReduce");
    }
    offset += sizes[r];
  }
}

void NcclCommunicator::send_recv(const std::vector<at::Tensor>& sends,
                                 std::vector<int64_t> send_peers,
                                 const std::vector<at::Tensor>& recvs,
                                 std::vector<int64_t> recv_peers) {
  constexpr const char* what = "NcclCommunicator.send_recv";
  TORCH_CHECK(sends.size() == send_peers.size(), what, ": sends has ", sends.size(),
              " tensors but send_peers has ", send_peers.size(), " ranks");
  TORCH_CHECK(recvs.size() == recv_peers.size(), what, ": recvs has ", recvs.size(),
              " tensors but recv_peers has ", recv_peers.size(), " ranks");
  for (const auto& t : sends) check_tensor(t, what, "sends[i]");
  for (const auto& t : recvs) check_tensor(t, what, "recvs[i]");
  for (const auto p : send_peers) {
    TORCH_CHECK(0 <= p && p < world_ && p != rank_, what, ": send_peers holds ", p,
                ", not another rank of a world of ", world_, " (this is rank ", rank_, ")");
  }
  for (const auto p : recv_peers) {
    TORCH_CHECK(0 <= p && p < world_ && p != rank_, what, ": recv_peers holds ", p,
                ", not another rank of a world of ", world_, " (this is rank ", rank_, ")");
  }
  if (sends.empty() && recvs.empty()) return;
  Call call(*this, what);
  for (const auto& t : sends) call.use(t);
  for (const auto& t : recvs) call.use(t);
  // Empty parts are skipped on both sides alike (their sizes agree across ranks by contract).
  Call::Scope group(call);
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sends[i].numel() == 0) continue;
    call.check(ncclSend(sends[i].data_ptr(), nbytes(sends[i]), ncclUint8,
                                             static_cast<int>(send_peers[i]), call.comm(),
                                             call.stream()), "ncclSend");
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (recvs[i].numel() == 0) continue;
    call.check(ncclRecv(recvs[i].data_ptr(), nbytes(recvs[i]), ncclUint8,
                                             static_cast<int>(recv_peers[i]), call.comm(),
                                             call.stream()), "ncclRecv");
  }
}

}  // namespace cpshard
