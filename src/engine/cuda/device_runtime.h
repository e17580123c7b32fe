// The GPU side of one ddlfast context, per device: ddlfast's two streams
// (CudaLanes; the inbound one is "ddlfast's stream"), the staging slots and
// one fused bucket per dtype. It borrows the context (engine/core.h), whose
// one transport and GPU engines run its collectives. Every method makes its
// device current for the call and restores the caller's. Not thread-safe: the
// Python context runs one collective at a time.
#pragma once

#include <mpi.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/core.h"
#include "engine/cuda/cuda_lanes.h"
#include "engine/cuda/fence.h"
#include "engine/device_ring_allreduce.h"
#include "kernels/cuda/cuda_kernels.h"

namespace ddlfast {

// Whether the MPI library reports CUDA support at run time (MPICH's
// MPIX_GPU_query_support, Open MPI's MPIX_Query_cuda_support); `how` names
// the query used, or why none exists in this MPI.
bool mpi_cuda_aware(std::string* how);

class DeviceRuntime {
 public:
  // `context` must outlive the runtime. Not collective: device state is made at first use.
  explicit DeviceRuntime(Core& context) : context_(context) {}

  // Work ddlfast enqueues on `device` from now on waits for `fence`.
  Status wait_for(int device, const Fence& fence);
  // The persistent fused bucket of `dtype` on `device`, at least `bytes`,
  // zero-filled whenever it is (re)allocated.
  Status bucket(int device, DType dtype, std::size_t bytes, char** out);
  // Fused pack/unpack on ddlfast's stream.
  Status copy_batch(int device, const std::vector<CopySpec>& specs);
  // One copy on ddlfast's stream (any direction).
  Status copy(int device, void* dst, const void* src, std::size_t bytes);
  // In-place allreduce of device memory on `device` with the context's GPU engine; see DeviceRingAllreduce.
  Status allreduce(int device, const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                   const std::vector<int>& order, const EngineOptions& options, DeviceTransfer transfer);
  // Records `done` after all work ddlfast enqueued on `device` so far.
  Status record(int device, Fence* done);
  // The host waits for ddlfast's streams on `device` (not the whole device).
  Status synchronize(int device);
  Status stream(int device, cudaStream_t* out);

 private:
  struct DeviceState {
    CudaLanes lanes;  // declared first: destroyed last, after the buffers freed on its stream
    PinnedBuffer host_recv;
    PinnedBuffer host_send;
    DeviceAllocation device_recv;
    int slots = 0;
    std::size_t slot_bytes = 0;
    DeviceAllocation buckets[kNumDTypes];
  };

  Status state_for(int device, DeviceState** out);
  Status ensure_staging(DeviceState* state, int slots, std::size_t slot_bytes, bool direct);

  Core& context_;
  std::map<int, std::unique_ptr<DeviceState>> devices_;
};

}  // namespace ddlfast
