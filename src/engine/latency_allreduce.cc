#include "engine/latency_allreduce.h"

#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
namespace {

// Whether `carried` bytes travel by recursive halving and doubling (EngineOptions::halving_bytes).
bool halves(std::size_t carried, const EngineOptions& options) {
  return options.halving_bytes > 0 && carried >= options.halving_bytes;
}

}  // namespace

bool LatencyAllreduce::takes(const SegmentedBuffer& data, DType dtype, ReduceOp op,
                             const EngineOptions& options) const {
  const std::size_t bytes = data.count() * dtype_size(dtype);
  const std::size_t carried = integer_average(dtype, op) ? 2 * bytes : bytes;  // the remainders travel too
  return options.small_path == SmallPath::kLatency && transport_.size() > 1 && bytes > 0 &&
         bytes <= options.small_bytes && carried <= transport_.agreement_capacity();
}

Status LatencyAllreduce::run(std::uint64_t digest, bool* agreed, const SegmentedBuffer& data, DType dtype, ReduceOp op,
                             const EngineOptions& options, bool disjoint) {
  const int world = transport_.size();
  const std::size_t count = data.count();
  const std::size_t esize = dtype_size(dtype);
  const double start = monotonic_seconds();
  // Straight from the caller's memory, written on agreement.
  if (!works_on_a_copy(dtype, op) && data.contiguous_from(0) == count) {
    const AgreedReduction reduction{data.address(0),
                                    count,
                                    dtype,
                                    op == ReduceOp::kAverage ? ReduceOp::kSum : op,
                                    halves(count * esize, options),
                                    disjoint && op == ReduceOp::kSum};
    DDLFAST_RETURN_IF_ERROR(transport_.agree(digest, agreed, &reduction));
    if (*agreed && op == ReduceOp::kAverage) divide_in_place(dtype, data.address(0), count, world);
  } else {
    if (copy_.size() < count * esize) copy_.resize(count * esize);
    const SegmentedBuffer copy = contiguous(copy_.data(), count, esize);
    copy_elements(data, copy);
    DDLFAST_RETURN_IF_ERROR(exact_.before(copy, dtype, op, world));
    const SegmentedBuffer& work = exact_.buffer();  // the copy, plus remainders for an integer average
    const bool packs = work.contiguous_from(0) < work.count();
    if (packs && packed_.size() < work.count() * esize) packed_.resize(work.count() * esize);
    const SegmentedBuffer packed = contiguous(packs ? packed_.data() : work.address(0), work.count(), esize);
    if (packs) copy_elements(work, packed);
    const ReduceOp reduce_op = exact_.op() == ReduceOp::kAverage ? ReduceOp::kSum : exact_.op();
    const AgreedReduction reduction{packed.address(0), work.count(), dtype, reduce_op,
                                    halves(work.count() * esize, options)};
    DDLFAST_RETURN_IF_ERROR(transport_.agree(digest, agreed, &reduction));
    if (!*agreed) return Status::ok();
    if (exact_.op() == ReduceOp::kAverage) divide_in_place(dtype, packed.address(0), work.count(), world);
    if (packs) copy_elements(packed, work);
    DDLFAST_RETURN_IF_ERROR(exact_.after(transport_));
    copy_elements(copy, data);
  }
  if (*agreed && options.events) {
    options.events->push_back({EventKind::kLatencyAllreduce, -1, start, monotonic_seconds(), count * esize});
  }
  return Status::ok();
}

}  // namespace ddlfast
