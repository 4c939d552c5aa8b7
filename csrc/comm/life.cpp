#include "comm/life.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "comm/settle.h"
#include "comm/teardown.h"

namespace cpshard {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             CommLife::Clock::now().time_since_epoch())
      .count();
}

// The least time a thread watches for a split child published after the wait gave up.
constexpr auto kLinger = std::chrono::milliseconds(60'000);

std::string ms(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

// Aborts a split child that appears in *cell within `linger`, then frees the cell; a child that
// never appears leaves the cell to NCCL (a pointer's worth), which may still write it. Once the
// process's teardown has begun the child is left to the process.
void reap_late_child(std::shared_ptr<CommLibrary> library, CommLibrary::Handle* cell,
                     std::chrono::milliseconds linger) {
  std::thread([library = std::move(library), cell, linger] {
    const auto deadline = CommLife::Clock::now() + linger;
    while (CommLife::Clock::now() < deadline && !tearing_down()) {
      if (const auto child = __atomic_load_n(cell, __ATOMIC_ACQUIRE); child != nullptr) {
        unless_tearing_down([&] { library->abort(child); });
        delete cell;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }).detach();
}

}  // namespace

std::chrono::milliseconds to_milliseconds(double seconds) {
  return std::chrono::milliseconds(std::isfinite(seconds) && seconds > 0 && seconds < 1e12
                                       ? static_cast<int64_t>(std::ceil(seconds * 1000))
                                       : 0);
}

CommLife::CommLife(std::shared_ptr<CommLibrary> library, std::string who,
                   std::chrono::milliseconds timeout, std::chrono::milliseconds poll)
    : lib_(std::move(library)), who_(std::move(who)), timeout_(timeout), poll_(poll) {
  TORCH_CHECK(lib_ != nullptr, "CommLife: no library");
  TORCH_CHECK(timeout_.count() > 0, "CommLife (", who_, "): the timeout must be positive, got ",
              ms(timeout_));
  TORCH_CHECK(poll_.count() > 0, "CommLife (", who_, "): the poll interval must be positive");
}

CommLife::~CommLife() {
  try {
    close(timeout_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpshard NCCL (%s): closing the communicator failed: %s\n", who_.c_str(),
                 e.what());
  }
}

CommLife::Handle CommLife::await_child(const std::shared_ptr<CommLibrary>& library,
                                       Handle* cell, std::chrono::milliseconds timeout,
                                       const char* what, const std::string& who) {
  Handle child = nullptr;
  std::string why;
  // settle's states: 1 while in progress, 0 ready, 2 failed. Only the child is polled (see the
  // header: the parent is torch's).
  const auto query = [&]() -> int {
    if (child == nullptr) child = __atomic_load_n(cell, __ATOMIC_ACQUIRE);
    if (child == nullptr) return 1;
    const CommState made = library->state(child, &why);
    return made == CommState::kReady ? 0 : made == CommState::kInProgress ? 1 : 2;
  };
  int last = 1;
  const Settled outcome = settle(query, 1, 0, timeout, &last);
  if (outcome == Settled::kReady) {
    delete cell;
    return child;
  }
  if (child != nullptr) {
    library->abort(child);
    delete cell;
  } else {
    reap_late_child(library, cell, std::max<std::chrono::milliseconds>(10 * timeout, kLinger));
  }
  TORCH_CHECK(outcome != Settled::kTimedOut, what, " (", who, "): the split has not completed "
              "within the process group's timeout of ", ms(timeout), ": a rank of the group "
              "never joined it (the child ", child == nullptr ? "was never published" : "never "
              "became ready", "). The group's NCCL communicators are unusable now.");
  TORCH_CHECK(false, what, " (", who, "): the split failed: ", why);
}

void CommLife::discard_split(const std::shared_ptr<CommLibrary>& library, Handle* cell) {
  if (const Handle child = __atomic_load_n(cell, __ATOMIC_ACQUIRE); child != nullptr) {
    library->abort(child);
  }
  delete cell;
}

void CommLife::check_blocking_environment(const char* what, const std::string& who) {
  const char* value = std::getenv("NCCL_COMM_BLOCKING");
  if (value == nullptr || *value == '\0') return;
  // As NCCL reads its integer parameters: strtoll with base 0, the whole string.
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value, &end, 0);
  const bool non_blocking = errno == 0 && *end == '\0' && parsed == 0;
  TORCH_CHECK(!non_blocking, what, " (", who, "): NCCL_COMM_BLOCKING=", value, " in the "
              "environment makes NCCL ignore the blocking mode cpshard's communicator is made "
              "with, and every call on a non-blocking communicator returns \"in progress\". "
              "Unset NCCL_COMM_BLOCKING (torch's non-blocking mode is "
              "TORCH_NCCL_USE_COMM_NONBLOCKING=1, which cpshard supports) or set it to 1.");
}

void CommLife::start(Handle comm) {
  TORCH_CHECK(comm != nullptr, "CommLife (", who_, "): no communicator to start");
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(comm_ == nullptr && !watchdog_.joinable(), "CommLife (", who_, "): started twice");
  comm_ = comm;
  watchdog_ = std::thread([this] { watch(); });
}

CommLife::Call::Call(CommLife& life, const char* what) : life_(life), calls_(life.calls_mu_) {
  std::unique_lock<std::mutex> lock(life_.mu_);
  if (life_.aborting_) {
    // The watchdog waits for the call lock to abort: hand it over and raise once it is done.
    calls_.unlock();
    life_.aborted_.wait(lock, [this] { return !life_.aborting_; });
  }
  TORCH_CHECK(!life_.closed_, what, " (", life_.who_, "): the communicator is closed");
  TORCH_CHECK(life_.error_.empty(), what, " (", life_.who_, "): the communicator was aborted: ",
              life_.error_);
  TORCH_CHECK(life_.comm_ != nullptr, what, " (", life_.who_, "): the communicator was not started");
  handle_ = life_.comm_;
  life_.entered_ns_.store(now_ns(), std::memory_order_release);
}

CommLife::Call::~Call() {
  life_.entered_ns_.store(0, std::memory_order_release);
  calls_.unlock();
  // A call the abort released (or one leaving while an abort is under way) returns only once the
  // reason is published, so its caller finds it in error().
  std::unique_lock<std::mutex> lock(life_.mu_);
  life_.aborted_.wait(lock, [this] { return !life_.aborting_; });
}

void CommLife::Call::enqueued(Marker marker) {
  if (marker == nullptr) return;
  std::lock_guard<std::mutex> lock(life_.mu_);
  life_.pending_.emplace_back(marker, Clock::now());
}

void CommLife::Call::captured() {
  std::lock_guard<std::mutex> lock(life_.mu_);
  ++life_.captured_;
}

std::string CommLife::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

bool CommLife::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

int64_t CommLife::captured_calls() {
  std::lock_guard<std::mutex> lock(mu_);
  return captured_;
}

CommLife::Clock::duration CommLife::inside_for() const {
  const int64_t entered = entered_ns_.load(std::memory_order_acquire);
  return entered == 0 ? Clock::duration::zero() : std::chrono::nanoseconds(now_ns() - entered);
}

void CommLife::close(std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;  // later calls raise; the watchdog stops
  wake_.notify_all();
  const auto deadline = Clock::now() + grace;
  const auto busy = [this] { return inside_for() != Clock::duration::zero() || !reap_locked(); };
  while (comm_ != nullptr && healthy_locked() && busy() && Clock::now() < deadline) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lock.lock();
  }
  const Handle comm = comm_;
  comm_ = nullptr;  // the watchdog, if it is aborting now, has already taken it
  lock.unlock();
  if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
  lock.lock();
  if (comm != nullptr && captured_ > 0) {
    std::fprintf(stderr,
                 "cpshard NCCL (%s): %lld calls were captured into CUDA graphs, which hold the "
                 "communicator until they are destroyed (NCCL's destroy and abort would wait for "
                 "them, maybe for ever): leaving the communicator to the process, not ending "
                 "it\n",
                 who_.c_str(), static_cast<long long>(captured_));
  } else if (comm != nullptr) {
    // A call still inside the library after the grace is stuck there: only the abort releases it.
    std::unique_lock<std::mutex> calls(calls_mu_, std::try_to_lock);
    const bool quiescent = calls.owns_lock() && healthy_locked_for(comm) && reap_locked();
    lock.unlock();
    if (quiescent) {
      const std::string failed = lib_->destroy(comm);
      if (!failed.empty()) {
        std::fprintf(stderr, "cpshard NCCL (%s): destroying the communicator failed: %s\n",
                     who_.c_str(), failed.c_str());
      }
    } else {
      std::fprintf(stderr,
                   "cpshard NCCL (%s): calls still unfinished after a grace of %lld ms at close, "
                   "or an error: aborting the communicator\n",
                   who_.c_str(), static_cast<long long>(grace.count()));
      lib_->abort(comm);
    }
    lock.lock();
  }
  release_markers_locked();
}

bool CommLife::healthy_locked() { return comm_ != nullptr && healthy_locked_for(comm_); }

bool CommLife::healthy_locked_for(Handle comm) {
  std::string why;
  return lib_->state(comm, &why) != CommState::kFailed;
}

void CommLife::watch() {
  lib_->prepare_watchdog_thread();
  std::unique_lock<std::mutex> lock(mu_);
  while (!closed_ && comm_ != nullptr) {
    wake_.wait_for(lock, poll_);
    if (closed_ || comm_ == nullptr) break;
    std::string why;
    if (lib_->state(comm_, &why) == CommState::kFailed) {
      abort_locked(lock, "asynchronous NCCL error: " + why);
      break;
    }
    if (!reap_locked() && Clock::now() - pending_.front().second > timeout_) {
      abort_locked(lock, "a call has not finished within the process group's timeout of " +
                             ms(timeout_));
      break;
    }
    if (inside_for() > timeout_) {
      abort_locked(lock, "a call has been inside NCCL for longer than the process group's "
                         "timeout of " + ms(timeout_) + " (a peer that never connected)");
      break;
    }
  }
}

bool CommLife::reap_locked() {
  while (!pending_.empty()) {
    if (!lib_->done(pending_.front().first)) return false;
    lib_->release(pending_.front().first);
    pending_.pop_front();
  }
  return true;
}

void CommLife::abort_locked(std::unique_lock<std::mutex>& lock, const std::string& reason) {
  aborting_ = true;  // calls wait from now on, and raise `reason` once it is published
  const Handle comm = comm_;
  comm_ = nullptr;
  std::fprintf(stderr, "cpshard NCCL (%s): %s; aborting the communicator\n", who_.c_str(),
               reason.c_str());
  lock.unlock();
  int64_t captured = 0;
  {
    std::unique_lock<std::mutex> calls(calls_mu_, std::defer_lock);
    while (!calls.try_lock() && inside_for() <= timeout_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    lock.lock();  // after the call lock (their order): a call that was inside is counted now
    captured = captured_;
    lock.unlock();
    if (comm != nullptr && captured > 0) {
      // NCCL's abort stops the kernels, then waits for the graphs holding the communicator: a
      // thread of its own does it, left to the process if the graphs outlive it.
      std::thread([lib = lib_, comm] { unless_tearing_down([&] { lib->abort(comm); }); }).detach();
    } else if (comm != nullptr) {
      lib_->abort(comm);
    }
  }
  lock.lock();
  release_markers_locked();
  // Published only now: whoever sees the error may rely on the abort having happened (having
  // been launched, with captured calls).
  error_ = captured > 0 ? reason + " (the abort runs in the background: " +
                              std::to_string(captured) + " calls captured into CUDA graphs "
                              "hold the communicator until the graphs are destroyed)"
                        : reason;
  aborting_ = false;
  aborted_.notify_all();
}

void CommLife::release_markers_locked() {
  for (const auto& [marker, since] : pending_) lib_->release(marker);
  pending_.clear();
}

}  // namespace cpshard
