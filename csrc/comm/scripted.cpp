#include "comm/scripted.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <thread>
#include <utility>

namespace cpshard {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int64_t> g_aborts{0};

// A scripted call: done from `at` on, or never.
struct Mark {
  Clock::time_point at;
  bool never;
};

}  // namespace

CommLibrary::Handle ScriptedLibrary::make(CommState state) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto handle = reinterpret_cast<Handle>(static_cast<intptr_t>(comms_.size() + 1));
  comms_.emplace(handle, Comm{state, state == CommState::kFailed ? "scripted failure" : ""});
  return handle;
}

ScriptedLibrary::Comm& ScriptedLibrary::find_locked(Handle comm) {
  const auto found = comms_.find(comm);
  TORCH_CHECK(found != comms_.end(), "ScriptedLibrary: unknown communicator ", id(comm));
  return found->second;
}

void ScriptedLibrary::set_state(Handle comm, CommState state, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm& c = find_locked(comm);
  c.state = state;
  c.why = why;
}

void ScriptedLibrary::split_later(Handle parent, Handle* cell, std::chrono::milliseconds delay,
                                  CommState child) {
  set_state(parent, CommState::kInProgress, "");
  if (delay.count() < 0) return;  // never published: the parent stays in progress
  // The thread keeps the library alive, as NCCL's split thread outlives the caller's wait.
  std::thread([self = shared_from_this(), parent, cell, delay, child] {
    std::this_thread::sleep_for(delay);
    const Handle made = self->make(child);
    const bool failed = child == CommState::kFailed;
    if (failed) self->set_state(made, child, "the split failed on NCCL's thread");
    __atomic_store_n(cell, made, __ATOMIC_RELEASE);  // NCCL's publication of the child
    self->set_state(parent, failed ? CommState::kFailed : CommState::kReady,
                    failed ? "the split failed on NCCL's thread" : "");
  }).detach();
}

bool ScriptedLibrary::split_now(Handle parent, Handle* cell, CommState child) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    find_locked(parent);  // an unknown parent raises
  }
  const Handle made = make(child);
  __atomic_store_n(cell, made, __ATOMIC_RELEASE);  // published even when its init failed
  return child != CommState::kFailed;
}

void ScriptedLibrary::set_abort_delay(std::chrono::milliseconds delay) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_delay_ = delay;
}

CommLibrary::Marker ScriptedLibrary::call(std::chrono::milliseconds after) {
  return new Mark{Clock::now() + after, after.count() < 0};
}

bool ScriptedLibrary::block(Handle comm, std::chrono::milliseconds at_most) {
  std::unique_lock<std::mutex> lock(mu_);
  return aborted_.wait_for(lock, at_most, [&] { return find_locked(comm).aborted; });
}

void ScriptedLibrary::capture(Handle comm) {
  std::lock_guard<std::mutex> lock(mu_);
  ++find_locked(comm).graphs;
}

void ScriptedLibrary::destroy_graphs(Handle comm) {
  std::lock_guard<std::mutex> lock(mu_);
  find_locked(comm).graphs = 0;
  graphs_gone_.notify_all();
}

void ScriptedLibrary::wait_for_graphs_locked(std::unique_lock<std::mutex>& lock, Handle comm) {
  graphs_gone_.wait_for(lock, std::chrono::minutes(2),
                        [&] { return find_locked(comm).graphs == 0; });
}

int64_t ScriptedLibrary::polls(Handle comm) {
  std::lock_guard<std::mutex> lock(mu_);
  return find_locked(comm).polls;
}

std::vector<std::string> ScriptedLibrary::events() {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

CommState ScriptedLibrary::state(Handle comm, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm& c = find_locked(comm);
  ++c.polls;
  *why = c.why;
  return c.state;
}

void ScriptedLibrary::abort(Handle comm) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto delay = abort_delay_;
  lock.unlock();
  std::this_thread::sleep_for(delay);
  lock.lock();
  find_locked(comm).aborted = true;
  g_aborts.fetch_add(1);
  events_.push_back("abort " + std::to_string(id(comm)));
  aborted_.notify_all();
  wait_for_graphs_locked(lock, comm);  // NCCL's reclaim waits for the graphs holding it
  lock.unlock();
  std::this_thread::sleep_for(delay);  // the teardown after the stuck calls are released
}

std::string ScriptedLibrary::destroy(Handle comm) {
  std::unique_lock<std::mutex> lock(mu_);
  find_locked(comm);
  wait_for_graphs_locked(lock, comm);
  events_.push_back("destroy " + std::to_string(id(comm)));
  return "";
}

int64_t ScriptedLibrary::aborts_total() { return g_aborts.load(); }

bool ScriptedLibrary::done(Marker marker) {
  const auto* mark = static_cast<const Mark*>(marker);
  return !mark->never && Clock::now() >= mark->at;
}

void ScriptedLibrary::release(Marker marker) { delete static_cast<Mark*>(marker); }

ScriptedCommunicator::ScriptedCommunicator(double timeout_s, int64_t publish_ms,
                                           const std::string& child, int64_t poll_ms,
                                           int64_t abort_ms, bool blocking)
    : library_(std::make_shared<ScriptedLibrary>()) {
  constexpr const char* what = "ScriptedCommunicator";
  TORCH_CHECK(child == "ready" || child == "failed", what,
              ": child must be \"ready\" or \"failed\", got \"", child, "\"");
  TORCH_CHECK(poll_ms > 0, what, ": poll_ms must be positive, got ", poll_ms);
  TORCH_CHECK(abort_ms >= 0, what, ": abort_ms must not be negative, got ", abort_ms);
  library_->set_abort_delay(std::chrono::milliseconds(abort_ms));
  const std::string who = "rank 0 of 1, scripted";
  const auto timeout = to_milliseconds(timeout_s);
  TORCH_CHECK(timeout.count() > 0, what, ": timeout_s must be positive and finite, got ",
              timeout_s);
  CommLife::check_blocking_environment(what, who);
  parent_ = library_->make(CommState::kReady);
  const CommState made = child == "ready" ? CommState::kReady : CommState::kFailed;
  auto* cell = new CommLibrary::Handle(nullptr);  // freed once the child is written
  if (blocking && !library_->split_now(parent_, cell, made)) {
    CommLife::discard_split(library_, cell);
    TORCH_CHECK(false, what, " (", who, "): the blocking split failed");
  }
  if (!blocking) library_->split_later(parent_, cell, std::chrono::milliseconds(publish_ms), made);
  child_ = CommLife::await_child(library_, cell, timeout, what, who);
  life_ = std::make_unique<CommLife>(library_, who, timeout, std::chrono::milliseconds(poll_ms));
  life_->start(child_);
}

void ScriptedCommunicator::enqueue(int64_t finish_ms) {
  CommLife::Call call(*life_, "ScriptedCommunicator.enqueue");
  call.enqueued(library_->call(std::chrono::milliseconds(finish_ms)));
}

void ScriptedCommunicator::enqueue_captured() {
  CommLife::Call call(*life_, "ScriptedCommunicator.enqueue_captured");
  library_->capture(call.handle());
  call.captured();
}

bool ScriptedCommunicator::enqueue_stuck(int64_t at_most_ms) {
  CommLife::Call call(*life_, "ScriptedCommunicator.enqueue_stuck");
  return library_->block(call.handle(), std::chrono::milliseconds(at_most_ms));
}

void ScriptedCommunicator::fail(const std::string& why) {
  library_->set_state(child_, CommState::kFailed, why);
}

void ScriptedCommunicator::close(double grace_s) {
  life_->close(grace_s < 0 ? life_->timeout() : to_milliseconds(grace_s));
}

}  // namespace cpshard
