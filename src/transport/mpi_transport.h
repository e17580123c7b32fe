// Transport over MPI point-to-point on a private duplicate of the caller's
// communicator, so ddlfast's messages never match the application's.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "transport/transport.h"

namespace ddlfast {

std::string mpi_error_string(int code);
std::string mpi_library_version();

class MpiTransport final : public Transport {
 public:
  // Duplicates `comm` (collective over it; gives up after timeout_s > 0) and
  // sets MPI_ERRORS_RETURN on the copy.
  static Status create(MPI_Comm comm, double timeout_s, std::unique_ptr<MpiTransport>* out);
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }
  void set_timeout(double seconds) { timeout_s_ = seconds; }

  Status isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) override;
  Status irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) override;
  Status wait(RequestId request) override;
  Status wait_all() override;

  // MPI's own allreduce on the private communicator (the small-message path).
  // fp16/bf16 use ddlfast's kernels as user-defined MPI ops.
  Status native_allreduce(void* data, std::size_t count, DType dtype);

 private:
  MpiTransport() = default;
  Status check(int code, const char* what, int peer) const;
  RequestId track(MPI_Request raw, int peer);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op fp16_sum_ = MPI_OP_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 0.0;  // 0: wait forever
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;
  std::vector<RequestId> free_ids_;
};

}  // namespace ddlfast
