// The direct (all-to-all) reduce-scatter of one ring dimension (RingPhase::direct,
// algo/ring_schedule.h): instead of d-1 ring steps, every rank sends each block
// of its segment straight to the block's owner, and each owner adds the d
// contributions to its own block in one fixed order, coordinate 0..d-1 with its
// own at its place, so the result does not depend on arrival order. The bytes
// each rank sends and receives are the ring's ((d-1)/d of the segment); the
// latency is one step instead of d-1.
//
// With an fp16/bf16 wire (HalfWire, engine/host_steps.h) every contribution
// is rounded once, when its sender encodes it, and the owner decodes and adds
// all d in float32 before the block is rounded once more (by the allgather that
// sends it): one rounding per dimension, where the ring rounds each partial sum
// at every hop.
//
// How it runs: all sends are posted at once (no block this phase sends is
// written during it); receives are posted in the order they are combined,
// chunk by chunk of the own block and, within a chunk, by coordinate, as far
// ahead as the window of receive slots allows (`receives_in_flight` chunks of
// d-1 contributions each); one polling loop, stall-limited like the ring's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "algo/ring_schedule.h"
#include "engine/host_steps.h"
#include "engine/ring_phases.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// What moves in one direct phase; ChunkItem::step is the peer's coordinate in the dimension.
struct DirectChunks {
  std::vector<ChunkItem> receives;  // per chunk of the own block, one contribution per other coordinate, in order
  std::vector<ChunkItem> sends;     // chunk by chunk, each round to coordinate+1, +2, ... so no owner is first
};

inline DirectChunks direct_chunks(const SegmentedBuffer& data, const RingPhase& phase, std::size_t chunk_elems) {
  const int d = static_cast<int>(phase.blocks.size());
  const int me = phase.coordinate;
  DirectChunks chunks;
  std::vector<ChunkItem> own;
  append_chunks(data, me, phase.blocks[me], chunk_elems, &own);
  for (const ChunkItem& chunk : own) {
    for (int j = 0; j < d; ++j) {
      if (j != me) chunks.receives.push_back({j, chunk.offset, chunk.count});
    }
  }
  std::vector<std::vector<ChunkItem>> to(d);
  std::size_t rounds = 0;
  for (int j = 0; j < d; ++j) {
    if (j == me) continue;
    append_chunks(data, j, phase.blocks[j], chunk_elems, &to[j]);
    rounds = std::max(rounds, to[j].size());
  }
  for (std::size_t k = 0; k < rounds; ++k) {
    for (int r = 1; r < d; ++r) {
      const int j = (me + r) % d;
      if (k < to[j].size()) chunks.sends.push_back(to[j][k]);
    }
  }
  return chunks;
}

// The host's arithmetic for a direct phase, for either wire (engine/host_steps.h). Contributions land in a
// window of receive slots; the sum of one chunk builds in an accumulator (or in the data itself when this rank's
// own contribution comes first) and is copied into the data when complete.
template <class Wire>
class DirectHostSteps {
 public:
  DirectHostSteps(const SegmentedBuffer& data, const RingPhase& phase, const DirectChunks& chunks, int slots,
                  std::size_t chunk_elems, Wire wire, HostScratch* scratch)
      : data_(data), wire_(wire) {
    window_ = static_cast<std::size_t>(slots) * (phase.blocks.size() - 1);
    slot_bytes_ = wire_.bytes(chunk_elems);
    if (scratch->receive_slots.size() < window_ * slot_bytes_) scratch->receive_slots.resize(window_ * slot_bytes_);
    receive_slots_ = scratch->receive_slots.data();
    const std::size_t sum_doubles = (chunk_elems * data.element_size() + sizeof(double) - 1) / sizeof(double);
    if (scratch->accumulator.size() < sum_doubles) scratch->accumulator.resize(sum_doubles);
    accumulator_ = reinterpret_cast<char*>(scratch->accumulator.data());
    if constexpr (!Wire::kInPlace) {
      // Sized before the phase: no stage may move while MPI reads it.
      std::size_t stage_bytes = 0;
      for (const ChunkItem& send : chunks.sends) stage_bytes += wire_.bytes(send.count);
      if (scratch->send_stage.size() < stage_bytes) scratch->send_stage.resize(stage_bytes);
      stage_cursor_ = scratch->send_stage.data();
      send_from_.resize(chunks.sends.size());
    }
  }

  std::size_t receive_window() const { return window_; }
  std::size_t wire_bytes(std::size_t count) const { return wire_.bytes(count); }
  void* receive_buffer(std::size_t index) const { return slot(index); }

  void stage(std::size_t index, const ChunkItem& send) {
    if constexpr (!Wire::kInPlace) {
      wire_.encode(stage_cursor_, data_.address(send.offset), send.count);
      send_from_[index] = stage_cursor_;
      stage_cursor_ += wire_.bytes(send.count);
    }
  }
  const void* send_buffer(std::size_t index, const ChunkItem& send) const {
    if constexpr (Wire::kInPlace) return data_.address(send.offset);
    return send_from_[index];
  }

  // The verbs of one chunk's sum, called in coordinate order.
  void begin_chunk(const ChunkItem& chunk, bool own_first) {
    sum_ = own_first ? data_.address(chunk.offset) : accumulator_;
  }
  void load(std::size_t index, const ChunkItem& chunk) { wire_.load(sum_, slot(index), chunk.count); }
  void add(std::size_t index, const ChunkItem& chunk, int divisor) {
    wire_.reduce(sum_, slot(index), chunk.count, divisor);
  }
  void add_own(const ChunkItem& chunk, int divisor) {
    wire_.reduce_values(sum_, data_.address(chunk.offset), chunk.count, divisor);
  }
  void finish_chunk(const ChunkItem& chunk) {
    char* target = data_.address(chunk.offset);
    if (sum_ != target) std::memcpy(target, sum_, chunk.count * data_.element_size());
  }

 private:
  unsigned char* slot(std::size_t index) const { return receive_slots_ + (index % window_) * slot_bytes_; }

  const SegmentedBuffer& data_;
  Wire wire_;
  std::size_t window_ = 0;
  std::size_t slot_bytes_ = 0;
  unsigned char* receive_slots_ = nullptr;
  char* accumulator_ = nullptr;
  char* sum_ = nullptr;
  unsigned char* stage_cursor_ = nullptr;
  std::vector<const unsigned char*> send_from_;
};

// Runs one direct phase. Each owner's sum of a chunk: coordinate 0 first (loaded, or its own data in place when
// it is coordinate 0), then every later coordinate added in turn, its own data at its place; average's divisor
// applies to the last addition, as on the ring's last step.
template <class Steps>
Status run_direct_phase(Transport& transport, const RingPhase& phase, const DirectChunks& chunks, int tag,
                        int final_divisor, Steps& steps) {
  const int d = static_cast<int>(phase.blocks.size());
  const int me = phase.coordinate;
  const int first = me == 0 ? 1 : 0;       // the first coordinate that arrives
  const int last = me == d - 1 ? d - 2 : d - 1;  // the last one
  for (std::size_t j = 0; j < chunks.sends.size(); ++j) {
    const ChunkItem& send = chunks.sends[j];
    steps.stage(j, send);
    RequestId id;
    DDLFAST_RETURN_IF_ERROR(transport.isend(steps.send_buffer(j, send), steps.wire_bytes(send.count),
                                            phase.peers[send.step], tag, &id));  // wait_all completes it
  }
  const std::vector<ChunkItem>& receives = chunks.receives;
  const std::size_t window = steps.receive_window();
  std::vector<RequestId> ids(receives.size());
  std::size_t posted = 0, arrived = 0;
  StallWatch watch(transport);
  while (arrived < receives.size()) {
    bool progress = false;
    while (posted < receives.size() && posted - arrived < window) {
      const ChunkItem& chunk = receives[posted];
      DDLFAST_RETURN_IF_ERROR(transport.irecv(steps.receive_buffer(posted), steps.wire_bytes(chunk.count),
                                              phase.peers[chunk.step], tag, &ids[posted]));
      ++posted;
      progress = true;
    }
    bool done = false;
    DDLFAST_RETURN_IF_ERROR(transport.test(ids[arrived], &done));
    if (done) {
      const ChunkItem& chunk = receives[arrived];
      const int j = chunk.step;
      if (j == first) steps.begin_chunk(chunk, me == 0);
      if (j == 0) {
        steps.load(arrived, chunk);
      } else {
        if (me != 0 && j == me + 1) steps.add_own(chunk, 1);
        steps.add(arrived, chunk, j == last && me != d - 1 ? final_divisor : 1);
      }
      if (j == last) {
        if (me == d - 1) steps.add_own(chunk, final_divisor);
        steps.finish_chunk(chunk);
      }
      ++arrived;
      progress = true;
    }
    if (progress) {
      watch.progressed();
    } else {
      DDLFAST_RETURN_IF_ERROR(watch.idle("direct reduce-scatter contributions", phase.peers[receives[arrived].step]));
    }
  }
  return transport.wait_all();
}

}  // namespace ddlfast
