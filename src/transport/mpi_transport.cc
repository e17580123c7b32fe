#include "transport/mpi_transport.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <memory>

#include "kernels/cpu_kernels.h"

namespace ddlfast {
namespace {

void fp16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(DType::kFloat16, inout, in, static_cast<std::size_t>(*len), 1);
}

void bf16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(DType::kBFloat16, inout, in, static_cast<std::size_t>(*len), 1);
}

bool mpi_is_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// Spinning in MPI_Wait starves the peer when ranks outnumber cores; polling
// with a yield keeps progress fair and costs nothing when cores are free.
constexpr int kSpinsBeforeYield = 64;

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
  return version;
}

Status MpiTransport::create(MPI_Comm comm, double timeout_s, std::unique_ptr<MpiTransport>* out) {
  std::unique_ptr<MpiTransport> transport(new MpiTransport());
  // Non-blocking dup, so a rank that never creates its context is a timeout
  // error on the others rather than a hang.
  // MPI writes the new handle whenever the dup completes, possibly after we
  // gave up; so it lands in a heap cell that is deliberately leaked on timeout.
  auto pending = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request request;
  int code = MPI_Comm_idup(comm, pending.get(), &request);
  if (code != MPI_SUCCESS) return Status(StatusCode::kMpiError, "MPI_Comm_idup failed: " + mpi_error_string(code));
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    int done = 0;
    code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return Status(StatusCode::kMpiError, "MPI_Comm_idup failed: " + mpi_error_string(code));
    if (done) break;
    if (spins % kSpinsBeforeYield == 0) {
      sched_yield();
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s > 0 && waited > timeout_s) {
        pending.release();  // see above: MPI may still complete the dup into it
        int rank = 0;
        MPI_Comm_rank(comm, &rank);
        return Status(StatusCode::kTimeout,
                      "rank " + std::to_string(rank) + " waited " + std::to_string(waited) +
                          " s for the other ranks to create their ddlfast context (a collective step); some rank "
                          "never called ddlfast (DDLFAST_TIMEOUT_S). Abort the job.");
      }
    }
  }
  transport->comm_ = *pending;
  MPI_Comm_set_errhandler(transport->comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(transport->comm_, &transport->rank_);
  MPI_Comm_size(transport->comm_, &transport->size_);
  MPI_Op_create(&fp16_sum_op, 1, &transport->fp16_sum_);
  MPI_Op_create(&bf16_sum_op, 1, &transport->bf16_sum_);
  *out = std::move(transport);
  return Status::ok();
}

MpiTransport::~MpiTransport() {
  if (mpi_is_finalized()) return;  // MPI already tore everything down at exit
  for (MPI_Request& request : requests_) {
    if (request != MPI_REQUEST_NULL) {
      MPI_Cancel(&request);
      MPI_Request_free(&request);
    }
  }
  if (fp16_sum_ != MPI_OP_NULL) MPI_Op_free(&fp16_sum_);
  if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Status MpiTransport::check(int code, const char* what, int peer) const {
  if (code == MPI_SUCCESS) return Status::ok();
  return Status(StatusCode::kMpiError, std::string(what) + " on rank " + std::to_string(rank_) + " with peer rank " +
                                           std::to_string(peer) + " failed: " + mpi_error_string(code));
}

RequestId MpiTransport::track(MPI_Request raw, int peer) {
  if (free_ids_.empty()) {
    requests_.push_back(raw);
    peers_.push_back(peer);
    return static_cast<RequestId>(requests_.size() - 1);
  }
  const RequestId id = free_ids_.back();
  free_ids_.pop_back();
  requests_[id] = raw;
  peers_[id] = peer;
  return id;
}

Status MpiTransport::isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) return Status::invalid("message of " + std::to_string(bytes) + " bytes is too large");
  MPI_Request raw;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &raw), "MPI_Isend", peer));
  *request = track(raw, peer);
  return Status::ok();
}

Status MpiTransport::irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) return Status::invalid("message of " + std::to_string(bytes) + " bytes is too large");
  MPI_Request raw;
  DDLFAST_RETURN_IF_ERROR(check(MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &raw), "MPI_Irecv", peer));
  *request = track(raw, peer);
  return Status::ok();
}

Status MpiTransport::wait(RequestId request) {
  MPI_Request& raw = requests_[request];
  const auto start = std::chrono::steady_clock::now();
  int spins = 0;
  while (raw != MPI_REQUEST_NULL) {
    int done = 0;
    DDLFAST_RETURN_IF_ERROR(check(MPI_Test(&raw, &done, MPI_STATUS_IGNORE), "MPI_Test", peers_[request]));
    if (done) break;
    if (++spins < kSpinsBeforeYield) continue;
    spins = 0;
    sched_yield();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_s_ > 0 && waited > timeout_s_) {
      return Status(StatusCode::kTimeout, "rank " + std::to_string(rank_) + " waited " + std::to_string(waited) +
                                              " s for data from rank " + std::to_string(peers_[request]) +
                                              " (DDLFAST_TIMEOUT_S)");
    }
  }
  free_ids_.push_back(request);
  return Status::ok();
}

Status MpiTransport::wait_all() {
  for (RequestId id = 0; id < static_cast<RequestId>(requests_.size()); ++id) {
    if (requests_[id] != MPI_REQUEST_NULL) DDLFAST_RETURN_IF_ERROR(wait(id));
  }
  free_ids_.clear();
  for (RequestId id = static_cast<RequestId>(requests_.size()) - 1; id >= 0; --id) free_ids_.push_back(id);
  return Status::ok();
}

Status MpiTransport::native_allreduce(void* data, std::size_t count, DType dtype) {
  if (count > static_cast<std::size_t>(INT_MAX)) return Status::invalid("count too large for MPI_Allreduce");
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op op = MPI_SUM;
  switch (dtype) {
    case DType::kFloat32: type = MPI_FLOAT; break;
    case DType::kFloat64: type = MPI_DOUBLE; break;
    case DType::kInt32: type = MPI_INT32_T; break;
    case DType::kInt64: type = MPI_INT64_T; break;
    case DType::kFloat16: type = MPI_UINT16_T; op = fp16_sum_; break;
    case DType::kBFloat16: type = MPI_UINT16_T; op = bf16_sum_; break;
  }
  return check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), type, op, comm_), "MPI_Allreduce", -1);
}

}  // namespace ddlfast
