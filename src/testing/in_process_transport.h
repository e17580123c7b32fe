// A Transport whose ranks are threads of one process (tests only): point-to-point messages go through
// per-rank mailboxes with MPI's matching rules (source and tag, in posting order, a message larger than its
// receive is an error), the small collectives and the per-call agreement through a board every rank posts its
// contribution to and reads everyone's from. Every wait is stall-limited like MpiTransport's: a rank that passed
// the limit names the ranks outside any ddlfast call ("did not join") and tells the others, who fail at their
// next poll with the same reason. So the one phase loop, both executors, the direct reduce-scatter and the
// latency path run at P = 2..16 in one process in milliseconds (ddlfast._testing.in_process_allreduce).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ddlfast {

// What the ranks of one in-process world share. Thread-safe; outlives its transports.
class InProcessWorld {
 public:
  // timeout_s: the stall limit (0: wait forever); agreement_capacity: as MpiTransport::create's.
  InProcessWorld(int size, double timeout_s, std::size_t agreement_capacity);

  int size() const { return size_; }
  // A rank that is inside no ddlfast call: a stalled rank names it (the census's "did not join").
  void set_outside(int rank, bool outside);

 private:
  friend class InProcessTransport;
  struct Completion {
    std::atomic<int> state{0};  // 0 pending, 1 done, 2 the message was larger than the receive
  };
  struct Message {
    int source;
    int tag;
    std::vector<char> bytes;
  };
  struct Receive {
    int source;
    int tag;
    void* data;
    std::size_t bytes;
    std::shared_ptr<Completion> completion;
  };
  struct Mailbox {
    std::deque<Message> unexpected;  // sent before a receive matched them
    std::deque<Receive> posted;      // receives no message matched yet
  };
  // One collective on the board: every rank's contribution, read by every rank, then erased.
  struct Round {
    std::vector<std::vector<char>> posts;
    int arrived = 0;
    int read = 0;
  };

  const int size_;
  const double timeout_s_;
  const std::size_t agreement_capacity_;
  std::mutex mutex_;  // guards everything below
  std::vector<Mailbox> mailboxes_;
  std::map<std::pair<int, std::uint64_t>, Round> rounds_;  // (channel, sequence)
  std::vector<char> outside_;
  StatusCode failure_code_ = StatusCode::kOk;
  std::string failure_;  // the first failure a rank reported: every waiting rank fails with it
};

class InProcessTransport final : public Transport {
 public:
  InProcessTransport(InProcessWorld& world, int rank) : world_(world), rank_(rank) {}
  // Cancels this rank's receives still posted, so no later message lands in memory about to be freed.
  ~InProcessTransport() override;
  InProcessTransport(const InProcessTransport&) = delete;
  InProcessTransport& operator=(const InProcessTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }

  Status isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) override;
  Status irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) override;
  Status test(RequestId request, bool* done) override;
  Status wait(RequestId request) override;
  Status wait_all() override;
  Status idle(std::chrono::steady_clock::time_point since, const char* what, int peer) override;
  // Threads outnumber cores here: yield at once, as MpiTransport does when ranks outnumber a host's cores.
  double spin_us() const override { return 0.0; }

  Status native_allreduce(void* data, std::size_t count, DType dtype, ReduceOp op = ReduceOp::kSum) override;
  Status native_reduce_scatter(const void* send, void* recv, const std::vector<std::size_t>& counts, DType dtype,
                               ReduceOp op = ReduceOp::kSum) override;
  Status native_allgather(const void* send, void* recv, const std::vector<std::size_t>& bytes) override;
  Status agree(std::uint64_t digest, bool* agreed, const AgreedReduction* reduction = nullptr) override;
  std::size_t agreement_capacity() const override { return world_.agreement_capacity_; }

  // After a failed collective (MpiTransport::abandon): cancel this rank's receives, refuse later work, and tell
  // the other ranks, whose waits fail with `failure`'s message.
  void abandon(const Status& failure);

 private:
  enum Channel : int { kAgreement = 0, kNative = 1 };
  // Posts `bytes` to the board's next round of `channel` and waits until every rank posted; *all gets every
  // rank's contribution in rank order.
  Status exchange(Channel channel, const void* data, std::size_t bytes, std::vector<std::vector<char>>* all,
                  const char* what);
  // op over every rank's `count` elements at `offset` bytes, in rank order (the same bits on every rank).
  static void fold(const std::vector<std::vector<char>>& all, std::size_t offset, std::size_t count, DType dtype,
                   ReduceOp op, void* out);
  Status refuse_if_broken() const;
  Status check_peer(int peer) const;
  void cancel_receives();

  InProcessWorld& world_;
  const int rank_;
  std::uint64_t sequence_[2] = {0, 0};  // rounds so far per channel
  std::map<RequestId, std::shared_ptr<InProcessWorld::Completion>> requests_;
  RequestId next_request_ = 0;
  std::string broken_;
};

}  // namespace ddlfast
