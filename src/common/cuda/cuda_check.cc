#include "common/cuda/cuda_check.h"

#include <string>

namespace ddlfast {
namespace {

const char* hint_for(cudaError_t error) {
  switch (error) {
    case cudaErrorNoDevice:
      return "no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES and that the NVIDIA "
             "driver is loaded)";
    case cudaErrorInsufficientDriver:
      return "the NVIDIA driver is missing or older than the CUDA runtime ddlfast was built with";
    case cudaErrorInvalidDevice:
      return "that device ordinal does not exist on this machine";
    case cudaErrorMemoryAllocation:
      return "out of memory for ddlfast's buffers (lower DDLFAST_BUCKET_BYTES or DDLFAST_CHUNK_BYTES)";
    case cudaErrorInvalidResourceHandle:
      return "a stream or event that belongs to another device, or one already destroyed";
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return "this build carries sm_90 code plus PTX that this GPU or driver cannot run; rebuild with "
             "CMAKE_CUDA_ARCHITECTURES set for this GPU";
    case cudaErrorIllegalAddress:
    case cudaErrorInvalidValue:
      return "a pointer or size passed to ddlfast does not describe memory of this device";
    default:
      return nullptr;
  }
}

}  // namespace

Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  cudaGetLastError();  // reset the non-sticky error so the next check starts clean
  std::string message = std::string("CUDA error in ") + what + ": " + cudaGetErrorName(error) + " (" +
                        cudaGetErrorString(error) + ")";
  if (const char* hint = hint_for(error)) message += "; " + std::string(hint);
  return Status(StatusCode::kInternal, message);
}

}  // namespace ddlfast
