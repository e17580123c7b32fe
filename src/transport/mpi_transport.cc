#include "transport/mpi_transport.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <memory>
#include <utility>

#include "kernels/cpu/cpu_kernels.h"
#include "transport/fault_tolerance.h"
#include "transport/poll_backoff.h"
#include "transport/shared_segment.h"
#include "transport/stall_census.h"

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

// How many ranks of `comm` share this rank's host (MPI_COMM_TYPE_SHARED; collective over `comm`); 1 where MPI
// cannot tell.
int ranks_on_this_host(MPI_Comm comm) {
  MPI_Comm local = MPI_COMM_NULL;
  int ranks_here = 1;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local) == MPI_SUCCESS) {
    MPI_Comm_size(local, &ranks_here);
    MPI_Comm_free(&local);
  }
  return ranks_here;
}

// 64 bits of `bytes` (FNV-1a): the same input gives the same value on every rank.
std::uint64_t fingerprint_of(const void* data, std::size_t bytes) {
  std::uint64_t hash = 14695981039346656037ULL;
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ULL;
  return hash;
}

// Which machine this rank runs on: its kernel's boot id, which every process of one kernel shares whatever
// hostname, container or network namespace it runs in (where MPI may see a host of its own); the processor name
// where the id cannot be read.
std::uint64_t machine_fingerprint() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(file >> id)) {
    char name[MPI_MAX_PROCESSOR_NAME];
    int length = 0;
    MPI_Get_processor_name(name, &length);
    id.assign(name, static_cast<std::size_t>(length));
  }
  return fingerprint_of(id.data(), id.size());
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

Status MpiTransport::create(MPI_Comm comm, double timeout_s, std::size_t agreement_capacity, bool shared_memory,
                            std::unique_ptr<MpiTransport>* out) {
  std::unique_ptr<MpiTransport> transport(new MpiTransport());
  DDLFAST_RETURN_IF_ERROR(dup_with_limit(comm, timeout_s, &transport->comm_));
  DDLFAST_RETURN_IF_ERROR(dup_with_limit(comm, timeout_s, &transport->census_comm_));
  DDLFAST_RETURN_IF_ERROR(dup_with_limit(comm, timeout_s, &transport->agree_comm_));
  MPI_Comm_rank(transport->comm_, &transport->rank_);
  MPI_Comm_size(transport->comm_, &transport->size_);
  transport->agreement_capacity_ = agreement_capacity;
  transport->allocate_exchange();
  if (transport->size_ > 1) transport->arrivals_ = ArrivalLog(transport->size_);
  const int ranks_here = ranks_on_this_host(transport->comm_);
  MPI_Op_create(&fp16_sum_op, 1, &transport->fp16_sum_);
  MPI_Op_create(&bf16_sum_op, 1, &transport->bf16_sum_);
  create_combine_row<0>(&transport->combine_ops_, std::make_index_sequence<kNumDTypes>());
  create_combine_row<1>(&transport->combine_ops_, std::make_index_sequence<kNumDTypes>());
  create_combine_row<2>(&transport->combine_ops_, std::make_index_sequence<kNumDTypes>());
  transport->timeout_s_ = timeout_s;
  DDLFAST_RETURN_IF_ERROR(transport->choose_spin());
  if (transport->size_ > 1 && ranks_here == transport->size_) {  // the same answer on every rank
    DDLFAST_RETURN_IF_ERROR(transport->attach_shared_memory(shared_memory));
  }
  transport->post_census_ask();
  *out = std::move(transport);
  return Status::ok();
}

// Spinning before yielding pays only when every rank has a core to itself: with more ranks than cores, a spinning
// rank holds the core its peer needs to answer, and every ring step then costs a scheduler slice (4 ranks on 2
// cores: 4 KiB allreduce 85 us -> 900 us with a 200 us spin). Then yield at once instead. Ranks compete for cores
// where they run on one machine (also where MPI sees hosts of their own: containers, network namespaces) with the
// same affinity mask; ranks pinned to cores of their own (Open MPI binds 2 ranks to a core each) do not.
Status MpiTransport::choose_spin() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int cores = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  const std::uint64_t mine[2] = {machine_fingerprint(), fingerprint_of(&cpus, sizeof cpus)};
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(size_));
  MPI_Request request;
  DDLFAST_RETURN_IF_ERROR(
      check(MPI_Iallgather(mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, comm_, &request),
            "MPI_Iallgather", -1));
  DDLFAST_RETURN_IF_ERROR(wait_request(&request, "the other ranks' machines and cores (creating the context)"));
  int sharing = 0;
  for (int rank = 0; rank < size_; ++rank) sharing += all[2 * rank] == mine[0] && all[2 * rank + 1] == mine[1];
  spin_us_ = sharing > cores ? 0.0 : PollBackoff::kDefaultSpinUs;
  return Status::ok();
}

MpiTransport::~MpiTransport() {
  if (mpi_is_finalized()) return;                 // MPI already tore everything down at exit
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
  if (bytes > static_cast<std::size_t>(INT_MAX))
    return Status::invalid("message of " + std::to_string(bytes) + " bytes is too large");
  MPI_Request raw;
  DDLFAST_RETURN_IF_ERROR(
      check(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &raw), "MPI_Isend", peer));
  *request = track(raw, peer, false);
  return Status::ok();
}

Status MpiTransport::irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  DDLFAST_RETURN_IF_ERROR(refuse_if_broken());
  if (bytes > static_cast<std::size_t>(INT_MAX))
    return Status::invalid("message of " + std::to_string(bytes) + " bytes is too large");
  MPI_Request raw;
  DDLFAST_RETURN_IF_ERROR(
      check(MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &raw), "MPI_Irecv", peer));
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
      DDLFAST_RETURN_IF_ERROR(
          wait_request(&requests_[id], is_receive_[id] ? "data" : "a send to be taken", peers_[id]));
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
  DDLFAST_RETURN_IF_ERROR(
      check(MPI_Iallreduce(MPI_IN_PLACE, copy.data(), static_cast<int>(count), type, mpi_op, comm_, &request),
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
  DDLFAST_RETURN_IF_ERROR(check(
      MPI_Ireduce_scatter(copy.data(), copy.data() + total * esize, recv_counts.data(), type, mpi_op, comm_, &request),
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
