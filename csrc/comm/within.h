// Waiting a bounded time for a call that may block for ever: a split from a blocking NCCL
// communicator runs to completion inside ncclCommSplit (NCCL takes the split's blocking mode
// from the parent), waiting for every peer with no timeout of its own. Header-only and free of
// NCCL types, so a CPU build can drive it with a stand-in call (cpshard._C._run_within, for the
// tests).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace cpshard {

// Runs `work()` (which must not throw) on a thread of its own and waits at most `timeout` for
// its result. Returns the result, or nullopt when it did not come in time: the call is then
// abandoned, its thread keeps running, and if the call ever returns, `late(result)` runs on that
// thread to release what the result holds (nobody else will). Nothing the caller owns may be
// captured by reference: the thread can outlive the caller.
template <class Result, class Work, class Late>
std::optional<Result> run_within(Work work, std::chrono::milliseconds timeout, Late late) {
  struct Shared {
    std::mutex mu;
    std::condition_variable arrived;
    std::optional<Result> result;
    bool abandoned = false;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, work = std::move(work), late = std::move(late)]() mutable {
    Result result = work();
    std::unique_lock<std::mutex> lock(shared->mu);
    if (shared->abandoned) {
      lock.unlock();
      late(std::move(result));
      return;
    }
    shared->result = std::move(result);
    shared->arrived.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mu);
  if (!shared->arrived.wait_for(lock, timeout, [&] { return shared->result.has_value(); })) {
    shared->abandoned = true;
    return std::nullopt;
  }
  return std::move(shared->result);
}

}  // namespace cpshard
