#include "engine/device_ring_allreduce.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>

#include "engine/chunking.h"
#include "kernels/cpu/cpu_kernels.h"
#include "transport/mpi_transport.h"

namespace ddlfast {
namespace {

using namespace chunking;  // NOLINT: the engine's chunk and tag helpers

// Marker numbers: one shared "everything enqueued so far" marker, then one
// per receive slot and one per send slot.
constexpr int kNowMarker = 0;
int recv_marker(int slot) { return 1 + slot; }
int send_marker(int slots, int slot) { return 1 + slots + slot; }

constexpr int kSpinsBeforeYield = 64;

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Status mpi_status(int code, const char* what, int peer) {
  if (code == MPI_SUCCESS) return Status::ok();
  return Status(StatusCode::kMpiError,
                std::string(what) + " with rank " + std::to_string(peer) + " failed: " + mpi_error_string(code));
}

// Turns of the polling loop that changed nothing: yield now and then, and let
// the transport decide (its one stall limit and census) once nothing has moved.
class Stall {
 public:
  explicit Stall(MpiTransport* transport) : transport_(transport), last_progress_(std::chrono::steady_clock::now()) {}
  void progressed() {
    idle_turns_ = 0;
    last_progress_ = std::chrono::steady_clock::now();
  }
  Status idle(const char* what, int peer) {
    if (++idle_turns_ % kSpinsBeforeYield != 0) return Status::ok();
    sched_yield();
    return transport_->idle(last_progress_, what, peer);
  }

 private:
  MpiTransport* transport_;
  std::chrono::steady_clock::time_point last_progress_;
  int idle_turns_ = 0;
};

// Requests a phase posted itself: on any early return the receives are
// cancelled (nothing may land in device memory later) and sends released.
struct PostedRequests {
  std::vector<MPI_Request> receives, sent;
  explicit PostedRequests(int slots) : receives(slots, MPI_REQUEST_NULL), sent(slots, MPI_REQUEST_NULL) {}
  ~PostedRequests() {
    for (MPI_Request& request : receives) {
      if (request == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
    }
    for (MPI_Request& request : sent) {
      if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
    }
  }
};

Status check_bytes(std::size_t bytes) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) return Status::invalid("a chunk of more than 2 GiB");
  return Status::ok();
}

enum SendState : int { kFree = 0, kCopying = 1, kInFlight = 2 };

// One message this rank sends in a phase: its own data (step 0) or a
// received chunk passed on once it is in place.
struct Send {
  std::size_t offset;
  std::size_t count;
  int step;
  long long forward_of;  // index of the received chunk it forwards; -1 for own data
};

}  // namespace

std::size_t staging_slot_bytes(std::size_t chunk_bytes) {
  const std::size_t chunk = std::max<std::size_t>(chunk_bytes, 8);
  return (chunk + 16 + 255) / 256 * 256;
}

struct DeviceRingAllreduce::Phase {
  const SegmentedBuffer& data;
  const RingPhase& ring;
  int tag_base;
  DType dtype;
  std::size_t chunk_elems;
  DeviceTransfer transfer;
  DeviceLanes* lanes;
  const DeviceStaging& staging;
  MPI_Comm comm;
  int rank;

  bool staged() const { return transfer == DeviceTransfer::kStaged; }
  std::size_t esize() const { return dtype_size(dtype); }
  char* host_recv(int slot) const { return staging.host_recv + slot * staging.slot_bytes; }
  char* host_send(int slot) const { return staging.host_send + slot * staging.slot_bytes; }
  // A device scratch slot at the same address mod 16 as `target`.
  char* device_recv(int slot, const void* target) const {
    return staging.device_recv + slot * staging.slot_bytes + reinterpret_cast<std::uintptr_t>(target) % 16;
  }
};

Status DeviceRingAllreduce::create(MpiTransport* transport, const std::vector<int>& dims,
                                   const std::vector<int>& order, std::unique_ptr<DeviceRingAllreduce>* out) {
  RankedTorus ring;
  DDLFAST_RETURN_IF_ERROR(RankedTorus::make(dims, order, transport->size(), transport->rank(), &ring));
  out->reset(new DeviceRingAllreduce(transport, std::move(ring)));
  return Status::ok();
}

// Tiny buffers: through host memory to MPI_Allreduce, as the host engine does
// (and with its arithmetic, so the bits agree).
Status DeviceRingAllreduce::run_small(const SegmentedBuffer& data, DType dtype, int divisor, DeviceLanes* lanes,
                                      const EngineOptions& options) {
  const std::size_t count = data.count();
  const std::size_t esize = dtype_size(dtype);
  const double start = monotonic_seconds();
  std::vector<char> host(count * esize);
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = data.contiguous_from(done);
    DDLFAST_RETURN_IF_ERROR(lanes->copy(host.data() + done * esize, data.address(done), n * esize, Lane::kInbound));
    done += n;
  }
  DDLFAST_RETURN_IF_ERROR(lanes->mark(kNowMarker, Lane::kInbound));
  DDLFAST_RETURN_IF_ERROR(lanes->wait(kNowMarker));
  DDLFAST_RETURN_IF_ERROR(transport_->native_allreduce(host.data(), count, dtype));
  if (divisor != 1) {
    std::vector<char> zeros(count * esize, 0);
    reduce_into(dtype, host.data(), zeros.data(), count, divisor);
  }
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = data.contiguous_from(done);
    DDLFAST_RETURN_IF_ERROR(lanes->copy(data.address(done), host.data() + done * esize, n * esize, Lane::kInbound));
    done += n;
  }
  DDLFAST_RETURN_IF_ERROR(lanes->mark(kNowMarker, Lane::kInbound));
  DDLFAST_RETURN_IF_ERROR(lanes->wait(kNowMarker));  // `host` is freed on return
  if (options.events) options.events->push_back({2, -1, start, monotonic_seconds(), count * esize});
  return Status::ok();
}

Status DeviceRingAllreduce::run(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options,
                                const DeviceRunOptions& run, DeviceLanes* lanes, const DeviceStaging& staging) {
  const int world = ring_.torus.world_size();
  const std::size_t count = data.count();
  if (count == 0 || world == 1) return Status::ok();
  // min, max and product run in the host engine on pinned copies (ddlfast/context.py, _HOST_ARITHMETIC): its
  // kernels alone carry their nan and signed-zero rules.
  if (op != ReduceOp::kSum && op != ReduceOp::kAverage) {
    return Status::invalid(std::string("op='") + reduce_op_name(op) + "' is not implemented in the GPU ring; stage "
                           "through host memory");
  }
  if (std::any_of(options.wire_by_dim.begin(), options.wire_by_dim.end(), [](int wire) { return wire >= 0; })) {
    return Status::invalid("wire compression is not implemented in the GPU ring; stage through host memory");
  }
  const std::size_t esize = dtype_size(dtype);
  const int divisor = op == ReduceOp::kAverage ? world : 1;
  DDLFAST_RETURN_IF_ERROR(lanes->reserve_markers(1 + 2 * std::max(staging.slots, 0)));
  if (count * esize <= options.small_bytes) return run_small(data, dtype, divisor, lanes, options);

  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / esize);
  DDLFAST_RETURN_IF_ERROR(check_bytes(chunk_elems * esize));
  const bool staged = run.transfer == DeviceTransfer::kStaged;
  if (staging.slots < 2 || staging.slot_bytes < staging_slot_bytes(chunk_elems * esize) ||
      staging.device_recv == nullptr || (staged && (staging.host_recv == nullptr || staging.host_send == nullptr))) {
    return Status(StatusCode::kInternal, "GPU ring: staging slots missing or smaller than one chunk");
  }

  const RingSchedule schedule = build_rank_schedule(ring_, count);
  const int last_reduce_scatter = last_reduce_scatter_phase(schedule);
  for (int i = 0; i < static_cast<int>(schedule.phases.size()); ++i) {
    const RingPhase& ring = schedule.phases[i];
    const Phase phase{data, ring, (i * kTagsPerPhase) % kTagSpace, dtype, chunk_elems, run.transfer,
                      lanes, staging, transport_->comm(), transport_->rank()};
    const double start = monotonic_seconds();
    const bool reduce = ring.kind == PhaseKind::kReduceScatter;
    DDLFAST_RETURN_IF_ERROR(run_phase(phase, reduce, reduce && i == last_reduce_scatter ? divisor : 1));
    if (options.events) {
      std::size_t phase_bytes = 0;
      for (const RingStep& step : ring.steps) phase_bytes += step.send.count * esize;
      options.events->push_back({static_cast<int>(ring.kind), ring.dim, start, monotonic_seconds(), phase_bytes});
    }
  }
  return Status::ok();
}

// One phase, reduce-scatter or allgather, as a polling loop.
//
// Receives rotate through `slots` slots in chunk order; chunk j+slots reuses
// chunk j's slot once the inbound lane has consumed it (its marker), so a
// receive slot waits for the device only, never for MPI. Sends (own data
// first, then every arrived chunk of every step but the last) rotate through
// `slots` send slots and start strictly in that order, which is the order in
// which the successor posts its receives, so the send slots always hold the
// successor's next messages and the ring cannot deadlock (holding a receive
// slot until its forward completed can: every rank's slots fill with
// forwards that the next rank has no room to receive). A send is copied out
// to its pinned slot (staged) or marked ready (direct), then posted in order,
// since MPI matches same-tag messages in posting order.
//
// What an arrived chunk does: reduce-scatter staged: pinned slot -> device
// scratch -> reduced into the data; direct: reduced from the device scratch
// it was received into. Allgather staged: pinned slot -> its place in the
// data; direct: received in place, nothing to do.
Status DeviceRingAllreduce::run_phase(const Phase& p, bool reduce, int final_divisor) {
  const RingPhase& ring = p.ring;
  const std::size_t esize = p.esize();
  const std::vector<ChunkItem> items = chunk_items(p.data, ring, p.chunk_elems);
  const int last_step = static_cast<int>(ring.steps.size()) - 1;
  std::vector<Send> sends;
  {
    std::vector<ChunkItem> own;
    append_chunks(p.data, 0, ring.steps[0].send, p.chunk_elems, &own);
    for (const ChunkItem& c : own) sends.push_back({c.offset, c.count, 0, -1});
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (items[i].step < last_step) sends.push_back({items[i].offset, items[i].count, items[i].step + 1,
                                                      static_cast<long long>(i)});
    }
  }
  const int slots = p.staging.slots;
  DeviceLanes* lanes = p.lanes;
  DDLFAST_RETURN_IF_ERROR(lanes->mark(kNowMarker, Lane::kInbound));
  if (p.staged()) {
    // Copies of own data start after everything enqueued before this phase.
    DDLFAST_RETURN_IF_ERROR(lanes->lane_wait(Lane::kOutbound, kNowMarker));
  } else if (!reduce) {
    // MPI will write the data in place: let every earlier kernel finish first.
    DDLFAST_RETURN_IF_ERROR(lanes->wait(kNowMarker));
  }
  PostedRequests requests(slots);
  std::vector<MPI_Request>& receives = requests.receives;
  std::vector<MPI_Request>& sent = requests.sent;
  std::vector<int> send_state(slots, kFree);
  std::size_t posted = 0, arrived = 0, started = 0, posted_sends = 0, finished_sends = 0;
  Stall stall(transport_);
  while (arrived < items.size() || finished_sends < sends.size()) {
    bool progress = false;
    lanes->poll();
    // 1. Post receives into slots the lanes are done with.
    while (posted < items.size() && posted < arrived + slots) {
      const int k = static_cast<int>(posted % slots);
      bool free = true;
      DDLFAST_RETURN_IF_ERROR(lanes->passed(recv_marker(k), &free));
      if (!free) break;
      const ChunkItem& item = items[posted];
      char* target = p.data.address(item.offset);
      void* buffer = p.staged() ? p.host_recv(k) : (reduce ? p.device_recv(k, target) : target);
      DDLFAST_RETURN_IF_ERROR(mpi_status(
          MPI_Irecv(buffer, static_cast<int>(item.count * esize), MPI_BYTE, ring.predecessor,
                    step_tag(p.tag_base, item.step), p.comm, &receives[k]),
          "MPI_Irecv", ring.predecessor));
      ++posted;
      progress = true;
    }
    // 2. Take arrived chunks, in order.
    while (arrived < posted) {
      const int k = static_cast<int>(arrived % slots);
      int done = 0;
      DDLFAST_RETURN_IF_ERROR(
          mpi_status(MPI_Test(&receives[k], &done, MPI_STATUS_IGNORE), "MPI_Test", ring.predecessor));
      if (!done) break;
      const ChunkItem& item = items[arrived];
      const std::size_t bytes = item.count * esize;
      char* target = p.data.address(item.offset);
      if (reduce) {
        char* scratch = p.device_recv(k, target);
        if (p.staged()) DDLFAST_RETURN_IF_ERROR(lanes->copy(scratch, p.host_recv(k), bytes, Lane::kInbound));
        DDLFAST_RETURN_IF_ERROR(lanes->reduce(p.dtype, target, scratch, item.count,
                                              item.step == last_step ? final_divisor : 1, Lane::kInbound));
      } else if (p.staged()) {
        DDLFAST_RETURN_IF_ERROR(lanes->copy(target, p.host_recv(k), bytes, Lane::kInbound));
      }
      // The slot is free again once the inbound lane has consumed it.
      DDLFAST_RETURN_IF_ERROR(lanes->mark(recv_marker(k), Lane::kInbound));
      ++arrived;
      progress = true;
    }
    // 3. Start sends in order, once their slot is free and their data has arrived.
    while (started < sends.size()) {
      const int k = static_cast<int>(started % slots);
      const Send& send = sends[started];
      if (send_state[k] != kFree || (send.forward_of >= 0 && static_cast<std::size_t>(send.forward_of) >= arrived)) {
        break;
      }
      if (p.staged()) {
        if (send.forward_of >= 0) {  // after the copy or reduce that put it in place
          DDLFAST_RETURN_IF_ERROR(lanes->mark(kNowMarker, Lane::kInbound));
          DDLFAST_RETURN_IF_ERROR(lanes->lane_wait(Lane::kOutbound, kNowMarker));
        }
        DDLFAST_RETURN_IF_ERROR(
            lanes->copy(p.host_send(k), p.data.address(send.offset), send.count * esize, Lane::kOutbound));
        DDLFAST_RETURN_IF_ERROR(lanes->mark(send_marker(slots, k), Lane::kOutbound));
      } else {
        DDLFAST_RETURN_IF_ERROR(lanes->mark(send_marker(slots, k), Lane::kInbound));
      }
      send_state[k] = kCopying;
      ++started;
      progress = true;
    }
    // 4. Post, in order, the sends whose data is ready.
    while (posted_sends < started) {
      const int k = static_cast<int>(posted_sends % slots);
      bool ready = false;
      DDLFAST_RETURN_IF_ERROR(lanes->passed(send_marker(slots, k), &ready));
      if (!ready) break;
      const Send& send = sends[posted_sends];
      const void* buffer = p.staged() ? static_cast<const void*>(p.host_send(k)) : p.data.address(send.offset);
      DDLFAST_RETURN_IF_ERROR(mpi_status(
          MPI_Isend(buffer, static_cast<int>(send.count * esize), MPI_BYTE, ring.successor,
                    step_tag(p.tag_base, send.step), p.comm, &sent[k]),
          "MPI_Isend", ring.successor));
      send_state[k] = kInFlight;
      ++posted_sends;
      progress = true;
    }
    // 5. Free the slots of completed sends.
    for (int k = 0; k < slots; ++k) {
      if (send_state[k] != kInFlight) continue;
      int done = 0;
      DDLFAST_RETURN_IF_ERROR(mpi_status(MPI_Test(&sent[k], &done, MPI_STATUS_IGNORE), "MPI_Test", ring.successor));
      if (done) {
        send_state[k] = kFree;
        ++finished_sends;
        progress = true;
      }
    }
    if (progress) {
      stall.progressed();
    } else {
      DDLFAST_RETURN_IF_ERROR(stall.idle(reduce ? "GPU ring reduce-scatter chunks" : "GPU ring allgather chunks",
                                         ring.predecessor));
    }
  }
  return Status::ok();
}

}  // namespace ddlfast
