#include "testing/emulated_lanes.h"

#include <cstring>
#include <string>

#include "engine/device_ring_allreduce.h"
#include "engine/segmented_buffer.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {

void EmulatedLanes::enqueue(Lane lane, Operation operation) {
  Queue& queue = queues_[static_cast<int>(lane)];
  queue.pending.push_back(std::move(operation));
  ++queue.enqueued;
}

Status EmulatedLanes::copy(void* dst, const void* src, std::size_t bytes, Lane lane) {
  enqueue(lane, {[dst, src, bytes] { std::memcpy(dst, src, bytes); }});
  return Status::ok();
}

Status EmulatedLanes::reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, Lane lane) {
  enqueue(lane, {[dtype, dst, src, n, divisor] { reduce_into(dtype, dst, src, n, divisor); }});
  return Status::ok();
}

Status EmulatedLanes::decode(WireType type, float* dst, const void* src, std::size_t n, Lane lane) {
  enqueue(lane, {[type, dst, src, n] { best_kernels().decode[static_cast<int>(type)](dst, src, n); }});
  return Status::ok();
}

Status EmulatedLanes::accumulate(WireType type, float* dst, const void* src, std::size_t n, int divisor, Lane lane) {
  enqueue(lane,
          {[type, dst, src, n, divisor] { best_kernels().accumulate[static_cast<int>(type)](dst, src, n, divisor); }});
  return Status::ok();
}

Status EmulatedLanes::encode(WireType type, void* dst, const float* src, std::size_t n, Lane lane) {
  // An overflow is inf in the result, which the half types' checks find (engine/exact_arithmetic.h).
  enqueue(lane, {[type, dst, src, n] { best_kernels().encode[static_cast<int>(type)](dst, src, n); }});
  return Status::ok();
}

Status EmulatedLanes::reserve_markers(int count) {
  if (static_cast<int>(markers_.size()) < count) markers_.resize(count);
  return Status::ok();
}

Status EmulatedLanes::point(int marker, Point** out) {
  if (marker < 0 || marker >= static_cast<int>(markers_.size())) {
    return Status(StatusCode::kInternal, "emulated lanes: marker " + std::to_string(marker) + " was never reserved");
  }
  *out = &markers_[marker];
  return Status::ok();
}

Status EmulatedLanes::mark(int marker, Lane lane) {
  Point* point = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->point(marker, &point));
  const int index = static_cast<int>(lane);
  *point = {index, queues_[index].enqueued};
  return Status::ok();
}

bool EmulatedLanes::runnable(int lane, bool force) const {
  const Queue& queue = queues_[lane];
  if (queue.pending.empty() || (!force && turn_ < stalled_until_[lane])) return false;
  const Operation& front = queue.pending.front();
  return front.wait_lane < 0 || queues_[front.wait_lane].executed >= front.wait_count;
}

bool EmulatedLanes::step(bool force) {
  const bool first = runnable(0, force), second = runnable(1, force);
  if (!first && !second) return false;
  const int lane = first && second ? static_cast<int>(random_() & 1u) : (first ? 0 : 1);
  Queue& queue = queues_[lane];
  Operation operation = std::move(queue.pending.front());
  queue.pending.pop_front();
  if (operation.run) operation.run();
  ++queue.executed;
  return true;
}

bool EmulatedLanes::poll() {
  ++turn_;
  if (random_() % 32 == 0) stalled_until_[random_() & 1u] = turn_ + random_() % 400;
  // Usually some work happens between two turns of the executor, sometimes none.
  const unsigned steps = static_cast<unsigned>(random_() % 3);
  for (unsigned i = 0; i < steps && step(); ++i) {
  }
  // Work that can run (now, or once a stall ends) runs only on later polls: a busy device, not an idle one.
  return runnable(0, true) || runnable(1, true);
}

Status EmulatedLanes::passed(int marker, bool* done) {
  Point* point = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->point(marker, &point));
  if (random_() % 4 == 0) step();
  *done = reached(*point);
  return Status::ok();
}

Status EmulatedLanes::wait(int marker) {
  Point* point = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->point(marker, &point));
  while (!reached(*point)) {
    if (!step(true)) return Status(StatusCode::kInternal, "emulated lanes: waiting for a marker no work leads to");
  }
  return Status::ok();
}

Status EmulatedLanes::lane_wait(Lane lane, int marker) {
  Point* point = nullptr;
  DDLFAST_RETURN_IF_ERROR(this->point(marker, &point));
  Operation wait;
  wait.wait_lane = point->lane;
  wait.wait_count = point->count;
  enqueue(lane, std::move(wait));
  return Status::ok();
}

Status EmulatedLanes::drain() {
  while (step(true)) {
  }
  if (!queues_[0].pending.empty() || !queues_[1].pending.empty()) {
    return Status(StatusCode::kInternal, "emulated lanes: work left that waits for work never enqueued");
  }
  return Status::ok();
}

EmulatedStaging::EmulatedStaging(const EngineOptions& options) {
  staging.slots = std::max(2, options.receives_in_flight);
  staging.slot_bytes = staging_slot_bytes(options.chunk_bytes);
  // Filled with garbage, so a read of a slot before its copy landed shows.
  const std::size_t host_bytes = static_cast<std::size_t>(staging.slots) * staging.slot_bytes;
  memory_[0].assign(host_bytes + 16, 0x77);
  memory_[1].assign(host_bytes + 16, 0x77);
  memory_[2].assign(device_staging_bytes(staging.slots, staging.slot_bytes) + 16, 0x77);
  auto aligned = [](std::vector<char>& v) {
    const auto address = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + (16 - address % 16) % 16;
  };
  staging.host_recv = aligned(memory_[0]);
  staging.host_send = aligned(memory_[1]);
  staging.device_recv = aligned(memory_[2]);
}

Status emulated_device_allreduce(Core& context, const std::vector<char*>& bases, const std::vector<std::size_t>& counts,
                                 DType dtype, ReduceOp op, const std::vector<int>& dims, const std::vector<int>& order,
                                 const EngineOptions& options, bool direct, std::uint64_t seed) {
  const EmulatedStaging staging(options);
  EmulatedLanes lanes(seed);
  const SegmentedBuffer data(bases, counts, dtype_size(dtype));
  DeviceRunOptions run;
  run.transfer = direct ? DeviceTransfer::kDirect : DeviceTransfer::kStaged;
  const Status status = context.device_allreduce(data, dtype, op, dims, order, options, run, &lanes, staging.staging);
  const Status drained = lanes.drain();
  return status.is_ok() ? drained : status;
}

}  // namespace ddlfast
