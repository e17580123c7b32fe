// Mixed-radix rank coordinates on a d1 x d2 x ... x dk torus; dimension 1
// varies fastest, so consecutive ranks (one host, by launcher convention)
// share a dimension-1 ring.
#pragma once

#include <vector>

#include "common/status.h"

namespace ddlfast {

class Torus {
 public:
  // Validates that every dimension is >= 1 and the product equals world_size.
  static Status make(const std::vector<int>& dims, int world_size, Torus* out);

  const std::vector<int>& dims() const { return dims_; }
  int num_dims() const { return static_cast<int>(dims_.size()); }
  int world_size() const { return world_size_; }

  std::vector<int> coords(int rank) const;
  int rank_of(const std::vector<int>& coords) const;
  // The rank reached from `rank` by moving `delta` steps along dimension `dim`.
  int neighbor(int rank, int dim, int delta) const;

 private:
  std::vector<int> dims_;
  std::vector<int> strides_;
  int world_size_ = 1;
};

// A torus laid over a communicator: which rank sits at each torus position
// (engines renumber so that each dimension-1 ring stays on one host) and
// where this rank sits.
struct RankedTorus {
  Torus torus;
  std::vector<int> rank_at;  // torus position -> communicator rank
  int position = -1;         // this rank's torus position

  // `order` empty: identity; otherwise it must be a permutation of 0..world-1.
  static Status make(const std::vector<int>& dims, const std::vector<int>& order, int world, int rank,
                     RankedTorus* out);
};

}  // namespace ddlfast
