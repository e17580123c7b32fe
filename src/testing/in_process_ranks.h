// Test entry: one collective at P ranks as threads of this process over InProcessTransport, through the
// engine's own classes: the host executor (RingAllreduce, with the direct reduce-scatter where the options ask),
// the GPU executor on emulated lanes (DeviceRingAllreduce, staged or direct transfers), or the latency path
// (LatencyAllreduce). Every rank first agrees on its layout digest, as Core::agreed_allreduce does; faults
// are injected by giving ranks different digests or counts, or by one rank that never joins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/engine_options.h"

namespace ddlfast {

enum class InProcessExecutor : int { kHost = 0, kDeviceStaged = 1, kDeviceDirect = 2, kLatency = 3 };

struct InProcessRun {
  int size = 1;
  double timeout_s = 0.0;  // the stall limit
  std::size_t agreement_capacity = 0;
  std::vector<int> dims;
  std::vector<int> order;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  EngineOptions options;
  InProcessExecutor executor = InProcessExecutor::kHost;
  std::uint64_t seed = 0;  // the emulated lanes' interleaving
  int stopped_rank = -1;   // this rank takes no part: the others must fail, naming it
};

// Rank r reduces the arrays at bases[r] (counts[r] elements each) in place after agreeing on digests[r];
// (*results)[r] is its status.
void in_process_allreduce(const InProcessRun& run, const std::vector<std::vector<char*>>& bases,
                          const std::vector<std::vector<std::size_t>>& counts,
                          const std::vector<std::uint64_t>& digests, std::vector<Status>* results);

}  // namespace ddlfast
