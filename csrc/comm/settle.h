// Waiting for a non-blocking NCCL communicator to become ready, bounded by a timeout: the loop
// the communicator runs after each call that returns ncclInProgress (creation, a split, a
// pattern's first ncclGroupEnd). Header-only and free of NCCL types, so a CPU build can drive it
// with a stand-in state (cpshard._C._settle_with_states, for the tests).
#pragma once

#include <chrono>
#include <thread>

namespace cpshard {

enum class Settled { kReady, kFailed, kTimedOut };

// Polls `query()` (returning the communicator's state) every `interval` until it returns
// something other than `in_progress`, or `timeout` has passed since the call: kReady when it
// returned `ready`, kFailed for any other state (stored in *last), kTimedOut when it never
// settled (the caller then aborts the communicator).
template <class State, class Query>
Settled settle(Query&& query, State in_progress, State ready, std::chrono::milliseconds timeout,
               std::chrono::microseconds interval, State* last) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    *last = query();
    if (*last != in_progress) return *last == ready ? Settled::kReady : Settled::kFailed;
    if (std::chrono::steady_clock::now() >= deadline) return Settled::kTimedOut;
    std::this_thread::sleep_for(interval);
  }
}

}  // namespace cpshard
