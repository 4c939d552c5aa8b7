// Runs the CPU or the CUDA kernel of an op by the data's device; without the CUDA build a CUDA
// tensor raises instead of reaching a kernel that does not exist.
#pragma once

#include <c10/util/Exception.h>

#ifdef CPSHARD_WITH_CUDA
#define CPSHARD_ON_DEVICE(t, cpu_call, cuda_call) \
  do {                                            \
    if ((t).is_cuda()) {                          \
      cuda_call;                                  \
    } else {                                      \
      cpu_call;                                   \
    }                                             \
  } while (0)
#else
#define CPSHARD_ON_DEVICE(t, cpu_call, cuda_call)                          \
  do {                                                                     \
    TORCH_CHECK(!(t).is_cuda(), "cpshard was built without CUDA kernels"); \
    cpu_call;                                                              \
  } while (0)
#endif
