#include "comm/teardown.h"

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace cpshard {
namespace {

struct Gate {
  std::mutex mu;
  std::condition_variable left;
  bool closed = false;
  int64_t inside = 0;
};

Gate& gate() {
  static auto* g = new Gate();  // never destroyed: released threads may outlive static destruction
  return *g;
}

// Begins teardown when the library's statics are destroyed (std::exit without Python's atexit).
struct AtStaticDestruction {
  ~AtStaticDestruction() { begin_teardown(kTeardownWait); }
} at_static_destruction;

}  // namespace

bool unless_tearing_down(const std::function<void()>& release) {
  Gate& g = gate();
  {
    std::lock_guard<std::mutex> lock(g.mu);
    if (g.closed) return false;
    ++g.inside;
  }
  try {
    release();
  } catch (...) {
    // A release that throws still leaves: teardown must not wait for it.
  }
  std::lock_guard<std::mutex> lock(g.mu);
  --g.inside;
  g.left.notify_all();
  return true;
}

bool begin_teardown(std::chrono::milliseconds wait) {
  Gate& g = gate();
  std::unique_lock<std::mutex> lock(g.mu);
  g.closed = true;
  return g.left.wait_for(lock, wait, [&] { return g.inside == 0; });
}

bool tearing_down() {
  Gate& g = gate();
  std::lock_guard<std::mutex> lock(g.mu);
  return g.closed;
}

}  // namespace cpshard
