#include "engine/context.h"

namespace ddlfast {

Status Context::create(MPI_Comm comm, std::unique_ptr<Context>* out) {
  std::unique_ptr<Context> context(new Context());
  DDLFAST_RETURN_IF_ERROR(MpiTransport::create(comm, &context->transport_));
  *out = std::move(context);
  return Status::ok();
}

Status Context::allreduce(void* data, std::size_t count, DType dtype, ReduceOp op, const std::vector<int>& dims,
                          const EngineOptions& options) {
  auto found = engines_.find(dims);
  if (found == engines_.end()) {
    Torus torus;
    DDLFAST_RETURN_IF_ERROR(Torus::make(dims, transport_->size(), &torus));
    found = engines_.emplace(dims, std::make_unique<RingAllreduce>(transport_.get(), std::move(torus))).first;
  }
  return found->second->run(data, count, dtype, op, options);
}

}  // namespace ddlfast
