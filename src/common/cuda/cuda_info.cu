// Linked when the build compiled the CUDA kernels.
#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_info.h"

namespace ddlfast {
bool cuda_compiled() { return true; }
std::string cuda_version_string() {
  return "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
}
}  // namespace ddlfast
