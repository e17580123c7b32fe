// Linked when the build has no CUDA (nvcc missing or DDLFAST_CUDA=off).
#include "common/cuda_info.h"

namespace ddlfast {
bool cuda_compiled() { return false; }
std::string cuda_version_string() { return "none"; }
}  // namespace ddlfast
