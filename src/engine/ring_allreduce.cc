#include "engine/ring_allreduce.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "engine/chunking.h"
#include "kernels/cpu_kernels.h"
#include "transport/mpi_transport.h"

namespace ddlfast {
namespace {

using namespace chunking;  // NOLINT: the engine's own helpers

void prescale(const SegmentedBuffer& data, float scale) {
  for (std::size_t done = 0; done < data.count();) {
    const std::size_t n = data.contiguous_from(done);
    float* values = reinterpret_cast<float*>(data.address(done));
    for (std::size_t i = 0; i < n; ++i) values[i] *= scale;
    done += n;
  }
}

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Status RingAllreduce::create(MpiTransport* transport, const std::vector<int>& dims, const std::vector<int>& order,
                             std::unique_ptr<RingAllreduce>* out) {
  RankedTorus ring;
  DDLFAST_RETURN_IF_ERROR(RankedTorus::make(dims, order, transport->size(), transport->rank(), &ring));
  out->reset(new RingAllreduce(transport, std::move(ring)));
  return Status::ok();
}

// Tiny buffers: MPI_Allreduce's log(p) steps beat the ring's 2(p-1). min, max
// and product run ddlfast's own kernels as MPI user ops (the transport's), so
// nan and signed zeros follow the same rules as on the ring.
Status RingAllreduce::run_small(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor,
                                const EngineOptions& options) {
  const std::size_t count = data.count();
  const std::size_t esize = dtype_size(dtype);
  const double start = monotonic_seconds();
  char* contiguous = data.address(0);
  std::vector<char> packed;
  if (data.contiguous_from(0) < count) {
    packed.resize(count * esize);
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = data.contiguous_from(done);
      std::copy_n(data.address(done), n * esize, packed.data() + done * esize);
      done += n;
    }
    contiguous = packed.data();
  }
  DDLFAST_RETURN_IF_ERROR(
      transport_->native_allreduce(contiguous, count, dtype, op == ReduceOp::kAverage ? ReduceOp::kSum : op));
  if (divisor != 1) {
    // One extra pass over a tiny buffer is cheaper than a custom MPI op per divisor.
    std::vector<char> zeros(count * esize, 0);
    reduce_into(dtype, contiguous, zeros.data(), count, divisor);
  }
  if (!packed.empty()) {
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = data.contiguous_from(done);
      std::copy_n(packed.data() + done * esize, n * esize, data.address(done));
      done += n;
    }
  }
  if (options.events) options.events->push_back({2, -1, start, monotonic_seconds(), count * esize});
  return Status::ok();
}

Status RingAllreduce::run(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options) {
  if (data.count() == 0 || ring_.torus.world_size() == 1) return Status::ok();
  // Integer average and the half types' range (engine/exact_arithmetic.h): the
  // same arithmetic on the ring and on the small-message path.
  DDLFAST_RETURN_IF_ERROR(exact_.before(data, dtype, op, ring_.torus.world_size()));
  DDLFAST_RETURN_IF_ERROR(reduce(exact_.buffer(), dtype, exact_.op(), options));
  return exact_.after(transport_);
}

Status RingAllreduce::reduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options) {
  const int world = ring_.torus.world_size();
  const std::size_t count = data.count();
  const std::size_t esize = dtype_size(dtype);
  int divisor = op == ReduceOp::kAverage ? world : 1;
  if (count * esize <= options.small_bytes) return run_small(data, dtype, op, divisor, options);
  const bool compressed = std::any_of(options.wire_by_dim.begin(), options.wire_by_dim.end(),
                                      [](int wire) { return wire >= 0; });
  if (compressed) {
    if (dtype != DType::kFloat32) return Status::invalid("wire compression needs float32 data");
    if (op == ReduceOp::kProduct) {
      return Status::invalid("op='product' cannot run on a compressed wire (each hop would round a product); use "
                             "compression='none'");
    }
    if (options.wire_by_dim.size() != static_cast<std::size_t>(ring_.torus.num_dims())) {
      return Status::invalid("compression is given for " + std::to_string(options.wire_by_dim.size()) +
                             " dimensions but the ring has " + std::to_string(ring_.torus.num_dims()));
    }
    if (divisor != 1) {
      // Average pre-scales, so partial sums stay within the inputs' range and
      // cannot overflow fp16 where the inputs did not.
      prescale(data, 1.0f / static_cast<float>(divisor));
      divisor = 1;
    }
  }
  const RingSchedule schedule = build_rank_schedule(ring_, count);
  const int last_reduce_scatter = last_reduce_scatter_phase(schedule);
  for (int i = 0; i < static_cast<int>(schedule.phases.size()); ++i) {
    const RingPhase& phase = schedule.phases[i];
    const int tag_base = (i * kTagsPerPhase) % kTagSpace;
    const double start = monotonic_seconds();
    const int wire = compressed ? options.wire_by_dim[phase.dim] : -1;
    if (phase.kind == PhaseKind::kReduceScatter) {
      const int final_divisor = i == last_reduce_scatter ? divisor : 1;
      DDLFAST_RETURN_IF_ERROR(
          wire >= 0 ? compressed_reduce_scatter_phase(data, phase, tag_base, wire, op, final_divisor, options)
                    : reduce_scatter_phase(data, phase, tag_base, dtype, op, final_divisor, options));
    } else {
      DDLFAST_RETURN_IF_ERROR(wire >= 0 ? compressed_allgather_phase(data, phase, tag_base, wire, options)
                                        : allgather_phase(data, phase, tag_base, dtype, options));
    }
    if (options.events) {
      std::size_t phase_bytes = 0;
      for (const RingStep& step : phase.steps) phase_bytes += step.send.count * esize;
      options.events->push_back({static_cast<int>(phase.kind), phase.dim, start, monotonic_seconds(), phase_bytes});
    }
  }
  return Status::ok();
}

// Receives land in a ring of scratch slots; slot j is re-posted for chunk
// j+W as soon as chunk j has been added into the data, and the reduced
// chunk goes straight on to the successor as part of the next step.
Status RingAllreduce::reduce_scatter_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, DType dtype,
                                           ReduceOp op, int final_divisor, const EngineOptions& options) {
  const std::size_t esize = dtype_size(dtype);
  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / esize);
  const std::vector<ChunkItem> items = chunk_items(data, phase, chunk_elems);
  const int slots = std::max(2, options.receives_in_flight);
  const std::size_t slot_bytes = chunk_elems * esize;
  if (scratch_.size() < slots * slot_bytes) scratch_.resize(slots * slot_bytes);
  const int last_step = static_cast<int>(phase.steps.size()) - 1;

  std::vector<RequestId> receives(items.size());
  auto post_receive = [&](std::size_t index) {
    const ChunkItem& item = items[index];
    unsigned char* slot = scratch_.data() + (index % slots) * slot_bytes;
    return transport_->irecv(slot, item.count * esize, phase.predecessor, step_tag(tag_base, item.step),
                             &receives[index]);
  };
  for (std::size_t i = 0; i < items.size() && i < static_cast<std::size_t>(slots); ++i) {
    DDLFAST_RETURN_IF_ERROR(post_receive(i));
  }
  // Step 0 sends this rank's own data, all of it at once.
  DDLFAST_RETURN_IF_ERROR(send_first_step(transport_, data, phase, step_tag(tag_base, 0), chunk_elems));
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ChunkItem& item = items[i];
    DDLFAST_RETURN_IF_ERROR(transport_->wait(receives[i]));
    unsigned char* slot = scratch_.data() + (i % slots) * slot_bytes;
    char* target = data.address(item.offset);
    reduce_into(dtype, op, target, slot, item.count, item.step == last_step ? final_divisor : 1);
    if (i + slots < items.size()) DDLFAST_RETURN_IF_ERROR(post_receive(i + slots));
    if (item.step < last_step) {
      RequestId ignored;
      DDLFAST_RETURN_IF_ERROR(transport_->isend(target, item.count * esize, phase.successor,
                                                step_tag(tag_base, item.step + 1), &ignored));
    }
  }
  return transport_->wait_all();
}

// Receives go straight into their final place; each received chunk is
// forwarded to the successor as part of the next step.
Status RingAllreduce::allgather_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base, DType dtype,
                                      const EngineOptions& options) {
  const std::size_t esize = dtype_size(dtype);
  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / esize);
  const std::vector<ChunkItem> items = chunk_items(data, phase, chunk_elems);
  const int last_step = static_cast<int>(phase.steps.size()) - 1;
  std::vector<RequestId> receives(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ChunkItem& item = items[i];
    DDLFAST_RETURN_IF_ERROR(transport_->irecv(data.address(item.offset), item.count * esize, phase.predecessor,
                                              step_tag(tag_base, item.step), &receives[i]));
  }
  DDLFAST_RETURN_IF_ERROR(send_first_step(transport_, data, phase, step_tag(tag_base, 0), chunk_elems));
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ChunkItem& item = items[i];
    DDLFAST_RETURN_IF_ERROR(transport_->wait(receives[i]));
    if (item.step < last_step) {
      RequestId ignored;
      DDLFAST_RETURN_IF_ERROR(transport_->isend(data.address(item.offset), item.count * esize, phase.successor,
                                                step_tag(tag_base, item.step + 1), &ignored));
    }
  }
  return transport_->wait_all();
}

}  // namespace ddlfast
