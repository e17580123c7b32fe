// MpiTransport's stall census (see transport/mpi_transport.h): who is alive when a wait passes the stall limit,
// the answers and verdicts on the census communicator, and the failure texts that name the missing ranks.
#include "transport/stall_census.h"

#include <sched.h>

#include <chrono>
#include <string>
#include <vector>

#include "transport/fault_tolerance.h"
#include "transport/mpi_transport.h"

namespace ddlfast {

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
  text += " in collective #" + std::to_string(shown(sequence_)) +
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
      missing = ranks.empty()
                    ? std::string("every rank answered its census") +
                          (point_to_point ? ", so no rank is sending what these point-to-point waits need "
                                            "(the program's sends and receives do not match)"
                                          : "")
                    : "rank" + std::string(ranks.size() > 1 ? "s " : " ") + rank_list(ranks) + " did not join";
    } else {
      MPI_Cancel(&receive);
      MPI_Wait(&receive, MPI_STATUS_IGNORE);
      missing = "its census verdict did not arrive";
    }
  }
  const std::string cause =
      "rank " + std::to_string(asker) +
      (asker_interrupted ? " was interrupted (a signal, e.g. Ctrl-C) in collective #" +
                               std::to_string(shown(static_cast<std::uint64_t>(asker_sequence))) + " and abandoned it"
       : asker_failed ? " abandoned collective #" + std::to_string(shown(static_cast<std::uint64_t>(asker_sequence))) +
                            " after an error there (its own message says which)"
                      : " gave up waiting in " +
                            wait_text(asker_wait[0], asker_wait[1], asker_wait[2],
                                      shown(static_cast<std::uint64_t>(asker_sequence))) +
                            " after DDLFAST_TIMEOUT_S (" + seconds_text(timeout_s_) + " s)") +
      (missing.empty() ? "" : "; " + missing) + ". Abort the job: this communicator is out of step.";
  const StatusCode code = asker_failed ? StatusCode::kBroken : StatusCode::kTimeout;
  if (asker_failed && asker_sequence > static_cast<std::int64_t>(sequence_)) {
    // The asker had completed this collective (it abandoned a later one): finish this one, fail the next.
    if (later_failure_.empty()) {
      later_failure_ = "rank " + std::to_string(rank_) + " could not start collective #" +
                       std::to_string(shown(static_cast<std::uint64_t>(asker_sequence))) + ": " + cause;
      later_failure_code_ = code;
    }
    return Status::ok();
  }
  std::string text = "rank " + std::to_string(rank_) + " stopped waiting for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " (collective #" + std::to_string(shown(sequence_)) + "): " + cause;
  mark_broken(text);
  return Status(code, text);
}

// A signal handler raised during this wait (Ctrl-C): the collective cannot complete here, so abandon it now
// and tell the other ranks, who fail naming this rank instead of waiting for their stall limit.
Status MpiTransport::interrupted(const char* what, int peer) {
  std::string text =
      "rank " + std::to_string(rank_) + " was interrupted (a signal, e.g. Ctrl-C) while it waited for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text += " in collective #" + std::to_string(shown(sequence_));
  const Status status(StatusCode::kInterrupted, text);
  abandon(status, /*force=*/true);
  return status;
}

// This rank passed the stall limit: ask every rank whether it is alive, tell the ones that are who is not.
Status MpiTransport::stalled(const char* what, int peer, double waited) {
  std::string text = "rank " + std::to_string(rank_) + " waited " + seconds_text(waited) + " s for " + what;
  if (peer >= 0) text += " from rank " + std::to_string(peer);
  text +=
      " in collective #" + std::to_string(shown(sequence_)) + " (DDLFAST_TIMEOUT_S=" + seconds_text(timeout_s_) + ")";
  std::vector<std::int64_t> waits;
  const std::vector<int> missing = census(kAskAfterStall, &waits);
  bool point_to_point = false;
  for (int r = 0; r < size_; ++r) point_to_point |= waits[3 * static_cast<std::size_t>(r)] > kWaitCollective;
  if (size_ > 1 && missing.empty() && point_to_point) {
    // Every rank is alive and waiting, some for a point-to-point message: a send/recv that nobody matches.
    text += "; every rank answered the census within " + seconds_text(kCensusSeconds) + " s: " + waits_text(waits) +
            ". No rank is sending (or receiving) what these point-to-point waits need: the "
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
  const std::int64_t ask[6] = {rank_,      static_cast<std::int64_t>(sequence_), kind, waiting_[0], waiting_[1],
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
            " waits in " + wait_text(wait[0], wait[1], wait[2], shown(static_cast<std::uint64_t>(wait[3])));
  }
  return text;
}

}  // namespace ddlfast
