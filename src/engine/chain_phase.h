// reproducible=True's canonical order host by host: the chain phase. The
// canonical order sums every element in rank order, x_0 + x_1 + ... + x_{P-1},
// in the accumulation type (float32 for 16-bit values, the data's type
// otherwise), and rounds once (ddlfast/engine/state.py). One flat direct
// reduce-scatter (engine/direct_phase.h) gives it on any placement, but each
// rank then sends the blocks of every owner on another host across the host
// link: P/4 times the ring's bytes there at 2 hosts. The chain gives the same
// additions, in the same order, with the ring's bytes on the host link.
//
// The ring is dims (H, G): G hosts of H consecutive ranks (dimension 1 within
// a host, dimension 2 across). Dimension 1 cuts the buffer into H blocks;
// block j is summed by coordinate j of every host, host after host:
//
//   host g's coordinate j adds, in rank order, the partial sum of hosts 0..g-1
//   (its seed, from coordinate j of host g-1; none on host 0) and the H
//   contributions of its own host (a direct reduce-scatter within the host),
//   then passes the unrounded partial to coordinate j of host g+1;
//   the last host's coordinate j holds the final sum, rounds it as the
//   allgather would, and sends it to coordinate j of every other host;
//   then each host allgathers its H blocks (a ring phase of dimension 1).
//
// Chunk by chunk, so while host 1 adds chunk k, host 0 already adds chunk k+1
// and the finals of chunk k-1 travel back (the host link carries both
// directions at once). Partial sums travel in the accumulation type (float32
// for the fp16/bf16 wire and for 16-bit data: twice the wire's bytes on the
// host link), contributions and finals as the wire carries them.
//
// How it runs: the direct phase's message loop (PhaseMessages) over one list
// of receives (per own chunk: the seed, then the contributions in coordinate
// order; then the finals) and one of sends (the contributions, then per own
// chunk its pass or its finals, each once the chunk's sum is done), with the
// executor's direct-phase step policy (DirectHostSteps, engine/direct_phase.h;
// DeviceSteps, engine/device_ring_allreduce.cc) and its chain verbs:
//   seed_buffer(i, chunk)              where seed i lands
//   load_seed(i, chunk)                the sum starts as seed i
//   keep_partial(chunk)                the finished partial sum stays, unrounded, for its pass send
//   stage_partial(j, chunk), partial_send_buffer(j, chunk), partial_bytes(count)
//   stage_final(j, chunk, first)       the final sum rounded (on its first send) as the allgather rounds it: the
//                                      owner keeps what the others get; final_send_buffer(j, chunk)
//   final_buffer(i, chunk), place_final(i, chunk)   a final from the last host, into the data
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "algo/ring_schedule.h"
#include "engine/direct_phase.h"
#include "engine/ring_phases.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// What a message of the chain phase is.
enum class ChainRole : int { kContribution = 0, kSeed = 1, kPass = 2, kFinal = 3 };

// One message of the chain phase: a chunk of the own block (seed, pass, final; `chunk` indexes the own chunks)
// or a contribution (step: the peer's coordinate within the host, as in a direct phase).
struct ChainItem {
  int step;
  std::size_t offset;  // elements
  std::size_t count;
  ChainRole role;
  std::size_t after = 0;  // a pass or final send: how many receives must be taken before it may start
  ChunkItem chunk() const { return {step, offset, count}; }
};

// The chain's dims (H, G) and what may run on them: at least 2 ranks per host and 2 hosts.
inline Status check_chain(const std::vector<int>& dims) {
  if (dims.size() != 2 || dims[0] < 2 || dims[1] < 2) {
    std::string shape;
    for (int d : dims) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    return Status::invalid("the canonical chain runs on dims (ranks per host >= 2) x (hosts >= 2), not " + shape);
  }
  return Status::ok();
}

// The chain's chunk: at most the call's, and small enough that each own block is cut into kChainPieces chunks
// or more (down to 64 KiB), so that the next host starts early: at 8 MiB on 2 hosts of 4 ranks, 1 MiB chunks
// cut each block in 2. A function of the call's size, so every rank cuts alike.
constexpr std::size_t kChainPieces = 8;
inline std::size_t chain_chunk_elems(std::size_t count, int per_host, std::size_t chunk_elems,
                                     std::size_t element_size) {
  const std::size_t smallest = std::max<std::size_t>(1, (64 * 1024) / element_size);
  const std::size_t piece = (count / static_cast<std::size_t>(per_host) + kChainPieces - 1) / kChainPieces;
  return std::min(chunk_elems, std::max(piece, smallest));
}

// The messages of this rank's chain phase. `within`: the direct reduce-scatter phase of dimension 1 (the own
// block, the host's ranks); `across`: dimension 2's phase (this host's coordinate, the peers on other hosts).
struct ChainPlan {
  int host = 0;
  int hosts = 0;
  std::vector<int> host_peers;  // the rank of this coordinate on each host
  ElementRange own;             // the own block of dimension 1
  std::vector<ChainItem> receives;
  std::vector<ChainItem> sends;
};

inline ChainPlan chain_plan(const SegmentedBuffer& data, const RingPhase& within, const RingPhase& across,
                            std::size_t chunk_elems) {
  ChainPlan plan;
  plan.host = across.coordinate;
  plan.hosts = static_cast<int>(across.peers.size());
  plan.host_peers = across.peers;
  plan.own = within.blocks[within.coordinate];
  const int d = static_cast<int>(within.blocks.size());
  const int me = within.coordinate;
  const bool seeded = plan.host > 0;
  const bool last_host = plan.host == plan.hosts - 1;
  std::vector<ChunkItem> own;
  append_chunks(data, -1, plan.own, chunk_elems, &own);
  for (const ChunkItem& c : direct_chunks(data, within, chunk_elems).sends) {
    plan.sends.push_back({c.step, c.offset, c.count, ChainRole::kContribution});
  }
  for (const ChunkItem& c : own) {
    if (seeded) plan.receives.push_back({-1, c.offset, c.count, ChainRole::kSeed});
    for (int j = 0; j < d; ++j) {
      if (j != me) plan.receives.push_back({j, c.offset, c.count, ChainRole::kContribution});
    }
    const std::size_t done = plan.receives.size();
    if (!last_host) {
      plan.sends.push_back({plan.host + 1, c.offset, c.count, ChainRole::kPass, done});
    } else {
      for (int g = 0; g + 1 < plan.hosts; ++g) plan.sends.push_back({g, c.offset, c.count, ChainRole::kFinal, done});
    }
  }
  if (!last_host) {
    for (const ChunkItem& c : own) plan.receives.push_back({plan.hosts - 1, c.offset, c.count, ChainRole::kFinal});
  }
  return plan;
}

// The phase loop's policy for the chain: the executor's direct-phase steps, asked per message by its role.
template <class Steps>
class ChainSteps {
 public:
  explicit ChainSteps(Steps& steps) : steps_(steps) {}
  std::size_t receive_window() const { return steps_.receive_window(); }
  std::size_t send_window() const { return steps_.send_window(); }
  Status receive_room(std::size_t i, bool* free) { return steps_.receive_room(i, free); }
  std::size_t wire_bytes(std::size_t count) const { return steps_.wire_bytes(count); }
  std::size_t item_bytes(const ChainItem& item) const {
    const bool partial = item.role == ChainRole::kSeed || item.role == ChainRole::kPass;
    return partial ? steps_.partial_bytes(item.count) : steps_.wire_bytes(item.count);
  }
  bool poll() { return steps_.poll(); }
  void* receive_buffer(std::size_t i, const ChainItem& item) {
    if (item.role == ChainRole::kSeed) return steps_.seed_buffer(i, item.chunk());
    if (item.role == ChainRole::kFinal) return steps_.final_buffer(i, item.chunk());
    return steps_.receive_buffer(i, item.chunk());
  }
  Status stage(std::size_t j, const ChainItem& item) {
    if (item.role == ChainRole::kPass) return steps_.stage_partial(j, item.chunk());
    if (item.role == ChainRole::kFinal) return steps_.stage_final(j, item.chunk(), item.step == 0);
    return steps_.stage(j, item.chunk());
  }
  Status staged(std::size_t j, bool* ready) { return steps_.staged(j, ready); }
  const void* send_buffer(std::size_t j, const ChainItem& item) const {
    if (item.role == ChainRole::kPass) return steps_.partial_send_buffer(j, item.chunk());
    if (item.role == ChainRole::kFinal) return steps_.final_send_buffer(j, item.chunk());
    return steps_.send_buffer(j, item.chunk());
  }

 private:
  Steps& steps_;
};

// Runs the chain phase (the header's comment): tags tag (contributions), tag + 1 (partials), tag + 2 (finals).
// Average's divisor applies on the last host's last addition, as on the flat order's.
template <class Steps>
Status run_chain_phase(Transport& transport, const RingPhase& within, const ChainPlan& plan, int tag, int final_divisor,
                       Steps& inner) {
  const int d = static_cast<int>(within.blocks.size());
  const int me = within.coordinate;
  const bool seeded = plan.host > 0;
  const bool last_host = plan.host == plan.hosts - 1;
  const int divisor = last_host ? final_divisor : 1;
  const int first = me == 0 ? 1 : 0;             // the first contribution that arrives
  const int last = me == d - 1 ? d - 2 : d - 1;  // the last one
  // Unseeded (host 0), coordinates 0 and 1 start the sum in their own data, as the direct phase does; a seeded
  // sum starts as the seed, and the own contribution joins it at its place.
  const bool own_first = !seeded && me <= 1;
  const bool own_last = !own_first && me == d - 1;
  ChainSteps<Steps> steps(inner);
  const std::vector<ChainItem>& receives = plan.receives;
  const std::vector<ChainItem>& sends = plan.sends;
  PhaseMessages<ChainSteps<Steps>, ChainItem, ChainItem> messages(transport, steps, receives, sends);
  auto peer_of = [&](const ChainItem& item) {
    if (item.role == ChainRole::kContribution) return within.peers[item.step];
    if (item.role == ChainRole::kSeed) return plan.host_peers[plan.host - 1];
    return plan.host_peers[item.step];  // a pass or a final: the host it goes to or comes from
  };
  auto tag_of = [&](const ChainItem& item) {
    if (item.role == ChainRole::kContribution) return tag;
    return item.role == ChainRole::kFinal ? tag + 2 : tag + 1;
  };
  auto from = [&](std::size_t i) { return peer_of(receives[i]); };
  auto to = [&](std::size_t j) { return peer_of(sends[j]); };
  auto receive_tag = [&](std::size_t i) { return tag_of(receives[i]); };
  auto send_tag = [&](std::size_t j) { return tag_of(sends[j]); };
  auto may_start = [&](std::size_t j, std::size_t arrived) { return sends[j].after <= arrived; };
  while (!messages.done()) {
    bool progress = steps.poll();
    DDLFAST_RETURN_IF_ERROR(messages.post_receives(from, receive_tag, &progress));
    DDLFAST_RETURN_IF_ERROR(messages.advance_sends(may_start, to, send_tag, &progress));
    bool done = false;
    DDLFAST_RETURN_IF_ERROR(messages.next_arrived(&done));
    if (done) {
      const std::size_t i = messages.arrived();
      const ChainItem& item = receives[i];
      const ChunkItem chunk = item.chunk();
      if (item.role == ChainRole::kFinal) {
        DDLFAST_RETURN_IF_ERROR(inner.place_final(i, chunk));
      } else if (item.role == ChainRole::kSeed) {
        DDLFAST_RETURN_IF_ERROR(inner.begin_chunk(chunk, false));
        DDLFAST_RETURN_IF_ERROR(inner.load_seed(i, chunk));
        if (me == 0) DDLFAST_RETURN_IF_ERROR(inner.add_own(chunk, 1));  // coordinate 0 comes right after the seed
        DDLFAST_RETURN_IF_ERROR(inner.consumed(i));
      } else {
        const int j = item.step;
        if (!seeded && j == first) DDLFAST_RETURN_IF_ERROR(inner.begin_chunk(chunk, own_first));
        if (!seeded && j == 0 && !own_first) {
          DDLFAST_RETURN_IF_ERROR(inner.load(i, chunk));
        } else {
          if (j == me + 1 && (seeded ? me > 0 : !own_first)) DDLFAST_RETURN_IF_ERROR(inner.add_own(chunk, 1));
          DDLFAST_RETURN_IF_ERROR(inner.add(i, chunk, j == last && !own_last ? divisor : 1));
        }
        if (j == last) {
          if (own_last) DDLFAST_RETURN_IF_ERROR(inner.add_own(chunk, divisor));
          DDLFAST_RETURN_IF_ERROR(last_host ? inner.finish_chunk(chunk) : inner.keep_partial(chunk));
        }
        DDLFAST_RETURN_IF_ERROR(inner.consumed(i));
      }
      messages.take_arrived();
      progress = true;
    }
    DDLFAST_RETURN_IF_ERROR(messages.complete_sends(&progress));
    const std::size_t waiting = messages.arrived();
    DDLFAST_RETURN_IF_ERROR(
        messages.end_turn(progress, "canonical chain partial sums", waiting < receives.size() ? from(waiting) : -1));
  }
  return transport.wait_all();
}

}  // namespace ddlfast
