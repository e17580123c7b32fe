#include "engine/small_allreduce.h"

#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
namespace {

// Copies every segment between `data` and the contiguous `host`, in either direction, on the lanes when given.
Status copy_segments(const SegmentedBuffer& data, char* host, bool into_host, DeviceLanes* lanes, int marker) {
  const std::size_t esize = data.element_size();
  for (std::size_t done = 0; done < data.count();) {
    const std::size_t bytes = data.contiguous_from(done) * esize;
    char* dst = into_host ? host + done * esize : data.address(done);
    const char* src = into_host ? data.address(done) : host + done * esize;
    if (lanes == nullptr) {
      std::memcpy(dst, src, bytes);
    } else {
      DDLFAST_RETURN_IF_ERROR(lanes->copy(dst, src, bytes, Lane::kInbound));
    }
    done += bytes / esize;
  }
  if (lanes == nullptr) return Status::ok();
  DDLFAST_RETURN_IF_ERROR(lanes->mark(marker, Lane::kInbound));
  return lanes->wait(marker);
}

}  // namespace

Status small_allreduce(Transport& transport, const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor,
                       const EngineOptions& options, DeviceLanes* lanes, int marker) {
  const std::size_t count = data.count();
  const std::size_t esize = dtype_size(dtype);
  const double start = monotonic_seconds();
  const bool in_place = lanes == nullptr && data.contiguous_from(0) >= count;
  std::vector<char> copy(in_place ? 0 : count * esize);
  char* contiguous = in_place ? data.address(0) : copy.data();
  if (!in_place) DDLFAST_RETURN_IF_ERROR(copy_segments(data, contiguous, true, lanes, marker));
  DDLFAST_RETURN_IF_ERROR(
      transport.native_allreduce(contiguous, count, dtype, op == ReduceOp::kAverage ? ReduceOp::kSum : op));
  // One extra pass over a tiny buffer is cheaper than a custom MPI op per divisor.
  divide_in_place(dtype, contiguous, count, divisor);
  if (!in_place) DDLFAST_RETURN_IF_ERROR(copy_segments(data, contiguous, false, lanes, marker));  // `copy` freed next
  if (options.events) {
    options.events->push_back({EventKind::kMpiAllreduce, -1, start, monotonic_seconds(), count * esize});
  }
  return Status::ok();
}

}  // namespace ddlfast
