// What the GPU ring executor needs from a device, as an interface, so the
// one executor runs on CUDA streams (CudaLanes) and, on machines without a
// GPU, on an emulation that defers and reorders work the way a GPU may
// (EmulatedLanes), which lets CPU-only tests check its ordering.
//
// A lane is an in-order queue of device work (a CUDA stream): inbound carries
// host->device copies and reduce kernels, outbound device->host copies, so
// the two copy directions overlap. A marker is a point in one lane's queue (a
// CUDA event): the host can ask whether the lane has passed it, or make the
// other lane wait for it. Markers are numbered; one never marked counts as
// passed.
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {

enum class Lane : int { kInbound = 0, kOutbound = 1 };

// Marker 0: "all work enqueued so far", shared by the GPU executor and the device runtime (staging and buckets);
// the executor numbers its per-slot markers after it.
inline constexpr int kNowMarker = 0;

class DeviceLanes {
 public:
  virtual ~DeviceLanes() = default;

  // Copies bytes between any two of host (pinned or not) and device memory.
  virtual Status copy(void* dst, const void* src, std::size_t bytes, Lane lane) = 0;
  // dst = (dst + src) / divisor on device memory (cuda_reduce's semantics).
  virtual Status reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, Lane lane) = 0;
  // The float32 codecs of 16-bit values (cuda_decode, cuda_accumulate, cuda_encode's semantics), on device
  // memory: a direct reduce-scatter of float16/bfloat16 data sums in float32 with them and rounds once.
  virtual Status decode(WireType type, float* dst, const void* src, std::size_t n, Lane lane) = 0;
  virtual Status accumulate(WireType type, float* dst, const void* src, std::size_t n, int divisor, Lane lane) = 0;
  virtual Status encode(WireType type, void* dst, const float* src, std::size_t n, Lane lane) = 0;

  // Makes markers 0..count-1 usable.
  virtual Status reserve_markers(int count) = 0;
  virtual Status mark(int marker, Lane lane) = 0;
  // Non-blocking: has the marked lane passed `marker`?
  virtual Status passed(int marker, bool* done) = 0;
  // Blocks the host until the marked lane has passed `marker` (that lane only).
  virtual Status wait(int marker) = 0;
  // Later work on `lane` waits until `marker`'s lane has passed it (as marked now).
  virtual Status lane_wait(Lane lane, int marker) = 0;

  // Called on every turn of the executor's polling loop. True while the
  // lanes advance only when polled and have work that can run: the executor
  // then keeps polling instead of backing off (a real device runs on its own).
  virtual bool poll() { return false; }
};

}  // namespace ddlfast
