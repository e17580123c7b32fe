#include "engine/context.h"

namespace ddlfast {

Status Context::create(MPI_Comm comm, double timeout_s, std::unique_ptr<Context>* out) {
  std::unique_ptr<Context> context(new Context());
  DDLFAST_RETURN_IF_ERROR(MpiTransport::create(comm, timeout_s, &context->transport_));
  *out = std::move(context);
  return Status::ok();
}

Status Context::engine_for(const std::vector<int>& dims, const std::vector<int>& order, RingAllreduce** out) {
  auto key = std::make_pair(dims, order);
  auto found = engines_.find(key);
  if (found == engines_.end()) {
    std::unique_ptr<RingAllreduce> engine;
    DDLFAST_RETURN_IF_ERROR(RingAllreduce::create(*transport_, dims, order, &engine));
    found = engines_.emplace(std::move(key), std::move(engine)).first;
  }
  *out = found->second.get();
  return Status::ok();
}

Status Context::device_engine_for(const std::vector<int>& dims, const std::vector<int>& order,
                                  DeviceRingAllreduce** out) {
  auto key = std::make_pair(dims, order);
  auto found = device_engines_.find(key);
  if (found == device_engines_.end()) {
    std::unique_ptr<DeviceRingAllreduce> engine;
    DDLFAST_RETURN_IF_ERROR(DeviceRingAllreduce::create(*transport_, dims, order, &engine));
    found = device_engines_.emplace(std::move(key), std::move(engine)).first;
  }
  *out = found->second.get();
  return Status::ok();
}

Status Context::finish(const Status& status) {
  if (!status.is_ok() && status.code() != StatusCode::kConsistent) transport_->abandon(status);
  return status;
}

Status Context::allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                          const std::vector<int>& order, const EngineOptions& options) {
  RingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(engine_for(dims, order, &engine));
  return finish(engine->run(data, dtype, op, options));
}

Status Context::reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                               const std::vector<std::size_t>& counts, DType dtype, ReduceOp op,
                               const std::vector<int>& dims, const std::vector<int>& order,
                               const EngineOptions& options) {
  RingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(engine_for(dims, order, &engine));
  return finish(engine->reduce_scatter(input, output, counts, dtype, op, options));
}

Status Context::allgather(const SegmentedBuffer& input, const SegmentedBuffer& output,
                          const std::vector<std::size_t>& counts, bool float32, const std::vector<int>& dims,
                          const std::vector<int>& order, const EngineOptions& options) {
  RingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(engine_for(dims, order, &engine));
  return finish(engine->allgather(input, output, counts, float32, options));
}

Status Context::device_allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                                 const std::vector<int>& order, const EngineOptions& options,
                                 const DeviceRunOptions& run, DeviceLanes* lanes, const DeviceStaging& staging) {
  DeviceRingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(device_engine_for(dims, order, &engine));
  const Status status = engine->run(data, dtype, op, options, run, lanes, staging);
  // The phase cancelled its own receives; ranks still in the ring are told (a census), and this transport refuses.
  if (!status.is_ok()) transport_->abandon(status, /*force=*/true);
  return status;
}

}  // namespace ddlfast
