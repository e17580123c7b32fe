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

  // The two halves on their own, with MPI's semantics: rank q's block is
  // counts[q] elements, the blocks lie in rank order. The ring leaves each
  // torus position the block of its own that the schedule gives it, so the
  // blocks are laid out for the ring (in_block_order) such that the position
  // rank q plays is given rank q's block; nothing is copied for it.
  //
  // reduce_scatter (MPI_Reduce_scatter): `input` holds every block and stays
  // unchanged; the working copy is this rank's `output` (its own block) plus
  // scratch for the others, so the reduced block lands in `output` directly.
  Status reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                        const std::vector<std::size_t>& counts, DType dtype, ReduceOp op, const EngineOptions& options);
  // allgather (MPI_Allgatherv): `input` is this rank's block, `output`
  // receives every block. Elements are opaque (of output.element_size()
  // bytes) unless options compress the wire, which needs float32 elements.
  Status allgather(const SegmentedBuffer& input, const SegmentedBuffer& output, const std::vector<std::size_t>& counts,
                   bool float32, const EngineOptions& options);

 private:
  enum class Halves { kBoth, kReduceScatter, kAllgather };

  // run() without the exact-arithmetic wrapping.
  Status reduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options);
  Status run_small(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor, const EngineOptions& options);
  // Whether options compress the wire (validated against the data, the op and the ring); average then pre-scales
  // `data` and leaves *divisor at 1, so partial sums stay within the inputs' range.
  Status prepare_wire(const SegmentedBuffer& data, bool float32, ReduceOp op, const EngineOptions& options,
                      int* divisor, bool* compressed);
  // Executes the schedule's phases of `halves`, in order (the one phase loop of the host engine); `op` reaches
  // the reduce kernel as it is (divisor: average's, on the last reduce-scatter step).
  Status run_phases(const SegmentedBuffer& data, const RingSchedule& schedule, DType dtype, ReduceOp op, int divisor,
                    bool compressed, const EngineOptions& options, Halves halves);
  // A rank-order buffer (block q: counts[q] elements) seen in the schedule's block order, and the owned-block
  // size of each torus position.
  SegmentedBuffer in_block_order(const SegmentedBuffer& rank_ordered, const std::vector<std::size_t>& counts) const;
  std::vector<std::size_t> counts_by_position(const std::vector<std::size_t>& counts) const;
  // Reduce-scatter of `data` (blocks in block order, block_counts per position) over MPI's own collective.
  Status reduce_scatter_small(const SegmentedBuffer& data, const std::vector<std::size_t>& block_counts,
                              DType dtype, ReduceOp op, int divisor, const EngineOptions& options);
  // float16/bfloat16 reduce-scatter: the overflow check (engine/exact_arithmetic.h) for results that differ
  // per rank, so the ranks agree on what they found before any branch that communicates.
  Status finish_half_reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                    const std::vector<std::size_t>& counts, DType dtype, ReduceOp op);
  Status reduce_scatter_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, DType dtype,
                              ReduceOp op, int final_divisor, const EngineOptions& options);
  // Compressed variants: the wire carries fp16/bf16, accumulation stays fp32.
  // min/max decode each received chunk and combine in float32: rounding is
  // monotonic, so the result is the wire rounding of the exact min/max.
  Status compressed_reduce_scatter_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base,
                                         int wire, ReduceOp op, int final_divisor, const EngineOptions& options);
  Status compressed_allgather_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, int wire,
                                    const EngineOptions& options);
  Status allgather_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base,
                         const EngineOptions& options);

  RingAllreduce(MpiTransport* transport, RankedTorus ring) : transport_(transport), ring_(std::move(ring)) {}

  MpiTransport* transport_;
  RankedTorus ring_;
  std::vector<unsigned char> scratch_;  // persistent across calls
  std::vector<unsigned char> send_stage_;  // encoded chunks until their sends complete
  std::vector<unsigned char> recv_stage_;  // encoded allgather chunks, kept for forwarding
  std::vector<float> decoded_;  // a received chunk decoded for compressed min/max
  std::vector<char> work_;  // reduce-scatter's working copy of the other ranks' blocks
  ExactArithmetic exact_;

 public:
  // Finite values this rank encoded to inf (wire overflow) since the last call.
  std::size_t take_overflows() { return std::exchange(overflows_, 0); }

 private:
  std::size_t overflows_ = 0;
};

}  // namespace ddlfast
