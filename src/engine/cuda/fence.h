// A point in a caller's stream (a CUDA event recorded there), handed across
// threads: the caller's thread records it when it submits a collective, the
// thread that executes the collective makes ddlfast's stream wait for it, and
// a finished collective hands one back for the caller's stream to wait on.
#pragma once

#include "common/cuda/cuda_resources.h"

namespace ddlfast {

class Fence {
 public:
  // Creates the event on `device` and records it on `stream` (a stream of
  // that device, or a default stream, which then means that device's).
  Status record(int device, cudaStream_t stream);
  // Later work on `stream` waits for the fence (the host does not).
  Status make_wait(cudaStream_t stream) const;
  // The host waits for this fence only.
  Status synchronize() const;
  Status query(bool* done) const;
  int device() const { return device_; }
  cudaEvent_t event() const { return event_.get(); }

 private:
  CudaEvent event_;
  int device_ = -1;
};

}  // namespace ddlfast
