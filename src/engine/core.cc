#include "engine/core.h"

#include <algorithm>
#include <cstring>

namespace ddlfast {

Status Core::create(MPI_Comm comm, double timeout_s, std::size_t agreement_capacity, bool shared_memory,
                    std::unique_ptr<Core>* out) {
  std::unique_ptr<Core> context(new Core());
  DDLFAST_RETURN_IF_ERROR(
      MpiTransport::create(comm, timeout_s, agreement_capacity, shared_memory, &context->transport_));
  context->latency_ = std::make_unique<LatencyAllreduce>(*context->transport_);
  *out = std::move(context);
  return Status::ok();
}

namespace {

// The engine of `Engine` type for (dims, order) from `cache`, made on first use.
template <typename Engine>
Status cached_engine(std::map<std::pair<std::vector<int>, std::vector<int>>, std::unique_ptr<Engine>>& cache,
                     Transport& transport, const std::vector<int>& dims, const std::vector<int>& order, Engine** out) {
  auto key = std::make_pair(dims, order);
  auto found = cache.find(key);
  if (found == cache.end()) {
    std::unique_ptr<Engine> engine;
    DDLFAST_RETURN_IF_ERROR(Engine::create(transport, dims, order, &engine));
    found = cache.emplace(std::move(key), std::move(engine)).first;
  }
  *out = found->second.get();
  return Status::ok();
}

}  // namespace

Status Core::engine_for(const std::vector<int>& dims, const std::vector<int>& order, RingAllreduce** out) {
  return cached_engine(engines_, *transport_, dims, order, out);
}

Status Core::device_engine_for(const std::vector<int>& dims, const std::vector<int>& order, DeviceRingAllreduce** out) {
  return cached_engine(device_engines_, *transport_, dims, order, out);
}

Status Core::finish(const Status& status) {
  if (!status.is_ok() && status.code() != StatusCode::kConsistent) transport_->abandon(status);
  return status;
}

Status Core::allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                       const std::vector<int>& order, const EngineOptions& options) {
  RingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(engine_for(dims, order, &engine));
  return finish(engine->run(data, dtype, op, options));
}

template <typename Collective>
Status Core::agree_then(std::uint64_t digest, bool* agreed, Collective&& collective) {
  Status status = finish(transport_->agree(digest, agreed));
  if (status.is_ok() && *agreed) status = collective();
  transport_->flight().end(status.is_ok(), false);  // the whole collective was this one call
  return status;
}

Status Core::agreed_allreduce(std::uint64_t digest, bool* agreed, const SegmentedBuffer& data, DType dtype, ReduceOp op,
                              const std::vector<int>& dims, const std::vector<int>& order, const EngineOptions& options,
                              bool disjoint) {
  if (!latency_->takes(data, dtype, op, options)) {
    return agree_then(digest, agreed, [&] { return allreduce(data, dtype, op, dims, order, options); });
  }
  const Status status = finish(latency_->run(digest, agreed, data, dtype, op, options, disjoint));
  transport_->flight().end(status.is_ok(), true);  // the whole collective was this one call
  return status;
}

Status Core::reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                            const std::vector<std::size_t>& counts, DType dtype, ReduceOp op,
                            const std::vector<int>& dims, const std::vector<int>& order, const EngineOptions& options) {
  RingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(engine_for(dims, order, &engine));
  return finish(engine->reduce_scatter(input, output, counts, dtype, op, options));
}

Status Core::allgather(const SegmentedBuffer& input, const SegmentedBuffer& output,
                       const std::vector<std::size_t>& counts, bool float32, const std::vector<int>& dims,
                       const std::vector<int>& order, const EngineOptions& options) {
  RingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(engine_for(dims, order, &engine));
  return finish(engine->allgather(input, output, counts, float32, options));
}

Status Core::agreed_reduce_scatter(std::uint64_t digest, bool carried, bool* agreed, const SegmentedBuffer& input,
                                   const SegmentedBuffer& output, const std::vector<std::size_t>& counts, DType dtype,
                                   ReduceOp op, const std::vector<int>& dims, const std::vector<int>& order,
                                   const EngineOptions& options) {
  const int me = rank();
  if (counts.size() != static_cast<std::size_t>(size()) || counts[me] != output.count()) {
    return Status::invalid("reduce-scatter counts do not match the ranks or the output");
  }
  if (!carried) {
    return agree_then(digest, agreed,
                      [&] { return reduce_scatter(input, output, counts, dtype, op, dims, order, options); });
  }
  const std::size_t esize = dtype_size(dtype);
  const std::size_t total = input.count();
  if (carried_.size() < total * esize + 1) carried_.resize(total * esize + 1);
  const SegmentedBuffer whole = contiguous(carried_.data(), total, esize);
  copy_elements(input, whole);
  DDLFAST_RETURN_IF_ERROR(agreed_allreduce(digest, agreed, whole, dtype, op, dims, order, options));
  if (*agreed) {
    std::size_t start = 0;
    for (int q = 0; q < me; ++q) start += counts[q];
    copy_elements(contiguous(carried_.data() + start * esize, counts[me], esize), output);
  }
  return Status::ok();
}

Status Core::agreed_allgather(std::uint64_t digest, bool carried, bool* agreed, const SegmentedBuffer& input,
                              const SegmentedBuffer& output, const std::vector<std::size_t>& counts,
                              const std::vector<int>& dims, const std::vector<int>& order,
                              const EngineOptions& options) {
  const int me = rank();
  const std::size_t esize = input.element_size();
  if (counts.size() != static_cast<std::size_t>(size()) || counts[me] != input.count() ||
      output.element_size() != esize) {
    return Status::invalid("allgather counts do not match the ranks or the input");
  }
  if (!carried) {
    return agree_then(digest, agreed, [&] { return allgather(input, output, counts, false, dims, order, options); });
  }
  std::size_t total = 0;
  for (std::size_t count : counts) total += count;
  if (total != output.count()) return Status::invalid("allgather output does not hold every rank's block");
  // int64 words: each rank's bytes at its place, zeros elsewhere, so the sum is every rank's bytes exactly. With
  // equal blocks each starts on a word, where the sum's own partition puts it (AgreedReduction::disjoint), so in
  // shared memory a rank writes and reads only blocks.
  constexpr std::size_t kWord = sizeof(std::int64_t);
  const bool equal = std::all_of(counts.begin(), counts.end(), [&](std::size_t n) { return n == counts[0]; });
  const std::size_t block_words = (counts[0] * esize + kWord - 1) / kWord;
  std::vector<std::size_t> starts;  // each rank's first byte in the words
  std::size_t bytes = 0;
  for (std::size_t count : counts) {
    starts.push_back(bytes);
    bytes += equal ? block_words * kWord : count * esize;
  }
  const std::size_t words = (bytes + kWord - 1) / kWord;
  if (carried_.size() < words * kWord) carried_.resize(words * kWord);
  std::memset(carried_.data(), 0, words * kWord);
  copy_elements(input, contiguous(carried_.data() + starts[me], input.count(), esize));
  DDLFAST_RETURN_IF_ERROR(agreed_allreduce(digest, agreed, contiguous(carried_.data(), words, kWord), DType::kInt64,
                                           ReduceOp::kSum, dims, order, options, equal));
  if (!*agreed) return Status::ok();
  std::vector<char*> blocks;  // each rank's block in the words, in rank order: the output's order
  for (std::size_t start : starts) blocks.push_back(carried_.data() + start);
  copy_elements(SegmentedBuffer(std::move(blocks), counts, esize), output);
  return Status::ok();
}

Status Core::device_allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const std::vector<int>& dims,
                              const std::vector<int>& order, const EngineOptions& options, const DeviceRunOptions& run,
                              DeviceLanes* lanes, const DeviceStaging& staging) {
  DeviceRingAllreduce* engine = nullptr;
  DDLFAST_RETURN_IF_ERROR(device_engine_for(dims, order, &engine));
  const Status status = engine->run(data, dtype, op, options, run, lanes, staging);
  // The phase cancelled its own receives; ranks still in the ring are told (a census), and this transport refuses.
  if (!status.is_ok()) transport_->abandon(status, /*force=*/true);
  return status;
}

}  // namespace ddlfast
