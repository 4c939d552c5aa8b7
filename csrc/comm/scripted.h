// A scripted stand-in for NCCL behind comm/library.h, and a communicator made of it and the real
// CommLife, so the CPU build's tests drive the communicator's life (the split's wait, the calls,
// the watchdog, close) through the code the CUDA build runs (cpshard._C._ScriptedCommunicator).
//
// Communicators are numbered handles with a state the script sets; a non-blocking split
// publishes its child into the caller's cell from a thread of its own after a delay, like NCCL's
// split thread; a call's marker is done after a set time or never; a call can block inside the
// library until an abort releases it (a connect to a peer that never comes); an abort can be
// made slow (NCCL's may take seconds) to widen the window in which it is under way.
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
  // Every later abort takes `delay` before it takes effect (releases the stuck calls, counts as
  // an event) and `delay` again before it returns.
  void set_abort_delay(std::chrono::milliseconds delay);
  // A call's marker, done `after` from now (negative: never).
  Marker call(std::chrono::milliseconds after);
  // A host call stuck inside the library on `comm` until it is aborted or `at_most` passed:
  // true when the abort released it.
  bool block(Handle comm, std::chrono::milliseconds at_most);
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
  };
  Comm& find_locked(Handle comm);

  std::mutex mu_;
  std::condition_variable aborted_;
  std::map<Handle, Comm> comms_;
  std::chrono::milliseconds abort_delay_{0};
  std::vector<std::string> events_;
};

class ScriptedCommunicator {
 public:
  // Made like a split child of a non-blocking parent: the child is published `publish_ms` after
  // the split returned (negative: never) in state "ready" or "failed" (`child`), waited for
  // within `timeout_s`, then started with a watchdog polling every `poll_ms`; an abort of it
  // takes `abort_ms` before it takes effect and again before it returns.
  ScriptedCommunicator(double timeout_s, int64_t publish_ms, const std::string& child,
                       int64_t poll_ms, int64_t abort_ms);
  // One call: enqueued through the communicator's call path, done `finish_ms` later (negative:
  // never).
  void enqueue(int64_t finish_ms);
  // One call stuck inside the library for at most `at_most_ms`: true when an abort released it.
  bool enqueue_stuck(int64_t at_most_ms);
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
  CommLibrary::Handle child_ = nullptr;
  std::unique_ptr<CommLife> life_;
};

}  // namespace cpshard
