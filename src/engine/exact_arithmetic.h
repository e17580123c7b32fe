// Keeps reductions within the inputs' range, on the ring and on the
// small-message path alike: the engine calls before() ahead of the
// reduction, reduces buffer() with op(), then calls after().
//
// Integer average is floor division of the exact sum, NumPy's
// `sum(int(x) for x in inputs) // p`, with no wider type: each rank splits
// v = q*p + r with q = trunc(v/p) and |r| < p, the ring sums q (in place) and
// r (n more elements, one more segment of the same buffer), and the result is
// sum(q) + floor(sum(r)/p). |q| <= |v|/p, so no partial sum of q ever leaves
// the type's range, and |sum(r)| < p*p (hence int32 average allows at most
// 46340 ranks). The wire carries 2n elements.
//
// float16/bfloat16 average pre-scales: each input becomes
// round(float(x) * float32(1/p)) in its own type, then the scaled values are
// summed (each add in float32, rounded once to the type). A sum of scaled
// values that overflows only by that rounding (every input finite) saturates
// to the type's largest finite value.
//
// float16/bfloat16 sum or product that overflows (every input at that element finite,
// the result inf or nan) is an error on every rank; inputs that hold inf or
// nan give inf or nan as IEEE says. Cheap in the common case: one scan of the
// inputs and one of the result, no message. Only when the result holds a
// non-finite value (every rank holds the same bits, so all see it together)
// do the ranks exchange how many of their inputs were non-finite, and, if
// some were, which ones, to tell overflow from propagated inf/nan.
//
// min and max need nothing here: they are exact in every type (the kernels
// pick one of the inputs' bits, kernels/cpu/combine_generic.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/segmented_buffer.h"

namespace ddlfast {

class Transport;

inline bool integer_average(DType dtype, ReduceOp op) {
  return (dtype == DType::kInt32 || dtype == DType::kInt64) && op == ReduceOp::kAverage;
}

// Whether ExactArithmetic::before may read or rewrite the data of this dtype and op (integer average, the half
// types): a reduction of the caller's memory in place, or of the input out of place, must give it a copy then.
inline bool works_on_a_copy(DType dtype, ReduceOp op) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || integer_average(dtype, op);
}

class ExactArithmetic {
 public:
  // Prepares `data` (every rank's count and dtype agree) for a `world`-rank
  // reduction; may rewrite it in place. `data` must outlive after().
  Status before(const SegmentedBuffer& data, DType dtype, ReduceOp op, int world);
  // What to reduce, and how: the data (plus remainders), summed for the
  // averages handled here.
  const SegmentedBuffer& buffer() const { return widened_ ? *widened_ : *data_; }
  ReduceOp op() const { return reduce_op_; }
  // Finishes the result in place; collective (all ranks take the same branch).
  Status after(Transport& transport);

 private:
  enum class Mode { kNone, kIntegerAverage, kHalfChecked, kHalfAverage };

  Status finish_halves(Transport& transport);
  // Logical positions where the result is non-finite but no rank's input was.
  Status overflowed_positions(Transport& transport, std::vector<std::size_t>* out);

  Mode mode_ = Mode::kNone;
  const SegmentedBuffer* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  ReduceOp reduce_op_ = ReduceOp::kSum;
  int world_ = 1;
  std::optional<SegmentedBuffer> widened_;  // data + remainders (integer average)
  std::vector<unsigned char> remainders_;  // persistent across calls
  std::vector<std::uint64_t> input_nonfinite_;  // bit per element; empty when every input was finite
  std::int64_t input_nonfinite_count_ = 0;
};

}  // namespace ddlfast
