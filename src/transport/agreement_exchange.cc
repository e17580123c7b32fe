// The per-call agreement and the latency path, one exchange (MpiTransport::agree).
//
// Every rank runs the butterfly of algo/butterfly.h on its own communicator.
// Each message is a 48-byte header — the sender's fingerprint (the collective's
// sequence number mixed with its layout digest), the mismatch flag, the
// payload's byte count — then the payload: nothing for a plain agreement, the
// partial result of a small allreduce on the latency path. A receiver compares
// the header with its own and ORs any difference into its flag, which it sends
// on; the butterfly connects every pair of ranks, so after the last step every
// rank holds the same verdict, without a message more.
//
// The header also carries this rank's wait in the previous collective's
// agreement, reduced on the way to the least (with its rank) and the most: who
// the others waited for (transport/arrivals.h), at no message more.
//
// Receives are posted at the header plus the agreement capacity (the same on
// every rank), and no sender sends more, so ranks that disagree — even one on
// the latency path and one agreeing before a ring — exchange exactly the same
// messages: nothing is truncated, nothing is left in flight, and the context
// stays usable. Data is combined only while no mismatch has been seen, and
// lands in the caller's memory only when every rank agreed.
//
// Halving (AgreedReduction::halve, from EngineOptions::halving_bytes up; by
// default on one host with a core per rank): the butterfly's steps send half
// of what the rank still reduces, with the header (recursive halving), so
// every rank ends owning one reduced block and — the butterfly being complete
// — knowing the verdict; only when all agreed do the same steps run
// backwards, bare blocks of exact sizes (recursive doubling). Smaller messages
// (below MPI's eager size where the whole payload is above it) and about
// twice the payload moved instead of log2(p) times it, for log2(p) steps
// more. Every block is reduced by one rank and copied to the others: the bits
// are the same on every rank. The header says which form its sender runs, and
// another form is a disagreement, so ranks never run different step counts
// on one verdict.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <utility>

#include "algo/butterfly.h"
#include "kernels/cpu/cpu_kernels.h"
#include "transport/agreement_wire.h"
#include "transport/mpi_transport.h"
#include "transport/shared_segment.h"

namespace ddlfast {
namespace {

using agreement_wire::disagrees;
using agreement_wire::kAgreement;
using agreement_wire::kGathered;
using agreement_wire::kHalving;
using agreement_wire::kHeaderBytes;
using agreement_wire::kSmallAllreduce;
using agreement_wire::kWhole;
using agreement_wire::mix;
using agreement_wire::waits_in;
using agreement_wire::write_header;
constexpr int kExchangeTag = 0;

// The part of [low, high) a rank keeps at a halving step: the lower half when its partner is the higher rank.
struct Halves {
  std::size_t low, middle, high;
  bool keeps_lower;
  std::size_t kept_low() const { return keeps_lower ? low : middle; }
  std::size_t kept_high() const { return keeps_lower ? middle : high; }
  std::size_t sent_low() const { return keeps_lower ? middle : low; }
  std::size_t sent_high() const { return keeps_lower ? high : middle; }
};

}  // namespace

void MpiTransport::allocate_exchange() {
  if (size_ == 1) return;
  // Written before read (a header, a payload, a message received): no zeroing, so a page is resident only once a
  // call that large used it.
  scratch_->exchange[0].resize(kHeaderBytes + agreement_capacity_);
  scratch_->exchange[1].resize(kHeaderBytes + agreement_capacity_);
  // Halving sends at most the upper half: half the capacity, rounded up to whole elements (8 bytes at most).
  scratch_->exchange[2].resize(kHeaderBytes + agreement_capacity_ / 2 + 8);
}

Status MpiTransport::grow_agreement_capacity(std::size_t capacity) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (capacity <= agreement_capacity_) return Status::ok();
  const std::size_t before = agreement_capacity_;
  agreement_capacity_ = capacity;
  if (shared_ == nullptr) {  // the butterfly's buffers: unused while the agreement runs in shared memory
    allocate_exchange();
    return Status::ok();
  }
  // The slots hold the old capacity: map larger ones beside them, on every rank alike (shared_agreement.cc). Where
  // any rank cannot (a small /dev/shm), every rank keeps the old slots and capacity: calls past it take the ring.
  const std::size_t old_slot_bytes = shared_slot_bytes_;
  const Status attached = attach_shared_memory(true);
  // Kept (on an error too): no call may pass the old slots' capacity.
  if (shared_slot_bytes_ == old_slot_bytes) agreement_capacity_ = before;
  return attached;
}

Status MpiTransport::exchange_step(int peer, const char* send, std::size_t send_bytes, char* receive,
                                   const char* what) {
  return exchange_bytes(peer, send, kHeaderBytes + send_bytes, receive, kHeaderBytes + agreement_capacity_, what);
}

Status MpiTransport::exchange_bytes(int peer, const char* send, std::size_t send_bytes, char* receive,
                                    std::size_t receive_bytes, const char* what) {
  MPI_Request receiving = MPI_REQUEST_NULL;
  MPI_Request sending = MPI_REQUEST_NULL;
  if (receive != nullptr) {
    DDLFAST_RETURN_IF_ERROR(check(
        MPI_Irecv(receive, static_cast<int>(receive_bytes), MPI_BYTE, peer, kExchangeTag, agree_comm_, &receiving),
        "MPI_Irecv", peer));
  }
  if (send != nullptr) {
    DDLFAST_RETURN_IF_ERROR(
        check(MPI_Isend(send, static_cast<int>(send_bytes), MPI_BYTE, peer, kExchangeTag, agree_comm_, &sending),
              "MPI_Isend", peer));
  }
  DDLFAST_RETURN_IF_ERROR(wait_request(&sending, what, peer));
  return wait_request(&receiving, what, peer);
}

Status MpiTransport::halve_and_double(const Butterfly& plan, std::uint64_t fingerprint, char* mine, char* theirs,
                                      const AgreedReduction& reduction, bool* mismatch, ArrivalWaits* previous) {
  const std::size_t element = dtype_size(reduction.dtype);
  const std::size_t bytes = reduction.count * element;
  char* sending = scratch_->exchange[2].data();
  char* payload = mine + kHeaderBytes;
  std::array<Halves, 64> steps;  // one per butterfly step: log2(p) < 32
  std::size_t taken = 0;
  std::size_t low = 0, high = reduction.count;
  for (int peer : plan.step_partners) {
    const Halves halves{low, low + (high - low) / 2, high, rank_ < peer};
    write_header(sending, fingerprint, *mismatch, bytes, kHalving, *previous);
    const std::size_t sent = (halves.sent_high() - halves.sent_low()) * element;
    std::memcpy(sending + kHeaderBytes, payload + halves.sent_low() * element, sent);
    DDLFAST_RETURN_IF_ERROR(exchange_step(peer, sending, sent, theirs, kSmallAllreduce));
    previous->combine(waits_in(theirs));
    *mismatch = *mismatch || disagrees(theirs, fingerprint, bytes, kHalving);
    const std::size_t kept = halves.kept_high() - halves.kept_low();
    char* block = payload + halves.kept_low() * element;
    if (!*mismatch && kept) {  // the lower rank's value first, as in the butterfly
      if (peer < rank_) {
        reduce_into(reduction.dtype, reduction.op, theirs + kHeaderBytes, block, kept, 1);
        std::memcpy(block, theirs + kHeaderBytes, kept * element);
      } else {
        reduce_into(reduction.dtype, reduction.op, block, theirs + kHeaderBytes, kept, 1);
      }
    }
    steps[taken++] = halves;
    low = halves.kept_low();
    high = halves.kept_high();
  }
  // Every rank knows the verdict now (the butterfly is complete): on a mismatch none doubles.
  if (*mismatch) return Status::ok();
  // The owners' blocks, back along the same partners.
  for (std::size_t step = taken; step-- > 0;) {
    const Halves& halves = steps[step];
    const int peer = plan.step_partners[step];
    DDLFAST_RETURN_IF_ERROR(exchange_bytes(
        peer, payload + halves.kept_low() * element, (halves.kept_high() - halves.kept_low()) * element,
        payload + halves.sent_low() * element, (halves.sent_high() - halves.sent_low()) * element, kSmallAllreduce));
  }
  return Status::ok();
}

Status MpiTransport::butterfly_exchange(std::uint64_t fingerprint, std::uint64_t form, const AgreedReduction* reduction,
                                        const char* what, bool* mismatch_out, ArrivalWaits* previous_out) {
  const std::size_t bytes = reduction == nullptr ? 0 : reduction->count * dtype_size(reduction->dtype);
  ArrivalWaits& previous = *previous_out;
  char* mine = scratch_->exchange[0].data();  // this rank's partial result, behind its header
  char* theirs = scratch_->exchange[1].data();
  if (bytes) std::memcpy(mine + kHeaderBytes, reduction->data, bytes);
  const Butterfly plan = butterfly(rank_, size_);
  bool& mismatch = *mismatch_out;
  // Combines the partner's payload with this rank's, the lower rank's value first (algo/butterfly.h).
  auto take = [&](int peer) {
    previous.combine(waits_in(theirs));
    mismatch = mismatch || disagrees(theirs, fingerprint, bytes, form);
    if (mismatch || bytes == 0) return;
    if (peer < rank_) {
      reduce_into(reduction->dtype, reduction->op, theirs + kHeaderBytes, mine + kHeaderBytes, reduction->count, 1);
      std::swap(mine, theirs);
    } else {
      reduce_into(reduction->dtype, reduction->op, mine + kHeaderBytes, theirs + kHeaderBytes, reduction->count, 1);
    }
  };
  if (plan.role == ButterflyRole::kFoldOut) {  // give the value away, get the result back
    write_header(mine, fingerprint, false, bytes, form, previous);
    DDLFAST_RETURN_IF_ERROR(exchange_step(plan.fold_partner, mine, bytes, theirs, what));
    mismatch = disagrees(theirs, fingerprint, bytes, form);
    previous = waits_in(theirs);  // the whole reduction
    std::swap(mine, theirs);
  } else {
    if (plan.role == ButterflyRole::kFoldIn) {
      DDLFAST_RETURN_IF_ERROR(exchange_step(plan.fold_partner, nullptr, 0, theirs, what));
      take(plan.fold_partner);
    }
    if (form == kHalving) {
      DDLFAST_RETURN_IF_ERROR(halve_and_double(plan, fingerprint, mine, theirs, *reduction, &mismatch, &previous));
    } else {
      for (int peer : plan.step_partners) {
        write_header(mine, fingerprint, mismatch, bytes, form, previous);
        DDLFAST_RETURN_IF_ERROR(exchange_step(peer, mine, bytes, theirs, what));
        take(peer);
      }
    }
    if (plan.role == ButterflyRole::kFoldIn) {
      write_header(mine, fingerprint, mismatch, bytes, form, previous);
      DDLFAST_RETURN_IF_ERROR(exchange_step(plan.fold_partner, mine, bytes, nullptr, what));
    }
  }
  if (!mismatch && bytes) std::memcpy(reduction->data, mine + kHeaderBytes, bytes);
  return Status::ok();
}

Status MpiTransport::agree(std::uint64_t digest, bool* agreed, const AgreedReduction* reduction) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (!later_failure_.empty()) {  // another rank abandoned this collective after finishing the last one
    mark_broken(later_failure_);
    return Status(later_failure_code_, later_failure_);
  }
  const std::size_t bytes = reduction == nullptr ? 0 : reduction->count * dtype_size(reduction->dtype);
  if (bytes > agreement_capacity_) {
    return Status::invalid("the latency path carries at most " + std::to_string(agreement_capacity_) + " bytes, not " +
                           std::to_string(bytes));
  }
  const std::uint64_t fingerprint = mix(++sequence_, digest);
  *agreed = true;
  const auto arrived = std::chrono::steady_clock::now();
  flight_.begin(sequence_, digest, FlightLog::seconds(arrived));
  if (size_ == 1) {
    flight_.agreed(0, true, FlightLog::seconds(arrived));
    return Status::ok();
  }
  // This rank's wait in the previous collective (none before the first), reduced with every partner's.
  ArrivalWaits previous = sequence_ > 1 ? ArrivalWaits::of_rank(last_wait_us_, rank_) : ArrivalWaits{};
  const char* what = bytes ? kSmallAllreduce : kAgreement;
  // A rank that abandoned this collective (Ctrl-C, a failure) may have sent all its messages first, so the
  // exchange could complete here (with the right numbers: every contribution arrived): a notice of it that has
  // already come fails this rank now, as a wait would; one still on its way fails the next collective.
  if (census_ask_arrived()) return answer_census(what, -1);
  const std::uint64_t form = !bytes                                      ? kWhole
                             : shared_ != nullptr && reduction->disjoint ? kGathered
                             : reduction->halve                          ? kHalving
                                                                         : kWhole;
  bool mismatch = false;
  if (shared_ != nullptr) {
    DDLFAST_RETURN_IF_ERROR(shared_exchange(fingerprint, form, reduction, what, &mismatch, &previous));
  } else {
    DDLFAST_RETURN_IF_ERROR(butterfly_exchange(fingerprint, form, reduction, what, &mismatch, &previous));
  }
  *agreed = !mismatch;
  arrivals_.add(sequence_ - 1, previous);
  const auto done = std::chrono::steady_clock::now();
  const std::chrono::duration<double> waited = done - arrived;
  last_wait_us_ = static_cast<std::uint64_t>(waited.count() * 1e6);
  flight_.agreed(waited.count(), *agreed, FlightLog::seconds(done));
  return Status::ok();
}

}  // namespace ddlfast
