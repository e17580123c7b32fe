// Executes the k-dimensional ring schedule (algo/ring_schedule.h) on data in
// GPU memory: the GPU twin of engine/ring_allreduce.h, running the same phase
// loop (engine/ring_phases.h) over the same Transport with a step policy on
// DeviceLanes, so it moves the same chunks with the same tags and reduces in
// the same order: it gives the host engine's bits.
//
// Per chunk, staged (MPI without CUDA support): the received chunk lands in
// a pinned host slot, is copied to a device scratch slot and reduced into the
// data on the inbound lane; a reduced chunk to forward is copied to a pinned
// send slot on the outbound lane and sent once that copy is done. Direct
// (CUDA-aware MPI): MPI reads and writes device memory; only the reduce runs
// on the device. The allgather places arrived chunks the same way (no
// reduce) and forwards them from the device data. `slots` receive and
// `slots` send slots rotate, so while chunk j is reduced, chunk j+1 is on the
// wire and chunk j-1 is being copied out. The host thread never blocks on
// the device: it polls MPI requests and lane markers in one loop, doing
// whatever became possible.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "algo/ring_schedule.h"
#include "common/dtype.h"
#include "engine/device_lanes.h"
#include "engine/engine_options.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// Memory the executor works in, owned by the caller and reused across runs.
struct DeviceStaging {
  int slots = 0;
  std::size_t slot_bytes = 0;   // at least staging_slot_bytes(chunk_bytes)
  char* host_recv = nullptr;    // pinned, slots * slot_bytes (staged transfers)
  char* host_send = nullptr;    // pinned, slots * slot_bytes (staged transfers)
  char* device_recv = nullptr;  // device, device_staging_bytes(slots, slot_bytes), 16-byte aligned
};

// The device slots: one per receive, and one more that, with the last receive slot, holds a direct
// reduce-scatter's sum (float32 for float16/bfloat16 data: twice a chunk's bytes, at the chunk's alignment).
inline std::size_t device_staging_bytes(int slots, std::size_t slot_bytes) {
  return static_cast<std::size_t>(slots + 1) * slot_bytes;
}

// One chunk plus room to place it at its destination's alignment mod 16, so
// the reduce kernel can use 16-byte vectors; a multiple of 256 bytes.
std::size_t staging_slot_bytes(std::size_t chunk_bytes);

enum class DeviceTransfer : int { kStaged = 0, kDirect = 1 };

struct DeviceRunOptions {
  DeviceTransfer transfer = DeviceTransfer::kStaged;
};

class DeviceRingAllreduce {
 public:
  // As RingAllreduce::create: `order[v]` is the rank at torus position v.
  static Status create(Transport& transport, const std::vector<int>& dims, const std::vector<int>& order,
                       std::unique_ptr<DeviceRingAllreduce>* out);

  // In-place allreduce of device data, after all work already on the inbound
  // lane. On return every MPI transfer has completed and the result is
  // complete on the inbound lane (the host has not necessarily waited for it).
  // `options.wire_by_dim` must be empty: compression runs on the host path.
  Status run(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options,
             const DeviceRunOptions& run, DeviceLanes* lanes, const DeviceStaging& staging);

 private:
  // options.chain: the canonical chain across hosts (engine/chain_phase.h), as the host executor runs it.
  Status run_chain(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor, std::size_t chunk_elems,
                   const EngineOptions& options, const DeviceRunOptions& run, DeviceLanes* lanes,
                   const DeviceStaging& staging);
  DeviceRingAllreduce(Transport& transport, RankedTorus ring) : transport_(transport), ring_(std::move(ring)) {}

  Transport& transport_;
  RankedTorus ring_;
};

}  // namespace ddlfast
