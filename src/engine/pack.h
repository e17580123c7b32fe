// Fusion copies: many arrays into one contiguous bucket and back. Plain
// memcpy, but called once per bucket from Cython with the GIL released.
#pragma once

#include <cstddef>
#include <cstring>

namespace ddlfast {

inline void pack(void* bucket, const void* const* arrays, const std::size_t* bytes, std::size_t count) {
  char* cursor = static_cast<char*>(bucket);
  for (std::size_t i = 0; i < count; ++i) {
    if (bytes[i] != 0) std::memcpy(cursor, arrays[i], bytes[i]);
    cursor += bytes[i];
  }
}

inline void unpack(const void* bucket, void* const* arrays, const std::size_t* bytes, std::size_t count) {
  const char* cursor = static_cast<const char*>(bucket);
  for (std::size_t i = 0; i < count; ++i) {
    if (bytes[i] != 0) std::memcpy(arrays[i], cursor, bytes[i]);
    cursor += bytes[i];
  }
}

}  // namespace ddlfast
