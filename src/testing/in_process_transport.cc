#include "testing/in_process_transport.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
namespace {

struct AgreementHeader {
  std::uint64_t digest;
  std::uint64_t payload_bytes;
};

// A message meets its receive: copied, or the receive fails as MPI's would (truncated).
void deliver(const void* message, std::size_t bytes, void* receive, std::size_t capacity,
             std::atomic<int>* completion) {
  if (bytes > capacity) {
    completion->store(2, std::memory_order_release);
    return;
  }
  if (bytes) std::memcpy(receive, message, bytes);
  completion->store(1, std::memory_order_release);
}

std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

}  // namespace

InProcessWorld::InProcessWorld(int size, double timeout_s, std::size_t agreement_capacity)
    : size_(size),
      timeout_s_(timeout_s),
      agreement_capacity_(agreement_capacity),
      mailboxes_(static_cast<std::size_t>(size)),
      outside_(static_cast<std::size_t>(size), 0) {}

void InProcessWorld::set_outside(int rank, bool outside) {
  const std::lock_guard<std::mutex> lock(mutex_);
  outside_[static_cast<std::size_t>(rank)] = outside ? 1 : 0;
}

InProcessTransport::~InProcessTransport() { cancel_receives(); }

void InProcessTransport::cancel_receives() {
  const std::lock_guard<std::mutex> lock(world_.mutex_);
  world_.mailboxes_[static_cast<std::size_t>(rank_)].posted.clear();
}

Status InProcessTransport::refuse_if_broken() const {
  if (broken_.empty()) return Status::ok();
  return Status(StatusCode::kBroken, broken_);
}

Status InProcessTransport::check_peer(int peer) const {
  if (peer < 0 || peer >= size()) {
    return Status::invalid("in-process transport: peer " + std::to_string(peer) + " of " + std::to_string(size()));
  }
  return Status::ok();
}

Status InProcessTransport::isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  DDLFAST_RETURN_IF_ERROR(check_peer(peer));
  auto completion = std::make_shared<InProcessWorld::Completion>();
  {
    const std::lock_guard<std::mutex> lock(world_.mutex_);
    InProcessWorld::Mailbox& box = world_.mailboxes_[static_cast<std::size_t>(peer)];
    auto match = std::find_if(box.posted.begin(), box.posted.end(),
                              [&](const InProcessWorld::Receive& r) { return r.source == rank_ && r.tag == tag; });
    if (match == box.posted.end()) {
      const char* from = static_cast<const char*>(data);
      box.unexpected.push_back({rank_, tag, std::vector<char>(from, from + bytes)});
    } else {
      deliver(data, bytes, match->data, match->bytes, &match->completion->state);
      box.posted.erase(match);
    }
  }
  completion->state.store(1, std::memory_order_relaxed);  // eager: the bytes were copied
  *request = next_request_++;
  requests_.emplace(*request, std::move(completion));
  return Status::ok();
}

Status InProcessTransport::irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  DDLFAST_RETURN_IF_ERROR(check_peer(peer));
  auto completion = std::make_shared<InProcessWorld::Completion>();
  {
    const std::lock_guard<std::mutex> lock(world_.mutex_);
    InProcessWorld::Mailbox& box = world_.mailboxes_[static_cast<std::size_t>(rank_)];
    auto match = std::find_if(box.unexpected.begin(), box.unexpected.end(),
                              [&](const InProcessWorld::Message& m) { return m.source == peer && m.tag == tag; });
    if (match == box.unexpected.end()) {
      box.posted.push_back({peer, tag, data, bytes, completion});
    } else {
      deliver(match->bytes.data(), match->bytes.size(), data, bytes, &completion->state);
      box.unexpected.erase(match);
    }
  }
  *request = next_request_++;
  requests_.emplace(*request, std::move(completion));
  return Status::ok();
}

Status InProcessTransport::test(RequestId request, bool* done) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  auto found = requests_.find(request);
  if (found == requests_.end()) {
    return Status(StatusCode::kInternal, "in-process transport: request " + std::to_string(request) + " unknown");
  }
  const int state = found->second->state.load(std::memory_order_acquire);
  *done = state != 0;
  if (*done) requests_.erase(found);
  if (state == 2) {
    const std::string text = "rank " + std::to_string(rank_) + ": a message was larger than its receive (truncated)";
    return Status(StatusCode::kMpiError, text);
  }
  return Status::ok();
}

Status InProcessTransport::wait(RequestId request) {
  StallWatch watch(*this);
  for (;;) {
    bool done = false;
    DDLFAST_RETURN_IF_ERROR(test(request, &done));
    if (done) return Status::ok();
    DDLFAST_RETURN_IF_ERROR(watch.idle("a point-to-point message", -1));
  }
}

Status InProcessTransport::wait_all() {
  while (!requests_.empty()) DDLFAST_RETURN_IF_ERROR(wait(requests_.begin()->first));
  return Status::ok();
}

Status InProcessTransport::idle(std::chrono::steady_clock::time_point since, const char* what, int peer) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  const std::lock_guard<std::mutex> lock(world_.mutex_);
  if (!world_.failure_.empty()) {
    broken_ = world_.failure_;
    return Status(world_.failure_code_, broken_);
  }
  if (world_.timeout_s_ <= 0 || waited < world_.timeout_s_) return Status::ok();
  // The census, in one process: every rank inside a ddlfast call is alive; the others did not join.
  std::string text = "rank " + std::to_string(rank_) + " waited " + seconds_text(waited) + " s for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " in collective #" + std::to_string(sequence_[kAgreement]) +
          " (DDLFAST_TIMEOUT_S=" + seconds_text(world_.timeout_s_) + ")";
  std::string missing;
  int count = 0;
  for (int r = 0; r < size(); ++r) {
    if (!world_.outside_[static_cast<std::size_t>(r)]) continue;
    missing += (count++ ? "," : "") + std::to_string(r);
  }
  if (count) {
    text += std::string("; rank") + (count > 1 ? "s " : " ") + missing + " did not join (inside no ddlfast call)";
  } else {
    text += "; every rank is inside a ddlfast call, so the collective was only slower than DDLFAST_TIMEOUT_S allows";
  }
  text += ". Abort the job: this communicator is out of step.";
  world_.failure_code_ = StatusCode::kTimeout;
  world_.failure_ = text;
  broken_ = text;
  return Status(StatusCode::kTimeout, text);
}

void InProcessTransport::abandon(const Status& failure) {
  cancel_receives();
  requests_.clear();
  const std::lock_guard<std::mutex> lock(world_.mutex_);
  if (world_.failure_.empty()) {
    world_.failure_code_ = StatusCode::kBroken;
    world_.failure_ = "rank " + std::to_string(rank_) + " abandoned the collective: " + failure.message();
  }
  if (broken_.empty()) broken_ = world_.failure_;
}

Status InProcessTransport::exchange(Channel channel, const void* data, std::size_t bytes,
                                    std::vector<std::vector<char>>* all, const char* what) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  const auto key = std::make_pair(static_cast<int>(channel), ++sequence_[channel]);
  {
    const std::lock_guard<std::mutex> lock(world_.mutex_);
    InProcessWorld::Round& round = world_.rounds_[key];
    round.posts.resize(static_cast<std::size_t>(size()));
    const char* from = static_cast<const char*>(data);
    round.posts[static_cast<std::size_t>(rank_)].assign(from, from + bytes);
    ++round.arrived;
  }
  StallWatch watch(*this);
  for (;;) {
    {
      const std::lock_guard<std::mutex> lock(world_.mutex_);
      InProcessWorld::Round& round = world_.rounds_[key];
      if (round.arrived == size()) {
        *all = round.posts;
        if (++round.read == size()) world_.rounds_.erase(key);
        return Status::ok();
      }
    }
    DDLFAST_RETURN_IF_ERROR(watch.idle(what, -1));
  }
}

void InProcessTransport::fold(const std::vector<std::vector<char>>& all, std::size_t offset, std::size_t count,
                              DType dtype, ReduceOp op, void* out) {
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return;
  std::memcpy(out, all[0].data() + offset, bytes);
  for (std::size_t q = 1; q < all.size(); ++q) reduce_into(dtype, op, out, all[q].data() + offset, count, 1);
}

Status InProcessTransport::native_allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) {
  std::vector<std::vector<char>> all;
  DDLFAST_RETURN_IF_ERROR(exchange(kNative, data, count * dtype_size(dtype), &all, "the small allreduce"));
  fold(all, 0, count, dtype, op, data);
  return Status::ok();
}

Status InProcessTransport::native_reduce_scatter(const void* send, void* recv, const std::vector<std::size_t>& counts,
                                                 DType dtype, ReduceOp op) {
  std::size_t total = 0, before = 0;
  for (std::size_t q = 0; q < counts.size(); ++q) {
    if (static_cast<int>(q) < rank_) before += counts[q];
    total += counts[q];
  }
  std::vector<std::vector<char>> all;
  DDLFAST_RETURN_IF_ERROR(exchange(kNative, send, total * dtype_size(dtype), &all, "the small reduce-scatter"));
  fold(all, before * dtype_size(dtype), counts[static_cast<std::size_t>(rank_)], dtype, op, recv);
  return Status::ok();
}

Status InProcessTransport::native_allgather(const void* send, void* recv, const std::vector<std::size_t>& bytes) {
  std::vector<std::vector<char>> all;
  DDLFAST_RETURN_IF_ERROR(exchange(kNative, send, bytes[static_cast<std::size_t>(rank_)], &all, "the allgather"));
  char* to = static_cast<char*>(recv);
  for (const std::vector<char>& part : all) {
    if (!part.empty()) std::memcpy(to, part.data(), part.size());
    to += part.size();
  }
  return Status::ok();
}

Status InProcessTransport::agree(std::uint64_t digest, bool* agreed, const AgreedReduction* reduction) {
  const std::size_t bytes = reduction == nullptr ? 0 : reduction->count * dtype_size(reduction->dtype);
  if (bytes > agreement_capacity()) {
    return Status::invalid("the latency path carries at most " + std::to_string(agreement_capacity()) + " bytes, not " +
                           std::to_string(bytes));
  }
  std::vector<char> mine(sizeof(AgreementHeader) + bytes);
  const AgreementHeader header{digest, bytes};
  std::memcpy(mine.data(), &header, sizeof header);
  if (bytes) std::memcpy(mine.data() + sizeof header, reduction->data, bytes);
  std::vector<std::vector<char>> all;
  DDLFAST_RETURN_IF_ERROR(exchange(kAgreement, mine.data(), mine.size(), &all,
                                   bytes ? "the small allreduce (its agreement in the same messages)"
                                         : "the agreement on the collective's arguments"));
  *agreed = std::all_of(all.begin(), all.end(), [&](const std::vector<char>& theirs) {
    return theirs.size() >= sizeof header && std::memcmp(theirs.data(), mine.data(), sizeof header) == 0;
  });
  if (*agreed && bytes) fold(all, sizeof header, reduction->count, reduction->dtype, reduction->op, reduction->data);
  return Status::ok();
}

}  // namespace ddlfast
