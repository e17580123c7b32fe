#include "transport/mpi_transport.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <memory>
#include <utility>

#include "kernels/cpu/cpu_kernels.h"
#include "transport/fault_tolerance.h"
#include "transport/poll_backoff.h"

namespace ddlfast {
namespace {

void fp16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(DType::kFloat16, inout, in, static_cast<std::size_t>(*len), 1);
}

void bf16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(DType::kBFloat16, inout, in, static_cast<std::size_t>(*len), 1);
}

// min, max and product over ddlfast's kernels: one MPI callback per (op, dtype), since MPI hands the callback
// no state of ours. The elements are opaque to MPI (bytes of the dtype's width).
template <int Combine, int Dtype>
void combine_op(void* in, void* inout, int* len, MPI_Datatype*) {
  best_kernels().combine.fn[Combine][Dtype](inout, in, static_cast<std::size_t>(*len));
}

template <int Combine, std::size_t... Dtypes>
void create_combine_row(std::vector<MPI_Op>* ops, std::index_sequence<Dtypes...>) {
  for (MPI_User_function* function : {&combine_op<Combine, static_cast<int>(Dtypes)>...}) {
    ops->push_back(MPI_OP_NULL);
    MPI_Op_create(function, 1, &ops->back());  // commutative: the kernels' results do not depend on order
  }
}

// What MPI sees of each dtype's elements: its own type where it has one (only MPI_SUM reads it), else 16 bits.
MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kFloat16:
    case DType::kBFloat16: return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

bool mpi_is_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// How long a stalled rank waits for census answers, and an answering rank for the verdict.
constexpr double kCensusSeconds = 2.0;
constexpr int kAskTag = 1;
constexpr int kReplyTag = 2;
constexpr int kVerdictTag = 3;
// What a census ask says of its sender: it passed the stall limit, or it abandoned a collective after an error.
constexpr std::int64_t kAskAfterStall = 0;
constexpr std::int64_t kAskAfterFailure = 1;
constexpr std::int64_t kAskAfterInterrupt = 2;  // a signal (Ctrl-C) interrupted its wait

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// What a rank waits in, as a census reports it: "collective #4", "a point-to-point receive from rank 0 with tag 7".
std::string wait_text(std::int64_t kind, std::int64_t peer, std::int64_t tag, std::int64_t sequence) {
  if (kind != MpiTransport::kWaitReceive && kind != MpiTransport::kWaitSend) {
    return "collective #" + std::to_string(sequence);
  }
  const bool receive = kind == MpiTransport::kWaitReceive;
  const std::string whom = peer < 0 ? std::string("any rank") : "rank " + std::to_string(peer);
  return std::string("a point-to-point ") + (receive ? "receive from " : "send to ") + whom + " with tag " +
         std::to_string(tag);
}

// "0-776,778-1023": runs of consecutive ranks as ranges, so a census at 1024 ranks names the missing ones in a
// line, not in 4 KB of numbers (issue 23).
std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t end = i;
    while (end + 1 < ranks.size() && ranks[end + 1] == ranks[end] + 1) ++end;
    text += (text.empty() ? "" : ",") + std::to_string(ranks[i]);
    if (end > i) text += (end > i + 1 ? "-" : ",") + std::to_string(ranks[end]);
    i = end + 1;
  }
  return text;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", seconds);
  return text;
}

// A non-blocking dup polled against the stall limit (a rank that never creates its context is a timeout).
Status dup_with_limit(MPI_Comm comm, double timeout_s, MPI_Comm* out) {
  // MPI writes the new handle whenever the dup completes, possibly after we
  // gave up; so it lands in a heap cell that is deliberately leaked on timeout.
  auto pending = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request request;
  int code = MPI_Comm_idup(comm, pending.get(), &request);
  if (code != MPI_SUCCESS) return Status(StatusCode::kMpiError, "MPI_Comm_idup failed: " + mpi_error_string(code));
  PollBackoff backoff;  // spin, then yield, then sleep (poll_backoff.h)
  for (;;) {
    int done = 0;
    code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return Status(StatusCode::kMpiError, "MPI_Comm_idup failed: " + mpi_error_string(code));
    if (done) break;
    if (backoff.idle()) {
      const double waited = backoff.waited_s();
      if (timeout_s > 0 && waited > timeout_s) {
        pending.release();  // see above: MPI may still complete the dup into it
        int rank = 0;
        MPI_Comm_rank(comm, &rank);
        return Status(StatusCode::kTimeout,
                      "rank " + std::to_string(rank) + " waited " + seconds_text(waited) +
                          " s for the other ranks to create their ddlfast context (a collective step); some rank "
                          "never called ddlfast (DDLFAST_TIMEOUT_S). Abort the job: this communicator is out of "
                          "step.");
      }
    }
  }
  *out = *pending;
  MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
  return Status::ok();
}

// Spinning before yielding pays only when every rank of this host has a core of its own: with more ranks than
// cores, a spinning rank holds the core its peer needs to answer, and every ring step then costs a scheduler
// slice (4 ranks on 2 cores: 4 KiB allreduce 85 us -> 900 us with a 200 us spin). Then yield at once instead.
double spin_us_for(MPI_Comm comm) {
  MPI_Comm local = MPI_COMM_NULL;
  int ranks_here = 1;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local) == MPI_SUCCESS) {
    MPI_Comm_size(local, &ranks_here);
    MPI_Comm_free(&local);
  }
  cpu_set_t cpus;
  const int cores = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  return ranks_here > cores ? 0.0 : PollBackoff::kDefaultSpinUs;
}

}  // namespace

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, length);
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, length);
  const auto newline = version.find('\n');
  if (newline != std::string::npos) version.resize(newline);
  // Open MPI counts the terminating NUL in `length`; strip it and trailing blanks.
  const auto end = version.find_last_not_of(std::string(" \t\r\n\0", 5));
  version.resize(end == std::string::npos ? 0 : end + 1);
  return version;
}

Status MpiTransport::create(MPI_Comm comm, double timeout_s, std::size_t agreement_capacity,
                            std::unique_ptr<MpiTransport>* out) {
  std::unique_ptr<MpiTransport> transport(new MpiTransport());
  DDLFAST_RETURN_IF_ERROR(dup_with_limit(comm, timeout_s, &transport->comm_));
  DDLFAST_RETURN_IF_ERROR(dup_with_limit(comm, timeout_s, &transport->census_comm_));
  DDLFAST_RETURN_IF_ERROR(dup_with_limit(comm, timeout_s, &transport->agree_comm_));
  MPI_Comm_rank(transport->comm_, &transport->rank_);
  MPI_Comm_size(transport->comm_, &transport->size_);
  transport->agreement_capacity_ = agreement_capacity;
  transport->allocate_exchange();
  transport->spin_us_ = spin_us_for(transport->comm_);
  MPI_Op_create(&fp16_sum_op, 1, &transport->fp16_sum_);
  MPI_Op_create(&bf16_sum_op, 1, &transport->bf16_sum_);
  create_combine_row<0>(&transport->combine_ops_, std::make_index_sequence<kNumDTypes>());
  create_combine_row<1>(&transport->combine_ops_, std::make_index_sequence<kNumDTypes>());
  create_combine_row<2>(&transport->combine_ops_, std::make_index_sequence<kNumDTypes>());
  transport->timeout_s_ = timeout_s;
  transport->post_census_ask();
  *out = std::move(transport);
  return Status::ok();
}

MpiTransport::~MpiTransport() {
  if (mpi_is_finalized()) return;  // MPI already tore everything down at exit
  if (census_ask_request_ != MPI_REQUEST_NULL) {  // cancelling a receive is always safe
    MPI_Cancel(&census_ask_request_);
    MPI_Wait(&census_ask_request_, MPI_STATUS_IGNORE);
  }
  if (broken()) {
    // Messages of an abandoned collective may still be in flight and MPI may
    // still write into scratch_: leave MPI's objects and that memory alone.
    scratch_.release();
    return;
  }
  for (std::size_t id = 0; id < requests_.size(); ++id) {
    if (requests_[id] == MPI_REQUEST_NULL) continue;
    if (is_receive_[id]) {
      MPI_Cancel(&requests_[id]);
      MPI_Wait(&requests_[id], MPI_STATUS_IGNORE);
    } else {
      MPI_Request_free(&requests_[id]);  // sends are never cancelled (MPI-4 deprecates it)
    }
  }
  if (fp16_sum_ != MPI_OP_NULL) MPI_Op_free(&fp16_sum_);
  if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
  for (MPI_Op& op : combine_ops_) {
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  }
  if (census_comm_ != MPI_COMM_NULL) MPI_Comm_free(&census_comm_);
  if (agree_comm_ != MPI_COMM_NULL) MPI_Comm_free(&agree_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Status MpiTransport::check(int code, const char* what, int peer) const {
  if (code == MPI_SUCCESS) return Status::ok();
  std::string where = " on rank " + std::to_string(rank_);
  if (peer >= 0) where += " with peer rank " + std::to_string(peer);
  return Status(StatusCode::kMpiError, std::string(what) + where + " failed: " + mpi_error_string(code));
}

Status MpiTransport::refuse_if_broken() const {
  if (!broken()) return Status::ok();
  return Status(StatusCode::kBroken, "this ddlfast context is unusable after an earlier failure (" + broken_ +
                                         "); abort the job, or create a new Context");
}

void MpiTransport::mark_broken(const std::string& reason) {
  if (broken()) return;
  broken_ = reason.empty() ? std::string("an abandoned collective") : reason;
  broken_flag_.store(true, std::memory_order_release);
}

RequestId MpiTransport::track(MPI_Request raw, int peer, bool is_receive) {
  if (free_ids_.empty()) {
    requests_.push_back(raw);
    peers_.push_back(peer);
    is_receive_.push_back(is_receive);
    return static_cast<RequestId>(requests_.size() - 1);
  }
  const RequestId id = free_ids_.back();
  free_ids_.pop_back();
  requests_[id] = raw;
  peers_[id] = peer;
  is_receive_[id] = is_receive;
  return id;
}

std::size_t MpiTransport::in_flight() const {
  return static_cast<std::size_t>(
      std::count_if(requests_.begin(), requests_.end(), [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
}

Status MpiTransport::isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (bytes > static_cast<std::size_t>(INT_MAX)) return Status::invalid("message of " + std::to_string(bytes) + " bytes is too large");
  MPI_Request raw;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &raw), "MPI_Isend", peer));
  *request = track(raw, peer, false);
  return Status::ok();
}

Status MpiTransport::irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (bytes > static_cast<std::size_t>(INT_MAX)) return Status::invalid("message of " + std::to_string(bytes) + " bytes is too large");
  MPI_Request raw;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &raw), "MPI_Irecv", peer));
  *request = track(raw, peer, true);
  return Status::ok();
}

Status MpiTransport::wait(RequestId request) {
  DDLFAST_RETURN_IF_ERROR(wait_request(&requests_[request], "data", peers_[request]));
  free_ids_.push_back(request);
  return Status::ok();
}

Status MpiTransport::wait_all() {
  for (RequestId id = 0; id < static_cast<RequestId>(requests_.size()); ++id) {
    if (requests_[id] != MPI_REQUEST_NULL) {
      DDLFAST_RETURN_IF_ERROR(wait_request(&requests_[id], is_receive_[id] ? "data" : "a send to be taken",
                                           peers_[id]));
    }
  }
  free_ids_.clear();
  for (RequestId id = static_cast<RequestId>(requests_.size()) - 1; id >= 0; --id) free_ids_.push_back(id);
  return Status::ok();
}

Status MpiTransport::test(RequestId request, bool* done) {
  int flag = 0;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Test(&requests_[request], &flag, MPI_STATUS_IGNORE), "MPI_Test", peers_[request]));
  *done = flag != 0;
  if (*done) free_ids_.push_back(request);
  return Status::ok();
}

// Every single wait (see the file comment of the header); the executors poll many requests the same way.
Status MpiTransport::wait_request(MPI_Request* request, const char* what, int peer) {
  StallWatch watch(*this);  // spin, then yield, then sleep (poll_backoff.h), then the stall check
  while (*request != MPI_REQUEST_NULL) {
    int done = 0;
    DDLFAST_RETURN_IF_ERROR(check(MPI_Test(request, &done, MPI_STATUS_IGNORE), "MPI_Test", peer));
    if (done) break;
    DDLFAST_RETURN_IF_ERROR(watch.idle(what, peer));
  }
  return Status::ok();
}

Status MpiTransport::wait_point_to_point(MPI_Request* request, const char* what, std::int64_t kind, int peer,
                                         std::int64_t tag) {
  waiting_[0] = kind;
  waiting_[1] = peer;
  waiting_[2] = tag;
  const Status status = wait_request(request, what, -1);  // `what` names the peer already
  waiting_[0] = kWaitCollective;
  waiting_[1] = -1;
  waiting_[2] = 0;
  return status;
}

Status MpiTransport::idle(std::chrono::steady_clock::time_point since, const char* what, int peer) {
  if (stop_requested_.load(std::memory_order_relaxed)) {
    mark_broken("the context was closed while rank " + std::to_string(rank_) + " waited for " + what);
    return refuse_if_broken();
  }
  if (interrupt_check_ != nullptr) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_interrupt_check_) {
      next_interrupt_check_ = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                        std::chrono::duration<double>(kInterruptCheckSeconds));
      if (interrupt_check_()) return interrupted(what, peer);
    }
  }
  if (census_ask_arrived()) return answer_census(what, peer);
  if (census_revoked_) return revoked(what, peer);
  const double waited = seconds_since(since);
  if (timeout_s_ > 0 && waited > timeout_s_) return stalled(what, peer, waited);
  return Status::ok();
}

void MpiTransport::post_census_ask() {
  if (size_ > 1 && census_comm_ != MPI_COMM_NULL) {
    MPI_Irecv(scratch_->census_ask, 6, MPI_INT64_T, MPI_ANY_SOURCE, kAskTag, census_comm_, &census_ask_request_);
  }
}

bool MpiTransport::census_ask_arrived() {
  if (census_ask_request_ == MPI_REQUEST_NULL) return false;
  int done = 0;
  const int code = MPI_Test(&census_ask_request_, &done, MPI_STATUS_IGNORE);
  if (code != MPI_SUCCESS) {
    census_revoked_ = census_revoked_ || ulfm_error(code);  // another survivor revoked the communicators
    return false;
  }
  return done != 0;
}

// Another rank lost a peer and revoked this transport's communicators (ULFM, fault_tolerance.h): this wait, on
// any communicator, can never complete as it was meant to.
Status MpiTransport::revoked(const char* what, int peer) {
  std::string text = "rank " + std::to_string(rank_) + " stopped waiting for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " in collective #" + std::to_string(sequence_) +
          ": another rank found a failed rank and revoked the communicators (MPI's fault tolerance, ULFM)";
  const Status status(StatusCode::kMpiError, text);
  abandon(status, /*force=*/true);
  return status;
}

// Tells the asking rank this one is alive (fire and forget), and listens for the next ask.
void MpiTransport::reply_to_census() {
  scratch_->census_reply[0] = rank_;
  scratch_->census_reply[1] = static_cast<std::int64_t>(sequence_);
  for (int i = 0; i < 3; ++i) scratch_->census_reply[2 + i] = waiting_[i];
  MPI_Request reply;
  if (MPI_Isend(scratch_->census_reply, 5, MPI_INT64_T, static_cast<int>(scratch_->census_ask[0]), kReplyTag,
                census_comm_, &reply) == MPI_SUCCESS) {
    MPI_Request_free(&reply);
  }
  post_census_ask();
}

// Another rank stalled and asks who is alive: answer, learn its verdict, and fail this wait too
// (the collective it abandoned can never complete here either).
Status MpiTransport::answer_census(const char* what, int peer) {
  const int asker = static_cast<int>(scratch_->census_ask[0]);
  const auto asker_sequence = scratch_->census_ask[1];
  const bool asker_failed = scratch_->census_ask[2] != kAskAfterStall;
  const bool asker_interrupted = scratch_->census_ask[2] == kAskAfterInterrupt;
  const std::int64_t asker_wait[3] = {scratch_->census_ask[3], scratch_->census_ask[4], scratch_->census_ask[5]};
  reply_to_census();
  std::vector<std::int64_t> verdict(static_cast<std::size_t>(size_) + 1, -1);
  MPI_Request receive;
  std::string missing;
  // An interrupted rank sends no verdict: it told every rank at once and returned to its user.
  if (!asker_interrupted &&
      MPI_Irecv(verdict.data(), size_ + 1, MPI_INT64_T, asker, kVerdictTag, census_comm_, &receive) == MPI_SUCCESS) {
    const auto start = std::chrono::steady_clock::now();
    int done = 0;
    while (!done && seconds_since(start) < kCensusSeconds + 1.0) {
      MPI_Test(&receive, &done, MPI_STATUS_IGNORE);
      if (census_ask_arrived()) reply_to_census();  // a second stalled rank asks too
      sched_yield();
    }
    if (done) {
      std::vector<int> ranks;
      for (std::int64_t i = 0; i < verdict[0] && i < size_; ++i) ranks.push_back(static_cast<int>(verdict[1 + i]));
      const bool point_to_point = asker_wait[0] > kWaitCollective || waiting_[0] > kWaitCollective;
      missing = ranks.empty() ? std::string("every rank answered its census") +
                                    (point_to_point ? ", so no rank is sending what these point-to-point waits need "
                                                      "(the program's sends and receives do not match)"
                                                    : "")
                              : "rank" + std::string(ranks.size() > 1 ? "s " : " ") + rank_list(ranks) +
                                    " did not join";
    } else {
      MPI_Cancel(&receive);
      MPI_Wait(&receive, MPI_STATUS_IGNORE);
      missing = "its census verdict did not arrive";
    }
  }
  const std::string cause =
      "rank " + std::to_string(asker) +
      (asker_interrupted ? " was interrupted (a signal, e.g. Ctrl-C) in collective #" +
                               std::to_string(asker_sequence) + " and abandoned it"
       : asker_failed    ? " abandoned collective #" + std::to_string(asker_sequence) +
                            " after an error there (its own message says which)"
                         : " gave up waiting in " +
                            wait_text(asker_wait[0], asker_wait[1], asker_wait[2], asker_sequence) +
                            " after DDLFAST_TIMEOUT_S (" + seconds_text(timeout_s_) + " s)") +
      (missing.empty() ? "" : "; " + missing) + ". Abort the job: this communicator is out of step.";
  const StatusCode code = asker_failed ? StatusCode::kBroken : StatusCode::kTimeout;
  if (asker_failed && asker_sequence > static_cast<std::int64_t>(sequence_)) {
    // The asker had completed this collective (it abandoned a later one): finish this one, fail the next.
    if (later_failure_.empty()) {
      later_failure_ = "rank " + std::to_string(rank_) + " could not start collective #" +
                       std::to_string(asker_sequence) + ": " + cause;
      later_failure_code_ = code;
    }
    return Status::ok();
  }
  std::string text = "rank " + std::to_string(rank_) + " stopped waiting for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " (collective #" + std::to_string(sequence_) + "): " + cause;
  mark_broken(text);
  return Status(code, text);
}

// A signal handler raised during this wait (Ctrl-C): the collective cannot complete here, so abandon it now
// and tell the other ranks, who fail naming this rank instead of waiting for their stall limit.
Status MpiTransport::interrupted(const char* what, int peer) {
  std::string text = "rank " + std::to_string(rank_) + " was interrupted (a signal, e.g. Ctrl-C) while it waited for " +
                     what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " in collective #" + std::to_string(sequence_);
  const Status status(StatusCode::kInterrupted, text);
  abandon(status, /*force=*/true);
  return status;
}

// This rank passed the stall limit: ask every rank whether it is alive, tell the ones that are who is not.
Status MpiTransport::stalled(const char* what, int peer, double waited) {
  std::string text = "rank " + std::to_string(rank_) + " waited " + seconds_text(waited) + " s for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " in collective #" + std::to_string(sequence_) + " (DDLFAST_TIMEOUT_S=" + seconds_text(timeout_s_) + ")";
  std::vector<std::int64_t> waits;
  const std::vector<int> missing = census(kAskAfterStall, &waits);
  bool point_to_point = false;
  for (int r = 0; r < size_; ++r) point_to_point |= waits[3 * static_cast<std::size_t>(r)] > kWaitCollective;
  if (size_ > 1 && missing.empty() && point_to_point) {
    // Every rank is alive and waiting, some for a point-to-point message: a send/recv that nobody matches.
    text += "; every rank answered the census within " + seconds_text(kCensusSeconds) + " s: " +
            waits_text(waits) + ". No rank is sending (or receiving) what these point-to-point waits need: the "
            "program's sends and receives do not match (a missing send, another peer or another tag)";
  } else if (size_ > 1 && missing.empty()) {
    text += "; every rank answered the census within " + seconds_text(kCensusSeconds) +
            " s, so the collective was only slower than DDLFAST_TIMEOUT_S allows";
  } else if (!missing.empty()) {
    text += "; rank" + std::string(missing.size() > 1 ? "s " : " ") + rank_list(missing) +
            " did not join (no answer from inside any ddlfast call within " + seconds_text(kCensusSeconds) + " s)";
  }
  text += ". Abort the job: this communicator is out of step.";
  mark_broken(text);
  return Status(StatusCode::kTimeout, text);
}

// Asks every other rank whether it is alive (ranks inside a ddlfast wait answer at once and fail their wait),
// sends the answering ranks the list of those that did not answer within kCensusSeconds, and returns it.
std::vector<int> MpiTransport::census(std::int64_t kind, std::vector<std::int64_t>* waits) {
  std::vector<int> missing;
  std::vector<std::int64_t> replies(5 * static_cast<std::size_t>(size_), -1);
  replies[5 * static_cast<std::size_t>(rank_) + 1] = static_cast<std::int64_t>(sequence_);
  for (int i = 0; i < 3; ++i) replies[5 * static_cast<std::size_t>(rank_) + 2 + i] = waiting_[i];
  if (waits != nullptr) {  // kind, peer, tag, sequence per rank; kind -1 until a rank answers
    waits->assign(4 * static_cast<std::size_t>(size_), -1);
    for (int i = 0; i < 3; ++i) (*waits)[4 * static_cast<std::size_t>(rank_) + i] = waiting_[i];
    (*waits)[4 * static_cast<std::size_t>(rank_) + 3] = static_cast<std::int64_t>(sequence_);
  }
  if (size_ == 1 || census_comm_ == MPI_COMM_NULL) return missing;
  if (kind == kAskAfterInterrupt) {
    // Ctrl-C: the user waits for KeyboardInterrupt, so only tell every rank (no answers, no verdict); the ask
    // lives where abandoned buffers live, since its sends may complete after this returns.
    std::vector<std::int64_t>& ask = scratch_->verdicts.emplace_back(std::vector<std::int64_t>{
        rank_, static_cast<std::int64_t>(sequence_), kind, waiting_[0], waiting_[1], waiting_[2]});
    for (int r = 0; r < size_; ++r) {
      MPI_Request send;
      if (r != rank_ && MPI_Isend(ask.data(), 6, MPI_INT64_T, r, kAskTag, census_comm_, &send) == MPI_SUCCESS) {
        MPI_Request_free(&send);
      }
    }
    return missing;
  }
  const std::int64_t ask[6] = {rank_, static_cast<std::int64_t>(sequence_), kind, waiting_[0], waiting_[1],
                               waiting_[2]};
  std::vector<MPI_Request> receives(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  std::vector<char> answered(static_cast<std::size_t>(size_), 0);
  answered[rank_] = 1;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request send;
    if (MPI_Isend(ask, 6, MPI_INT64_T, r, kAskTag, census_comm_, &send) == MPI_SUCCESS) MPI_Request_free(&send);
    MPI_Irecv(&replies[5 * r], 5, MPI_INT64_T, r, kReplyTag, census_comm_, &receives[r]);
  }
  const auto start = std::chrono::steady_clock::now();
  int waiting_for = size_ - 1;
  while (waiting_for > 0 && seconds_since(start) < kCensusSeconds) {
    for (int r = 0; r < size_; ++r) {
      if (answered[r]) continue;
      int done = 0;
      MPI_Test(&receives[r], &done, MPI_STATUS_IGNORE);
      if (done) {
        answered[r] = 1;
        --waiting_for;
      }
    }
    if (census_ask_arrived()) reply_to_census();  // another rank asks at the same time: tell it we live
    sched_yield();
  }
  std::vector<int> alive;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    if (answered[r]) {
      alive.push_back(r);
      if (waits != nullptr) {
        for (int i = 0; i < 3; ++i) (*waits)[4 * static_cast<std::size_t>(r) + i] = replies[5 * r + 2 + i];
        (*waits)[4 * static_cast<std::size_t>(r) + 3] = replies[5 * r + 1];
      }
    } else {
      missing.push_back(r);
      MPI_Cancel(&receives[r]);
      MPI_Wait(&receives[r], MPI_STATUS_IGNORE);
    }
  }
  // The verdict buffer must outlive its sends: it goes where abandoned buffers go.
  std::vector<std::int64_t>& verdict = scratch_->verdicts.emplace_back(static_cast<std::size_t>(size_) + 1, 0);
  verdict[0] = static_cast<std::int64_t>(missing.size());
  for (std::size_t i = 0; i < missing.size(); ++i) verdict[1 + i] = missing[i];
  for (int r : alive) {
    MPI_Request send;
    if (MPI_Isend(verdict.data(), size_ + 1, MPI_INT64_T, r, kVerdictTag, census_comm_, &send) == MPI_SUCCESS) {
      MPI_Request_free(&send);
    }
  }
  return missing;
}

// "rank 1 waits in a point-to-point receive from rank 0 with tag 7; rank 0 in collective #4", from census().
std::string MpiTransport::waits_text(const std::vector<std::int64_t>& waits) const {
  std::string text;
  for (int r = 0; r < size_; ++r) {
    const std::int64_t* wait = &waits[4 * static_cast<std::size_t>(r)];
    if (wait[0] < 0) continue;
    text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + (r == rank_ ? " (this rank)" : "") +
            " waits in " + wait_text(wait[0], wait[1], wait[2], wait[3]);
  }
  return text;
}

void MpiTransport::abandon(const Status& failure, bool force) {
  bool abandoned = false;
  for (std::size_t id = 0; id < requests_.size(); ++id) {
    if (requests_[id] == MPI_REQUEST_NULL) continue;
    abandoned = true;
    if (is_receive_[id]) {  // nothing may land in the caller's memory later
      MPI_Cancel(&requests_[id]);
      MPI_Wait(&requests_[id], MPI_STATUS_IGNORE);
    } else {
      MPI_Request_free(&requests_[id]);  // never cancel a send
    }
  }
  free_ids_.clear();
  for (RequestId id = static_cast<RequestId>(requests_.size()) - 1; id >= 0; --id) free_ids_.push_back(id);
  if (failure.code() == StatusCode::kTimeout || failure.code() == StatusCode::kBroken) {
    mark_broken(failure.message());  // the stall census already told the other ranks
  } else if (abandoned || force) {
    abandon_and_tell(failure.message(), failure.code() == StatusCode::kInterrupted);
  }
}

void MpiTransport::abandon_and_tell(const std::string& reason, bool interrupted) {
  if (broken()) return;
  if (failure_known()) {
    // MPI reports a dead rank (ULFM): revoking fails every survivor's waits at once, where a census would wait
    // for the dead rank's answer.
    mark_broken(reason + " (MPI reports a failed rank; this rank revoked the communicators)");
    revoke_communicators();
    return;
  }
  mark_broken(reason);
  // ranks waiting for this one fail now instead of at their stall limit
  census(interrupted ? kAskAfterInterrupt : kAskAfterFailure);
}

bool MpiTransport::failure_known() const {
  return census_revoked_ || ulfm_failure_known(comm_) || ulfm_failure_known(agree_comm_) ||
         ulfm_failure_known(census_comm_);
}

void MpiTransport::revoke_communicators() {
  ulfm_revoke(comm_);
  ulfm_revoke(agree_comm_);
  ulfm_revoke(census_comm_);
}

Status MpiTransport::native_allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (count > static_cast<std::size_t>(INT_MAX)) return Status::invalid("count too large for MPI_Allreduce");
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op mpi_op = MPI_SUM;
  DDLFAST_RETURN_IF_ERROR(mpi_reduction(dtype, op, &type, &mpi_op));
  const std::size_t bytes = count * dtype_size(dtype);
  std::vector<char>& copy = scratch_->small;
  if (copy.size() < bytes) copy.resize(bytes);
  std::memcpy(copy.data(), data, bytes);
  MPI_Request request;
  DDLFAST_RETURN_IF_ERROR(check(
      MPI_Iallreduce(MPI_IN_PLACE, copy.data(), static_cast<int>(count), type, mpi_op, comm_, &request),
      "MPI_Iallreduce", -1));
  DDLFAST_RETURN_IF_ERROR(wait_request(&request, "MPI_Allreduce (buffers <= DDLFAST_SMALL_BYTES)"));
  std::memcpy(data, copy.data(), bytes);
  return Status::ok();
}

Status MpiTransport::mpi_reduction(DType dtype, ReduceOp op, MPI_Datatype* type, MPI_Op* mpi_op) const {
  if (op == ReduceOp::kAverage) return Status::invalid("MPI's reductions sum; the caller divides for an average");
  *type = mpi_type(dtype);
  *mpi_op = MPI_SUM;
  if (op != ReduceOp::kSum) {
    *mpi_op = combine_ops_[combine_index(op) * kNumDTypes + static_cast<int>(dtype)];
  } else if (dtype == DType::kFloat16) {
    *mpi_op = fp16_sum_;
  } else if (dtype == DType::kBFloat16) {
    *mpi_op = bf16_sum_;
  }
  return Status::ok();
}

Status MpiTransport::native_reduce_scatter(const void* send, void* recv, const std::vector<std::size_t>& counts,
                                           DType dtype, ReduceOp op) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (counts.size() != static_cast<std::size_t>(size_)) return Status::invalid("one count per rank is needed");
  std::vector<int> recv_counts;
  std::size_t total = 0;
  for (std::size_t count : counts) {
    if (count > static_cast<std::size_t>(INT_MAX)) return Status::invalid("count too large for MPI_Reduce_scatter");
    recv_counts.push_back(static_cast<int>(count));
    total += count;
  }
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op mpi_op = MPI_SUM;
  DDLFAST_RETURN_IF_ERROR(mpi_reduction(dtype, op, &type, &mpi_op));
  const std::size_t esize = dtype_size(dtype);
  const std::size_t mine = counts[rank_] * esize;
  std::vector<char>& copy = scratch_->small;  // the send copy, then the receive buffer
  if (copy.size() < total * esize + mine + 1) copy.resize(total * esize + mine + 1);
  if (total) std::memcpy(copy.data(), send, total * esize);
  MPI_Request request;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Ireduce_scatter(copy.data(), copy.data() + total * esize, recv_counts.data(),
                                                    type, mpi_op, comm_, &request),
                                "MPI_Ireduce_scatter", -1));
  DDLFAST_RETURN_IF_ERROR(wait_request(&request, "MPI_Reduce_scatter (buffers <= DDLFAST_SMALL_BYTES)"));
  if (mine) std::memcpy(recv, copy.data() + total * esize, mine);
  return Status::ok();
}

Status MpiTransport::native_allgather(const void* send, void* recv, const std::vector<std::size_t>& bytes) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (bytes.size() != static_cast<std::size_t>(size_)) return Status::invalid("one size per rank is needed");
  std::vector<int> recv_counts;
  std::vector<int> displacements;
  std::size_t total = 0;
  for (std::size_t size : bytes) {
    if (total > static_cast<std::size_t>(INT_MAX) - size) return Status::invalid("too many bytes for MPI_Allgatherv");
    recv_counts.push_back(static_cast<int>(size));
    displacements.push_back(static_cast<int>(total));
    total += size;
  }
  const std::size_t mine = bytes[rank_];
  std::vector<char>& copy = scratch_->small;  // the send copy, then the receive buffer
  if (copy.size() < mine + total + 1) copy.resize(mine + total + 1);
  if (mine) std::memcpy(copy.data(), send, mine);
  const bool uniform = std::all_of(bytes.begin(), bytes.end(), [&](std::size_t size) { return size == mine; });
  MPI_Request request;
  const int code = uniform ? MPI_Iallgather(copy.data(), static_cast<int>(mine), MPI_BYTE, copy.data() + mine,
                                            static_cast<int>(mine), MPI_BYTE, comm_, &request)
                           : MPI_Iallgatherv(copy.data(), static_cast<int>(mine), MPI_BYTE, copy.data() + mine,
                                             recv_counts.data(), displacements.data(), MPI_BYTE, comm_, &request);
  DDLFAST_RETURN_IF_ERROR(check(code, "MPI_Iallgather", -1));
  DDLFAST_RETURN_IF_ERROR(wait_request(&request, "MPI_Allgather (buffers <= DDLFAST_SMALL_BYTES)"));
  if (total) std::memcpy(recv, copy.data() + mine, total);
  return Status::ok();
}

}  // namespace ddlfast
