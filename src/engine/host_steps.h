// The host executor's step policy for the phase loop (engine/ring_phases.h):
// data in host memory, each arrived chunk reduced or placed at once with the
// CPU kernels, sends posted as soon as their data is in place (no send
// window; the phase ends with wait_all). The wire codec is a policy of its
// own, so the compiler sees every kernel call:
//
//   PlainWire  elements travel as they are: reduce-scatter chunks land in a
//              window of receive slots and are reduced into the data;
//              allgather chunks land in place; sends read the data itself.
//   HalfWire   float32 data travels as fp16 or bf16 (DESIGN §2): every send
//              is encoded into a stage kept until it completes, received
//              chunks accumulate in float32. The owner of each reduced block
//              rounds it through the wire type before the allgather sends it,
//              and forwards what arrived as it arrived (no second rounding),
//              so every rank ends with the same bits.
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "common/uninitialized_vector.h"
#include "engine/ring_phases.h"
#include "engine/segmented_buffer.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {

// Memory the host steps work in: owned by the executor, grown, never shrunk.
struct HostScratch {
  UninitializedVector<unsigned char> receive_slots;  // reduce-scatter's window of receive slots
  std::vector<unsigned char> send_stage;             // encoded chunks until their sends complete
  std::vector<unsigned char> receive_stage;          // encoded allgather chunks, kept for forwarding
  std::vector<float> decoded;                        // a received chunk decoded for compressed min/max
  std::vector<double> accumulator;                   // a direct reduce-scatter's sum of one chunk (double: aligned)
  UninitializedVector<unsigned char> own_stage;  // a direct reduce-scatter's own contribution on its way to the wire
  std::vector<unsigned char> chain_stage;  // the chain phase's partial sums or rounded finals (engine/chain_phase.h)
};

class PlainWire {
 public:
  static constexpr bool kInPlace = true;  // the wire carries the data's own bytes
  static constexpr bool kSumInScratch = false;
  PlainWire(DType dtype, ReduceOp op, std::size_t element_size) : dtype_(dtype), op_(op), esize_(element_size) {}
  std::size_t bytes(std::size_t count) const { return count * esize_; }
  void reduce(char* target, const unsigned char* wire, std::size_t count, int divisor) const {
    reduce_into(dtype_, op_, target, wire, count, divisor);
  }
  void encode(unsigned char*, const char*, std::size_t) const {}
  void decode(char*, const unsigned char*, std::size_t) const {}
  // The direct reduce-scatter's verbs: take a contribution as it is, and add data values (not wire ones).
  void load(char* target, const unsigned char* wire, std::size_t count) const {
    std::memcpy(target, wire, count * esize_);
  }
  void reduce_values(char* target, const char* values, std::size_t count, int divisor) const {
    reduce_into(dtype_, op_, target, values, count, divisor);
  }
  void round_through(char*, unsigned char*, std::size_t) const {}  // the values are what travels

 private:
  DType dtype_;
  ReduceOp op_;
  std::size_t esize_;
};

class HalfWire {
 public:
  static constexpr bool kInPlace = false;
  static constexpr bool kSumInScratch = false;
  // `overflows` counts finite values encoded to inf (wire overflow).
  HalfWire(int wire, ReduceOp op, std::vector<float>* decoded, std::size_t* overflows)
      : kernels_(best_kernels()), wire_(wire), op_(op), decoded_(decoded), overflows_(overflows) {}
  std::size_t bytes(std::size_t count) const { return count * wire_size(static_cast<WireType>(wire_)); }
  // min/max decode and combine in float32: rounding is monotonic, so the
  // result is the wire rounding of the exact min/max.
  void reduce(char* target, const unsigned char* wire, std::size_t count, int divisor) const {
    float* values = reinterpret_cast<float*>(target);
    if (op_ == ReduceOp::kMin || op_ == ReduceOp::kMax) {
      if (decoded_->size() < count) decoded_->resize(count);
      kernels_.decode[wire_](decoded_->data(), wire, count);
      reduce_into(DType::kFloat32, op_, values, decoded_->data(), count, 1);
    } else {
      kernels_.accumulate[wire_](values, wire, count, divisor);
    }
  }
  void encode(unsigned char* wire, const char* values, std::size_t count) const {
    *overflows_ += kernels_.encode[wire_](wire, reinterpret_cast<const float*>(values), count);
  }
  void decode(char* values, const unsigned char* wire, std::size_t count) const {
    kernels_.decode[wire_](reinterpret_cast<float*>(values), wire, count);
  }
  // The direct reduce-scatter's verbs: a contribution decoded to float32, and float32 values added.
  void load(char* target, const unsigned char* wire, std::size_t count) const { decode(target, wire, count); }
  void reduce_values(char* target, const char* values, std::size_t count, int divisor) const {
    reduce_into(DType::kFloat32, op_, target, values, count, divisor);
  }
  // values <- their wire rounding, through `stage` (wire bytes of count): under reproducible=True the owner's own
  // contribution is rounded like every other, so a block's sum does not depend on which rank owns it.
  void round_through(char* values, unsigned char* stage, std::size_t count) const {
    encode(stage, values, count);
    decode(values, stage, count);
  }

 private:
  const KernelTable& kernels_;
  int wire_;
  ReduceOp op_;
  std::vector<float>* decoded_;
  std::size_t* overflows_;
};

// float16/bfloat16 data summed by a direct reduce-scatter (engine/direct_phase.h): the values travel as they
// are, the owner accumulates all d contributions in float32 and rounds the sum once to the type (the ring rounds
// each partial sum to the type). The sum always builds in float32 scratch (kSumInScratch), never in the data.
class HalfSum {
 public:
  static constexpr bool kInPlace = true;
  static constexpr bool kSumInScratch = true;
  explicit HalfSum(DType dtype) : kernels_(best_kernels()), wire_(static_cast<int>(half_type(dtype))) {}
  std::size_t bytes(std::size_t count) const { return count * 2; }
  std::size_t sum_bytes(std::size_t count) const { return count * sizeof(float); }
  void encode(unsigned char*, const char*, std::size_t) const {}
  void round_through(char*, unsigned char*, std::size_t) const {}
  // The direct reduce-scatter's verbs on the float32 sum: a contribution or the own values decoded, added.
  void load(char* sum, const unsigned char* values, std::size_t count) const {
    kernels_.decode[wire_](reinterpret_cast<float*>(sum), values, count);
  }
  void reduce(char* sum, const unsigned char* values, std::size_t count, int divisor) const {
    kernels_.accumulate[wire_](reinterpret_cast<float*>(sum), values, count, divisor);
  }
  void reduce_values(char* sum, const char* values, std::size_t count, int divisor) const {
    kernels_.accumulate[wire_](reinterpret_cast<float*>(sum), values, count, divisor);
  }
  // The finished sum, rounded once, into the data (an overflow is inf there: exact_arithmetic reports it).
  void store(char* data, const char* sum, std::size_t count) const {
    kernels_.encode[wire_](data, reinterpret_cast<const float*>(sum), count);
  }

 private:
  const KernelTable& kernels_;
  int wire_;
};

// `source` (a plain wire's reduce-scatter phase, or nullptr): the input, cut like `data`, which this phase reads
// instead of `data` — its own chunks are sent from it, and each received chunk is added to its source chunk into
// `data` — so an out-of-place reduce-scatter needs no working copy of its whole input first.
template <class Wire>
class HostSteps {
 public:
  HostSteps(const SegmentedBuffer& data, const RingPhase& phase, const PhaseChunks& chunks, int slots,
            std::size_t chunk_elems, Wire wire, HostScratch* scratch, const SegmentedBuffer* source = nullptr)
      : data_(data),
        source_(Wire::kInPlace && phase.kind == PhaseKind::kReduceScatter ? source : nullptr),
        reduces_(phase.kind == PhaseKind::kReduceScatter),
        slots_(slots),
        wire_(wire) {
    if (reduces_) {
      slot_bytes_ = wire_.bytes(std::min(chunk_elems, largest_count(chunks.receives)));
      if (scratch->receive_slots.size() < slots_ * slot_bytes_) scratch->receive_slots.resize(slots_ * slot_bytes_);
      receive_slots_ = scratch->receive_slots.data();
    }
    if constexpr (!Wire::kInPlace) {
      // Sized before the phase: no stage may move while MPI reads or writes it.
      std::size_t stage_bytes = 0;
      for (const ChunkSend& send : chunks.sends) {
        if (reduces_ || send.forward_of < 0) stage_bytes += wire_.bytes(send.count);
      }
      if (scratch->send_stage.size() < stage_bytes) scratch->send_stage.resize(stage_bytes);
      stage_cursor_ = scratch->send_stage.data();
      send_from_.resize(chunks.sends.size());
      if (!reduces_) {
        std::size_t landing_bytes = 0;
        for (const ChunkItem& chunk : chunks.receives) landing_bytes += wire_.bytes(chunk.count);
        if (scratch->receive_stage.size() < landing_bytes) scratch->receive_stage.resize(landing_bytes);
        unsigned char* cursor = scratch->receive_stage.data();
        landing_.reserve(chunks.receives.size());
        for (const ChunkItem& chunk : chunks.receives) {
          landing_.push_back(cursor);
          cursor += wire_.bytes(chunk.count);
        }
      }
    }
  }

  // Reduce-scatter receives rotate through the slots; allgather chunks all land where they stay.
  std::size_t receive_window() const { return reduces_ ? static_cast<std::size_t>(slots_) : kUnbounded; }
  std::size_t send_window() const { return kUnbounded; }
  Status receive_room(std::size_t, bool*) const { return Status::ok(); }
  std::size_t wire_bytes(std::size_t count) const { return wire_.bytes(count); }
  bool poll() const { return false; }

  void* receive_buffer(std::size_t index, const ChunkItem& chunk) const {
    if (reduces_) return slot(index);
    if constexpr (Wire::kInPlace) return data_.address(chunk.offset);
    return landing_[index];
  }

  Status receive_reduce(std::size_t index, const ChunkItem& chunk, int divisor) {
    if (source_ != nullptr) {  // the chunk is cache-warm for the addition that follows
      std::memcpy(data_.address(chunk.offset), source_->address(chunk.offset), chunk.count * data_.element_size());
    }
    wire_.reduce(data_.address(chunk.offset), slot(index), chunk.count, divisor);
    return Status::ok();
  }

  Status receive_copy(std::size_t index, const ChunkItem& chunk) {
    if constexpr (!Wire::kInPlace) wire_.decode(data_.address(chunk.offset), landing_[index], chunk.count);
    return Status::ok();
  }

  Status stage(std::size_t index, const ChunkSend& send) {
    if constexpr (!Wire::kInPlace) {
      if (!reduces_ && send.forward_of >= 0) {  // an allgather chunk goes on as it arrived
        send_from_[index] = landing_[send.forward_of];
        return Status::ok();
      }
      char* values = data_.address(send.offset);
      wire_.encode(stage_cursor_, values, send.count);
      if (!reduces_) wire_.decode(values, stage_cursor_, send.count);  // the owner keeps what the others get
      send_from_[index] = stage_cursor_;
      stage_cursor_ += wire_.bytes(send.count);
    }
    return Status::ok();
  }
  Status staged(std::size_t, bool*) const { return Status::ok(); }

  const void* send_buffer(std::size_t index, const ChunkSend& send) const {
    if constexpr (Wire::kInPlace) {
      return (source_ != nullptr && send.forward_of < 0 ? *source_ : data_).address(send.offset);
    }
    return send_from_[index];
  }

 private:
  unsigned char* slot(std::size_t index) const { return receive_slots_ + (index % slots_) * slot_bytes_; }

  const SegmentedBuffer& data_;
  const SegmentedBuffer* source_;
  bool reduces_;
  std::size_t slots_;
  Wire wire_;
  unsigned char* receive_slots_ = nullptr;
  std::size_t slot_bytes_ = 0;
  unsigned char* stage_cursor_ = nullptr;
  std::vector<const unsigned char*> send_from_;  // encoded wire: what each send carries
  std::vector<unsigned char*> landing_;          // encoded allgather: where each receive lands
};

}  // namespace ddlfast
