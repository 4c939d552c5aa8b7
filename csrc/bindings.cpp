// The one place that registers cpshard's operator schemas and their CPU / CUDA kernels, and the
// Python module that reports how the extension was built. Fake (meta) kernels and autograd
// formulas are registered in Python (cpshard/ops.py).
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/scripted.h"
#include "comm/settle.h"
#include "comm/teardown.h"
#include "comm/within.h"
#include "index/index_ops.h"
#include "ragged/ragged_ops.h"
#include "segment/segment_ops.h"
#ifdef CPSHARD_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace {

// The values of stand-in calls that _run_within gave up on, recorded when they came (by the
// threads that ran them).
class LateResults {
 public:
  void push(int64_t value) {
    std::lock_guard<std::mutex> lock(mu_);
    values_.push_back(value);
  }
  std::vector<int64_t> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return values_;
  }

 private:
  std::mutex mu_;
  std::vector<int64_t> values_;
};

LateResults& late_results() {
  static auto* results = new LateResults();  // never destroyed: late threads may outlive exit
  return *results;
}

}  // namespace

TORCH_LIBRARY(cpshard, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("pack_ragged(Tensor x, int[] counts, int dim, int pad_to, Scalar fill) -> Tensor", tags);
  m.def("unpack_ragged(Tensor packed, int[] counts, int dim, int pad_to, SymInt[] out_shape) -> Tensor",
        tags);
  m.def("interleave_sequence(Tensor x, int dim) -> Tensor", tags);
  m.def("deinterleave_sequence(Tensor x, SymInt world, int dim) -> Tensor", tags);
  m.def("index_gather(Tensor src, Tensor index, int dim, Scalar fill) -> Tensor", tags);
  m.def("index_scatter_add(Tensor grad, Tensor index, int dim, SymInt dim_size) -> Tensor", tags);
  m.def("document_segments(Tensor doc_ids, int start, int end) -> (Tensor, Tensor, Tensor, Tensor)",
        tags);
#ifdef CPSHARD_WITH_NCCL
  using cpshard::NcclCommunicator;
  m.class_<NcclCommunicator>("NcclCommunicator")
      .def(torch::init<int64_t, int64_t, at::Tensor, int64_t, int64_t, int64_t, double>())
      .def_static("unique_id", &NcclCommunicator::unique_id)
      .def_static("version", &NcclCommunicator::version)
      .def_static("split_config", &NcclCommunicator::split_config)
      .def_static("parent_matches", &NcclCommunicator::parent_matches)
      .def("rank", &NcclCommunicator::rank)
      .def("world", &NcclCommunicator::world)
      .def("device", &NcclCommunicator::device)
      .def("error", &NcclCommunicator::error)
      .def("close", &NcclCommunicator::close)
      .def("all_gather", &NcclCommunicator::all_gather)
      .def("all_gather_v", &NcclCommunicator::all_gather_v)
      .def("reduce_scatter", &NcclCommunicator::reduce_scatter)
      .def("reduce_scatter_v", &NcclCommunicator::reduce_scatter_v)
      .def("send_recv", &NcclCommunicator::send_recv);
#endif
}

// The operators validate and dispatch to the device kernel themselves, so one registration
// serves every backend the build has.
#define CPSHARD_REGISTER_KERNELS(m)                                 \
  m.impl("pack_ragged", &cpshard::pack_ragged);                     \
  m.impl("unpack_ragged", &cpshard::unpack_ragged);                 \
  m.impl("interleave_sequence", &cpshard::interleave_sequence);     \
  m.impl("deinterleave_sequence", &cpshard::deinterleave_sequence); \
  m.impl("index_gather", &cpshard::index_gather);                   \
  m.impl("index_scatter_add", &cpshard::index_scatter_add);         \
  m.impl("document_segments", &cpshard::document_segments)

TORCH_LIBRARY_IMPL(cpshard, CPU, m) { CPSHARD_REGISTER_KERNELS(m); }
#ifdef CPSHARD_WITH_CUDA
TORCH_LIBRARY_IMPL(cpshard, CUDA, m) { CPSHARD_REGISTER_KERNELS(m); }
#endif

PYBIND11_MODULE(_C, module) {
  module.doc() = "cpshard native core: operators are registered under torch.ops.cpshard";
#ifdef CPSHARD_WITH_CUDA
  module.attr("cuda_kernels") = true;
  module.attr("cuda_archs") = CPSHARD_CUDA_ARCHS;
#else
  module.attr("cuda_kernels") = false;
  module.attr("cuda_archs") = "";
#endif
#ifdef CPSHARD_WITH_NCCL
  module.attr("nccl") = true;
#else
  module.attr("nccl") = false;
#endif
#ifdef CPSHARD_SANITIZE
  module.attr("sanitized") = true;
#else
  module.attr("sanitized") = false;
#endif
  // The communicator's bounded polling wait (for a split child), driven by a stand-in state:
  // the i-th poll sees states[i] (the last one from then on; 1 stands for "in progress", 0
  // for "ready"). Returns the outcome ("ready", "failed", "timed_out"), the last state seen and
  // the number of polls. spin_us / interval_us default to the communicator's. For the tests:
  // the communicator itself needs a GPU.
  module.def(
      "_settle_with_states",
      [](std::vector<int64_t> states, int64_t timeout_ms, int64_t spin_us, int64_t interval_us) {
        TORCH_CHECK(!states.empty(), "_settle_with_states: states is empty");
        TORCH_CHECK(timeout_ms >= 0, "_settle_with_states: timeout_ms = ", timeout_ms,
                    " is negative");
        TORCH_CHECK(spin_us >= 0 && interval_us >= 0, "_settle_with_states: negative interval");
        size_t polls = 0;
        int64_t last = 0;
        const auto query = [&] { return states[std::min(polls++, states.size() - 1)]; };
        const auto outcome = cpshard::settle<int64_t>(
            query, 1, 0, std::chrono::milliseconds(timeout_ms), &last,
            std::chrono::microseconds(spin_us), std::chrono::microseconds(interval_us));
        const char* name = outcome == cpshard::Settled::kReady    ? "ready"
                           : outcome == cpshard::Settled::kFailed ? "failed"
                                                                  : "timed_out";
        return std::make_tuple(std::string(name), last, static_cast<int64_t>(polls));
      },
      pybind11::arg("states"), pybind11::arg("timeout_ms"),
      pybind11::arg("spin_us") = cpshard::kSettleSpin.count(),
      pybind11::arg("interval_us") = cpshard::kSettleInterval.count());
  // The bounded wait for a call that may block for ever (a split from a blocking parent),
  // driven by a stand-in call that sleeps block_ms and returns `value`: the value, or None when
  // it has not come within timeout_ms. A call given up on hands its value, when it comes, to the
  // late handler, which here records it for _late_results() (the communicator's releases the
  // late child). For the tests: the communicator itself needs a GPU.
  module.def(
      "_run_within",
      [](int64_t block_ms, int64_t timeout_ms, int64_t value) {
        TORCH_CHECK(block_ms >= 0 && timeout_ms >= 0, "_run_within: negative time");
        return cpshard::run_within<int64_t>(
            [block_ms, value] {
              std::this_thread::sleep_for(std::chrono::milliseconds(block_ms));
              return value;
            },
            std::chrono::milliseconds(timeout_ms),
            [](int64_t late) { late_results().push(late); });
      },
      pybind11::arg("block_ms"), pybind11::arg("timeout_ms"), pybind11::arg("value"));
  module.def("_late_results", [] { return late_results().all(); });
  // The communicator's life (the split's wait, calls, watchdog, close: comm/life.h) over a
  // scripted NCCL, for the tests: the communicator itself needs a GPU. Every method that waits
  // releases the GIL, as the real communicator's callers do.
  using cpshard::ScriptedCommunicator;
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<ScriptedCommunicator>(module, "_ScriptedCommunicator")
      .def(pybind11::init<double, int64_t, const std::string&, int64_t, int64_t, bool>(),
           release_gil(),
           pybind11::arg("timeout_s"), pybind11::arg("publish_ms"),
           pybind11::arg("child") = "ready", pybind11::arg("poll_ms") = 20,
           pybind11::arg("abort_ms") = 0, pybind11::arg("blocking") = false)
      .def("enqueue", &ScriptedCommunicator::enqueue, release_gil(), pybind11::arg("finish_ms"))
      .def("enqueue_captured", &ScriptedCommunicator::enqueue_captured, release_gil())
      .def("destroy_graphs", &ScriptedCommunicator::destroy_graphs)
      .def("captured", &ScriptedCommunicator::captured)
      .def("parent_polls", &ScriptedCommunicator::parent_polls)
      .def("enqueue_stuck", &ScriptedCommunicator::enqueue_stuck, release_gil(),
           pybind11::arg("at_most_ms"))
      .def("fail", &ScriptedCommunicator::fail, pybind11::arg("why"))
      .def("error", &ScriptedCommunicator::error)
      .def("close", &ScriptedCommunicator::close, release_gil(), pybind11::arg("grace_s"))
      .def("device", &ScriptedCommunicator::device)
      .def("child", &ScriptedCommunicator::child)
      .def("events", &ScriptedCommunicator::events);
  module.def("_scripted_aborts", &cpshard::ScriptedLibrary::aborts_total);
  // The process's teardown begins at interpreter exit: registered now, at the extension's
  // import, so it runs after cpshard.comm.nccl's handler (which ends the communicators) and
  // before the interpreter is torn down (comm/teardown.h). Releases the GIL while it waits.
  pybind11::module_::import("atexit").attr("register")(pybind11::cpp_function(
      [] { cpshard::begin_teardown(cpshard::kTeardownWait); }, release_gil()));
  module.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}
