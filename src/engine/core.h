// The one context object: owns the private communicator (its one transport)
// and, per ring shape, the host engine and the GPU engine, both on that
// transport. The GPU side's per-device resources (streams, staging, buckets:
// engine/cuda/device_runtime.h) borrow this context and run its GPU engines.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "engine/device_ring_allreduce.h"
#include "engine/latency_allreduce.h"
#include "engine/ring_allreduce.h"
#include "transport/mpi_transport.h"

namespace ddlfast {

class Core {
 public:
  // agreement_capacity, shared_memory: MpiTransport::create's.
  static Status create(MPI_Comm comm, double timeout_s, std::size_t agreement_capacity, bool shared_memory,
                       std::unique_ptr<Core>* out);

  int rank() const { return transport_->rank(); }
  int size() const { return transport_->size(); }
  MpiTransport& transport() { return *transport_; }
  // MpiTransport::grow_agreement_capacity's.
  Status grow_agreement_capacity(std::size_t capacity) { return transport_->grow_agreement_capacity(capacity); }

  // `order`: torus position -> rank (empty: identity); see RingAllreduce.
  // Wire overflows counted by every engine since the last call.
  std::size_t take_overflows() {
    std::size_t total = 0;
    for (auto& entry : engines_) total += entry.second->take_overflows();
    return total;
  }

  // A failure leaves the transport broken when it abandoned messages in
  // flight (see MpiTransport::abandon): every later call then refuses.
  Status allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                   const std::vector<int>& order, const EngineOptions& options);
  // allreduce() with the per-call agreement on `digest` in the same call: a buffer the latency path takes
  // (LatencyAllreduce) rides in the agreement's own messages, a larger one is reduced once the agreement passed.
  // *agreed false: the ranks disagree, and nothing was written into `data`.
  // `disjoint`: a sum of operands that are zero outside each rank's block (AgreedReduction::disjoint).
  Status agreed_allreduce(std::uint64_t digest, bool* agreed, const SegmentedBuffer& data, DType dtype, ReduceOp op,
                          const std::vector<int>& dims, const std::vector<int>& order, const EngineOptions& options,
                          bool disjoint = false);
  // The two halves on their own (RingAllreduce::reduce_scatter / allgather), with the same failure handling.
  Status reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                        const std::vector<std::size_t>& counts, DType dtype, ReduceOp op, const std::vector<int>& dims,
                        const std::vector<int>& order, const EngineOptions& options);
  Status allgather(const SegmentedBuffer& input, const SegmentedBuffer& output, const std::vector<std::size_t>& counts,
                   bool float32, const std::vector<int>& dims, const std::vector<int>& order,
                   const EngineOptions& options);
  // The two halves with the per-call agreement on `digest` in the same call, as agreed_allreduce. `carried`: the
  // result rides in the agreement's own messages (agreed_allreduce of a private buffer): a reduce-scatter as the
  // allreduce of a copy of the whole input, this rank's block then copied out; an (uncompressed) allgather of
  // opaque elements as the exact int64 sum of a zeroed buffer that holds each rank's bytes at its place. Without
  // it, the agreement and then the ring's half. Ranks decide `carried` from the agreed layout
  // (ddlfast/engine/shards.py, carried_options), so ranks that agree choose alike; ranks that disagree exchange
  // agreement messages either way. *agreed false: the ranks disagree, and nothing was written into `output`.
  Status agreed_reduce_scatter(std::uint64_t digest, bool carried, bool* agreed, const SegmentedBuffer& input,
                               const SegmentedBuffer& output, const std::vector<std::size_t>& counts, DType dtype,
                               ReduceOp op, const std::vector<int>& dims, const std::vector<int>& order,
                               const EngineOptions& options);
  Status agreed_allgather(std::uint64_t digest, bool carried, bool* agreed, const SegmentedBuffer& input,
                          const SegmentedBuffer& output, const std::vector<std::size_t>& counts,
                          const std::vector<int>& dims, const std::vector<int>& order, const EngineOptions& options);

  // In-place allreduce of device data with the GPU engine (DeviceRingAllreduce::run) on `lanes` and
  // `staging`, which the caller owns: CUDA streams (DeviceRuntime) or emulated lanes (tests). A failure
  // breaks the transport as above.
  Status device_allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                          const std::vector<int>& order, const EngineOptions& options, const DeviceRunOptions& run,
                          DeviceLanes* lanes, const DeviceStaging& staging);

 private:
  using RingKey = std::pair<std::vector<int>, std::vector<int>>;  // (dims, order)

  Status engine_for(const std::vector<int>& dims, const std::vector<int>& order, RingAllreduce** out);
  Status device_engine_for(const std::vector<int>& dims, const std::vector<int>& order, DeviceRingAllreduce** out);
  Status finish(const Status& status);
  // The agreement on `digest`, then collective() where every rank agreed; the flight entry ends with both.
  template <typename Collective>
  Status agree_then(std::uint64_t digest, bool* agreed, Collective&& collective);

  std::unique_ptr<MpiTransport> transport_;
  std::unique_ptr<LatencyAllreduce> latency_;
  std::map<RingKey, std::unique_ptr<RingAllreduce>> engines_;
  std::map<RingKey, std::unique_ptr<DeviceRingAllreduce>> device_engines_;
  std::vector<char> carried_;  // the private buffer of a carried reduce-scatter or allgather
};

}  // namespace ddlfast
