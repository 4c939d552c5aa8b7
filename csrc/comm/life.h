// The life of one communicator, free of NCCL and CUDA types (they sit behind comm/library.h), so
// the CPU build runs the very same logic with a scripted library (comm/scripted.h):
//
//   * the wait for a split child: NCCL publishes the child's address into a cell the caller
//     handed it, after ncclCommSplit has returned when the parent is non-blocking (it returns
//     success while the split still runs on NCCL's thread). The wait polls the cell and then the
//     child's asynchronous state within the group's timeout; never the parent's: the parent is
//     torch's, and polling it (ncclCommGetAsyncError) completes and frees its pending group job
//     outside torch's lock, racing torch's own watchdog polling the same communicator. NCCL
//     publishes the child at the end of the split whether it succeeded or failed, so the child's
//     state says both. The cell is freed only once NCCL has written it. A split that returned an
//     error may have published a child all the same (its initialisation failed after it was
//     made): discard_split aborts it;
//   * the environment: NCCL_COMM_BLOCKING=0 overrides the blocking = 1 every communicator here
//     is made with, after which every verb would return "in progress": refused at creation,
//     naming the variable (check_blocking_environment);
//   * the calls: a blocking communicator, so a call enqueues on the caller's thread and returns
//     (no thread of NCCL's per call, no polling). Each call holds the call lock while inside
//     the library and leaves a completion marker, or is counted as captured when it went into
//     a CUDA graph (no marker: it runs at each replay);
//   * the watchdog (torch's model for its blocking communicators): a thread that every poll
//     interval reads the asynchronous state, the oldest unfinished call and how long a call has
//     been inside the library, and aborts the communicator on an asynchronous error, a call
//     unfinished after the group's timeout, or a host call (a first connect to a peer that never
//     comes) inside the library for longer than the timeout; every later call raises the reason.
//     NCCL forbids an abort while another thread is inside a call on the communicator: the
//     abort waits for the call lock, except for a call stuck past the timeout, which only the
//     abort releases (torch's watchdog does the same). The reason is published only once the
//     abort has returned: whoever sees it (error(), or a call that raises it) may rely on the
//     communicator being aborted and its calls released. A call that starts or returns while
//     the abort is under way waits for it (a call the abort released finds the reason in
//     error() on return). Once a call was captured, NCCL's abort (and its destroy) waits until
//     every CUDA graph holding the communicator is destroyed, which may be never: the abort then
//     runs on a thread of its own (it still stops the kernels first) and the reason is published
//     at once, saying so;
//   * the end: close(grace) lets the queued calls finish for at most `grace`, then destroys a
//     quiescent communicator or aborts it (an interpreter exit passes a short grace: a rank whose
//     peer died never waits out the group's timeout there). With captured calls it does neither
//     (either would wait for the graphs, a hang at exit): the communicator is left to the
//     process, with a warning.
//   Threads left behind (a late split child's reaper, the abort held up by graphs) make no
//   library call once the process's teardown has begun (comm/teardown.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "comm/library.h"

namespace cpshard {

// `seconds` rounded up to milliseconds; zero when it is not positive and finite (CommLife refuses
// a zero timeout, naming the communicator).
std::chrono::milliseconds to_milliseconds(double seconds);

class CommLife {
 public:
  using Handle = CommLibrary::Handle;
  using Marker = CommLibrary::Marker;
  using Clock = std::chrono::steady_clock;

  // `who` names the communicator in messages ("rank 1 of 4, cuda:1"); `timeout` is the process
  // group's; `poll` the watchdog's interval.
  CommLife(std::shared_ptr<CommLibrary> library, std::string who, std::chrono::milliseconds timeout,
           std::chrono::milliseconds poll = std::chrono::milliseconds(100));
  // Closes with the full timeout as grace if close() was not called.
  ~CommLife();
  CommLife(const CommLife&) = delete;
  CommLife& operator=(const CommLife&) = delete;

  // Waits until the split child that `library` publishes into *cell is ready: its address has
  // appeared and it is not in progress (the parent, torch's, is never polled). Frees the cell
  // and returns the child; raises (naming `what` and `who`) when the child failed or `timeout`
  // passed. A child already published is then aborted; one not yet published is left to a
  // thread that aborts it if it appears within ten more timeouts (a minute at least) and only
  // then frees the cell (never the memory NCCL is still to write).
  static Handle await_child(const std::shared_ptr<CommLibrary>& library, Handle* cell,
                            std::chrono::milliseconds timeout, const char* what,
                            const std::string& who);
  // After a split that returned an error (nothing left running in the background): aborts the
  // child NCCL may have published into *cell all the same, and frees the cell.
  static void discard_split(const std::shared_ptr<CommLibrary>& library, Handle* cell);
  // Raises (naming `what`, `who` and the variable) when NCCL_COMM_BLOCKING in the environment
  // would make NCCL ignore the blocking = 1 of the communicator about to be made: NCCL parses it
  // as an integer, and 0 makes every communicator non-blocking.
  static void check_blocking_environment(const char* what, const std::string& who);

  // Adopts a ready communicator and starts the watchdog.
  void start(Handle comm);

  // One call into the library: holds the call lock while alive (an abort waits for it), raises
  // if the communicator is closed or aborted, and times the host time spent inside. While the
  // watchdog aborts, a call neither starts nor returns before the abort has: it raises, or
  // returns, once the reason is published.
  class Call {
   public:
    Call(CommLife& life, const char* what);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    Handle handle() const { return handle_; }
    // The call was enqueued: `marker` (null: untimed, CUDA refused the event) is done when it
    // has finished on the device.
    void enqueued(Marker marker);
    // The call was captured into a CUDA graph: counted, so that close never waits for a graph
    // (see the end, above).
    void captured();

   private:
    CommLife& life_;
    std::unique_lock<std::mutex> calls_;
    Handle handle_ = nullptr;
  };

  // Why the communicator was aborted, once the abort has returned; "" while it is usable or the
  // abort is still under way.
  std::string error();
  // Whether close() has run.
  bool closed();
  // Ends the communicator: waits at most `grace` for the call inside and the queued ones (not
  // past an error), then destroys it when all finished without error, else aborts it; leaves it
  // to the process (with a warning) when a call was captured into a CUDA graph. Idempotent.
  void close(std::chrono::milliseconds grace);
  // How many calls were captured into CUDA graphs.
  int64_t captured_calls();
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& who() const { return who_; }

 private:
  void watch();
  // With mu_ held: drops the markers of finished calls; true when none is left.
  bool reap_locked();
  // With mu_ held: whether the communicator is there and the library reports no asynchronous
  // error on it (or on `comm`).
  bool healthy_locked();
  bool healthy_locked_for(Handle comm);
  // With mu_ held (released inside, held again on return): takes the handle out of use, aborts
  // it once no call is inside the library (or one has been stuck there for longer than the
  // timeout), then publishes `reason` as the error.
  void abort_locked(std::unique_lock<std::mutex>& lock, const std::string& reason);
  // With mu_ held: gives every marker back.
  void release_markers_locked();
  // How long the call now inside the library has been there (zero when none is).
  Clock::duration inside_for() const;

  const std::shared_ptr<CommLibrary> lib_;
  const std::string who_;
  const std::chrono::milliseconds timeout_;
  const std::chrono::milliseconds poll_;

  std::mutex calls_mu_;  // held by a call while inside the library; taken before mu_
  std::atomic<int64_t> entered_ns_{0};  // when the call inside entered (steady clock), 0: none
  std::mutex mu_;        // guards everything below
  Handle comm_ = nullptr;
  std::string error_;  // set only once the abort has returned
  bool aborting_ = false;  // the watchdog is aborting: calls wait for error_ (on aborted_)
  std::condition_variable aborted_;
  bool closed_ = false;
  int64_t captured_ = 0;  // calls captured into CUDA graphs, which then hold the communicator
  std::deque<std::pair<Marker, Clock::time_point>> pending_;  // calls not known finished
  std::condition_variable wake_;
  std::thread watchdog_;
};

}  // namespace cpshard
