#include "engine/context.h"

namespace ddlfast {

Status Context::create(MPI_Comm comm, double timeout_s, std::unique_ptr<Context>* out) {
  std::unique_ptr<Context> context(new Context());
  DDLFAST_RETURN_IF_ERROR(MpiTransport::create(comm, timeout_s, &context->transport_));
  *out = std::move(context);
  return Status::ok();
}

Status Context::allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                          const std::vector<int>& order, const EngineOptions& options) {
  auto key = std::make_pair(dims, order);
  auto found = engines_.find(key);
  if (found == engines_.end()) {
    std::unique_ptr<RingAllreduce> engine;
    DDLFAST_RETURN_IF_ERROR(RingAllreduce::create(transport_.get(), dims, order, &engine));
    found = engines_.emplace(std::move(key), std::move(engine)).first;
  }
  const Status status = found->second->run(data, dtype, op, options);
  if (!status.is_ok() && status.code() != StatusCode::kConsistent) transport_->abandon(status);
  return status;
}

}  // namespace ddlfast
