// The host CPU's result bits for an invalid floating-point operation (such as
// inf - inf), which the CUDA kernels reproduce instead of the GPU's canonical
// NaN (kernels/cuda/elementwise.cuh). A plain struct in common/, so the CUDA runtime wrappers
// (common/cuda/cuda_device.h) that measure it need not include the kernels above them.
#pragma once

#include <cstdint>

namespace ddlfast {
namespace elementwise {

struct NanRule {
  std::uint32_t default_nan32;
  std::uint64_t default_nan64;
};

}  // namespace elementwise
}  // namespace ddlfast
