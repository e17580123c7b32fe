#include "engine/cuda/fence.h"

#include <string>

#include "common/cuda/cuda_device.h"

namespace ddlfast {

Status Fence::record(int device, cudaStream_t stream) {
  int stream_owner = -1;
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DDLFAST_RETURN_IF_ERROR(stream_device(stream, &stream_owner));
  if (stream_owner >= 0 && stream_owner != device) {
    return Status::invalid("the stream belongs to cuda:" + std::to_string(stream_owner) + " but the arrays are on cuda:" +
                           std::to_string(device) + "; pass a stream of the arrays' device");
  }
  if (!event_.get() || device_ != device) {
    event_ = CudaEvent();
    DDLFAST_RETURN_IF_ERROR(event_.create());
  }
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_.get(), stream));
  device_ = device;
  return Status::ok();
}

Status Fence::make_wait(cudaStream_t stream) const {
  if (!event_.get()) return Status::ok();
  int stream_owner = -1;
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device_));
  DDLFAST_RETURN_IF_ERROR(stream_device(stream, &stream_owner));
  if (stream_owner >= 0 && stream_owner != device_) {
    return Status::invalid("the stream belongs to cuda:" + std::to_string(stream_owner) + " but the arrays are on cuda:" +
                           std::to_string(device_) + "; pass a stream of the arrays' device");
  }
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, event_.get(), 0));
  return Status::ok();
}

Status Fence::synchronize() const {
  if (!event_.get()) return Status::ok();
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_.get()));
  return Status::ok();
}

Status Fence::query(bool* done) const {
  *done = true;
  if (!event_.get()) return Status::ok();
  const cudaError_t state = cudaEventQuery(event_.get());
  if (state == cudaErrorNotReady) {
    *done = false;
    return Status::ok();
  }
  DDLFAST_CUDA_RETURN_IF_ERROR(state);
  return Status::ok();
}

}  // namespace ddlfast
