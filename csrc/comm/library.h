// What the communicator's life (comm/life.h) needs from NCCL and CUDA, behind one interface free
// of their types: the real implementation wraps ncclComm_t and CUDA events (CUDA builds), a
// scripted one serves the same logic on CPU in the tests (comm/scripted.h). Handles are the
// library's communicators (ncclComm_t), markers the completion marks of enqueued calls (CUDA
// events).
#pragma once

#include <string>

namespace cpshard {

enum class CommState { kReady, kInProgress, kFailed };

class CommLibrary {
 public:
  using Handle = void*;
  using Marker = void*;
  virtual ~CommLibrary() = default;

  // Run first on the watchdog's thread (the real one selects the device its events live on).
  virtual void prepare_watchdog_thread() {}

  // The communicator's asynchronous state (ncclCommGetAsyncError); on kFailed, *why says what
  // failed. Thread-safe against a call another thread has inside the library.
  virtual CommState state(Handle comm, std::string* why) = 0;
  // Aborts the communicator: its kernels and any host wait inside the library return, its
  // resources are freed (ncclCommAbort).
  virtual void abort(Handle comm) = 0;
  // Frees a communicator with nothing in flight (ncclCommDestroy); "" or what failed.
  virtual std::string destroy(Handle comm) = 0;
  // Whether the call marked by `marker` has finished on the device (cudaEventQuery).
  virtual bool done(Marker marker) = 0;
  // Gives a marker back once its call is known finished (or given up on).
  virtual void release(Marker marker) = 0;
};

}  // namespace cpshard
