// The one path from cudaError_t to Status. Every CUDA runtime call in ddlfast
// goes through DDLFAST_CUDA_RETURN_IF_ERROR, so a failure names the call,
// CUDA's error name and text, and for the failures users cause (no device,
// old driver, out of memory, wrong device) what to do about it.
#pragma once

#include <cuda_runtime_api.h>

#include "common/status.h"

namespace ddlfast {

// kOk for cudaSuccess; otherwise kInternal with a message a user can act on.
// Clears CUDA's (non-sticky) last-error state so it cannot resurface later.
Status cuda_status(cudaError_t error, const char* what);

}  // namespace ddlfast

#define DDLFAST_CUDA_RETURN_IF_ERROR(call)                         \
  do {                                                             \
    const cudaError_t cuda_error_ = (call);                        \
    if (cuda_error_ != cudaSuccess) return ::ddlfast::cuda_status(cuda_error_, #call); \
  } while (0)
