// Waiting for something NCCL does in the background to become ready, bounded by a timeout: the
// loop that waits for a split child (comm/life.h: its publication and the parent's and child's
// asynchronous state). Header-only and free of NCCL types, so a CPU build can drive it with a
// stand-in state (cpshard._C._settle_with_states, for the tests).
#pragma once

#include <chrono>
#include <thread>

namespace cpshard {

enum class Settled { kReady, kFailed, kTimedOut };

// How it polls: yielding for the first kSettleSpin (what is done in tens of microseconds should
// not wait out a sleep), then sleeping kSettleInterval between polls (a split: milliseconds to
// seconds).
constexpr auto kSettleSpin = std::chrono::microseconds(200);
constexpr auto kSettleInterval = std::chrono::microseconds(500);

// Polls `query()` (returning the communicator's state) until it returns something other than
// `in_progress`, or `timeout` has passed since the call: yielding between polls for the first
// `spin`, then sleeping `interval`. kReady when it returned `ready`, kFailed for any other state
// (stored in *last), kTimedOut when it never settled (the caller then aborts the communicator).
template <class State, class Query>
Settled settle(Query&& query, State in_progress, State ready, std::chrono::milliseconds timeout,
               State* last, std::chrono::microseconds spin = kSettleSpin,
               std::chrono::microseconds interval = kSettleInterval) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  while (true) {
    *last = query();
    if (*last != in_progress) return *last == ready ? Settled::kReady : Settled::kFailed;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return Settled::kTimedOut;
    if (now - start < spin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(interval);
    }
  }
}

}  // namespace cpshard
