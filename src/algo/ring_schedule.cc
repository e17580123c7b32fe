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

// tail[i]: how many owned blocks one block of dimension i holds (the product of the later dimensions).
std::vector<int> blocks_below(const Torus& torus) {
  std::vector<int> tail(torus.num_dims(), 1);
  for (int dim = torus.num_dims() - 2; dim >= 0; --dim) tail[dim] = tail[dim + 1] * torus.dims()[dim + 1];
  return tail;
}

// The buffer as seen by one rank: where each owned block starts, in block order.
class BlockLayout {
 public:
  BlockLayout(const Torus& torus, const std::vector<std::size_t>& block_counts)
      : tail_(blocks_below(torus)), starts_(block_counts.size() + 1, 0) {
    const std::vector<int> order = positions_in_block_order(torus);
    for (std::size_t key = 0; key < order.size(); ++key) starts_[key + 1] = starts_[key] + block_counts[order[key]];
  }

  // Block `index` of dimension `dim` inside the segment whose first owned block is `first_key`.
  ElementRange block(int dim, int first_key, int index) const {
    const int lo = first_key + index * tail_[dim];
    return {starts_[lo], starts_[lo + tail_[dim]] - starts_[lo]};
  }
  int tail(int dim) const { return tail_[dim]; }

 private:
  std::vector<int> tail_;
  std::vector<std::size_t> starts_;  // prefix sums of the owned blocks in block order
};

RingPhase make_phase(const Torus& torus, const BlockLayout& layout, int rank, int dim, PhaseKind kind,
                     int first_key) {
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
    step.send = layout.block(dim, first_key, wrap(c - s - shift, d));
    step.recv = layout.block(dim, first_key, wrap(c - s - shift - 1, d));
    phase.steps.push_back(step);
  }
  return phase;
}

// Dimension `dim`'s reduce-scatter as one direct phase: block j of the segment goes to coordinate j.
RingPhase make_direct_phase(const Torus& torus, const BlockLayout& layout, int rank, int dim, int first_key) {
  const int d = torus.dims()[dim];
  std::vector<int> coords = torus.coords(rank);
  RingPhase phase;
  phase.kind = PhaseKind::kReduceScatter;
  phase.dim = dim;
  phase.successor = torus.neighbor(rank, dim, +1);
  phase.predecessor = torus.neighbor(rank, dim, -1);
  phase.direct = true;
  phase.coordinate = coords[dim];
  for (int j = 0; j < d; ++j) {
    coords[dim] = j;
    phase.peers.push_back(torus.rank_of(coords));
    phase.blocks.push_back(layout.block(dim, first_key, j));
  }
  return phase;
}

}  // namespace

std::vector<int> positions_in_block_order(const Torus& torus) {
  std::vector<int> order(torus.world_size());
  std::vector<int> coords(torus.num_dims(), 0);
  for (int key = 0; key < torus.world_size(); ++key) {
    int rest = key;
    for (int dim = torus.num_dims() - 1; dim >= 0; --dim) {  // the last dimension varies fastest in block order
      coords[dim] = rest % torus.dims()[dim];
      rest /= torus.dims()[dim];
    }
    order[key] = torus.rank_of(coords);
  }
  return order;
}

std::vector<std::size_t> near_equal_block_counts(const Torus& torus, std::size_t count) {
  // Cut level by level; the blocks come out in block order.
  std::vector<std::size_t> sizes{count};
  for (int d : torus.dims()) {
    std::vector<std::size_t> cut;
    cut.reserve(sizes.size() * d);
    for (std::size_t size : sizes) {
      for (int i = 0; i < d; ++i) cut.push_back(block_of({0, size}, d, i).count);
    }
    sizes.swap(cut);
  }
  const std::vector<int> order = positions_in_block_order(torus);
  std::vector<std::size_t> counts(sizes.size());
  for (std::size_t key = 0; key < sizes.size(); ++key) counts[order[key]] = sizes[key];
  return counts;
}

RingSchedule build_ring_schedule(const Torus& torus, int rank, const std::vector<std::size_t>& block_counts,
                                 const std::vector<int>& direct_by_dim) {
  const BlockLayout layout(torus, block_counts);
  const std::vector<int> coords = torus.coords(rank);
  RingSchedule schedule;
  std::vector<int> first_keys;  // first_keys[i]: the first owned block of the segment dimension i works on
  int first_key = 0;
  for (int dim = 0; dim < torus.num_dims(); ++dim) {
    first_keys.push_back(first_key);
    const bool direct = dim < static_cast<int>(direct_by_dim.size()) && direct_by_dim[dim] != 0;
    if (torus.dims()[dim] > 1) {
      schedule.phases.push_back(direct ? make_direct_phase(torus, layout, rank, dim, first_key)
                                       : make_phase(torus, layout, rank, dim, PhaseKind::kReduceScatter, first_key));
    }
    first_key += coords[dim] * layout.tail(dim);
  }
  schedule.owned = layout.block(torus.num_dims() - 1, first_key, 0);
  for (int dim = torus.num_dims() - 1; dim >= 0; --dim) {
    if (torus.dims()[dim] > 1) {
      schedule.phases.push_back(make_phase(torus, layout, rank, dim, PhaseKind::kAllgather, first_keys[dim]));
    }
  }
  return schedule;
}

RingSchedule build_ring_schedule(const Torus& torus, int rank, std::size_t count,
                                 const std::vector<int>& direct_by_dim) {
  return build_ring_schedule(torus, rank, near_equal_block_counts(torus, count), direct_by_dim);
}

RingSchedule build_rank_schedule(const RankedTorus& ring, const std::vector<std::size_t>& block_counts,
                                 const std::vector<int>& direct_by_dim) {
  RingSchedule schedule = build_ring_schedule(ring.torus, ring.position, block_counts, direct_by_dim);
  for (RingPhase& phase : schedule.phases) {
    phase.successor = ring.rank_at[phase.successor];
    phase.predecessor = ring.rank_at[phase.predecessor];
    for (int& peer : phase.peers) peer = ring.rank_at[peer];
  }
  return schedule;
}

RingSchedule build_rank_schedule(const RankedTorus& ring, std::size_t count, const std::vector<int>& direct_by_dim) {
  return build_rank_schedule(ring, near_equal_block_counts(ring.torus, count), direct_by_dim);
}

int last_reduce_scatter_phase(const RingSchedule& schedule) {
  int last = -1;
  for (int i = 0; i < static_cast<int>(schedule.phases.size()); ++i) {
    if (schedule.phases[i].kind == PhaseKind::kReduceScatter) last = i;
  }
  return last;
}

}  // namespace ddlfast
