// A logical buffer made of several arrays back to back, so a fusion bucket
// can be reduced where its arrays lie instead of being packed and unpacked.
// The ring cuts its messages at segment boundaries, so every rank must build
// the buffers it moves with the same segment sizes: sizes from the agreed
// layout (the agreement check guarantees those match), never from how this
// rank's memory happens to be split (RingAllreduce::reduce_scatter cuts its
// working copy like the input for that reason).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

namespace ddlfast {

class SegmentedBuffer {
 public:
  SegmentedBuffer(std::vector<char*> bases, const std::vector<std::size_t>& counts, std::size_t element_size)
      : bases_(std::move(bases)), element_size_(element_size) {
    starts_.reserve(counts.size() + 1);
    starts_.push_back(0);
    for (std::size_t count : counts) starts_.push_back(starts_.back() + count);
  }

  std::size_t count() const { return starts_.back(); }
  std::size_t element_size() const { return element_size_; }

  // Address of logical element `element` (which must be < count()).
  char* address(std::size_t element) const {
    const std::size_t s = segment_of(element);
    return bases_[s] + (element - starts_[s]) * element_size_;
  }

  // How many elements from `element` stay inside its segment.
  std::size_t contiguous_from(std::size_t element) const { return starts_[segment_of(element) + 1] - element; }

 private:
  std::size_t segment_of(std::size_t element) const {
    // Last segment whose start is <= element; empty segments are skipped by upper_bound.
    return static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), element) - starts_.begin()) - 1;
  }

  std::vector<char*> bases_;
  std::vector<std::size_t> starts_;  // prefix sums of element counts
  std::size_t element_size_;
};

inline SegmentedBuffer contiguous(char* base, std::size_t count, std::size_t element_size) {
  return SegmentedBuffer({base}, {count}, element_size);
}

// Every element of `from` into `to` (the same count and element size).
inline void copy_elements(const SegmentedBuffer& from, const SegmentedBuffer& to) {
  for (std::size_t done = 0; done < from.count();) {
    const std::size_t n = std::min(from.contiguous_from(done), to.contiguous_from(done));
    std::memcpy(to.address(done), from.address(done), n * from.element_size());
    done += n;
  }
}

}  // namespace ddlfast
