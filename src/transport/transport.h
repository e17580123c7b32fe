// The one interface both ring executors (the host's RingAllreduce and the
// GPU's DeviceRingAllreduce) move bytes and wait through: non-blocking
// point-to-point messages named by small integer handles, a non-blocking
// test, the small-message collectives, and the stall check every wait makes
// between polls. The stall limit, the census that names a missing rank and
// the refusal after a failure live behind it, once (MpiTransport).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "transport/poll_backoff.h"

namespace ddlfast {

using RequestId = int;

// A small allreduce carried by the per-call agreement's own messages (the latency path): `data` holds `count`
// contiguous elements and receives the result only once every rank agreed and the exchange completed.
struct AgreedReduction {
  void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // not kAverage: the caller divides
  // Recursive halving, then doubling, instead of the whole payload in every step: 2 log2(p) steps moving about
  // twice the payload instead of log2(p) steps moving log2(p) times it, each message a part of the payload.
  bool halve = false;
  // A sum whose operands are zero outside each rank's own block (count * rank / size up to the next rank's): in
  // shared memory each rank's block is copied instead (MpiTransport::shared_exchange), the same bytes as the sum.
  bool disjoint = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual Status isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) = 0;
  virtual Status irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) = 0;
  // Non-blocking: *done once the request has completed; its handle is then
  // released (test it no more).
  virtual Status test(RequestId request, bool* done) = 0;
  // Completes one request; fails with kTimeout, naming the peer, when it does
  // not complete within the transport's stall limit.
  virtual Status wait(RequestId request) = 0;
  virtual Status wait_all() = 0;

  // What every wait does between polls once it gives the core away (see
  // StallWatch): fails when the context is being closed, when another rank
  // reports a stall or failure, or once nothing has moved since `since` for
  // the stall limit. `what` names the wait in messages; peer < 0: a collective.
  virtual Status idle(std::chrono::steady_clock::time_point since, const char* what, int peer) = 0;
  // How long a wait spins before it yields (PollBackoff), as this transport chose.
  virtual double spin_us() const = 0;

  // The small-message collectives (latency-bound sizes), stall-limited, never
  // writing into the caller's memory after a failure. `op` is not kAverage.
  // allreduce in place; reduce_scatter: `send` holds counts[q] elements per
  // rank q in rank order, `recv` gets this rank's reduced block; allgather of
  // bytes: `recv` gets every rank's bytes[q] bytes in rank order.
  virtual Status native_allreduce(void* data, std::size_t count, DType dtype, ReduceOp op = ReduceOp::kSum) = 0;
  virtual Status native_reduce_scatter(const void* send, void* recv, const std::vector<std::size_t>& counts,
                                       DType dtype, ReduceOp op = ReduceOp::kSum) = 0;
  virtual Status native_allgather(const void* send, void* recv, const std::vector<std::size_t>& bytes) = 0;

  // The per-call agreement (MpiTransport::agree): *agreed when every rank passed the same digest in the same
  // collective; with `reduction`, that allreduce travels in the agreement's messages (at most
  // agreement_capacity() bytes of it, the same on every rank).
  virtual Status agree(std::uint64_t digest, bool* agreed, const AgreedReduction* reduction = nullptr) = 0;
  virtual std::size_t agreement_capacity() const = 0;
};

// How a loop that polls several requests waits: spin, yield, then sleep
// (PollBackoff) while nothing moves, and let the transport check the stall
// limit measured from the last progress. Host and GPU executors poll through
// it, and so does every single wait of the transport itself.
class StallWatch {
 public:
  explicit StallWatch(Transport& transport) : transport_(transport), backoff_(transport.spin_us()) {}

  void progressed() { backoff_ = PollBackoff(transport_.spin_us()); }
  // Call after a turn that changed nothing.
  Status idle(const char* what, int peer) {
    if (!backoff_.idle()) return Status::ok();
    return transport_.idle(backoff_.started(), what, peer);
  }

 private:
  Transport& transport_;
  PollBackoff backoff_;
};

}  // namespace ddlfast
