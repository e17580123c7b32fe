// DeviceLanes on one CUDA device: two non-blocking streams and a pool of
// events. Owned per device by DeviceRuntime; the inbound stream is "ddlfast's
// stream" that callers order against.
#pragma once

#include <vector>

#include "common/cuda/cuda_resources.h"
#include "engine/device_lanes.h"

namespace ddlfast {

class CudaLanes final : public DeviceLanes {
 public:
  // Creates the streams on `device`, which must be current.
  Status create(int device);
  int device() const { return device_; }
  cudaStream_t stream(Lane lane) const { return streams_[static_cast<int>(lane)].get(); }

  Status copy(void* dst, const void* src, std::size_t bytes, Lane lane) override;
  Status reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, Lane lane) override;
  Status decode(WireType type, float* dst, const void* src, std::size_t n, Lane lane) override;
  Status accumulate(WireType type, float* dst, const void* src, std::size_t n, int divisor, Lane lane) override;
  Status encode(WireType type, void* dst, const float* src, std::size_t n, Lane lane) override;
  Status reserve_markers(int count) override;
  Status mark(int marker, Lane lane) override;
  Status passed(int marker, bool* done) override;
  Status wait(int marker) override;
  Status lane_wait(Lane lane, int marker) override;

 private:
  Status event(int marker, cudaEvent_t* out) const;

  int device_ = -1;
  CudaStream streams_[2];
  std::vector<CudaEvent> markers_;
};

}  // namespace ddlfast
