// The direct (all-to-all) reduce-scatter of one ring dimension (RingPhase::direct,
// algo/ring_schedule.h): instead of d-1 ring steps, every rank sends each block
// of its segment straight to the block's owner, and each owner adds the d
// contributions to its own block in one fixed order, coordinate 0..d-1 with its
// own at its place, so the result does not depend on arrival order. The bytes
// each rank sends and receives are the ring's ((d-1)/d of the segment); the
// latency is one step instead of d-1.
//
// With an fp16/bf16 wire (HalfWire, engine/host_steps.h) every other rank's
// contribution is rounded once, when its sender encodes it (under
// reproducible=True the owner's own too, so the sum does not depend on which
// rank owns the block; otherwise the owner's own values join as they are), and
// the owner decodes and adds all d in float32 before the block is rounded once
// more (by the allgather that sends it): one rounding per dimension, where the
// ring rounds each partial sum at every hop. float16/bfloat16 data
// (uncompressed) is summed the same way: the d contributions in float32,
// rounded once to the type, on both executors (sums_halves_in_float32). A flat
// ring of every rank in rank order with this phase is reproducible=True's
// canonical order (ddlfast/engine/state.py).
//
// How it runs: one polling loop for both executors (run_direct_phase), with
// their step policies: the host's (DirectHostSteps, below) and the GPU's
// (DeviceSteps, engine/device_ring_allreduce.cc). Every send may start at once
// (no block this phase sends is written during it), within the executor's send
// window (the host: all; the GPU: its send slots); receives are posted in the
// order they are combined, chunk by chunk of the own block and, within a
// chunk, by coordinate, as far ahead as the receive slots allow (the host:
// `receives_in_flight` chunks of d-1 contributions; the GPU: its slots but
// one, which holds the sum); stall-limited like the ring's loop.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "algo/ring_schedule.h"
#include "engine/host_steps.h"
#include "engine/ring_phases.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// Whether a direct phase sums in float32 and rounds once to the type: float16/bfloat16 data summed or averaged
// (the ring rounds each partial sum to the type). Both executors ask this one question: the host builds the sum
// in float32 scratch (HalfSum, engine/host_steps.h), the GPU in a float32 device slot (DeviceSteps,
// engine/device_ring_allreduce.cc), so their bits stay equal.
inline bool sums_halves_in_float32(DType dtype, ReduceOp op) {
  return (dtype == DType::kFloat16 || dtype == DType::kBFloat16) && (op == ReduceOp::kSum || op == ReduceOp::kAverage);
}

// direct_by_dim: empty, or one 0 (ring) or 1 (direct) per ring dimension.
inline Status check_direct(const std::vector<int>& direct_by_dim, int num_dims) {
  if (direct_by_dim.empty()) return Status::ok();
  if (direct_by_dim.size() != static_cast<std::size_t>(num_dims)) {
    return Status::invalid("direct reduce-scatter is given for " + std::to_string(direct_by_dim.size()) +
                           " dimensions but the ring has " + std::to_string(num_dims));
  }
  for (int direct : direct_by_dim) {
    if (direct != 0 && direct != 1) {
      return Status::invalid("direct reduce-scatter per dimension is 0 (ring) or 1 (direct), not " +
                             std::to_string(direct));
    }
  }
  return Status::ok();
}

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
// window of receive slots; the sum of one chunk builds in the data itself (coordinates 0 and 1), or in an
// accumulator until this rank's own contribution joins it in the data.
template <class Wire>
class DirectHostSteps {
 public:
  // `rounds_own`: the own contribution is rounded to the wire type like the others' (EngineOptions::reproducible).
  DirectHostSteps(const SegmentedBuffer& data, const RingPhase& phase, const DirectChunks& chunks, int slots,
                  std::size_t chunk_elems, Wire wire, HostScratch* scratch, bool rounds_own)
      : data_(data), wire_(wire), rounds_own_(rounds_own) {
    window_ = static_cast<std::size_t>(slots) * (phase.blocks.size() - 1);
    const std::size_t largest = std::min(chunk_elems, largest_count(chunks.receives));  // ring_phases.h
    slot_bytes_ = wire_.bytes(largest);
    if (scratch->receive_slots.size() < window_ * slot_bytes_) scratch->receive_slots.resize(window_ * slot_bytes_);
    receive_slots_ = scratch->receive_slots.data();
    const std::size_t sum_doubles = (sum_bytes(largest) + sizeof(double) - 1) / sizeof(double);
    if (scratch->accumulator.size() < sum_doubles) scratch->accumulator.resize(sum_doubles);
    accumulator_ = reinterpret_cast<char*>(scratch->accumulator.data());
    if constexpr (!Wire::kInPlace) {
      // Sized before the phase: no stage may move while MPI reads it.
      std::size_t stage_bytes = 0;
      for (const ChunkItem& send : chunks.sends) stage_bytes += wire_.bytes(send.count);
      if (scratch->send_stage.size() < stage_bytes) scratch->send_stage.resize(stage_bytes);
      stage_cursor_ = scratch->send_stage.data();
      send_from_.resize(chunks.sends.size());
      if (scratch->own_stage.size() < slot_bytes_) scratch->own_stage.resize(slot_bytes_);
      own_stage_ = scratch->own_stage.data();
    }
  }

  // The phase loop's policy (run_direct_phase): slots rotate, everything runs at once on the CPU.
  std::size_t receive_window() const { return window_; }
  std::size_t send_window() const { return kUnbounded; }
  Status receive_room(std::size_t, bool*) const { return Status::ok(); }
  std::size_t wire_bytes(std::size_t count) const { return wire_.bytes(count); }
  bool poll() const { return false; }
  void* receive_buffer(std::size_t index, const ChunkItem&) const { return slot(index); }

  Status stage(std::size_t index, const ChunkItem& send) {
    if constexpr (!Wire::kInPlace) {
      wire_.encode(stage_cursor_, data_.address(send.offset), send.count);
      send_from_[index] = stage_cursor_;
      stage_cursor_ += wire_.bytes(send.count);
    }
    return Status::ok();
  }
  Status staged(std::size_t, bool*) const { return Status::ok(); }
  const void* send_buffer(std::size_t index, const ChunkItem& send) const {
    if constexpr (Wire::kInPlace) return data_.address(send.offset);
    return send_from_[index];
  }

  // The verbs of one chunk's sum, called in coordinate order.
  Status begin_chunk(const ChunkItem& chunk, bool own_first) {
    // The own contribution is read only as such from here on: rounded to the wire type in place where asked.
    if (rounds_own_) wire_.round_through(data_.address(chunk.offset), own_stage_, chunk.count);
    if constexpr (sum_in_scratch()) {
      sum_ = accumulator_;  // the sum starts as the own values, in float32
      if (own_first) wire_.load(sum_, reinterpret_cast<const unsigned char*>(data_.address(chunk.offset)), chunk.count);
    } else {
      sum_ = own_first ? data_.address(chunk.offset) : accumulator_;
    }
    return Status::ok();
  }
  Status load(std::size_t index, const ChunkItem& chunk) {
    wire_.load(sum_, slot(index), chunk.count);
    return Status::ok();
  }
  Status add(std::size_t index, const ChunkItem& chunk, int divisor) {
    wire_.reduce(sum_, slot(index), chunk.count, divisor);
    return Status::ok();
  }
  // The own contribution joins the sum in its place: own + sum into the data, which then holds the sum (addition,
  // min, max and product commute: the bits of sum + own, without a copy of the sum back into the data).
  Status add_own(const ChunkItem& chunk, int divisor) {
    char* own = data_.address(chunk.offset);
    if constexpr (sum_in_scratch()) {
      wire_.reduce_values(sum_, own, chunk.count, divisor);
    } else {
      wire_.reduce_values(own, sum_, chunk.count, divisor);
      sum_ = own;
    }
    return Status::ok();
  }
  Status finish_chunk(const ChunkItem& chunk) {
    char* target = data_.address(chunk.offset);
    if constexpr (sum_in_scratch()) {
      wire_.store(target, sum_, chunk.count);
    } else if (sum_ != target) {
      std::memcpy(target, sum_, chunk.count * data_.element_size());
    }
    return Status::ok();
  }
  Status consumed(std::size_t) const { return Status::ok(); }

  // The chain phase's verbs (engine/chain_phase.h). Seeds take a receive slot (partial sums are wider than a
  // 16-bit wire); a 16-bit sum's unrounded partial (HalfSum) and a 16-bit wire's rounded final (HalfWire) wait in
  // chain_stage, at their place in the own block, until their sends complete; the rest go out of the data.
  template <class Plan>
  void prepare_chain(const Plan& plan, HostScratch* scratch) {
    if (send_from_.size() < plan.sends.size()) send_from_.resize(plan.sends.size());
    const std::size_t chunk_elems = slot_bytes_ / wire_.bytes(1);
    slot_bytes_ = std::max(slot_bytes_, sum_bytes(chunk_elems));
    if (scratch->receive_slots.size() < window_ * slot_bytes_) scratch->receive_slots.resize(window_ * slot_bytes_);
    receive_slots_ = scratch->receive_slots.data();
    chain_origin_ = plan.own.offset;
    const std::size_t stage_bytes = plan.own.count * std::max(sum_bytes(1), wire_.bytes(1));
    if (scratch->chain_stage.size() < stage_bytes) scratch->chain_stage.resize(stage_bytes);
    chain_stage_ = scratch->chain_stage.data();
  }
  std::size_t partial_bytes(std::size_t count) const { return sum_bytes(count); }
  void* seed_buffer(std::size_t index, const ChunkItem&) const { return slot(index); }
  Status load_seed(std::size_t index, const ChunkItem& chunk) {
    std::memcpy(sum_, slot(index), sum_bytes(chunk.count));
    return Status::ok();
  }
  Status keep_partial(const ChunkItem& chunk) {
    if constexpr (sum_in_scratch()) {
      std::memcpy(chain_at(chunk, sum_bytes(1)), sum_, sum_bytes(chunk.count));
      return Status::ok();
    }
    return finish_chunk(chunk);
  }
  Status stage_partial(std::size_t, const ChunkItem&) const { return Status::ok(); }
  const void* partial_send_buffer(std::size_t, const ChunkItem& chunk) const {
    if constexpr (sum_in_scratch()) return chain_at(chunk, sum_bytes(1));
    return data_.address(chunk.offset);
  }
  Status stage_final(std::size_t, const ChunkItem& chunk, bool first) {
    if constexpr (!Wire::kInPlace) {
      if (first) {  // rounded as the allgather's stage rounds it; the owner keeps what the others get
        unsigned char* wire = chain_at(chunk, wire_.bytes(1));
        wire_.encode(wire, data_.address(chunk.offset), chunk.count);
        wire_.decode(data_.address(chunk.offset), wire, chunk.count);
      }
    }
    return Status::ok();
  }
  const void* final_send_buffer(std::size_t, const ChunkItem& chunk) const {
    if constexpr (!Wire::kInPlace) return chain_at(chunk, wire_.bytes(1));
    return data_.address(chunk.offset);
  }
  void* final_buffer(std::size_t index, const ChunkItem& chunk) const {
    if constexpr (!Wire::kInPlace) return slot(index);
    return data_.address(chunk.offset);
  }
  Status place_final(std::size_t index, const ChunkItem& chunk) {
    if constexpr (!Wire::kInPlace) wire_.decode(data_.address(chunk.offset), slot(index), chunk.count);
    return Status::ok();
  }

 private:
  unsigned char* slot(std::size_t index) const { return receive_slots_ + (index % window_) * slot_bytes_; }
  unsigned char* chain_at(const ChunkItem& chunk, std::size_t element_bytes) const {
    return chain_stage_ + (chunk.offset - chain_origin_) * element_bytes;
  }
  // Whether the sum builds in float32 scratch whatever the order (HalfSum), and that scratch's size.
  static constexpr bool sum_in_scratch() { return Wire::kSumInScratch; }
  std::size_t sum_bytes(std::size_t count) const {
    if constexpr (sum_in_scratch()) return wire_.sum_bytes(count);
    return count * data_.element_size();
  }

  const SegmentedBuffer& data_;
  Wire wire_;
  bool rounds_own_;
  std::size_t window_ = 0;
  std::size_t slot_bytes_ = 0;
  unsigned char* receive_slots_ = nullptr;
  char* accumulator_ = nullptr;
  char* sum_ = nullptr;
  unsigned char* stage_cursor_ = nullptr;
  unsigned char* own_stage_ = nullptr;
  std::vector<const unsigned char*> send_from_;
  std::size_t chain_origin_ = 0;  // the chain phase: the own block's first element
  unsigned char* chain_stage_ = nullptr;
};

// Runs one direct phase, on either executor. `Steps` provides what the ring's phase loop asks of a policy
// (engine/ring_phases.h: receive_window, send_window, receive_room, receive_buffer, wire_bytes, stage, staged,
// send_buffer, poll; a send here is a ChunkItem whose step is the destination's coordinate) and the verbs of
// one chunk's sum, each called once its contribution is in place, in coordinate order:
//   begin_chunk(chunk, own_first)    the sum starts in the data itself (this rank is coordinate 0 or 1) or in
//                                    scratch
//   load(i, chunk)                   the sum is contribution i (coordinate 0's, at coordinates 2 and up)
//   add(i, chunk, divisor)           add contribution i (divisor 1 but on the last addition)
//   add_own(chunk, divisor)          add this rank's own data at its place
//   finish_chunk(chunk)              the finished sum into the data (after the chunk's last contribution)
//   consumed(i)                      receive i's slot may be reused once the executor has read it
// Average's divisor applies to the last addition, as on the ring's last step. Sends are staged and posted
// strictly in order within the send window; receives are taken strictly in order.
template <class Steps>
Status run_direct_phase(Transport& transport, const RingPhase& phase, const DirectChunks& chunks, int tag,
                        int final_divisor, Steps& steps) {
  const int d = static_cast<int>(phase.blocks.size());
  const int me = phase.coordinate;
  const int first = me == 0 ? 1 : 0;             // the first coordinate that arrives
  const int last = me == d - 1 ? d - 2 : d - 1;  // the last one
  // Coordinates 0 and 1 start the sum in their own data (coordinate 1 adds coordinate 0's contribution to its
  // own: addition commutes, so these are the bits of c0 + c1 without a copy of c0); the others build it in
  // scratch until their own contribution joins.
  const bool own_first = me <= 1;
  const bool own_last = !own_first && me == d - 1;
  const std::vector<ChunkItem>& receives = chunks.receives;
  PhaseMessages<Steps, ChunkItem, ChunkItem> messages(transport, steps, receives, chunks.sends);
  auto from_owner = [&](std::size_t i) { return phase.peers[receives[i].step]; };
  auto to_owner = [&](std::size_t j) { return phase.peers[chunks.sends[j].step]; };
  auto one_tag = [&](std::size_t) { return tag; };
  auto at_once = [](std::size_t, std::size_t) { return true; };  // no block this phase sends is written in it
  while (!messages.done()) {
    bool progress = steps.poll();
    DDLFAST_RETURN_IF_ERROR(messages.post_receives(from_owner, one_tag, &progress));
    DDLFAST_RETURN_IF_ERROR(messages.advance_sends(at_once, to_owner, one_tag, &progress));
    bool done = false;
    DDLFAST_RETURN_IF_ERROR(messages.next_arrived(&done));
    if (done) {
      const std::size_t i = messages.arrived();
      const ChunkItem& chunk = receives[i];
      const int j = chunk.step;
      if (j == first) DDLFAST_RETURN_IF_ERROR(steps.begin_chunk(chunk, own_first));
      if (j == 0 && !own_first) {
        DDLFAST_RETURN_IF_ERROR(steps.load(i, chunk));
      } else {
        if (!own_first && j == me + 1) DDLFAST_RETURN_IF_ERROR(steps.add_own(chunk, 1));
        DDLFAST_RETURN_IF_ERROR(steps.add(i, chunk, j == last && !own_last ? final_divisor : 1));
      }
      if (j == last) {
        if (own_last) DDLFAST_RETURN_IF_ERROR(steps.add_own(chunk, final_divisor));
        DDLFAST_RETURN_IF_ERROR(steps.finish_chunk(chunk));
      }
      DDLFAST_RETURN_IF_ERROR(steps.consumed(i));
      messages.take_arrived();
      progress = true;
    }
    DDLFAST_RETURN_IF_ERROR(messages.complete_sends(&progress));
    const std::size_t waiting = messages.arrived();
    DDLFAST_RETURN_IF_ERROR(messages.end_turn(progress, "direct reduce-scatter contributions",
                                              waiting < receives.size() ? from_owner(waiting) : -1));
  }
  return transport.wait_all();
}

}  // namespace ddlfast
