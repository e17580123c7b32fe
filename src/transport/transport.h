// The narrow interface the engine moves bytes through: non-blocking
// point-to-point messages identified by small integer handles.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace ddlfast {

using RequestId = int;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Status isend(const void* data, std::size_t bytes, int peer, int tag, RequestId* request) = 0;
  virtual Status irecv(void* data, std::size_t bytes, int peer, int tag, RequestId* request) = 0;
  // Completes one request; fails with kTimeout, naming the peer, when it does
  // not complete within the transport's stall limit.
  virtual Status wait(RequestId request) = 0;
  virtual Status wait_all() = 0;
};

}  // namespace ddlfast
