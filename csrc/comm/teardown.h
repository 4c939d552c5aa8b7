// Process teardown and the threads that outlive their caller: a thread left behind to release a
// late communicator (comm/life.h's split child published after the wait gave up, the watchdog's
// abort held up by CUDA graphs, the late creation of nccl_communicator.cpp) may wake after the
// process began exiting, when NCCL, CUDA and torch may be half torn down. Once teardown begins,
// such a thread makes no library call: teardown waits a bounded time for the calls already
// inside, and what the others would have released is left to the process, which is ending.
#pragma once

#include <chrono>
#include <functional>

namespace cpshard {

// How long the exit waits for a release already inside the library (NCCL's abort can take
// seconds): the exit's grace for queued calls (cpshard.comm.nccl.EXIT_GRACE_S).
constexpr auto kTeardownWait = std::chrono::milliseconds(3000);

// Runs `release` unless teardown has begun, counted as inside so that begin_teardown waits for
// it; true when it ran. The check and the count are taken under one lock, so no release starts
// once begin_teardown has returned.
bool unless_tearing_down(const std::function<void()>& release);

// Begins teardown (idempotent): later unless_tearing_down calls skip their release. Waits at
// most `wait` for those already inside; true when none was left inside. The extension runs it
// from a Python atexit handler (after cpshard.comm.nccl's, which ends the communicators) and
// again when the library's statics are destroyed (an exit that skipped Python's handlers).
bool begin_teardown(std::chrono::milliseconds wait);

// Whether teardown has begun.
bool tearing_down();

}  // namespace cpshard
