// The latency path: allreduce of a buffer of at most the small-message limit
// inside the per-call agreement's own messages (a butterfly, log2(p) steps,
// transport/agreement_exchange.cc), so the check costs no message of its own.
// The exact arithmetic (integer average, the half types' range) is the ring's
// (engine/exact_arithmetic.h), applied to a private copy so that a
// disagreement leaves the caller's data as it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "engine/engine_options.h"
#include "engine/exact_arithmetic.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

class LatencyAllreduce {
 public:
  explicit LatencyAllreduce(Transport& transport) : transport_(transport) {}

  // Whether this path takes the call: a choice from the call's own arguments and settings, so ranks that
  // disagree may choose differently — and still exchange the same messages, and all learn of it.
  bool takes(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options) const;
  // The agreement on `digest` and the allreduce in place; *agreed false: the ranks disagree, and nothing was
  // written into `data`. `disjoint`: a sum of operands that are zero outside each rank's block
  // (AgreedReduction::disjoint).
  Status run(std::uint64_t digest, bool* agreed, const SegmentedBuffer& data, DType dtype, ReduceOp op,
             const EngineOptions& options, bool disjoint = false);

 private:
  Transport& transport_;
  ExactArithmetic exact_;
  std::vector<char> copy_;  // the private copy of the input
  std::vector<char> packed_;  // what the exact arithmetic reduces, contiguous
};

}  // namespace ddlfast
