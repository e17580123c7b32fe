#include "engine/device_ring_allreduce.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "engine/chain_phase.h"
#include "engine/direct_phase.h"
#include "engine/ring_phases.h"
#include "engine/small_allreduce.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
namespace {

// Marker numbers after kNowMarker (device_lanes.h): one per receive slot and
// one per send slot.
int recv_marker(int slot) { return 1 + slot; }
int send_marker(int slots, int slot) { return 1 + slots + slot; }

// The GPU executor's step policy for the phase loop (engine/ring_phases.h).
//
// Receives and sends each rotate through `slots` slots; receive i+slots
// reuses receive i's slot once the inbound lane has consumed it (its marker),
// so a receive slot waits for the device only, never for MPI, and a send slot
// is free again once its send completed. Holding a receive slot until its
// forward completed could deadlock: every rank's slots would fill with
// forwards the next rank has no room to receive.
//
// What an arrived chunk does: reduce-scatter staged: pinned slot -> device
// scratch -> reduced into the data; direct: reduced from the device scratch
// it was received into. A direct reduce-scatter phase (engine/direct_phase.h)
// builds each chunk's sum in the data or in the last device slot, and for
// float16/bfloat16 sums in float32 in the last slot and the extra one after
// it, rounded once into the data (sums_halves_in_float32, as the host does).
// Allgather staged: pinned slot -> its place in the data; direct: received
// in place, nothing to do. A send is copied out to its pinned slot on the
// outbound lane (staged; a forward after the inbound work that put it in
// place) or only marked (direct: MPI reads device memory), and posted once
// that marker has passed.
class DeviceSteps {
 public:
  DeviceSteps(const SegmentedBuffer& data, const RingPhase& phase, DType dtype, ReduceOp op, DeviceTransfer transfer,
              DeviceLanes* lanes, const DeviceStaging& staging)
      : data_(data),
        reduces_(phase.kind == PhaseKind::kReduceScatter),
        dtype_(dtype),
        float32_sum_(phase.direct && reduces_ && sums_halves_in_float32(dtype, op)),
        esize_(dtype_size(dtype)),
        staged_(transfer == DeviceTransfer::kStaged),
        lanes_(lanes),
        staging_(staging),
        slots_(staging.slots),
        receive_slots_(phase.direct ? staging.slots - 1 : staging.slots) {}

  // Orders the phase after all work enqueued before it.
  Status begin() {
    DDLFAST_RETURN_IF_ERROR(lanes_->mark(kNowMarker, Lane::kInbound));
    if (staged_) return lanes_->lane_wait(Lane::kOutbound, kNowMarker);  // copies of own data start after it
    if (!reduces_) return lanes_->wait(kNowMarker);  // MPI will write the data in place: earlier kernels first
    return Status::ok();
  }

  std::size_t receive_window() const { return static_cast<std::size_t>(receive_slots_); }
  std::size_t send_window() const { return static_cast<std::size_t>(slots_); }
  std::size_t wire_bytes(std::size_t count) const { return count * esize_; }
  bool poll() { return lanes_->poll(); }

  Status receive_room(std::size_t index, bool* free) {
    return lanes_->passed(recv_marker(receive_slot(index)), free);
  }

  void* receive_buffer(std::size_t index, const ChunkItem& chunk) const {
    char* target = data_.address(chunk.offset);
    if (staged_) return host_recv(receive_slot(index));
    return reduces_ ? device_recv(receive_slot(index), target) : target;
  }

  Status receive_reduce(std::size_t index, const ChunkItem& chunk, int divisor) {
    const int k = receive_slot(index);
    char* target = data_.address(chunk.offset);
    char* scratch = device_recv(k, target);
    if (staged_) DDLFAST_RETURN_IF_ERROR(lanes_->copy(scratch, host_recv(k), chunk.count * esize_, Lane::kInbound));
    DDLFAST_RETURN_IF_ERROR(lanes_->reduce(dtype_, target, scratch, chunk.count, divisor, Lane::kInbound));
    return lanes_->mark(recv_marker(k), Lane::kInbound);  // the slot is free once the lane consumed it
  }

  Status receive_copy(std::size_t index, const ChunkItem& chunk) {
    const int k = receive_slot(index);
    if (staged_) {
      DDLFAST_RETURN_IF_ERROR(
          lanes_->copy(data_.address(chunk.offset), host_recv(k), chunk.count * esize_, Lane::kInbound));
    }
    return lanes_->mark(recv_marker(k), Lane::kInbound);
  }

  Status stage(std::size_t index, const ChunkSend& send) {
    const int k = send_slot(index);
    if (!staged_) return lanes_->mark(send_marker(slots_, k), Lane::kInbound);
    if (send.forward_of >= 0) {  // after the copy or reduce that put it in place
      DDLFAST_RETURN_IF_ERROR(lanes_->mark(kNowMarker, Lane::kInbound));
      DDLFAST_RETURN_IF_ERROR(lanes_->lane_wait(Lane::kOutbound, kNowMarker));
    }
    DDLFAST_RETURN_IF_ERROR(
        lanes_->copy(host_send(k), data_.address(send.offset), send.count * esize_, Lane::kOutbound));
    return lanes_->mark(send_marker(slots_, k), Lane::kOutbound);
  }

  Status staged(std::size_t index, bool* ready) {
    return lanes_->passed(send_marker(slots_, send_slot(index)), ready);
  }

  const void* send_buffer(std::size_t index, const ChunkSend& send) const {
    return staged_ ? static_cast<const void*>(host_send(send_slot(index))) : data_.address(send.offset);
  }

  // A direct reduce-scatter phase (engine/direct_phase.h): its sends are own data, its sum is built on the
  // inbound lane, in order, so one accumulator (the last device slot, kept from receives) serves every chunk.
  Status stage(std::size_t index, const ChunkItem& send) {
    return stage(index, ChunkSend{send.offset, send.count, 0, -1});
  }
  const void* send_buffer(std::size_t index, const ChunkItem& send) const {
    return send_buffer(index, ChunkSend{send.offset, send.count, 0, -1});
  }
  Status begin_chunk(const ChunkItem& chunk, bool own_first) {
    char* target = data_.address(chunk.offset);
    if (float32_sum_) {
      sum_ = float32_sum(target);  // the sum starts as the own values, in float32
      return own_first ? lanes_->decode(half_type(dtype_), sum32(), target, chunk.count, Lane::kInbound)
                       : Status::ok();
    }
    sum_ = own_first ? target : device_recv(slots_ - 1, target);
    return Status::ok();
  }
  Status load(std::size_t index, const ChunkItem& chunk) {
    char* contribution = nullptr;
    DDLFAST_RETURN_IF_ERROR(on_device(index, chunk, &contribution));
    if (float32_sum_) return lanes_->decode(half_type(dtype_), sum32(), contribution, chunk.count, Lane::kInbound);
    return lanes_->copy(sum_, contribution, chunk.count * esize_, Lane::kInbound);
  }
  Status add(std::size_t index, const ChunkItem& chunk, int divisor) {
    char* contribution = nullptr;
    DDLFAST_RETURN_IF_ERROR(on_device(index, chunk, &contribution));
    return add_values(contribution, chunk.count, divisor);
  }
  Status add_own(const ChunkItem& chunk, int divisor) {
    return add_values(data_.address(chunk.offset), chunk.count, divisor);
  }
  Status finish_chunk(const ChunkItem& chunk) {
    char* target = data_.address(chunk.offset);
    if (float32_sum_) return lanes_->encode(half_type(dtype_), target, sum32(), chunk.count, Lane::kInbound);
    if (sum_ == target) return Status::ok();
    return lanes_->copy(target, sum_, chunk.count * esize_, Lane::kInbound);
  }
  Status consumed(std::size_t index) { return lanes_->mark(recv_marker(receive_slot(index)), Lane::kInbound); }

  // The chain phase's verbs (engine/chain_phase.h), for data summed in its own type (DeviceRingAllreduce::run
  // runs the chain for no other): a seed is received and loaded as a contribution is, the finished partial sum
  // or final is in the data, and its sends go out as a ring's forwards do, after the inbound work.
  std::size_t partial_bytes(std::size_t count) const { return count * esize_; }
  void* seed_buffer(std::size_t index, const ChunkItem& chunk) const { return receive_buffer(index, chunk); }
  Status load_seed(std::size_t index, const ChunkItem& chunk) { return load(index, chunk); }
  Status keep_partial(const ChunkItem& chunk) { return finish_chunk(chunk); }
  Status stage_partial(std::size_t index, const ChunkItem& send) { return stage(index, forward(send)); }
  const void* partial_send_buffer(std::size_t index, const ChunkItem& send) const {
    return send_buffer(index, forward(send));
  }
  Status stage_final(std::size_t index, const ChunkItem& send, bool) { return stage(index, forward(send)); }
  const void* final_send_buffer(std::size_t index, const ChunkItem& send) const {
    return send_buffer(index, forward(send));
  }
  void* final_buffer(std::size_t index, const ChunkItem& chunk) const {  // as an allgather chunk lands
    return staged_ ? host_recv(receive_slot(index)) : data_.address(chunk.offset);
  }
  Status place_final(std::size_t index, const ChunkItem& chunk) { return receive_copy(index, chunk); }

 private:
  static ChunkSend forward(const ChunkItem& send) { return ChunkSend{send.offset, send.count, 0, 0}; }
  int receive_slot(std::size_t index) const {
    return static_cast<int>(index % static_cast<std::size_t>(receive_slots_));
  }
  Status add_values(const char* values, std::size_t count, int divisor) {
    if (float32_sum_) return lanes_->accumulate(half_type(dtype_), sum32(), values, count, divisor, Lane::kInbound);
    return lanes_->reduce(dtype_, sum_, values, count, divisor, Lane::kInbound);
  }
  float* sum32() const { return reinterpret_cast<float*>(sum_); }
  // A direct phase's float32 sum of 16-bit data: the last slot and the extra one (device_staging_bytes), at twice
  // `target`'s offset mod 16, so 16-byte vectors of the sum meet 8-byte vectors of the values at the same element.
  char* float32_sum(const void* target) const {
    const std::size_t shift = 2 * (reinterpret_cast<std::uintptr_t>(target) % 16);
    return staging_.device_recv + (slots_ - 1) * staging_.slot_bytes + shift;
  }
  int send_slot(std::size_t index) const { return static_cast<int>(index % static_cast<std::size_t>(slots_)); }
  // Where contribution `index` is on the device: staged, copied there from its pinned slot first.
  Status on_device(std::size_t index, const ChunkItem& chunk, char** contribution) {
    const int k = receive_slot(index);
    *contribution = device_recv(k, data_.address(chunk.offset));
    if (!staged_) return Status::ok();
    return lanes_->copy(*contribution, host_recv(k), chunk.count * esize_, Lane::kInbound);
  }
  char* host_recv(int k) const { return staging_.host_recv + k * staging_.slot_bytes; }
  char* host_send(int k) const { return staging_.host_send + k * staging_.slot_bytes; }
  // A device scratch slot at the same address mod 16 as `target`, so the reduce kernel can use 16-byte vectors.
  char* device_recv(int k, const void* target) const {
    return staging_.device_recv + k * staging_.slot_bytes + reinterpret_cast<std::uintptr_t>(target) % 16;
  }

  const SegmentedBuffer& data_;
  bool reduces_;
  DType dtype_;
  bool float32_sum_;  // a direct phase of float16/bfloat16 sums (sums_halves_in_float32)
  std::size_t esize_;
  bool staged_;
  DeviceLanes* lanes_;
  const DeviceStaging& staging_;
  int slots_;
  int receive_slots_;       // all slots; a direct phase keeps the last device slot for its sum
  char* sum_ = nullptr;     // a direct phase: where the current chunk's sum builds
};

}  // namespace

std::size_t staging_slot_bytes(std::size_t chunk_bytes) {
  const std::size_t chunk = std::max<std::size_t>(chunk_bytes, 8);
  return (chunk + 16 + 255) / 256 * 256;
}

Status DeviceRingAllreduce::create(Transport& transport, const std::vector<int>& dims, const std::vector<int>& order,
                                   std::unique_ptr<DeviceRingAllreduce>* out) {
  RankedTorus ring;
  DDLFAST_RETURN_IF_ERROR(RankedTorus::make(dims, order, transport.size(), transport.rank(), &ring));
  out->reset(new DeviceRingAllreduce(transport, std::move(ring)));
  return Status::ok();
}

// Tiny buffers: through host memory to MPI_Allreduce, as the host engine does
// (and with its arithmetic, so the bits agree).
Status DeviceRingAllreduce::run(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options,
                                const DeviceRunOptions& run, DeviceLanes* lanes, const DeviceStaging& staging) {
  // min, max and product run in the host engine on pinned copies (ddlfast/engine/device.py, _HOST_ARITHMETIC): its
  // kernels alone carry their nan and signed-zero rules.
  if (op != ReduceOp::kSum && op != ReduceOp::kAverage) {
    return Status::invalid(std::string("op='") + reduce_op_name(op) + "' is not implemented in the GPU ring; stage "
                           "through host memory");
  }
  // So do the exact integer average (the floor of the exact sum) and the 16-bit average (scaled against overflow):
  // dividing in the ring's last step gives other bits (seen on an H100 when a test asked the ring for them).
  if (op == ReduceOp::kAverage && dtype != DType::kFloat32 && dtype != DType::kFloat64) {
    return Status::invalid(std::string("op='average' of ") + dtype_name(dtype) + " is not implemented in the GPU "
                           "ring (the host engine's exact arithmetic); stage through host memory");
  }
  const int world = ring_.torus.world_size();
  const std::size_t count = data.count();
  if (count == 0 || world == 1) return Status::ok();
  if (std::any_of(options.wire_by_dim.begin(), options.wire_by_dim.end(), [](int wire) { return wire >= 0; })) {
    return Status::invalid("wire compression is not implemented in the GPU ring; stage through host memory");
  }
  const std::size_t esize = dtype_size(dtype);
  const int divisor = op == ReduceOp::kAverage ? world : 1;
  DDLFAST_RETURN_IF_ERROR(lanes->reserve_markers(1 + 2 * std::max(staging.slots, 0)));
  if (count * esize <= options.small_bytes) {
    return small_allreduce(transport_, data, dtype, ReduceOp::kSum, divisor, options, lanes, kNowMarker);
  }

  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / esize);
  if (chunk_elems * esize > static_cast<std::size_t>(INT_MAX)) return Status::invalid("a chunk of more than 2 GiB");
  const bool staged = run.transfer == DeviceTransfer::kStaged;
  if (staging.slots < 2 || staging.slot_bytes < staging_slot_bytes(chunk_elems * esize) ||
      staging.device_recv == nullptr || (staged && (staging.host_recv == nullptr || staging.host_send == nullptr))) {
    return Status(StatusCode::kInternal, "GPU ring: staging slots missing or smaller than one chunk");
  }
  DDLFAST_RETURN_IF_ERROR(check_direct(options.direct_by_dim, ring_.torus.num_dims()));
  if (options.chain) return run_chain(data, dtype, op, divisor, chunk_elems, options, run, lanes, staging);
  return run_ring_schedule(
      data, build_rank_schedule(ring_, count, options.direct_by_dim), RingPasses::kBoth, divisor, chunk_elems,
      options.events, [&](const RingPhase& phase, const PhaseChunks& chunks, int tag_base, int final_divisor) {
        DeviceSteps steps(data, phase, dtype, op, run.transfer, lanes, staging);
        DDLFAST_RETURN_IF_ERROR(steps.begin());
        if (phase.direct) {
          return run_direct_phase(transport_, phase, direct_chunks(data, phase, chunk_elems), tag_base,
                                  final_divisor, steps);
        }
        return run_ring_phase(transport_, phase, chunks, tag_base, final_divisor, steps);
      });
}

// The host executor's RingAllreduce::run_chain, on the device: the chain phase with the direct phase's step
// policy, then the allgather within each host. 16-bit data sums in float32 on this executor, whose one float32
// slot holds a chunk's sum only until the next chunk begins: the caller runs it on the flat order instead.
Status DeviceRingAllreduce::run_chain(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor,
                                      std::size_t call_chunk_elems, const EngineOptions& options,
                                      const DeviceRunOptions& run, DeviceLanes* lanes, const DeviceStaging& staging) {
  DDLFAST_RETURN_IF_ERROR(check_chain(ring_.torus.dims()));
  if (sums_halves_in_float32(dtype, op)) {
    return Status::invalid("the GPU executor runs the canonical chain on float32/float64 sums only; 16-bit data "
                           "takes the flat order");
  }
  const std::size_t chunk_elems =
      chain_chunk_elems(data.count(), ring_.torus.dims()[0], call_chunk_elems, data.element_size());
  const RingSchedule schedule = build_rank_schedule(ring_, data.count(), {1, 1});
  const RingPhase& within = schedule.phases[0];
  const ChainPlan plan = chain_plan(data, within, schedule.phases[1], chunk_elems);
  const double start = monotonic_seconds();
  {
    DeviceSteps steps(data, within, dtype, op, run.transfer, lanes, staging);
    DDLFAST_RETURN_IF_ERROR(steps.begin());
    DDLFAST_RETURN_IF_ERROR(run_chain_phase(transport_, within, plan, kTagsPerPhase, divisor, steps));
  }
  if (options.events) {
    options.events->push_back({EventKind::kReduceScatter, 1, start, monotonic_seconds(),
                               data.count() * data.element_size()});
  }
  RingSchedule gather;
  gather.phases.push_back(schedule.phases.back());
  return run_ring_schedule(data, gather, RingPasses::kAllgather, 1, chunk_elems, options.events,
                           [&](const RingPhase& phase, const PhaseChunks& chunks, int tag_base, int final_divisor) {
                             DeviceSteps steps(data, phase, dtype, op, run.transfer, lanes, staging);
                             DDLFAST_RETURN_IF_ERROR(steps.begin());
                             return run_ring_phase(transport_, phase, chunks, tag_base, final_divisor, steps);
                           });
}

}  // namespace ddlfast
