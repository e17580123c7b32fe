// The one context object: owns the private communicator (transport) and one
// engine per ring shape. The GPU side (src/kernels/cuda/cuda_context.h) is the
// other context object; nothing else in the C++ core holds mutable state.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "engine/ring_allreduce.h"
#include "transport/mpi_transport.h"

namespace ddlfast {

class Context {
 public:
  static Status create(MPI_Comm comm, double timeout_s, std::unique_ptr<Context>* out);

  int rank() const { return transport_->rank(); }
  int size() const { return transport_->size(); }
  MpiTransport& transport() { return *transport_; }

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
  // The two halves on their own (RingAllreduce::reduce_scatter / allgather), with the same failure handling.
  Status reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                        const std::vector<std::size_t>& counts, DType dtype, ReduceOp op, const std::vector<int>& dims,
                        const std::vector<int>& order, const EngineOptions& options);
  Status allgather(const SegmentedBuffer& input, const SegmentedBuffer& output, const std::vector<std::size_t>& counts,
                   bool float32, const std::vector<int>& dims, const std::vector<int>& order,
                   const EngineOptions& options);

 private:
  Status engine_for(const std::vector<int>& dims, const std::vector<int>& order, RingAllreduce** out);
  Status finish(const Status& status);

  std::unique_ptr<MpiTransport> transport_;
  std::map<std::pair<std::vector<int>, std::vector<int>>, std::unique_ptr<RingAllreduce>> engines_;
};

}  // namespace ddlfast
