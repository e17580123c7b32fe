// The k-dimensional ring allreduce as data: which element range each rank
// sends to whom and receives from whom, step by step. Pure (no I/O), so the
// whole world can be simulated in one process by the tests.
#pragma once

#include <cstddef>
#include <vector>

#include "algo/torus.h"

namespace ddlfast {

struct ElementRange {
  std::size_t offset = 0;
  std::size_t count = 0;
};

enum class PhaseKind : int { kReduceScatter = 0, kAllgather = 1 };

struct RingStep {
  ElementRange send;  // to the ring successor
  ElementRange recv;  // from the ring predecessor: added in (reduce-scatter) or copied (allgather)
};

// All steps of one dimension's ring, in order. Within a phase, the range
// received in step s is the range sent in step s+1, so a received chunk can
// be forwarded as soon as it has been reduced (NCCL's recv-reduce-send).
struct RingPhase {
  PhaseKind kind = PhaseKind::kReduceScatter;
  int dim = 0;
  int successor = 0;
  int predecessor = 0;
  std::vector<RingStep> steps;  // empty for a direct reduce-scatter
  // Direct (all-to-all) reduce-scatter of this dimension instead of its ring: every block of the segment goes
  // straight to the rank that owns it (the same owner the ring gives), which adds the d contributions in
  // coordinate order 0..d-1. One latency step instead of d-1, the same bytes per rank.
  bool direct = false;
  int coordinate = 0;                // this rank's coordinate in the dimension: it ends owning blocks[coordinate]
  std::vector<int> peers;            // the rank at each coordinate of this dimension (peers[coordinate]: this rank)
  std::vector<ElementRange> blocks;  // the segment's d blocks; block j ends at coordinate j
};

struct RingSchedule {
  std::vector<RingPhase> phases;
  // The slice this rank holds fully reduced between the two passes.
  ElementRange owned;
};

// Block `index` of `parts` near-equal blocks of `segment` (sizes differ by at
// most one element, larger blocks first), so no padding is ever needed.
ElementRange block_of(ElementRange segment, int parts, int index);

// The torus positions in the order their owned blocks lie in the buffer:
// coordinate 1 most significant, because dimension 1 cuts the whole buffer
// first and each later dimension cuts the block the previous one left.
std::vector<int> positions_in_block_order(const Torus& torus);

// The owned-block sizes of the near-equal split of `count` elements, per
// torus position: each dimension cuts its segment with block_of.
std::vector<std::size_t> near_equal_block_counts(const Torus& torus, std::size_t count);

// Dimension i (dims[i] = d, coordinate c): reduce-scatter step s sends block
// (c-s-1) mod d and receives block (c-s-2) mod d, so after d-1 steps the rank
// owns block c, which is the segment of dimension i+1. The allgather runs the
// dimensions in reverse: step s sends block (c-s) mod d and receives
// (c-s-1) mod d. Dimensions of size 1 contribute no phase.
//
// `block_counts[v]` is the size of the block torus position v owns between
// the halves; the blocks lie in positions_in_block_order, and a block of
// dimension i is the union of the owned blocks of the positions under it.
// The `count` form is the near-equal split (near_equal_block_counts).
RingSchedule build_ring_schedule(const Torus& torus, int rank, const std::vector<std::size_t>& block_counts,
                                 const std::vector<int>& direct_by_dim = {});
RingSchedule build_ring_schedule(const Torus& torus, int rank, std::size_t count,
                                 const std::vector<int>& direct_by_dim = {});

// The same for this rank's position on `ring`, with each phase's neighbours
// translated to communicator ranks.
RingSchedule build_rank_schedule(const RankedTorus& ring, const std::vector<std::size_t>& block_counts,
                                 const std::vector<int>& direct_by_dim = {});
RingSchedule build_rank_schedule(const RankedTorus& ring, std::size_t count,
                                 const std::vector<int>& direct_by_dim = {});

// Index of the last reduce-scatter phase (where averaging divides), or -1.
int last_reduce_scatter_phase(const RingSchedule& schedule);

}  // namespace ddlfast
