// DeviceLanes emulated in host memory, for testing the GPU ring executor on
// machines without a GPU. Nothing runs when it is enqueued: each lane keeps a
// queue, and work executes only when the executor polls or queries a marker,
// one operation at a time, from a lane picked by a seeded random generator;
// now and then a lane stalls for a few hundred polls, as a busy GPU would.
// So copies land late and the lanes interleave in many orders; a missing
// marker or lane_wait in the executor shows up as wrong results. "Device"
// memory is ordinary host memory and reduce() and the codecs run the CPU kernels.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "engine/core.h"
#include "engine/device_lanes.h"
#include "engine/ring_allreduce.h"

namespace ddlfast {

class EmulatedLanes final : public DeviceLanes {
 public:
  explicit EmulatedLanes(std::uint64_t seed) : random_(seed) {}

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
  bool poll() override;

  // Runs everything still queued (end of a test).
  Status drain();

 private:
  struct Operation {
    std::function<void()> run;  // empty for a wait
    int wait_lane = -1;         // a wait: blocked until lane wait_lane has executed wait_count operations
    std::uint64_t wait_count = 0;
  };
  struct Queue {
    std::deque<Operation> pending;
    std::uint64_t enqueued = 0;
    std::uint64_t executed = 0;
  };
  struct Point {
    int lane = 0;
    std::uint64_t count = 0;  // passed once the lane has executed this many operations
  };

  Status point(int marker, Point** out);
  void enqueue(Lane lane, Operation operation);
  bool runnable(int lane, bool force) const;
  bool step(bool force = false);  // executes one runnable operation; false if none is
  bool reached(const Point& point) const { return queues_[point.lane].executed >= point.count; }

  std::mt19937_64 random_;
  std::uint64_t turn_ = 0;                 // polls so far
  std::uint64_t stalled_until_[2] = {0, 0};  // a stalled lane runs nothing before this turn (unless forced)
  Queue queues_[2];
  std::vector<Point> markers_;
};

// Host memory standing in for a GPU executor's staging slots (pinned and device), sized for `options`.
struct EmulatedStaging {
  explicit EmulatedStaging(const EngineOptions& options);
  EmulatedStaging(const EmulatedStaging&) = delete;
  EmulatedStaging& operator=(const EmulatedStaging&) = delete;
  DeviceStaging staging;

 private:
  std::vector<char> memory_[3];
};

// Test entry: allreduces host arrays with the context's GPU engine on
// emulated lanes, staged (pinned-copy path) or direct.
Status emulated_device_allreduce(Core& context, const std::vector<char*>& bases,
                                 const std::vector<std::size_t>& counts, DType dtype, ReduceOp op,
                                 const std::vector<int>& dims, const std::vector<int>& order,
                                 const EngineOptions& options, bool direct, std::uint64_t seed);

}  // namespace ddlfast
