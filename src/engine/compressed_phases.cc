// Ring phases with a compressed wire (DESIGN §2): float32 data travels as
// fp16 or bf16, the receiver accumulates in float32, and the allgather
// carries the wire type. The owner of each reduced block rounds it through
// the wire type before sending it, so every rank ends with the same bits.
#include <algorithm>

#include "engine/chunking.h"
#include "engine/ring_allreduce.h"
#include "kernels/cpu/cpu_kernels.h"
#include "transport/mpi_transport.h"

namespace ddlfast {

using namespace chunking;  // NOLINT: the engine's own helpers

namespace {

std::size_t total_count(const std::vector<ChunkItem>& items) {
  std::size_t total = 0;
  for (const ChunkItem& item : items) total += item.count;
  return total;
}

}  // namespace

// Like reduce_scatter_phase, but each send is encoded into its own spot of
// send_stage_ (kept until the send completes) and receives are accumulated
// into float32 from the wire type.
Status RingAllreduce::compressed_reduce_scatter_phase(const SegmentedBuffer& data, const RingPhase& phase,
                                                      int tag_base, int wire, ReduceOp op, int final_divisor,
                                                      const EngineOptions& options) {
  const KernelTable& kernels = best_kernels();
  const std::size_t wsize = wire_size(static_cast<WireType>(wire));
  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / sizeof(float));
  const std::vector<ChunkItem> items = chunk_items(data, phase, chunk_elems);
  std::vector<ChunkItem> first;
  append_chunks(data, 0, phase.steps[0].send, chunk_elems, &first);
  const int slots = std::max(2, options.receives_in_flight);
  const std::size_t slot_bytes = chunk_elems * wsize;
  if (scratch_.size() < slots * slot_bytes) scratch_.resize(slots * slot_bytes);
  const std::size_t stage_bytes = (total_count(first) + total_count(items)) * wsize;
  if (send_stage_.size() < stage_bytes) send_stage_.resize(stage_bytes);
  unsigned char* stage_cursor = send_stage_.data();
  const int last_step = static_cast<int>(phase.steps.size()) - 1;

  auto encode_and_send = [&](const ChunkItem& item, int step) -> Status {
    overflows_ += kernels.encode[wire](stage_cursor, reinterpret_cast<const float*>(data.address(item.offset)),
                                       item.count);
    RequestId ignored;
    DDLFAST_RETURN_IF_ERROR(transport_->isend(stage_cursor, item.count * wsize, phase.successor,
                                              step_tag(tag_base, step), &ignored));
    stage_cursor += item.count * wsize;
    return Status::ok();
  };
  std::vector<RequestId> receives(items.size());
  auto post_receive = [&](std::size_t index) {
    unsigned char* slot = scratch_.data() + (index % slots) * slot_bytes;
    return transport_->irecv(slot, items[index].count * wsize, phase.predecessor,
                             step_tag(tag_base, items[index].step), &receives[index]);
  };
  for (std::size_t i = 0; i < items.size() && i < static_cast<std::size_t>(slots); ++i) {
    DDLFAST_RETURN_IF_ERROR(post_receive(i));
  }
  for (const ChunkItem& item : first) DDLFAST_RETURN_IF_ERROR(encode_and_send(item, 0));
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ChunkItem& item = items[i];
    DDLFAST_RETURN_IF_ERROR(transport_->wait(receives[i]));
    const unsigned char* slot = scratch_.data() + (i % slots) * slot_bytes;
    float* target = reinterpret_cast<float*>(data.address(item.offset));
    if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
      if (decoded_.size() < item.count) decoded_.resize(item.count);
      kernels.decode[wire](decoded_.data(), slot, item.count);
      reduce_into(DType::kFloat32, op, target, decoded_.data(), item.count, 1);
    } else {
      kernels.accumulate[wire](target, slot, item.count, item.step == last_step ? final_divisor : 1);
    }
    if (i + slots < items.size()) DDLFAST_RETURN_IF_ERROR(post_receive(i + slots));
    if (item.step < last_step) DDLFAST_RETURN_IF_ERROR(encode_and_send(item, item.step + 1));
  }
  return transport_->wait_all();
}

// Every received chunk lands encoded in recv_stage_, is decoded into place and
// forwarded as it arrived (no second rounding).
Status RingAllreduce::compressed_allgather_phase(const SegmentedBuffer& data, const RingPhase& phase, int tag_base,
                                                 int wire, const EngineOptions& options) {
  const KernelTable& kernels = best_kernels();
  const std::size_t wsize = wire_size(static_cast<WireType>(wire));
  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / sizeof(float));
  const std::vector<ChunkItem> items = chunk_items(data, phase, chunk_elems);
  std::vector<ChunkItem> first;
  append_chunks(data, 0, phase.steps[0].send, chunk_elems, &first);
  if (send_stage_.size() < total_count(first) * wsize) send_stage_.resize(total_count(first) * wsize);
  if (recv_stage_.size() < total_count(items) * wsize) recv_stage_.resize(total_count(items) * wsize);
  const int last_step = static_cast<int>(phase.steps.size()) - 1;

  std::vector<RequestId> receives(items.size());
  std::vector<unsigned char*> landing(items.size());
  unsigned char* cursor = recv_stage_.data();
  for (std::size_t i = 0; i < items.size(); ++i) {
    landing[i] = cursor;
    DDLFAST_RETURN_IF_ERROR(transport_->irecv(cursor, items[i].count * wsize, phase.predecessor,
                                              step_tag(tag_base, items[i].step), &receives[i]));
    cursor += items[i].count * wsize;
  }
  unsigned char* stage = send_stage_.data();
  for (const ChunkItem& item : first) {
    float* values = reinterpret_cast<float*>(data.address(item.offset));
    overflows_ += kernels.encode[wire](stage, values, item.count);
    kernels.decode[wire](values, stage, item.count);  // the owner keeps what the others will get
    RequestId ignored;
    DDLFAST_RETURN_IF_ERROR(
        transport_->isend(stage, item.count * wsize, phase.successor, step_tag(tag_base, 0), &ignored));
    stage += item.count * wsize;
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ChunkItem& item = items[i];
    DDLFAST_RETURN_IF_ERROR(transport_->wait(receives[i]));
    kernels.decode[wire](reinterpret_cast<float*>(data.address(item.offset)), landing[i], item.count);
    if (item.step < last_step) {
      RequestId ignored;
      DDLFAST_RETURN_IF_ERROR(transport_->isend(landing[i], item.count * wsize, phase.successor,
                                                step_tag(tag_base, item.step + 1), &ignored));
    }
  }
  return transport_->wait_all();
}

}  // namespace ddlfast
