#include "engine/cuda/cuda_lanes.h"

#include <string>

#include "kernels/cuda/cuda_kernels.h"

namespace ddlfast {

Status CudaLanes::create(int device) {
  device_ = device;
  for (CudaStream& stream : streams_) DDLFAST_RETURN_IF_ERROR(stream.create());
  return Status::ok();
}

Status CudaLanes::copy(void* dst, const void* src, std::size_t bytes, Lane lane) {
  if (bytes == 0) return Status::ok();
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream(lane)));
  return Status::ok();
}

Status CudaLanes::reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, Lane lane) {
  return cuda_reduce(dtype, dst, src, n, divisor, stream(lane));
}

Status CudaLanes::decode(WireType type, float* dst, const void* src, std::size_t n, Lane lane) {
  return cuda_decode(type, dst, src, n, stream(lane));
}

Status CudaLanes::accumulate(WireType type, float* dst, const void* src, std::size_t n, int divisor, Lane lane) {
  return cuda_accumulate(type, dst, src, n, divisor, stream(lane));
}

Status CudaLanes::encode(WireType type, void* dst, const float* src, std::size_t n, Lane lane) {
  return cuda_encode(type, dst, src, n, stream(lane));
}

Status CudaLanes::reserve_markers(int count) {
  while (static_cast<int>(markers_.size()) < count) {
    CudaEvent event;
    DDLFAST_RETURN_IF_ERROR(event.create());
    markers_.push_back(std::move(event));
  }
  return Status::ok();
}

Status CudaLanes::event(int marker, cudaEvent_t* out) const {
  if (marker < 0 || marker >= static_cast<int>(markers_.size())) {
    return Status(StatusCode::kInternal, "GPU lanes: marker " + std::to_string(marker) + " was never reserved");
  }
  *out = markers_[marker].get();
  return Status::ok();
}

Status CudaLanes::mark(int marker, Lane lane) {
  cudaEvent_t event = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->event(marker, &event));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventRecord(event, stream(lane)));
  return Status::ok();
}

Status CudaLanes::passed(int marker, bool* done) {
  cudaEvent_t event = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->event(marker, &event));
  const cudaError_t state = cudaEventQuery(event);
  *done = state == cudaSuccess;
  if (state == cudaSuccess || state == cudaErrorNotReady) return Status::ok();
  return cuda_status(state, "cudaEventQuery on a ddlfast stream");
}

Status CudaLanes::wait(int marker) {
  cudaEvent_t event = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->event(marker, &event));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event));
  return Status::ok();
}

Status CudaLanes::lane_wait(Lane lane, int marker) {
  cudaEvent_t event = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->event(marker, &event));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream(lane), event, 0));
  return Status::ok();
}

}  // namespace ddlfast
