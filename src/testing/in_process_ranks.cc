#include "testing/in_process_ranks.h"

#include <memory>
#include <string>
#include <thread>

#include "engine/device_ring_allreduce.h"
#include "engine/latency_allreduce.h"
#include "engine/ring_allreduce.h"
#include "testing/emulated_lanes.h"
#include "testing/in_process_transport.h"

namespace ddlfast {
namespace {

Status disagreed(int rank) {
  return Status::consistent("rank " + std::to_string(rank) +
                            ": the ranks disagree on the collective's arguments (the agreement failed)");
}

// One rank's collective; the engines live until `transport` has cancelled what they left posted.
Status run_rank(const InProcessRun& run, InProcessTransport& transport, const SegmentedBuffer& data,
                std::uint64_t digest, std::unique_ptr<RingAllreduce>* host,
                std::unique_ptr<DeviceRingAllreduce>* device, std::unique_ptr<LatencyAllreduce>* latency) {
  bool agreed = false;
  if (run.executor == InProcessExecutor::kLatency) {
    *latency = std::make_unique<LatencyAllreduce>(transport);
    if (!(*latency)->takes(data, run.dtype, run.op, run.options)) {
      return Status::invalid("the latency path does not take this call");
    }
    DDLFAST_RETURN_IF_ERROR((*latency)->run(digest, &agreed, data, run.dtype, run.op, run.options));
    return agreed ? Status::ok() : disagreed(transport.rank());
  }
  DDLFAST_RETURN_IF_ERROR(transport.agree(digest, &agreed));
  if (!agreed) return disagreed(transport.rank());
  if (run.executor == InProcessExecutor::kHost) {
    DDLFAST_RETURN_IF_ERROR(RingAllreduce::create(transport, run.dims, run.order, host));
    return (*host)->run(data, run.dtype, run.op, run.options);
  }
  DDLFAST_RETURN_IF_ERROR(DeviceRingAllreduce::create(transport, run.dims, run.order, device));
  const EmulatedStaging staging(run.options);
  EmulatedLanes lanes(run.seed + static_cast<std::uint64_t>(transport.rank()));
  DeviceRunOptions transfer;
  transfer.transfer =
      run.executor == InProcessExecutor::kDeviceDirect ? DeviceTransfer::kDirect : DeviceTransfer::kStaged;
  const Status status = (*device)->run(data, run.dtype, run.op, run.options, transfer, &lanes, staging.staging);
  const Status drained = lanes.drain();
  return status.is_ok() ? drained : status;
}

}  // namespace

void in_process_allreduce(const InProcessRun& run, const std::vector<std::vector<char*>>& bases,
                          const std::vector<std::vector<std::size_t>>& counts,
                          const std::vector<std::uint64_t>& digests, std::vector<Status>* results) {
  results->assign(static_cast<std::size_t>(run.size), Status::ok());
  InProcessWorld world(run.size, run.timeout_s, run.agreement_capacity);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < run.size; ++rank) {
    threads.emplace_back([&, rank] {
      const auto r = static_cast<std::size_t>(rank);
      if (rank == run.stopped_rank) {
        world.set_outside(rank, true);
        (*results)[r] = Status(StatusCode::kInternal, "stopped (fault injected)");
        return;
      }
      InProcessTransport transport(world, rank);
      std::unique_ptr<RingAllreduce> host;
      std::unique_ptr<DeviceRingAllreduce> device;
      std::unique_ptr<LatencyAllreduce> latency;
      const SegmentedBuffer data(bases[r], counts[r], dtype_size(run.dtype));
      Status status = run_rank(run, transport, data, digests[r], &host, &device, &latency);
      if (!status.is_ok() && status.code() != StatusCode::kConsistent) transport.abandon(status);
      world.set_outside(rank, true);
      (*results)[r] = std::move(status);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

}  // namespace ddlfast
