// Executes a RingSchedule on a Transport: each step is cut into chunks, a
// window of receives stays in flight so reducing chunk j overlaps receiving
// chunk j+1, and every reduced chunk is forwarded at once to the next step.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "algo/ring_schedule.h"
#include "common/dtype.h"
#include "engine/exact_arithmetic.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// One executed phase, for the timeline (seconds on the monotonic clock, the
// same clock as Python's time.perf_counter on Linux).
struct PhaseEvent {
  int kind;  // 0 reduce-scatter, 1 allgather, 2 MPI_Allreduce handoff
  int dim;
  double start_s;
  double end_s;
  std::size_t bytes;
};

struct EngineOptions {
  std::size_t chunk_bytes = 1024 * 1024;
  int receives_in_flight = 4;  // scratch slots per reduce-scatter phase (>= 2)
  // Buffers of at most this many bytes go to MPI_Allreduce (latency-bound
  // sizes, where log(p) steps beat 2(p-1)). 0 disables the handoff.
  std::size_t small_bytes = 0;
  std::vector<PhaseEvent>* events = nullptr;  // append phase events here when set
  // Wire type per torus dimension for float32 data: -1 sends float32, 0 fp16,
  // 1 bf16 (WireType). Empty: no compression anywhere.
  std::vector<int> wire_by_dim;
};

class MpiTransport;

class RingAllreduce {
 public:
  // `order[v]` is the communicator rank that plays torus position v, so a
  // topology-aware caller can keep each dimension-1 ring on one host even when
  // the launcher did not place ranks host-contiguously. Empty: identity.
  static Status create(MpiTransport* transport, const std::vector<int>& dims, const std::vector<int>& order,
                       std::unique_ptr<RingAllreduce>* out);

  // In-place allreduce of several arrays treated as one buffer (no packing);
  // every rank passes the same counts, dtype, op and options (the per-call
  // agreement checked it). Identical bits land on every rank because each
  // element is reduced by exactly one rank and then copied.
  Status run(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options);

 private:
  // run() without the exact-arithmetic wrapping.
  Status reduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options);
  Status run_small(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor, const EngineOptions& options);
  // `op` reaches the reduce kernel as it is (final_divisor: average's, on the last step).
  Status reduce_scatter_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, DType dtype, ReduceOp op,
                              int final_divisor, const EngineOptions& options);
  // Compressed variants: the wire carries fp16/bf16, accumulation stays fp32.
  // min/max decode each received chunk and combine in float32: rounding is
  // monotonic, so the result is the wire rounding of the exact min/max.
  Status compressed_reduce_scatter_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base,
                                         int wire, ReduceOp op, int final_divisor, const EngineOptions& options);
  Status compressed_allgather_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, int wire,
                                    const EngineOptions& options);
  Status allgather_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, DType dtype,
                         const EngineOptions& options);

  RingAllreduce(MpiTransport* transport, RankedTorus ring) : transport_(transport), ring_(std::move(ring)) {}

  MpiTransport* transport_;
  RankedTorus ring_;
  std::vector<unsigned char> scratch_;  // persistent across calls
  std::vector<unsigned char> send_stage_;  // encoded chunks until their sends complete
  std::vector<unsigned char> recv_stage_;  // encoded allgather chunks, kept for forwarding
  std::vector<float> decoded_;  // a received chunk decoded for compressed min/max
  ExactArithmetic exact_;

 public:
  // Finite values this rank encoded to inf (wire overflow) since the last call.
  std::size_t take_overflows() { return std::exchange(overflows_, 0); }

 private:
  std::size_t overflows_ = 0;
};

}  // namespace ddlfast
