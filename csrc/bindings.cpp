// The one place that registers cpshard's operator schemas and their CPU / CUDA kernels, and the
// Python module that reports how the extension was built. Fake (meta) kernels and autograd
// formulas are registered in Python (cpshard/ops.py).
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include "comm/settle.h"
#include "index/index_ops.h"
#include "ragged/ragged_ops.h"
#include "segment/segment_ops.h"
#ifdef CPSHARD_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

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
      .def(torch::init<int64_t, at::Tensor, int64_t, int64_t, int64_t, double>())
      .def_static("unique_id", &NcclCommunicator::unique_id)
      .def_static("version", &NcclCommunicator::version)
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
#else
  module.attr("cuda_kernels") = false;
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
  // The communicator's bounded wait for a non-blocking NCCL call, driven by a stand-in state:
  // the i-th poll sees states[i] (the last one from then on; 1 stands for "in progress", 0
  // for "ready"). Returns the outcome ("ready", "failed", "timed_out"), the last state seen and
  // the number of polls. For the tests: the communicator itself needs a GPU.
  module.def(
      "_settle_with_states",
      [](std::vector<int64_t> states, int64_t timeout_ms) {
        TORCH_CHECK(!states.empty(), "_settle_with_states: states is empty");
        TORCH_CHECK(timeout_ms >= 0, "_settle_with_states: timeout_ms = ", timeout_ms,
                    " is negative");
        size_t polls = 0;
        int64_t last = 0;
        const auto query = [&] { return states[std::min(polls++, states.size() - 1)]; };
        const auto outcome = cpshard::settle<int64_t>(query, 1, 0,
                                                      std::chrono::milliseconds(timeout_ms),
                                                      std::chrono::microseconds(500), &last);
        const char* name = outcome == cpshard::Settled::kReady    ? "ready"
                           : outcome == cpshard::Settled::kFailed ? "failed"
                                                                  : "timed_out";
        return std::make_tuple(std::string(name), last, static_cast<int64_t>(polls));
      },
      pybind11::arg("states"), pybind11::arg("timeout_ms"));
  module.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}
