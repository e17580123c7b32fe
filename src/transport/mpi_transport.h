// Transport over MPI on a private duplicate of the caller's communicator, so
// ddlfast's messages never match the application's. Every wait in ddlfast —
// both ring executors' phase loops, the small-message collectives, the
// per-call agreement and the Python side's control collectives — polls
// through one stall check here (idle, reached through StallWatch), which also
// answers the stall census (below).
//
// Stall census. When a wait passes DDLFAST_TIMEOUT_S, the rank asks every
// other rank "are you there?" on a census communicator of its own. A rank that
// is inside any ddlfast wait answers at once (its poll loop tests for asks),
// then learns the verdict and fails too; a rank that does not answer within
// kCensusSeconds is named as the one that never joined. So every live rank
// raises within the stall limit plus a few seconds, naming the missing ranks,
// and no census message can be mistaken for data (own communicator and tags).
//
// After a failure with messages in flight the transport is broken: receives
// are cancelled (nothing may later land in user memory), sends are released
// (never cancelled), and every later call fails with the first reason.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/uninitialized_vector.h"
#include "kernels/cpu/cpu_kernels.h"
#include "transport/arrivals.h"
#include "transport/flight_log.h"
#include "transport/transport.h"

namespace ddlfast {

struct Butterfly;     // algo/butterfly.h
class SharedSegment;  // transport/shared_segment.h

std::string mpi_error_string(int code);
std::string mpi_library_version();

class MpiTransport final : public Transport {
 public:
  // Duplicates `comm` (collective over it; gives up after timeout_s > 0) and
  // sets MPI_ERRORS_RETURN on the copy. `agreement_capacity`: how many bytes
  // of a small allreduce each agreement message may carry (the latency path);
  // every rank must pass the same (the context's creation agreement checks the
  // setting it comes from before any message carries data). `shared_memory`: where every rank of `comm` runs on
  // one host, run the agreement in memory they share instead of the butterfly's messages (shared_agreement.cc);
  // used only when every rank asks for it and maps the segment.
  static Status create(MPI_Comm comm, double timeout_s, std::size_t agreement_capacity, bool shared_memory,
                       std::unique_ptr<MpiTransport>* out);
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }
  // How long each later wait spins before it yields (DDLFAST_SPIN_US), in
  // place of the automatic choice made at creation. Rank-local. Set it before
  // any collective: the waits read it unsynchronized.
  void set_spin_us(double microseconds) { spin_us_ = microseconds; }
  double spin_us() const override { return spin_us_; }

  Status isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) override;
  Status irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) override;
  Status test(RequestId request, bool* done) override;
  Status wait(RequestId request) override;
  Status wait_all() override;

  // Polls any MPI request (also the Python side's, on other communicators)
  // until it completes, the stall limit passes (census, then kTimeout), or
  // request_stop() is called (kAborted). `what` names the wait in messages;
  // peer < 0: a collective.
  Status wait_request(MPI_Request* request, const char* what, int peer = -1);
  // wait_request for a point-to-point message of the caller's own (the torch backend's send/recv): while it
  // waits, a stall census reports this rank as waiting in a receive (kind kWaitReceive) or send (kWaitSend)
  // with `peer` (-1: any rank) and the caller's `tag`, so a rank waiting for a message no rank sends is named
  // as such, not as "only slower than DDLFAST_TIMEOUT_S".
  static constexpr std::int64_t kWaitCollective = 0;
  static constexpr std::int64_t kWaitReceive = 1;
  static constexpr std::int64_t kWaitSend = 2;
  Status wait_point_to_point(MPI_Request* request, const char* what, std::int64_t kind, int peer, std::int64_t tag);
  // What every wait does between polls (Transport::idle, through
  // StallWatch): fails when the context is being closed, answers a census,
  // and runs one (kTimeout) once nothing has moved since `since` for the
  // stall limit.
  Status idle(std::chrono::steady_clock::time_point since, const char* what, int peer) override;

  // The per-call agreement (transport/agreement_exchange.cc): *agreed when
  // every rank passed the same digest in the same collective (this
  // transport's sequence number, counted here and mixed into the
  // fingerprint). A butterfly of point-to-point messages on a communicator of
  // its own, each headed by the sender's fingerprint: every rank compares its
  // partners' with its own and passes any mismatch on, so all ranks learn the
  // outcome together, with nothing left in flight. With `reduction`, a small
  // allreduce rides in the same messages (the latency path), and lands in its
  // data only when every rank agreed.
  Status agree(std::uint64_t digest, bool* agreed, const AgreedReduction* reduction = nullptr) override;
  std::size_t agreement_capacity() const override { return agreement_capacity_; }
  // Whether the agreement runs in memory shared by every rank (shared_agreement.cc), the same on every rank.
  bool shared_memory() const { return shared_ != nullptr; }
  // Raises the capacity to `capacity` bytes (never lowers it): between collectives, alike on every rank, since
  // receives are posted at it (the context does, once, from the topology every rank shares, where the cost model
  // takes the latency path past the capacity it was created with). A shared segment is mapped anew at the
  // capacity (collective); where that fails on any rank, every rank keeps the old slots and the old capacity.
  Status grow_agreement_capacity(std::size_t capacity);
  // The sequence number of the latest agreement (the collective in progress).
  std::uint64_t sequence() const { return sequence_; }
  // Collectives as users count them: the context's creation agreement is not one of theirs, so the binding calls
  // number_from_here() once it passed, and the user's first call is #1 in every text, record and census report
  // (all ranks count from the same agreement). The sequence itself, compared across ranks, is unchanged.
  void number_from_here() { numbering_base_ = sequence_; }
  std::int64_t shown(std::uint64_t sequence) const { return static_cast<std::int64_t>(sequence - numbering_base_); }
  // Who the others waited for in each collective (transport/arrivals.h): the same log on every rank, up to the
  // collective before the latest agreement. Thread: the one running collectives.
  ArrivalLog& arrivals() { return arrivals_; }
  // The flight recorder's per-call entries (transport/flight_log.h), one per agreement. Thread: the one
  // running collectives.
  FlightLog& flight() { return flight_; }
  // This rank's wait in the latest agreement (microseconds, its own clock).
  std::uint64_t last_wait_us() const { return last_wait_us_; }

  // MPI's own allreduce on the private communicator (the small-message path),
  // stall-limited, through an internal copy so that a collective abandoned
  // after a stall can never write into the caller's memory.
  // fp16/bf16 sums and every min, max and product use ddlfast's kernels as
  // user-defined MPI ops (created with the transport, freed with it), so the
  // nan and signed-zero rules are the ring's. `op` is not kAverage.
  Status native_allreduce(void* data, std::size_t count, DType dtype, ReduceOp op = ReduceOp::kSum) override;
  // MPI's reduce-scatter (the small-message path of reduce_scatter): `send`
  // holds counts[q] elements for each rank q in rank order, `recv` gets this
  // rank's counts[rank] reduced elements. Stall-limited, through internal
  // copies like native_allreduce; ops as native_allreduce.
  Status native_reduce_scatter(const void* send, void* recv, const std::vector<std::size_t>& counts, DType dtype,
                               ReduceOp op = ReduceOp::kSum) override;
  // MPI's allgather of bytes: `send` is this rank's bytes[rank] bytes, `recv`
  // gets every rank's bytes in rank order (MPI_Allgatherv when they differ).
  Status native_allgather(const void* send, void* recv, const std::vector<std::size_t>& bytes) override;

  // After a failed collective: cancel receives, release sends, refuse all
  // later work with the failure's message, and tell the other ranks (a
  // census, so ranks waiting for this one fail at once). No-op when nothing
  // was in flight and the failure did not abandon a collective (unless force).
  void abandon(const Status& failure, bool force = false);
  // The same for a failure outside the transport (the Python side's).
  void abandon_and_tell(const std::string& reason, bool interrupted = false);
  void mark_broken(const std::string& reason);
  // ULFM (fault_tolerance.h): revoke the three communicators, so every survivor's pending and later operations on
  // them fail at once; a no-op where MPI has no fault tolerance. abandon_and_tell calls it when MPI reports a dead
  // rank, ddlfast/ulfm.py before it shrinks.
  void revoke_communicators();
  // ULFM: whether MPI reports a failed rank of this transport's communicators, or a survivor revoked them.
  bool failure_known() const;
  // Thread-safe: the reason is written once, before the flag is published.
  bool broken() const { return broken_flag_.load(std::memory_order_acquire); }
  std::string broken_reason() const { return broken() ? broken_ : std::string(); }
  std::size_t in_flight() const;

  // Thread-safe: a wait in progress (on another thread) returns kAborted
  // within a poll; used by close() so that no thread is inside MPI when the
  // context is torn down.
  void request_stop() { stop_requested_.store(true, std::memory_order_relaxed); }

  // Ctrl-C during a wait. Every kInterruptCheckSeconds of a wait that gave
  // its core away, idle() calls `check` (the bindings' PyErr_CheckSignals,
  // run on the main thread only); when it returns true (a signal handler
  // raised) the collective is abandoned at once — receives cancelled, the
  // other ranks told, so they fail naming this rank instead of at their stall
  // limit — and the wait returns kInterrupted. The Python side then raises
  // what the handler raised (KeyboardInterrupt).
  using InterruptCheck = bool (*)();
  void set_interrupt_check(InterruptCheck check) { interrupt_check_ = check; }
  static constexpr double kInterruptCheckSeconds = 0.005;

 private:
  MpiTransport() = default;
  Status check(int code, const char* what, int peer) const;
  // MPI's type and sum op for `dtype` (fp16/bf16: ddlfast's kernels as user-defined ops).
  Status mpi_reduction(DType dtype, ReduceOp op, MPI_Datatype* type, MPI_Op* mpi_op) const;
  RequestId track(MPI_Request raw, int peer, bool is_receive);
  Status refuse_if_broken() const;
  Status stalled(const char* what, int peer, double waited);
  Status answer_census(const char* what, int peer);
  Status interrupted(const char* what, int peer);
  Status revoked(const char* what, int peer);
  // Asks who is alive; `waits` gets each rank's wait (kind, peer, tag) from its answer (this rank's own too;
  // kind -1 for a rank that did not answer).
  std::vector<int> census(std::int64_t kind, std::vector<std::int64_t>* waits = nullptr);
  std::string waits_text(const std::vector<std::int64_t>& waits) const;
  bool census_ask_arrived();
  void post_census_ask();
  void reply_to_census();

  // The agreement's message buffers, at agreement_capacity_ (agreement_exchange.cc).
  void allocate_exchange();
  // One step of the agreement's butterfly: receive from and/or send to `peer`, both waited for.
  Status exchange_step(int peer, const char* send, std::size_t send_bytes, char* receive, const char* what);
  // The latency path's halving form (agreement_exchange.cc): recursive halving with headers, then, where no
  // mismatch was seen, doubling of bare blocks; the whole result ends in `mine` behind its header.
  Status halve_and_double(const Butterfly& plan, std::uint64_t fingerprint, char* mine, char* theirs,
                          const AgreedReduction& reduction, bool* mismatch, ArrivalWaits* previous);
  // The agreement's exchange itself, either form: the verdict into *mismatch, the previous collective's waits
  // reduced into *previous, and the result into reduction->data when every rank agreed.
  Status butterfly_exchange(std::uint64_t fingerprint, std::uint64_t form, const AgreedReduction* reduction,
                            const char* what, bool* mismatch, ArrivalWaits* previous);
  Status shared_exchange(std::uint64_t fingerprint, std::uint64_t form, const AgreedReduction* reduction,
                         const char* what, bool* mismatch, ArrivalWaits* previous);
  // spin_us_ where DDLFAST_SPIN_US is not set: 0 where more ranks share this rank's cores than it has
  // (collective, at creation).
  Status choose_spin();
  // Maps a shared segment at agreement_capacity_ where every rank wants it (collective; the caller knows every
  // rank of the communicator is on this host: create, or grow_agreement_capacity once it was). It replaces the
  // one in use only where every rank mapped the new one.
  Status attach_shared_memory(bool wanted);
  // This rank's view of `rank`'s slot for the collective in progress, and the wait for every slot's counter.
  char* shared_slot(int rank) const;
  Status wait_shared(std::size_t offset, const char* what);
  // One step of bare bytes, both sizes exact (the latency path's doubling, after the verdict).
  Status exchange_bytes(int peer, const char* send, std::size_t send_bytes, char* receive, std::size_t receive_bytes,
                        const char* what);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm census_comm_ = MPI_COMM_NULL;
  MPI_Comm agree_comm_ = MPI_COMM_NULL;  // the agreement's butterfly (and the latency path's data) only
  std::size_t agreement_capacity_ = 0;
  std::unique_ptr<SharedSegment> shared_;  // the agreement's slots, when it runs in shared memory
  std::size_t shared_slot_bytes_ = 0;
  MPI_Op fp16_sum_ = MPI_OP_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL;
  // min, max and product as MPI ops over ddlfast's kernels, index combine * kNumDTypes + dtype.
  std::vector<MPI_Op> combine_ops_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 0.0;            // 0: wait forever
  double spin_us_ = 0.0;              // how long a wait spins before it yields (choose_spin)
  std::uint64_t sequence_ = 0;        // the collective this rank is in (agreements so far; in census answers too)
  std::uint64_t numbering_base_ = 0;  // number_from_here()
  std::uint64_t last_wait_us_ = 0;    // this rank's wait in the latest agreement
  ArrivalLog arrivals_{1};            // sized in allocate_exchange()
  FlightLog flight_;                  // off until the bindings size it (DDLFAST_FLIGHT_RECORDS)
  // A rank that abandoned a later collective than the one this rank is still finishing (it had completed this
  // one): this one completes, and the notice fails this rank's next agreement instead (answer_census, agree).
  std::string later_failure_;
  StatusCode later_failure_code_ = StatusCode::kBroken;
  std::int64_t waiting_[3] = {kWaitCollective, -1, 0};  // what this rank waits in: kind, peer, tag (census)
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;
  std::vector<char> is_receive_;
  std::vector<RequestId> free_ids_;
  // Memory MPI may still write after a collective was abandoned (agreement,
  // small-message copy, census messages): deliberately leaked, not freed, when
  // a broken transport is destroyed.
  struct Scratch {
    // The agreement's messages: header, then up to agreement_capacity_ bytes (this rank's, the partner's), and
    // what the latency path's halving sends (half of that).
    UninitializedVector<char> exchange[3];
    std::vector<char> small;
    // asker, its collective, the ask's kind, then the asker's wait (kind, peer, tag)
    std::int64_t census_ask[6] = {0, 0, 0, 0, -1, 0};
    // who answers, its collective, its wait (kind, peer, tag)
    std::int64_t census_reply[5] = {0, 0, 0, -1, 0};
    std::vector<std::vector<std::int64_t>> verdicts;  // census verdicts sent (fire and forget)
  };
  std::unique_ptr<Scratch> scratch_ = std::make_unique<Scratch>();
  MPI_Request census_ask_request_ = MPI_REQUEST_NULL;
  bool census_revoked_ = false;  // the census ask failed with a ULFM error: a survivor revoked the communicators
  std::string broken_;           // written once, by the thread running collectives, then never again
  std::atomic<bool> broken_flag_{false};
  std::atomic<bool> stop_requested_{false};
  InterruptCheck interrupt_check_ = nullptr;
  std::chrono::steady_clock::time_point next_interrupt_check_{};
};

}  // namespace ddlfast
