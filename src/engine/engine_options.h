// What a caller sets for one collective on either executor, and the phase
// events they report for the timeline.
#pragma once

#include <chrono>
#include <cstddef>
#include <vector>

namespace ddlfast {

// One executed phase, for the timeline (seconds on the monotonic clock, the
// same clock as Python's time.perf_counter on Linux).
enum class EventKind : int { kReduceScatter = 0, kAllgather = 1, kMpiAllreduce = 2, kLatencyAllreduce = 3 };

struct PhaseEvent {
  EventKind kind;  // a ring phase, the handoff to the transport's allreduce, or the latency path
  int dim;
  double start_s;
  double end_s;
  std::size_t bytes;
};

// Which path takes buffers of at most small_bytes (DDLFAST_ALGORITHM): ddlfast's latency path, a butterfly
// whose messages carry the per-call agreement too (transport/agreement_exchange.cc), or MPI's own allreduce once
// the agreement passed.
enum class SmallPath : int { kLatency = 0, kMpi = 1 };

struct EngineOptions {
  std::size_t chunk_bytes = 1024 * 1024;
  int receives_in_flight = 4;  // scratch slots per reduce-scatter phase (>= 2)
  // Buffers of at most this many bytes go to MPI_Allreduce (latency-bound
  // sizes, where log(p) steps beat 2(p-1)). 0 disables the handoff.
  std::size_t small_bytes = 0;
  SmallPath small_path = SmallPath::kLatency;
  // The latency path halves payloads of at least this many bytes (recursive halving, then doubling: Rabenseifner's
  // algorithm inside the agreement's messages, agreement_exchange.cc); 0: never. The same on every rank.
  std::size_t halving_bytes = 0;
  std::vector<PhaseEvent>* events = nullptr;  // append phase events here when set
  // Wire type per torus dimension for float32 data: -1 sends float32, 0 fp16,
  // 1 bf16 (WireType). Empty: no compression anywhere.
  std::vector<int> wire_by_dim;
  // Reduce-scatter per torus dimension: 1 direct (all-to-all, engine/direct_phase.h), 0 the ring. Empty: the
  // ring everywhere. Both executors run it.
  std::vector<int> direct_by_dim;
  // reproducible=True across hosts: the ring's dims are (ranks per host, hosts) and the reduce-scatter is the
  // canonical order host by host (engine/chain_phase.h), whose bits are the flat direct order's. Both executors.
  bool chain = false;
  // reproducible=True: a direct reduce-scatter on the 16-bit wire rounds the owner's own contribution to the wire
  // type like every other, so a block's bits do not depend on which rank owns it (the canonical order). Otherwise
  // the owner adds its own values as they are: one wire rounding fewer per element (torch's fp16_compress_hook
  // rounds every contribution, and every partial sum).
  bool reproducible = false;
};

inline double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace ddlfast
