#include "engine/exact_arithmetic.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "transport/transport.h"

namespace ddlfast {
namespace {

// int32 remainder sums stay below world^2 <= INT32_MAX.
constexpr int kMaxInt32AverageWorld = 46340;

// Calls f(base, first, n) for each run of contiguous elements, in order.
template <typename F>
void for_each_run(const SegmentedBuffer& data, F f) {
  for (std::size_t done = 0; done < data.count();) {
    const std::size_t n = data.contiguous_from(done);
    f(data.address(done), done, n);
    done += n;
  }
}

// Calls f(element) for each fp16/bf16 element whose exponent bits are all set.
template <typename F>
void for_each_nonfinite(const SegmentedBuffer& data, std::uint16_t mask, F f) {
  for_each_run(data, [&](char* base, std::size_t first, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, base + 2 * i, sizeof bits);
      if ((bits & mask) == mask) f(first + i);
    }
  });
}

int integer_index(DType dtype) { return dtype == DType::kInt32 ? 0 : 1; }
int half_index(DType dtype) { return dtype == DType::kFloat16 ? 0 : 1; }
std::uint16_t exponent_mask(DType dtype) { return dtype == DType::kFloat16 ? 0x7c00 : 0x7f80; }
std::uint16_t largest_finite(DType dtype) { return dtype == DType::kFloat16 ? 0x7bff : 0x7f7f; }
const char* largest_finite_text(DType dtype) { return dtype == DType::kFloat16 ? "65504" : "3.39e38"; }

std::uint16_t bits_at(const SegmentedBuffer& data, std::size_t element) {
  std::uint16_t bits;
  std::memcpy(&bits, data.address(element), sizeof bits);
  return bits;
}

// In place: x = round(float(x) * float32(1/divisor)), rounded once (divide_in_place adds -0.0 and scales).
void prescale_halves(DType dtype, char* values, std::size_t n, int divisor) {
  divide_in_place(dtype, values, n, divisor);
}

}  // namespace

Status ExactArithmetic::before(const SegmentedBuffer& data, DType dtype, ReduceOp op, int world) {
  data_ = &data;
  dtype_ = dtype;
  world_ = world;
  reduce_op_ = op;
  widened_.reset();
  input_nonfinite_.clear();
  input_nonfinite_count_ = 0;
  const bool integer = dtype == DType::kInt32 || dtype == DType::kInt64;
  const bool half = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  mode_ = Mode::kNone;
  if (integer && op == ReduceOp::kAverage) {
    if (dtype == DType::kInt32 && world > kMaxInt32AverageWorld) {
      return Status::consistent("int32 average is exact up to " + std::to_string(kMaxInt32AverageWorld) + " ranks, not " +
                             std::to_string(world) + "; use int64");
    }
    mode_ = Mode::kIntegerAverage;
    const std::size_t esize = dtype_size(dtype);
    if (remainders_.size() < data.count() * esize) remainders_.resize(data.count() * esize);
    const SplitFn split = best_kernels().split[integer_index(dtype)];
    std::vector<char*> bases;
    std::vector<std::size_t> counts;
    for_each_run(data, [&](char* base, std::size_t first, std::size_t n) {
      split(base, remainders_.data() + first * esize, n, world);
      bases.push_back(base);
      counts.push_back(n);
    });
    bases.push_back(reinterpret_cast<char*>(remainders_.data()));
    counts.push_back(data.count());
    widened_.emplace(std::move(bases), counts, esize);
    reduce_op_ = ReduceOp::kSum;
  } else if (half && op != ReduceOp::kMin && op != ReduceOp::kMax) {  // min/max of halves are exact
    mode_ = op == ReduceOp::kAverage ? Mode::kHalfAverage : Mode::kHalfChecked;
    const AnyNonFiniteFn any_nonfinite = best_kernels().any_nonfinite[half_index(dtype)];
    bool any = false;
    for_each_run(data, [&](char* base, std::size_t, std::size_t n) { any = any || any_nonfinite(base, n); });
    if (any) {  // rare: remember which, so inf/nan that came in is not mistaken for overflow
      const std::uint16_t mask = exponent_mask(dtype);
      input_nonfinite_.assign((data.count() + 63) / 64, 0);
      for_each_nonfinite(data, mask, [&](std::size_t i) {
        input_nonfinite_[i / 64] |= std::uint64_t{1} << (i % 64);
        ++input_nonfinite_count_;
      });
    }
    if (op == ReduceOp::kAverage) {
      for_each_run(data, [&](char* base, std::size_t, std::size_t n) { prescale_halves(dtype, base, n, world); });
      reduce_op_ = ReduceOp::kSum;
    }
  }
  return Status::ok();
}

Status ExactArithmetic::after(Transport& transport) {
  switch (mode_) {
    case Mode::kNone:
      return Status::ok();
    case Mode::kIntegerAverage: {
      const std::size_t esize = dtype_size(dtype_);
      const JoinFn join = best_kernels().join[integer_index(dtype_)];
      for_each_run(*data_, [&](char* base, std::size_t first, std::size_t n) {
        join(base, remainders_.data() + first * esize, n, world_);
      });
      return Status::ok();
    }
    case Mode::kHalfChecked:
    case Mode::kHalfAverage:
      return finish_halves(transport);
  }
  return Status::ok();
}

Status ExactArithmetic::finish_halves(Transport& transport) {
  const AnyNonFiniteFn any_nonfinite = best_kernels().any_nonfinite[half_index(dtype_)];
  bool any = false;
  for_each_run(*data_, [&](char* base, std::size_t, std::size_t n) { any = any || any_nonfinite(base, n); });
  if (!any) return Status::ok();  // the common case: no message
  std::vector<std::size_t> overflowed;
  DDLFAST_RETURN_IF_ERROR(overflowed_positions(transport, &overflowed));
  if (overflowed.empty()) return Status::ok();
  if (mode_ == Mode::kHalfAverage) {
    // Every input there was finite, so the exact average is within the range
    // and only the rounding of the scaled terms went past it.
    for (std::size_t element : overflowed) {
      const std::uint16_t bits = bits_at(*data_, element);
      if ((bits & 0x7fff) != exponent_mask(dtype_)) continue;  // nan cannot come from finite scaled terms
      const std::uint16_t saturated = static_cast<std::uint16_t>((bits & 0x8000) | largest_finite(dtype_));
      std::memcpy(data_->address(element), &saturated, sizeof saturated);
    }
    return Status::ok();
  }
  const bool product = reduce_op_ == ReduceOp::kProduct;
  return Status::consistent(std::string(dtype_name(dtype_)) + (product ? " product" : " sum") + " overflowed: " +
                         std::to_string(overflowed.size()) + " of " + std::to_string(data_->count()) +
                         " elements (first at " + std::to_string(overflowed.front()) + ") went past +-" +
                         largest_finite_text(dtype_) + ", the largest " + dtype_name(dtype_) + ", in a partial " +
                         (product ? "product" : "sum") + " of finite inputs, and the result holds inf or nan "
                         "there; " + (product ? "reduce in float32" : "use op='average' (which pre-scales by "
                         "1/world size) or reduce in float32"));
}

Status ExactArithmetic::overflowed_positions(Transport& transport, std::vector<std::size_t>* out) {
  // The result's non-finite elements: the same on every rank (identical bits).
  std::vector<std::size_t> nonfinite;
  for_each_nonfinite(*data_, exponent_mask(dtype_), [&](std::size_t i) { nonfinite.push_back(i); });
  std::int64_t inputs_nonfinite = input_nonfinite_count_;
  DDLFAST_RETURN_IF_ERROR(transport.native_allreduce(&inputs_nonfinite, 1, DType::kInt64));
  if (inputs_nonfinite == 0) {
    *out = std::move(nonfinite);
    return Status::ok();
  }
  // Per non-finite element, how many ranks had a non-finite input there, as
  // `width`-bit fields packed into int64 words (a field holds up to world_,
  // so the sum never carries into its neighbour nor into the sign bit).
  int width = 1;
  while ((std::int64_t{1} << width) <= world_) ++width;
  const std::size_t per_word = 63 / width;
  std::vector<std::int64_t> counts((nonfinite.size() + per_word - 1) / per_word, 0);
  for (std::size_t k = 0; k < nonfinite.size(); ++k) {
    const std::size_t i = nonfinite[k];
    if (!input_nonfinite_.empty() && (input_nonfinite_[i / 64] >> (i % 64) & 1)) {
      counts[k / per_word] += std::int64_t{1} << (width * (k % per_word));
    }
  }
  DDLFAST_RETURN_IF_ERROR(transport.native_allreduce(counts.data(), counts.size(), DType::kInt64));
  const std::int64_t field = (std::int64_t{1} << width) - 1;
  out->clear();
  for (std::size_t k = 0; k < nonfinite.size(); ++k) {
    if (((counts[k / per_word] >> (width * (k % per_word))) & field) == 0) out->push_back(nonfinite[k]);
  }
  return Status::ok();
}

}  // namespace ddlfast
