// Element types and reduction ops shared by kernels, engine and bindings.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddlfast {

// Values are part of the Python binding (ddlfast/buffers/dtypes.py mirrors them).
enum class DType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};
constexpr int kNumDTypes = 6;

// Values are part of the Python binding (ddlfast/ops.py mirrors them).
enum class ReduceOp : int {
  kSum = 0,
  kAverage = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
};
constexpr int kNumReduceOps = 5;

inline bool reduce_op_valid(int value) { return value >= 0 && value < kNumReduceOps; }

inline const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAverage: return "average";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "unknown";
}

inline bool dtype_valid(int value) { return value >= 0 && value < kNumDTypes; }

inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

}  // namespace ddlfast
