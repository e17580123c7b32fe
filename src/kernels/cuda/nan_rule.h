// The host CPU's result bits for an invalid floating-point operation (such as
// inf - inf), which the CUDA kernels reproduce instead of the GPU's canonical
// NaN; see elementwise.cuh.
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
