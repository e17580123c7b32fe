// A std::vector whose growth leaves new elements uninitialized (default-initialized: no zeroing), for buffers
// that are always written before they are read (receive slots, message buffers). Zero-filling a buffer makes
// every page of it resident at once; left alone, a page costs memory only once a message lands in it, so a
// buffer sized for the largest call costs only what the calls use (at 1024 simulated ranks in one process,
// gigabytes: docs/scale.md).
#pragma once

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace ddlfast {

template <typename T>
class DefaultInitAllocator : public std::allocator<T> {
 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}

  // resize(n) constructs with no arguments: default-initialize (for trivial T, leave the bytes as they are).
  template <typename U>
  void construct(U* place) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(place)) U;
  }
  template <typename U, typename... Args>
  void construct(U* place, Args&&... args) {
    ::new (static_cast<void*>(place)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using UninitializedVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace ddlfast
