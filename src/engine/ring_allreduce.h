// The host executor: runs a RingSchedule on host memory through the phase
// loop (engine/ring_phases.h) with the host step policy and its wire codecs
// (engine/host_steps.h), or a dimension's direct reduce-scatter
// (engine/direct_phase.h) where EngineOptions::direct_by_dim asks, or the
// canonical chain across hosts (engine/chain_phase.h) where EngineOptions::chain does, plus the
// small-message path and the two passes on their own. Its GPU twin is DeviceRingAllreduce, over the same Transport.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "algo/ring_schedule.h"
#include "common/dtype.h"
#include "engine/chain_phase.h"
#include "engine/direct_phase.h"
#include "engine/engine_options.h"
#include "engine/exact_arithmetic.h"
#include "engine/host_steps.h"
#include "engine/ring_phases.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

class RingAllreduce {
 public:
  // `order[v]` is the communicator rank that plays torus position v, so a
  // topology-aware caller can keep each dimension-1 ring on one host even when
  // the launcher did not place ranks host-contiguously. Empty: identity.
  static Status create(Transport& transport, const std::vector<int>& dims, const std::vector<int>& order,
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
  // run() without the exact-arithmetic wrapping.
  Status reduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options);
  // Whether options compress the wire (validated against the data, the op and the ring); average then pre-scales
  // `data` and leaves *divisor at 1, so partial sums stay within the inputs' range.
  Status prepare_wire(const SegmentedBuffer& data, bool float32, ReduceOp op, const EngineOptions& options,
                      int* divisor, bool* compressed);
  // Executes the schedule's phases of `halves` through the one phase loop; `op` reaches the reduce kernel as it
  // is (divisor: average's, on the last reduce-scatter step). `source`: the input, cut like `data`, which the
  // first phase (a ring's reduce-scatter, uncompressed) reads instead of `data` (HostSteps); nullptr: none.
  Status run_phases(const SegmentedBuffer& data, const RingSchedule& schedule, DType dtype, ReduceOp op, int divisor,
                    bool compressed, const EngineOptions& options, RingPasses halves,
                    const SegmentedBuffer* source = nullptr);
  // reduce_scatter with options.chain: the chain's allreduce of the whole input, then this rank's block.
  Status reduce_scatter_by_chain(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                 const std::vector<std::size_t>& counts, DType dtype, ReduceOp op,
                                 const EngineOptions& options);
  // The chain phase (engine/chain_phase.h, options.chain) and the allgather within each host.
  Status run_chain(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor, bool compressed,
                   const EngineOptions& options);
  // A rank-order buffer (block q: counts[q] elements) seen in the schedule's block order, and the owned-block
  // size of each torus position.
  SegmentedBuffer in_block_order(const SegmentedBuffer& rank_ordered, const std::vector<std::size_t>& counts) const;
  std::vector<std::size_t> counts_by_position(const std::vector<std::size_t>& counts) const;
  // Reduce-scatter of `data` (blocks in block order, block_counts per position) over MPI's own collective.
  Status reduce_scatter_small(const SegmentedBuffer& data, const std::vector<std::size_t>& block_counts,
                              DType dtype, ReduceOp op, int divisor, const EngineOptions& options);
  // float16/bfloat16 reduce-scatter: the overflow check (engine/exact_arithmetic.h) for results that differ
  // per rank, so the ranks agree on what they found before any branch that communicates.
  Status finish_fp16_bf16_reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                    const std::vector<std::size_t>& counts, DType dtype, ReduceOp op);

  RingAllreduce(Transport& transport, RankedTorus ring) : transport_(transport), ring_(std::move(ring)) {}

  Transport& transport_;
  RankedTorus ring_;
  HostScratch scratch_;  // persistent across calls
  std::vector<char> work_;  // reduce-scatter's working copy of the other ranks' blocks
  std::vector<char> whole_;  // reduce_scatter_by_chain's copy of the whole input
  ExactArithmetic exact_;

 public:
  // Finite values this rank encoded to inf (wire overflow) since the last call.
  std::size_t take_overflows() { return std::exchange(overflows_, 0); }

 private:
  std::size_t overflows_ = 0;
};

}  // namespace ddlfast
