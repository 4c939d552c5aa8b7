#include "comm/nccl_communicator.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>

#include "comm/settle.h"
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

constexpr auto kPollInterval = std::chrono::milliseconds(100);

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
// (its ProcessGroupNCCL options' config, at address `torch_config`), made non-blocking. NCCL
// resolves the fields torch left undefined from the environment, as it did for the parent, so
// the child gets the parent's settings (CTAs, network, traffic class, ...; resource sharing is
// taken from the parent's own config either way). 0: no config of torch's; the split then
// passes none and the child inherits the parent's, blocking mode included.
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
  config.blocking = 0;
  return config;
}

}  // namespace

// One verb's enqueue, after its argument checks: holds the communicator's lock (the watchdog
// cannot abort mid-enqueue), raises if the communicator is closed or aborted, selects its device
// and the current stream there, tells the caching allocator about every tensor used on that
// stream, and on exit records an event the watchdog times.
class NcclCommunicator::Call {
 public:
  Call(NcclCommunicator& c, const char* what)
      : c_(c),
        lock_(c.mu_),
        guard_(static_cast<c10::DeviceIndex>(c.device_)),
        stream_(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.device_))) {
    TORCH_CHECK(!c_.closed_, what, ": the communicator is closed");
    TORCH_CHECK(c_.error_.empty(), what, ": the communicator was aborted: ", c_.error_);
  }
  ~Call() {
    // Calls captured into a CUDA graph run later, at replay: nothing to time now.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_.stream(), &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      (void)cudaGetLastError();
      return;
    }
    cudaEvent_t event = nullptr;
    if (!c_.spare_.empty()) {
      event = c_.spare_.back();
      c_.spare_.pop_back();
    } else if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      return;  // untimed: the async-error poll still covers this call
    }
    if (cudaEventRecord(event, stream_.stream()) != cudaSuccess) {
      (void)cudaGetLastError();
      c_.spare_.push_back(event);
      return;
    }
    c_.pending_.emplace_back(event, Clock::now());
  }

  // `t` is used on this call's stream: the caching allocator must not hand its memory out again
  // until the transfer is done there (a no-op when that is the stream t was allocated on).
  void use(const at::Tensor& t) const {
    if (t.numel() > 0) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
  }
  cudaStream_t stream() const { return stream_.stream(); }
  ncclComm_t comm() const { return c_.comm_; }
  // The status of an NCCL call on this communicator: success, or (a non-blocking communicator)
  // in progress, then waited for until ready within the timeout; anything else raises.
  void check(ncclResult_t status, const char* op) { c_.settle_locked(status, op); }

  // ncclGroupStart/End around a verb's calls; only entered once every argument is checked. An
  // error inside makes ncclGroupEnd drop the whole group rather than launch part of it. The
  // first ncclGroupEnd of a pattern connects the peers (on a non-blocking communicator it
  // returns in progress and is waited for within the timeout).
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
  NcclCommunicator& c_;
  std::unique_lock<std::mutex> lock_;
  c10::cuda::CUDAGuard guard_;
  c10::cuda::CUDAStream stream_;
};

NcclCommunicator::NcclCommunicator(int64_t parent, int64_t parent_config,
                                   const at::Tensor& unique_id, int64_t rank, int64_t world,
                                   int64_t device, double timeout_s)
    : rank_(rank),
      world_(world),
      device_(device),
      timeout_(std::chrono::milliseconds(
          std::isfinite(timeout_s) && timeout_s > 0 && timeout_s < 1e12
              ? static_cast<int64_t>(std::ceil(timeout_s * 1000))
              : 0)) {
  constexpr const char* what = "NcclCommunicator";
  TORCH_CHECK(world >= 1 && 0 <= rank && rank < world, what, ": rank ", rank,
              " out of range for world ", world);
  TORCH_CHECK(0 <= device && device < c10::cuda::device_count(), what, ": device ", device,
              " is not a visible CUDA device (", static_cast<int>(c10::cuda::device_count()),
              " visible)");
  TORCH_CHECK(timeout_.count() > 0, what, ": timeout_s must be positive and finite, got ",
              timeout_s);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  std::unique_lock<std::mutex> lock(mu_);
  // A creation that fails or times out leaves no communicator behind (no destructor runs).
  const auto settle_or_abort = [this](ncclResult_t status, const char* op) {
    try {
      settle_locked(status, op);
    } catch (...) {
      if (comm_ != nullptr) (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      throw;
    }
  };
  if (parent != 0) {
    TORCH_CHECK(parent_matches(parent, rank, world, device), what,
                ": the parent communicator is not this group's on cuda:", device);
    const auto from = reinterpret_cast<ncclComm_t>(parent);
    // The child is non-blocking with torch's settings (child_config), so its own waits are
    // bounded. The split itself takes its blocking mode from the parent: from a blocking one it
    // waits inside NCCL for every peer, so it runs on a thread of its own, waited for within
    // the timeout; from a non-blocking one it returns in progress at once. NCCL writes the child
    // into `cell` when the split's work ends (after ncclCommSplit has returned, for a
    // non-blocking parent), so the cell lives on the heap and is freed only once that write
    // has been seen; a split given up on before then leaves it (a pointer's worth) to NCCL.
    auto* cell = new ncclComm_t(nullptr);
    const auto published = [cell] { return __atomic_load_n(cell, __ATOMIC_ACQUIRE); };
    const bool inherit = parent_config == 0;
    const std::optional<ncclResult_t> split = run_within<ncclResult_t>(
        [from, rank, device, inherit, cell, config = child_config(parent_config, what)]() mutable {
          if (cudaSetDevice(static_cast<int>(device)) != cudaSuccess) {
            (void)cudaGetLastError();
            return ncclUnhandledCudaError;
          }
          return ncclCommSplit(from, /*color=*/0, /*key=*/static_cast<int>(rank), cell,
                               inherit ? nullptr : &config);
        },
        timeout_,
        [cell, published](ncclResult_t late) {  // a split completed after we gave up on it
          if (late == ncclInProgress) return;    // NCCL is still to write the cell
          if (const ncclComm_t child = published(); child != nullptr) {
            (void)(late == ncclSuccess ? ncclCommDestroy(child) : ncclCommAbort(child));
          }
          delete cell;
        });
    const auto joined_in_time = [&](bool in_time) {
      TORCH_CHECK(in_time, what, ": ncclCommSplit has not completed within the process group's "
                  "timeout of ", timeout_.count(), " ms: a rank of the group never joined it. "
                  "The group's NCCL communicators are unusable now.");
    };
    joined_in_time(split.has_value());
    const ncclResult_t status = *split;
    if (status == ncclInProgress) {  // a non-blocking parent: wait for the child to appear
      int appeared = 0;  // settle's states: 1 while the cell is empty, then 0
      const auto query = [&published] { return published() == nullptr ? 1 : 0; };
      joined_in_time(settle(query, 1, 0, timeout_, &appeared) == Settled::kReady);
    }
    comm_ = published();
    delete cell;
    if (status != ncclSuccess && status != ncclInProgress && comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    TORCH_CHECK(status == ncclSuccess || status == ncclInProgress, what,
                ": ncclCommSplit failed: ", ncclGetErrorString(status), ". ",
                ncclGetLastError(from));
    settle_or_abort(status, "ncclCommSplit");
  } else {
    TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte &&
                    unique_id.numel() == static_cast<int64_t>(sizeof(ncclUniqueId)),
                what, ": unique_id must be a uint8 CPU tensor of ", sizeof(ncclUniqueId),
                " bytes");
    ncclUniqueId id;
    std::memcpy(&id, unique_id.contiguous().const_data_ptr(), sizeof(id));
    // Non-blocking: creation (and each pattern's first connect later) returns in progress and
    // is waited for here within the timeout, never blocking on a dead or late peer for ever.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t status = ncclCommInitRankConfig(&comm_, static_cast<int>(world), id,
                                                       static_cast<int>(rank), &config);
    if (status != ncclSuccess && status != ncclInProgress && comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    TORCH_CHECK(status == ncclSuccess || status == ncclInProgress, what,
                ": ncclCommInitRankConfig failed: ", ncclGetErrorString(status));
    settle_or_abort(status, "ncclCommInitRankConfig");
  }
  lock.unlock();
  watchdog_ = std::thread([this] { watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpshard NCCL: closing the communicator failed: %s\n", e.what());
  }
}

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

std::string NcclCommunicator::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void NcclCommunicator::close() {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;  // later calls raise; the watchdog stops
  wake_.notify_all();
  // Calls in flight may finish first (an abort of a split child would also stop torch's
  // communicator when they share resources), for at most the group's timeout or until an error.
  const auto deadline = Clock::now() + timeout_;
  while (comm_ != nullptr && healthy_locked() && !reap_locked() && Clock::now() < deadline) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lock.lock();
  }
  if (comm_ != nullptr) {
    // Destroying a quiescent communicator waits for nothing; anything else is aborted.
    const bool quiescent = healthy_locked() && reap_locked();
    const ncclResult_t status = quiescent ? ncclCommDestroy(comm_) : ncclCommAbort(comm_);
    if (status != ncclSuccess) {
      std::fprintf(stderr, "cpshard NCCL: ending the communicator failed: %s\n",
                   ncclGetErrorString(status));
    }
    comm_ = nullptr;
  }
  release_events_locked();
  lock.unlock();
  if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
}

void NcclCommunicator::settle_locked(ncclResult_t status, const char* op) {
  TORCH_CHECK(comm_ != nullptr, "cpshard NCCL: ", op, ": the communicator was aborted: ", error_);
  if (status == ncclInProgress) {
    // A non-blocking communicator works on the call in the background: poll its state until
    // it is ready, an error shows, or the group's timeout passes (then abort it: peers that
    // never arrive cannot hold this rank for ever). No other call can enter meanwhile (mu_ is
    // held), and NCCL must not be given another call on it before it is ready.
    const auto query = [this] {
      ncclResult_t state = ncclInProgress;
      const ncclResult_t polled = ncclCommGetAsyncError(comm_, &state);
      return polled != ncclSuccess ? polled : state;
    };
    const Settled outcome = settle(query, ncclInProgress, ncclSuccess, timeout_, &status);
    if (outcome == Settled::kTimedOut) {
      const std::string reason = std::string(op) +
                                 " has not completed within the process group's timeout of " +
                                 std::to_string(timeout_.count()) + " ms";
      abort_locked(reason);
      TORCH_CHECK(false, "cpshard NCCL: ", reason);
    }
  }
  // An error: raised here; the communicator is left to the watchdog, which aborts it on the
  // asynchronous error (aborting here could free it inside an open NCCL group).
  TORCH_CHECK(status == ncclSuccess, "cpshard NCCL: ", op, " failed: ",
              ncclGetErrorString(status), ". ", ncclGetLastError(comm_));
}

bool NcclCommunicator::healthy_locked() {
  ncclResult_t async = ncclSuccess;
  return ncclCommGetAsyncError(comm_, &async) == ncclSuccess &&
         (async == ncclSuccess || async == ncclInProgress);
}

void NcclCommunicator::watch() {
  (void)cudaSetDevice(static_cast<int>(device_));  // for the event queries
  // Relaxed: this thread's event queries must not invalidate a CUDA graph another thread is
  // capturing in global mode (the default of torch.cuda.graph).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lock(mu_);
  while (!closed_ && comm_ != nullptr) {
    wake_.wait_for(lock, kPollInterval);
    if (closed_ || comm_ == nullptr) break;
    if (!healthy_locked()) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t polled = ncclCommGetAsyncError(comm_, &async);
      abort_locked(std::string("asynchronous NCCL error: ") +
                   ncclGetErrorString(polled != ncclSuccess ? polled : async) + ". " +
                   ncclGetLastError(comm_));
      break;
    }
    if (!reap_locked() && Clock::now() - pending_.front().second > timeout_) {
      abort_locked("a call has not finished within the process group's timeout of " +
                   std::to_string(timeout_.count()) + " ms");
      break;
    }
  }
}

bool NcclCommunicator::reap_locked() {
  while (!pending_.empty()) {
    const cudaError_t state = cudaEventQuery(pending_.front().first);
    if (state == cudaErrorNotReady) return false;
    // Finished, or its stream failed (that error surfaces on the stream's own next check).
    if (state != cudaSuccess) (void)cudaGetLastError();
    spare_.push_back(pending_.front().first);
    pending_.pop_front();
  }
  return true;
}

void NcclCommunicator::abort_locked(const std::string& reason) {
  error_ = reason;
  std::fprintf(stderr,
               "cpshard NCCL (rank %lld of %lld, cuda:%lld): %s; aborting the communicator\n",
               static_cast<long long>(rank_), static_cast<long long>(world_),
               static_cast<long long>(device_), reason.c_str());
  (void)ncclCommAbort(comm_);
  comm_ = nullptr;
  release_events_locked();
}

void NcclCommunicator::release_events_locked() {
  for (const auto& [event, since] : pending_) (void)cudaEventDestroy(event);
  for (const auto event : spare_) (void)cudaEventDestroy(event);
  pending_.clear();
  spare_.clear();
  (void)cudaGetLastError();
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
