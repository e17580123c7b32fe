// The agreement and the latency path in memory shared by every rank of the communicator, when all run on one host
// (MpiTransport::agree; DDLFAST_SHARED_MEMORY). The same header, fingerprint and verdict as the butterfly's
// messages (agreement_wire.h), but no message: MPI's own small allreduce on one host goes through shared memory
// too, and a butterfly of point-to-point messages pays log2(p) of MPI's copies and matchings where this pays one
// copy in and, for the result, a read of what the others wrote.
//
// Each rank owns a slot per bank: a published counter, a reduced counter (each on its own cache line), the header,
// then up to the agreement capacity of payload. Collective s uses bank s % 2:
//   1. a rank writes its header and payload into its slot, then publishes s (a release store);
//   2. it waits until every slot of the bank shows s (acquire loads; stall-limited, the census answered, as every
//      wait) and reads every header: every rank reads the same headers, so all reach the same verdict and the
//      same reduction of the previous collective's waits (transport/arrivals.h), at no extra cost;
//   3. on agreement, the whole form reduces every payload in rank order into the caller's memory (the gathered
//      form, AgreedReduction::disjoint, writes only its own block and copies the others' blocks); in the halving
//      form (AgreedReduction::halve) a rank writes every block but its own into its slot, reduces only its own
//      block (rank order; its own operand read from its memory) into the part of its slot it left empty, marks it
//      reduced, waits for every block and copies them out. Either way every element is one reduction in rank
//      order: the bits are the same on every rank.
// Why two banks suffice: a rank writes bank s % 2 again only in collective s + 2, which it can enter only after
// every rank published s + 1, and a rank publishes s + 1 only once it has read all it needs of collective s.
// A disagreement, a rank on another form or the plain agreement beside the latency path all show in the headers,
// read before any payload; slots hold the capacity, so no size a rank passes can overrun another's.
#include <chrono>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"
#include "transport/agreement_wire.h"
#include "transport/mpi_transport.h"
#include "transport/shared_segment.h"

namespace ddlfast {
namespace {

using agreement_wire::disagrees;
using agreement_wire::kGathered;
using agreement_wire::kHalving;
using agreement_wire::kSmallAllreduce;
using agreement_wire::waits_in;
using agreement_wire::write_header;

constexpr std::size_t kPublishedOffset = 0;  // the collective whose header and payload this slot holds
constexpr std::size_t kReducedOffset = 64;   // the collective whose block this rank reduced into its slot
constexpr std::size_t kHeaderOffset = 128;
constexpr std::size_t kPayloadOffset = 192;
constexpr std::size_t kNameBytes = 64;
// How often a wait that gave its core away asks MPI whether a rank failed (ULFM; the census notices it too).
constexpr double kFailureCheckSeconds = 0.005;

std::size_t slot_bytes(std::size_t capacity) { return kPayloadOffset + (capacity + 63) / 64 * 64; }

std::uint64_t load(const char* counter) {
  return __atomic_load_n(reinterpret_cast<const std::uint64_t*>(counter), __ATOMIC_ACQUIRE);
}

void store(char* counter, std::uint64_t value) {
  __atomic_store_n(reinterpret_cast<std::uint64_t*>(counter), value, __ATOMIC_RELEASE);
}

// MPI writes into these whenever its operation completes, possibly after a creation that gave up: they are
// deliberately leaked then.
struct SharedSetup {
  char name[kNameBytes] = {};
  int usable = 0;
};

}  // namespace

Status MpiTransport::attach_shared_memory(bool wanted) {
  const std::size_t slot = slot_bytes(agreement_capacity_);
  const std::size_t bytes = 2 * static_cast<std::size_t>(size_) * slot;
  auto setup = std::make_unique<SharedSetup>();
  std::unique_ptr<SharedSegment> segment;
  if (rank_ == 0 && wanted) {
    const std::string name = SharedSegment::unique_name();
    if (SharedSegment::create(name, bytes, &segment).is_ok()) {
      std::strncpy(setup->name, name.c_str(), kNameBytes - 1);
    }
  }
  const char* what = "the other ranks to map the agreement's shared memory (creating the context)";
  MPI_Request request;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Ibcast(setup->name, kNameBytes, MPI_CHAR, 0, comm_, &request), "MPI_Ibcast", -1));
  Status status = wait_request(&request, what);
  if (status.is_ok()) {
    // Every rank wants it (a rank that does not, or fails to map it, turns it off for all), or none uses it.
    setup->usable = wanted && setup->name[0] != '\0';
    if (setup->usable && rank_ != 0) setup->usable = SharedSegment::open(setup->name, bytes, &segment).is_ok();
    status =
        check(MPI_Iallreduce(MPI_IN_PLACE, &setup->usable, 1, MPI_INT, MPI_MIN, comm_, &request), "MPI_Iallreduce", -1);
    if (status.is_ok()) status = wait_request(&request, what);
  }
  if (rank_ == 0 && segment != nullptr) SharedSegment::unlink(setup->name);  // every rank has mapped it or failed
  if (!status.is_ok()) {
    setup.release();  // see SharedSetup
    return status;
  }
  if (setup->usable) {
    shared_ = std::move(segment);
    shared_slot_bytes_ = slot;
  }
  return Status::ok();
}

char* MpiTransport::shared_slot(int rank) const {
  return shared_->data() + ((sequence_ & 1) * static_cast<std::size_t>(size_) + rank) * shared_slot_bytes_;
}

// Until every rank's slot of this collective shows it at `offset` (published or reduced).
Status MpiTransport::wait_shared(std::size_t offset, const char* what) {
  StallWatch watch(*this);  // spin, then yield, then sleep (poll_backoff.h), then the stall check
  const auto failure_check_period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(kFailureCheckSeconds));
  // Not before the first period: asking MPI costs microseconds (ULFM), more than most of these waits take.
  auto next_failure_check = std::chrono::steady_clock::now() + failure_check_period;
  for (int rank = 0; rank < size_;) {
    if (load(shared_slot(rank) + offset) == sequence_) {
      ++rank;
      watch.progressed();
      continue;
    }
    DDLFAST_RETURN_IF_ERROR(watch.idle(what, rank));
    const auto now = std::chrono::steady_clock::now();
    if (now < next_failure_check) continue;
    // No MPI call of this wait would fail on a dead rank (ULFM), so ask MPI directly, now and then.
    next_failure_check = now + failure_check_period;
    if (failure_known()) {
      return Status(StatusCode::kMpiError, "rank " + std::to_string(rank_) + " stopped waiting for " + what +
                                               " from rank " + std::to_string(rank) + " in collective #" +
                                               std::to_string(shown(sequence_)) + ": MPI reports a failed rank");
    }
  }
  return Status::ok();
}

Status MpiTransport::shared_exchange(std::uint64_t fingerprint, std::uint64_t form, const AgreedReduction* reduction,
                                     const char* what, bool* mismatch, ArrivalWaits* previous) {
  const std::size_t bytes = reduction == nullptr ? 0 : reduction->count * dtype_size(reduction->dtype);
  const std::size_t element = bytes ? dtype_size(reduction->dtype) : 1;
  const std::size_t count = bytes ? reduction->count : 0;
  char* result = bytes ? static_cast<char*>(reduction->data) : nullptr;
  auto block_low = [&](int rank) { return count * static_cast<std::size_t>(rank) / static_cast<std::size_t>(size_); };
  const std::size_t low = block_low(rank_), high = block_low(rank_ + 1);
  char* mine = shared_slot(rank_);
  write_header(mine + kHeaderOffset, fingerprint, false, bytes, form, *previous);
  if (form == kHalving) {  // the others read every block but this rank's own, which it reduces from its memory
    std::memcpy(mine + kPayloadOffset, result, low * element);
    std::memcpy(mine + kPayloadOffset + high * element, result + high * element, (count - high) * element);
  } else if (form == kGathered) {  // only this rank's block is not zero
    std::memcpy(mine + kPayloadOffset + low * element, result + low * element, (high - low) * element);
  } else if (bytes) {
    std::memcpy(mine + kPayloadOffset, result, bytes);
  }
  store(mine + kPublishedOffset, sequence_);
  DDLFAST_RETURN_IF_ERROR(wait_shared(kPublishedOffset, what));
  ArrivalWaits waits;
  for (int rank = 0; rank < size_; ++rank) {
    const char* header = shared_slot(rank) + kHeaderOffset;
    waits.combine(waits_in(header));
    *mismatch = *mismatch || disagrees(header, fingerprint, bytes, form);
  }
  *previous = waits;
  if (*mismatch || bytes == 0) return Status::ok();
  auto payload = [&](int rank, std::size_t from) { return shared_slot(rank) + kPayloadOffset + from * element; };
  if (form == kGathered) {  // every other rank's block where the sum would have put it; no wait follows
    for (int rank = 0; rank < size_; ++rank) {
      const std::size_t from = block_low(rank);
      if (rank != rank_)
        std::memcpy(result + from * element, payload(rank, from), (block_low(rank + 1) - from) * element);
    }
    return Status::ok();
  }
  if (form != kHalving) {  // every rank reduces everything; no wait follows, so the caller's memory is safe to use
    if (rank_ != 0) std::memcpy(result, payload(0, 0), bytes);  // rank 0's own value is there already
    for (int rank = 1; rank < size_; ++rank) {
      reduce_into(reduction->dtype, reduction->op, result, payload(rank, 0), count, 1);
    }
    return Status::ok();
  }
  // This rank's block, in rank order, into the part of its slot it left empty; its own value from its memory.
  const std::size_t kept = high - low;
  if (kept) {
    char* block = payload(rank_, low);
    std::memcpy(block, rank_ == 0 ? result + low * element : payload(0, low), kept * element);
    for (int rank = 1; rank < size_; ++rank) {
      const char* operand = rank == rank_ ? result + low * element : payload(rank, low);
      reduce_into(reduction->dtype, reduction->op, block, operand, kept, 1);
    }
  }
  store(mine + kReducedOffset, sequence_);
  // The caller's memory is written only once every block is there: a wait that fails leaves it as it was.
  DDLFAST_RETURN_IF_ERROR(wait_shared(kReducedOffset, kSmallAllreduce));
  for (int rank = 0; rank < size_; ++rank) {
    const std::size_t from = block_low(rank);
    std::memcpy(result + from * element, payload(rank, from), (block_low(rank + 1) - from) * element);
  }
  return Status::ok();
}

}  // namespace ddlfast
