#include "engine/cuda/device_runtime.h"

#include <algorithm>

#if defined(OPEN_MPI) && OPEN_MPI && defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI declares MPIX_Query_cuda_support here
#endif
#endif

namespace ddlfast {

bool mpi_cuda_aware(std::string* how) {
#if defined(MPIX_GPU_SUPPORT_CUDA)
  // MPICH. Not MPIX_Query_cuda_support: before MPICH 4 it asserts when the
  // library was built without GPU support; this query returns an error instead.
  int supported = 0;
  const bool ok = MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS;
  if (how) *how = "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)";
  return ok && supported != 0;
#elif defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  if (how) *how = "MPIX_Query_cuda_support()";
  return MPIX_Query_cuda_support() == 1;
#else
  if (how) *how = "this MPI offers no CUDA-support query";
  return false;
#endif
}

Status DeviceRuntime::state_for(int device, DeviceState** out) {
  auto found = devices_.find(device);
  if (found == devices_.end()) {
    std::unique_ptr<DeviceState> state(new DeviceState());
    DDLFAST_RETURN_IF_ERROR(state->lanes.create(device));
    DDLFAST_RETURN_IF_ERROR(state->lanes.reserve_markers(1));
    found = devices_.emplace(device, std::move(state)).first;
  }
  *out = found->second.get();
  return Status::ok();
}

Status DeviceRuntime::ensure_staging(DeviceState* state, int slots, std::size_t slot_bytes, bool direct) {
  const bool pooled = !direct;  // MPI may open device slots over CUDA IPC
  const std::size_t bytes = static_cast<std::size_t>(slots) * slot_bytes;
  const std::size_t device_bytes = device_staging_bytes(slots, slot_bytes);
  const bool device_fits = state->device_recv.data() && state->device_recv.bytes() >= device_bytes &&
                           state->device_recv.pooled() == pooled;
  const bool host_fits = direct || (state->host_recv.data() && state->host_recv.bytes() >= bytes);
  if (!device_fits || !host_fits) {
    // Pending copies may still read the old slots: let ddlfast's streams drain.
    DDLFAST_RETURN_IF_ERROR(synchronize(state->lanes.device()));
    if (!device_fits) {
      DDLFAST_RETURN_IF_ERROR(state->device_recv.allocate(device_bytes, state->lanes.stream(Lane::kInbound), pooled));
    }
    if (!host_fits) {
      DDLFAST_RETURN_IF_ERROR(state->host_recv.allocate(bytes));
      DDLFAST_RETURN_IF_ERROR(state->host_send.allocate(bytes));
    }
  }
  state->slots = slots;
  state->slot_bytes = slot_bytes;
  return Status::ok();
}

Status DeviceRuntime::wait_for(int device, const Fence& fence) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  if (fence.device() >= 0 && fence.device() != device) {
    return Status::invalid("a fence recorded on cuda:" + std::to_string(fence.device()) +
                           " cannot order work on cuda:" + std::to_string(device));
  }
  return fence.make_wait(state->lanes.stream(Lane::kInbound));
}

Status DeviceRuntime::bucket(int device, DType dtype, std::size_t bytes, char** out) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  DeviceAllocation& buffer = state->buckets[static_cast<int>(dtype)];
  if (!buffer.data() || buffer.bytes() < bytes) {
    const cudaStream_t stream = state->lanes.stream(Lane::kInbound);
    // Grow by half again, so a slowly growing bucket is not reallocated every step.
    const std::size_t grown = std::max(bytes, buffer.bytes() + buffer.bytes() / 2);
    // Not pooled: CUDA-aware MPI may send from the bucket over CUDA IPC.
    DDLFAST_RETURN_IF_ERROR(synchronize(device));
    DDLFAST_RETURN_IF_ERROR(buffer.allocate(grown, stream, false));
    DDLFAST_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(buffer.data(), 0, grown, stream));
  }
  *out = buffer.data();
  return Status::ok();
}

Status DeviceRuntime::copy_batch(int device, const std::vector<CopySpec>& specs) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  return cuda_copy_batch(specs.data(), specs.size(), state->lanes.stream(Lane::kInbound));
}

Status DeviceRuntime::copy(int device, void* dst, const void* src, std::size_t bytes) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  return state->lanes.copy(dst, src, bytes, Lane::kInbound);
}

Status DeviceRuntime::allreduce(int device, const SegmentedBuffer& data, DType dtype, ReduceOp op,
                                const std::vector<int>& dims, const std::vector<int>& order,
                                const EngineOptions& options, DeviceTransfer transfer) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  const bool direct = transfer == DeviceTransfer::kDirect;
  const int slots = std::max(2, options.receives_in_flight);
  DDLFAST_RETURN_IF_ERROR(ensure_staging(state, slots, staging_slot_bytes(options.chunk_bytes), direct));
  DeviceStaging staging;
  staging.slots = state->slots;
  staging.slot_bytes = state->slot_bytes;
  staging.device_recv = state->device_recv.data();
  staging.host_recv = direct ? nullptr : state->host_recv.data();
  staging.host_send = direct ? nullptr : state->host_send.data();
  DeviceRunOptions run;
  run.transfer = transfer;
  return context_.device_allreduce(data, dtype, op, dims, order, options, run, &state->lanes, staging);
}

Status DeviceRuntime::record(int device, Fence* done) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  DDLFAST_RETURN_IF_ERROR(state->lanes.mark(kNowMarker, Lane::kOutbound));
  DDLFAST_RETURN_IF_ERROR(state->lanes.lane_wait(Lane::kInbound, kNowMarker));
  return done->record(device, state->lanes.stream(Lane::kInbound));
}

Status DeviceRuntime::synchronize(int device) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(state->lanes.stream(Lane::kInbound)));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(state->lanes.stream(Lane::kOutbound)));
  return Status::ok();
}

Status DeviceRuntime::stream(int device, cudaStream_t* out) {
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  DeviceState* state = nullptr;
  DDLFAST_RETURN_IF_ERROR(state_for(device, &state));
  *out = state->lanes.stream(Lane::kInbound);
  return Status::ok();
}

}  // namespace ddlfast
