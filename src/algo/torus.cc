#include "algo/torus.h"

#include <string>
#include <utility>

namespace ddlfast {

Status Torus::make(const std::vector<int>& dims, int world_size, Torus* out) {
  if (dims.empty()) return Status::invalid("ring dims are empty");
  long long product = 1;
  std::string shape;
  for (int d : dims) {
    if (d < 1) return Status::invalid("ring dimension " + std::to_string(d) + " is not >= 1");
    product *= d;
    shape += (shape.empty() ? "" : "x") + std::to_string(d);
    if (product > (1LL << 30)) return Status::invalid("ring dims " + shape + "... are too large");
  }
  if (product != world_size) {
    return Status::invalid("ring dims " + shape + " multiply to " + std::to_string(product) +
                           " but the communicator has " + std::to_string(world_size) + " ranks");
  }
  Torus torus;
  torus.dims_ = dims;
  torus.world_size_ = world_size;
  int stride = 1;
  for (int d : dims) {
    torus.strides_.push_back(stride);
    stride *= d;
  }
  *out = std::move(torus);
  return Status::ok();
}

std::vector<int> Torus::coords(int rank) const {
  std::vector<int> result(dims_.size());
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    result[i] = rank % dims_[i];
    rank /= dims_[i];
  }
  return result;
}

int Torus::rank_of(const std::vector<int>& coords) const {
  int rank = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i) rank += coords[i] * strides_[i];
  return rank;
}

int Torus::neighbor(int rank, int dim, int delta) const {
  std::vector<int> c = coords(rank);
  const int d = dims_[dim];
  c[dim] = ((c[dim] + delta) % d + d) % d;
  return rank_of(c);
}

Status RankedTorus::make(const std::vector<int>& dims, const std::vector<int>& order, int world, int rank,
                         RankedTorus* out) {
  RankedTorus ring;
  DDLFAST_RETURN_IF_ERROR(Torus::make(dims, world, &ring.torus));
  ring.rank_at = order;
  if (ring.rank_at.empty()) {
    for (int r = 0; r < world; ++r) ring.rank_at.push_back(r);
  }
  if (static_cast<int>(ring.rank_at.size()) != world) {
    return Status::invalid("rank order has " + std::to_string(ring.rank_at.size()) + " entries for " +
                           std::to_string(world) + " ranks");
  }
  std::vector<int> seen(world, 0);
  for (int v = 0; v < world; ++v) {
    const int r = ring.rank_at[v];
    if (r < 0 || r >= world || seen[r]++) return Status::invalid("rank order is not a permutation of the ranks");
    if (r == rank) ring.position = v;
  }
  *out = std::move(ring);
  return Status::ok();
}

}  // namespace ddlfast
