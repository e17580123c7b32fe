#include "algo/ring_schedule.h"

namespace ddlfast {

ElementRange block_of(ElementRange segment, int parts, int index) {
  const std::size_t base = segment.count / parts;
  const std::size_t extra = segment.count % parts;
  const std::size_t i = static_cast<std::size_t>(index);
  ElementRange block;
  block.offset = segment.offset + i * base + (i < extra ? i : extra);
  block.count = base + (i < extra ? 1 : 0);
  return block;
}

namespace {

int wrap(int value, int modulus) { return ((value % modulus) + modulus) % modulus; }

RingPhase make_phase(const Torus& torus, int rank, int dim, PhaseKind kind, ElementRange segment) {
  const int d = torus.dims()[dim];
  const int c = torus.coords(rank)[dim];
  // Reduce-scatter is shifted one block against the allgather so that it ends owning block c.
  const int shift = kind == PhaseKind::kReduceScatter ? 1 : 0;
  RingPhase phase;
  phase.kind = kind;
  phase.dim = dim;
  phase.successor = torus.neighbor(rank, dim, +1);
  phase.predecessor = torus.neighbor(rank, dim, -1);
  for (int s = 0; s < d - 1; ++s) {
    RingStep step;
    step.send = block_of(segment, d, wrap(c - s - shift, d));
    step.recv = block_of(segment, d, wrap(c - s - shift - 1, d));
    phase.steps.push_back(step);
  }
  return phase;
}

}  // namespace

RingSchedule build_ring_schedule(const Torus& torus, int rank, std::size_t count) {
  RingSchedule schedule;
  const std::vector<int> coords = torus.coords(rank);
  std::vector<ElementRange> segments;  // segments[i]: the range dimension i works on
  ElementRange segment{0, count};
  for (int dim = 0; dim < torus.num_dims(); ++dim) {
    segments.push_back(segment);
    const int d = torus.dims()[dim];
    if (d > 1) schedule.phases.push_back(make_phase(torus, rank, dim, PhaseKind::kReduceScatter, segment));
    segment = block_of(segment, d, coords[dim]);
  }
  schedule.owned = segment;
  for (int dim = torus.num_dims() - 1; dim >= 0; --dim) {
    if (torus.dims()[dim] > 1) {
      schedule.phases.push_back(make_phase(torus, rank, dim, PhaseKind::kAllgather, segments[dim]));
    }
  }
  return schedule;
}

RingSchedule build_rank_schedule(const RankedTorus& ring, std::size_t count) {
  RingSchedule schedule = build_ring_schedule(ring.torus, ring.position, count);
  for (RingPhase& phase : schedule.phases) {
    phase.successor = ring.rank_at[phase.successor];
    phase.predecessor = ring.rank_at[phase.predecessor];
  }
  return schedule;
}

int last_reduce_scatter_phase(const RingSchedule& schedule) {
  int last = -1;
  for (int i = 0; i < static_cast<int>(schedule.phases.size()); ++i) {
    if (schedule.phases[i].kind == PhaseKind::kReduceScatter) last = i;
  }
  return last;
}

}  // namespace ddlfast
