// Chunk bookkeeping shared by the plain and the compressed phase executors.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "algo/ring_schedule.h"
#include "common/status.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {
namespace chunking {

// One chunk of one step: the unit that is received, reduced and forwarded.
struct ChunkItem {
  int step;
  std::size_t offset;  // elements
  std::size_t count;
};

// Cuts `range` into chunks of at most chunk_elems that never cross a segment
// boundary; sender and receiver cut the same range identically.
inline void append_chunks(const SegmentedBuffer& data, int step, ElementRange range, std::size_t chunk_elems,
                   std::vector<ChunkItem>* items) {
  std::size_t done = 0;
  while (done < range.count) {
    const std::size_t offset = range.offset + done;
    const std::size_t n = std::min({chunk_elems, range.count - done, data.contiguous_from(offset)});
    items->push_back({step, offset, n});
    done += n;
  }
}

inline std::vector<ChunkItem> chunk_items(const SegmentedBuffer& data, const RingPhase& phase, std::size_t chunk_elems) {
  std::vector<ChunkItem> items;
  for (int s = 0; s < static_cast<int>(phase.steps.size()); ++s) {
    append_chunks(data, s, phase.steps[s].recv, chunk_elems, &items);
  }
  return items;
}

// Tags separate phases and steps so a fast rank's next-step chunks can never
// match a slow rank's current-step receives.
constexpr int kTagsPerPhase = 1 << 12;
constexpr int kTagSpace = 1 << 15;  // MPI guarantees tags up to 32767
inline int step_tag(int tag_base, int step) { return (tag_base + step) % kTagSpace; }

// Posts step 0's sends (data this rank already holds) in chunks; later steps
// are sent chunk by chunk as they arrive.
inline Status send_first_step(Transport* transport, const SegmentedBuffer& data, const RingPhase& phase, int tag,
                       std::size_t chunk_elems) {
  std::vector<ChunkItem> items;
  append_chunks(data, 0, phase.steps[0].send, chunk_elems, &items);
  for (const ChunkItem& item : items) {
    RequestId ignored;
    DDLFAST_RETURN_IF_ERROR(transport->isend(data.address(item.offset), item.count * data.element_size(),
                                             phase.successor, tag, &ignored));
  }
  return Status::ok();
}

}  // namespace chunking
}  // namespace ddlfast
