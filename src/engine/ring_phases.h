// The ring's phase loop, written once for every executor: the host with a
// plain or an fp16/bf16 wire (HostSteps, engine/host_steps.h) and the GPU on
// its device lanes (DeviceSteps, engine/device_ring_allreduce.cc) run this
// same loop; only the step policy that says where bytes land and how they
// are reduced differs.
//
// One phase is one dimension's ring (algo/ring_schedule.h: d ranks, d-1
// steps). In NCCL's step verbs, a rank does, chunk by chunk:
//
//   send(chunk)                       every chunk of its own step-0 range
//   reduce-scatter, step s < d-2:     receive_reduce_forward(chunk)  add the predecessor's chunk into ours,
//                                                                     pass the sum on as step s+1
//                   step d-2:         receive_reduce_keep(chunk)     the last addition (average divides here)
//   allgather,      step s < d-2:     receive_copy_forward(chunk)    place the predecessor's chunk, pass it on
//                   step d-2:         receive_copy(chunk)
//
// The range received in step s is the range sent in step s+1, so a chunk goes
// on as soon as it is in place. Chunks are at most chunk_elems long and never
// cross a segment boundary (sender and receiver cut alike); step s carries tag
// tag_base + s, and MPI matches same-tag messages in posting order, so sends
// and receives are each posted in chunk order. Each element is added in the
// same order on every executor, so they give the same bits.
//
// How it runs: one polling loop, never blocking. Receives are posted as far
// ahead as the policy has room (a window of receive slots, or every chunk at
// once when chunks land in place); arrived chunks are taken strictly in order;
// sends (own chunks first, then each forward) start strictly in order once
// their data is in place and a send slot is free (a GPU policy first copies or
// marks them, and posts once that is done). Sends never wait for a receive
// slot of their own rank, so bounded slots cannot deadlock the ring: the
// successor posts its receives in the same order we send. Idle turns back off
// and let the transport check the stall limit (StallWatch), in one place.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "algo/ring_schedule.h"
#include "engine/engine_options.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// One chunk of one step: the unit that is received, reduced and forwarded.
struct ChunkItem {
  int step;
  std::size_t offset;  // elements
  std::size_t count;
};

// The largest of `items`' counts (at least 1). Receive slots are sized to it, not to the chunk limit: a call
// whose blocks are smaller than a chunk held (and zeroed) chunk-sized slots, 4 MiB per rank for a ring and
// 4 x (d-1) MiB for a direct dimension of d ranks (28 GiB of slots for 1 MiB at 1024 simulated ranks).
inline std::size_t largest_count(const std::vector<ChunkItem>& items) {
  std::size_t largest = 1;
  for (const ChunkItem& item : items) largest = std::max(largest, item.count);
  return largest;
}

// Cuts `range` into chunks of at most chunk_elems that never cross a segment
// boundary; sender and receiver cut the same range identically.
inline void append_chunks(const SegmentedBuffer& data, int step, ElementRange range, std::size_t chunk_elems,
                          std::vector<ChunkItem>* items) {
  for (std::size_t done = 0; done < range.count;) {
    const std::size_t offset = range.offset + done;
    const std::size_t n = std::min({chunk_elems, range.count - done, data.contiguous_from(offset)});
    items->push_back({step, offset, n});
    done += n;
  }
}

// Tags separate phases and steps so a fast rank's next-step chunks can never
// match a slow rank's current-step receives.
constexpr int kTagsPerPhase = 1 << 12;
constexpr int kTagSpace = 1 << 15;  // MPI guarantees tags up to 32767
inline int step_tag(int tag_base, int step) { return (tag_base + step) % kTagSpace; }

// One message a rank sends in a phase: its own data (step 0) or a received
// chunk passed on once it is in place.
struct ChunkSend {
  std::size_t offset;  // elements
  std::size_t count;
  int step;
  long long forward_of;  // index of the received chunk it forwards; -1 for own data
};

// What moves in one phase: every chunk received, and every chunk sent, each
// in the order it is posted.
struct PhaseChunks {
  std::vector<ChunkItem> receives;
  std::vector<ChunkSend> sends;
  int last_step = 0;
};

inline PhaseChunks phase_chunks(const SegmentedBuffer& data, const RingPhase& phase, std::size_t chunk_elems) {
  PhaseChunks chunks;
  chunks.last_step = static_cast<int>(phase.steps.size()) - 1;
  for (int s = 0; s <= chunks.last_step; ++s) append_chunks(data, s, phase.steps[s].recv, chunk_elems, &chunks.receives);
  std::vector<ChunkItem> own;
  append_chunks(data, 0, phase.steps[0].send, chunk_elems, &own);
  chunks.sends.reserve(own.size() + chunks.receives.size());
  for (const ChunkItem& c : own) chunks.sends.push_back({c.offset, c.count, 0, -1});
  for (std::size_t i = 0; i < chunks.receives.size(); ++i) {
    const ChunkItem& c = chunks.receives[i];
    if (c.step < chunks.last_step) chunks.sends.push_back({c.offset, c.count, c.step + 1, static_cast<long long>(i)});
  }
  return chunks;
}

// No bound on posted receives or sends.
constexpr std::size_t kUnbounded = std::numeric_limits<std::size_t>::max();

// The bytes one message carries: the policy's item_bytes(item) where it has one (the chain phase's partial sums
// travel wider than its contributions, engine/chain_phase.h), else wire_bytes of the item's count.
template <class Steps, class Item>
auto message_bytes(const Steps& steps, const Item& item, int) -> decltype(steps.item_bytes(item)) {
  return steps.item_bytes(item);
}
template <class Steps, class Item>
std::size_t message_bytes(const Steps& steps, const Item& item, long) {
  return steps.wire_bytes(item.count);
}

// The message bookkeeping every phase loop shares (the ring's below, the direct reduce-scatter's in
// engine/direct_phase.h): receives posted as far ahead as the window and the policy allow and taken strictly
// in order; sends started (staged) strictly in order within the send window and posted once staged; the send
// slots of completed sends freed in order; idle turns handed to the StallWatch. `Receive` and `Send` are the
// loop's item types; the loop says, per item, its peer and tag.
template <class Steps, class Receive, class Send>
class PhaseMessages {
 public:
  PhaseMessages(Transport& transport, Steps& steps, const std::vector<Receive>& receives,
                const std::vector<Send>& sends)
      : transport_(transport),
        steps_(steps),
        receives_(receives),
        sends_(sends),
        receive_window_(steps.receive_window()),
        send_window_(steps.send_window()),
        receive_ids_(receives.size()),
        send_ids_(send_window_ == kUnbounded ? 0 : sends.size()),
        watch_(transport) {}

  bool done() const { return arrived_ == receives_.size() && completed_ == sends_.size(); }
  std::size_t arrived() const { return arrived_; }

  // Posts receives while there is room; peer(i) and tag(i) address receive i.
  template <class PeerOf, class TagOf>
  Status post_receives(PeerOf peer, TagOf tag, bool* progress) {
    while (posted_ < receives_.size() && posted_ - arrived_ < receive_window_) {
      bool free = true;
      DDLFAST_RETURN_IF_ERROR(steps_.receive_room(posted_, &free));
      if (!free) break;
      const Receive& item = receives_[posted_];
      DDLFAST_RETURN_IF_ERROR(transport_.irecv(steps_.receive_buffer(posted_, item), message_bytes(steps_, item, 0),
                                               peer(posted_), tag(posted_), &receive_ids_[posted_]));
      ++posted_;
      *progress = true;
    }
    return Status::ok();
  }

  // Sends, strictly in order: post each once it is staged, and start (stage) the next one once
  // may_start(j, arrived) says its data is in place, within the send window.
  template <class MayStart, class PeerOf, class TagOf>
  Status advance_sends(MayStart may_start, PeerOf peer, TagOf tag, bool* progress) {
    for (;;) {
      while (sent_ < started_) {
        bool ready = true;
        DDLFAST_RETURN_IF_ERROR(steps_.staged(sent_, &ready));
        if (!ready) break;
        const Send& send = sends_[sent_];
        RequestId id;
        DDLFAST_RETURN_IF_ERROR(transport_.isend(steps_.send_buffer(sent_, send), message_bytes(steps_, send, 0),
                                                 peer(sent_), tag(sent_), &id));
        if (send_window_ == kUnbounded) {
          ++completed_;  // wait_all at the end completes it
        } else {
          send_ids_[sent_] = id;
        }
        ++sent_;
        *progress = true;
      }
      if (started_ == sends_.size() || started_ - completed_ >= send_window_ || !may_start(started_, arrived_)) {
        return Status::ok();
      }
      DDLFAST_RETURN_IF_ERROR(steps_.stage(started_, sends_[started_]));
      ++started_;
      *progress = true;
    }
  }

  // Whether the next receive in order has arrived; take_arrived() once it has been handled.
  Status next_arrived(bool* done) {
    *done = false;
    if (arrived_ == posted_) return Status::ok();
    return transport_.test(receive_ids_[arrived_], done);
  }
  void take_arrived() { ++arrived_; }

  // Frees the send slots of completed sends, in order.
  Status complete_sends(bool* progress) {
    while (send_window_ != kUnbounded && completed_ < sent_) {
      bool done = false;
      DDLFAST_RETURN_IF_ERROR(transport_.test(send_ids_[completed_], &done));
      if (!done) break;
      ++completed_;
      *progress = true;
    }
    return Status::ok();
  }

  // The end of one turn: idle turns back off and let the transport check the stall limit.
  Status end_turn(bool progress, const char* what, int peer) {
    if (progress) {
      watch_.progressed();
      return Status::ok();
    }
    return watch_.idle(what, peer);
  }

 private:
  Transport& transport_;
  Steps& steps_;
  const std::vector<Receive>& receives_;
  const std::vector<Send>& sends_;
  const std::size_t receive_window_;
  const std::size_t send_window_;
  std::vector<RequestId> receive_ids_;
  std::vector<RequestId> send_ids_;
  std::size_t posted_ = 0, arrived_ = 0;                // receives
  std::size_t started_ = 0, sent_ = 0, completed_ = 0;  // sends
  StallWatch watch_;
};

// Runs one phase. `Steps` (a policy, so no call per chunk is virtual) provides:
//   receive_window(), send_window()   how many receives / sends may be in flight (kUnbounded: all at once;
//                                     unbounded sends are completed by wait_all at the end)
//   receive_room(i, &free)           whether receive i's slot is free of earlier work (the GPU's lanes)
//   receive_buffer(i, chunk)         where receive i lands
//   wire_bytes(count)                bytes on the wire for `count` elements
//   receive_reduce(i, chunk, divisor)  add arrived chunk i into the data (divisor 1 but on the last step)
//   receive_copy(i, chunk)             put arrived chunk i in its place
//   stage(j, send), staged(j, &ok)   prepare send j (encode, copy out) and whether it may be posted
//   send_buffer(j, send)             what send j carries
//   poll()                           once per turn: lets device work advance; true while it is busy (no backoff)
template <class Steps>
Status run_ring_phase(Transport& transport, const RingPhase& phase, const PhaseChunks& chunks, int tag_base,
                      int final_divisor, Steps& steps) {
  const bool reduces = phase.kind == PhaseKind::kReduceScatter;
  const std::vector<ChunkItem>& receives = chunks.receives;
  const std::vector<ChunkSend>& sends = chunks.sends;
  PhaseMessages<Steps, ChunkItem, ChunkSend> messages(transport, steps, receives, sends);
  auto from_predecessor = [&](std::size_t) { return phase.predecessor; };
  auto to_successor = [&](std::size_t) { return phase.successor; };
  auto receive_tag = [&](std::size_t i) { return step_tag(tag_base, receives[i].step); };
  auto send_tag = [&](std::size_t j) { return step_tag(tag_base, sends[j].step); };
  // An own chunk may start at once, a forward once the chunk it forwards is in place.
  auto in_place = [&](std::size_t j, std::size_t arrived) {
    return sends[j].forward_of < 0 || static_cast<std::size_t>(sends[j].forward_of) < arrived;
  };
  while (!messages.done()) {
    bool progress = steps.poll();
    DDLFAST_RETURN_IF_ERROR(messages.post_receives(from_predecessor, receive_tag, &progress));
    DDLFAST_RETURN_IF_ERROR(messages.advance_sends(in_place, to_successor, send_tag, &progress));
    // Take the next chunk if it arrived: the step verb for its step. Its forward, if any, goes out on the
    // next turn, after the receive that reuses its slot is posted.
    bool done = false;
    DDLFAST_RETURN_IF_ERROR(messages.next_arrived(&done));
    if (done) {
      const std::size_t i = messages.arrived();
      const ChunkItem& chunk = receives[i];
      const bool keeps = chunk.step == chunks.last_step;  // receive_reduce_keep: the last step divides
      if (reduces) {
        DDLFAST_RETURN_IF_ERROR(steps.receive_reduce(i, chunk, keeps ? final_divisor : 1));
      } else {
        DDLFAST_RETURN_IF_ERROR(steps.receive_copy(i, chunk));
      }
      messages.take_arrived();
      progress = true;
    }
    DDLFAST_RETURN_IF_ERROR(messages.complete_sends(&progress));
    DDLFAST_RETURN_IF_ERROR(messages.end_turn(
        progress, reduces ? "ring reduce-scatter chunks" : "ring allgather chunks", phase.predecessor));
  }
  return transport.wait_all();
}

// Which halves of the schedule to run: allreduce both, reduce_scatter and allgather one each.
enum class RingPasses { kBoth, kReduceScatter, kAllgather };

// Runs the schedule's phases of `halves` in order, each as
// run_phase(phase, chunks, tag_base, final_divisor) (chunks empty for a direct
// phase, which the executor runs itself): average's divisor applies
// on the last step of the last reduce-scatter phase. Each phase gets its own
// band of tags, so a fast rank's next phase never matches a slow rank's
// current one. One timeline event per phase when `events` is set.
template <class RunPhase>
Status run_ring_schedule(const SegmentedBuffer& data, const RingSchedule& schedule, RingPasses halves, int divisor,
                         std::size_t chunk_elems, std::vector<PhaseEvent>* events, RunPhase&& run_phase) {
  const int last_reduce_scatter = last_reduce_scatter_phase(schedule);
  for (int i = 0; i < static_cast<int>(schedule.phases.size()); ++i) {
    const RingPhase& phase = schedule.phases[i];
    const bool reduces = phase.kind == PhaseKind::kReduceScatter;
    if ((halves == RingPasses::kReduceScatter && !reduces) || (halves == RingPasses::kAllgather && reduces)) continue;
    const double start = monotonic_seconds();
    // A direct phase (engine/direct_phase.h) cuts its own chunks; it has no ring steps.
    const PhaseChunks chunks = phase.direct ? PhaseChunks{} : phase_chunks(data, phase, chunk_elems);
    const int tag_base = (i * kTagsPerPhase) % kTagSpace;
    DDLFAST_RETURN_IF_ERROR(run_phase(phase, chunks, tag_base, i == last_reduce_scatter ? divisor : 1));
    if (events) {
      std::size_t phase_bytes = 0;
      for (const RingStep& step : phase.steps) phase_bytes += step.send.count * data.element_size();
      for (std::size_t j = 0; j < phase.blocks.size(); ++j) {
        if (static_cast<int>(j) != phase.coordinate) phase_bytes += phase.blocks[j].count * data.element_size();
      }
      const EventKind kind =
          phase.kind == PhaseKind::kReduceScatter ? EventKind::kReduceScatter : EventKind::kAllgather;
      events->push_back({kind, phase.dim, start, monotonic_seconds(), phase_bytes});
    }
  }
  return Status::ok();
}

}  // namespace ddlfast
