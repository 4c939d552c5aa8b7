// A scripted stand-in for NCCL behind comm/library.h, and a communicator made of it and the real
// CommLife, so the CPU build's tests drive the communicator's life (the split's wait, the calls,
// the watchdog, close) through the code the CUDA build runs (cpshard._C._ScriptedCommunicator).
//
// Communicators are numbered handles with a state the script sets; a non-blocking split
// publishes its child into the caller's cell from a thread of its own after a delay, like NCCL's
// split thread, and a blocking one before it returns (a failed child too, as NCCL does); every
// poll of a communicator's state is counted (the parent, torch's, must never be polled); a
// call's marker is done after a set time or never; a call can block inside the library until an
// abort releases it (a connect to a peer that never comes); a call can be captured into a CUDA
// graph, which holds the communicator: its destroy or abort then waits until the graphs are
// destroyed, as NCCL's do; an abort can be made slow (NCCL's may take seconds) to widen the
// window in which it is under way.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/library.h"
#include "comm/life.h"

namespace cpshard {

class ScriptedLibrary final : public CommLibrary,
                              public std::enable_shared_from_this<ScriptedLibrary> {
 public:
  // A new communicator in state `state`.
  Handle make(CommState state);
  void set_state(Handle comm, CommState state, const std::string& why);
  // A non-blocking split of `parent`: the parent is in progress until, `delay` later, a thread
  // makes the child (in state `child`), writes its address into *cell and sets the parent ready
  // (failed with the child when `child` is kFailed). A negative delay: never.
  void split_later(Handle parent, Handle* cell, std::chrono::milliseconds delay, CommState child);
  // A split of a blocking `parent`: makes the child (in state `child`) and publishes it into
  // *cell before returning; false (the split's error) when the child failed.
  bool split_now(Handle parent, Handle* cell, CommState child);
  // Every later abort takes `delay` before it takes effect (releases the stuck calls, counts as
  // an event) and `delay` again before it returns.
  void set_abort_delay(std::chrono::milliseconds delay);
  // A call's marker, done `after` from now (negative: never).
  Marker call(std::chrono::milliseconds after);
  // A host call stuck inside the library on `comm` until it is aborted or `at_most` passed:
  // true when the abort released it.
  bool block(Handle comm, std::chrono::milliseconds at_most);
  // A call on `comm` captured into a CUDA graph: the graph holds the communicator.
  void capture(Handle comm);
  // Every graph holding `comm` destroyed: a destroy or abort waiting for them returns.
  void destroy_graphs(Handle comm);
  // How many times the state of `comm` was read.
  int64_t polls(Handle comm);
  // What happened to the communicators, in order: "abort <n>", "destroy <n>".
  std::vector<std::string> events();
  // Aborts made by every scripted library so far (a late child is aborted by a thread after the
  // library's communicator is gone: the tests count it here).
  static int64_t aborts_total();
  int64_t id(Handle comm) const { return static_cast<int64_t>(reinterpret_cast<intptr_t>(comm)); }

  CommState state(Handle comm, std::string* why) override;
  void abort(Handle comm) override;
  std::string destroy(Handle comm) override;
  bool done(Marker marker) override;
  void release(Marker marker) override;

 private:
  struct Comm {
    CommState state;
    std::string why;
    bool aborted = false;
    int64_t graphs = 0;  // CUDA graphs holding the communicator
    int64_t polls = 0;
  };
  Comm& find_locked(Handle comm);
  // With `lock` held: waits until no graph holds `comm` (at most two minutes: a test that
  // fails must not hang).
  void wait_for_graphs_locked(std::unique_lock<std::mutex>& lock, Handle comm);

  std::mutex mu_;
  std::condition_variable aborted_;
  std::condition_variable graphs_gone_;
  std::map<Handle, Comm> comms_;
  std::chrono::milliseconds abort_delay_{0};
  std::vector<std::string> events_;
};

class ScriptedCommunicator {
 public:
  // Made like a split child of a non-blocking parent: the child is published `publish_ms` after
  // the split returned (negative: never) in state "ready" or "failed" (`child`), waited for
  // within `timeout_s`, then started with a watchdog polling every `poll_ms`; an abort of it
  // takes `abort_ms` before it takes effect and again before it returns. `blocking`: the parent
  // is blocking, so the split completes (publishing the child, failed or not) before it
  // returns, and returns an error when the child failed. Refused like the real one when
  // NCCL_COMM_BLOCKING=0 is in the environment.
  ScriptedCommunicator(double timeout_s, int64_t publish_ms, const std::string& child,
                       int64_t poll_ms, int64_t abort_ms, bool blocking);
  // One call: enqueued through the communicator's call path, done `finish_ms` later (negative:
  // never).
  void enqueue(int64_t finish_ms);
  // One call stuck inside the library for at most `at_most_ms`: true when an abort released it.
  bool enqueue_stuck(int64_t at_most_ms);
  // One call captured into a CUDA graph (the graph holds the communicator until
  // destroy_graphs).
  void enqueue_captured();
  void destroy_graphs() { library_->destroy_graphs(child_); }
  int64_t captured() { return life_->captured_calls(); }
  // How many times the parent's state was read.
  int64_t parent_polls() { return library_->polls(parent_); }
  // An asynchronous error on the communicator, as NCCL reports a dead peer.
  void fail(const std::string& why);
  std::string error() { return life_->error(); }
  // close() with `grace_s` (negative: the group's timeout).
  void close(double grace_s);
  int64_t device() const { return 0; }
  int64_t child() const { return library_->id(child_); }
  std::vector<std::string> events() { return library_->events(); }

 private:
  std::shared_ptr<ScriptedLibrary> library_;
  CommLibrary::Handle parent_ = nullptr;
  CommLibrary::Handle child_ = nullptr;
  std::unique_ptr<CommLife> life_;
};

}  // namespace cpshard
