// Whether this build carries the CUDA kernels; implemented once per device
// kind (common/cuda/cuda_info.cu or common/cuda_info_none.cc).
#pragma once

#include <string>

namespace ddlfast {
bool cuda_compiled();
std::string cuda_version_string();
}  // namespace ddlfast
