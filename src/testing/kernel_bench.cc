#include "testing/kernel_bench.h"

#include <vector>

#include "common/cuda/cuda_resources.h"
#include "kernels/cuda/cuda_kernels.h"

namespace ddlfast {

Status bench_kernel(int device, const std::string& kernel, DType dtype, std::size_t elements, int repeats,
                    KernelTiming* out) {
  if (repeats < 1) return Status::invalid("repeats must be >= 1");
  const bool cast = kernel == "encode" || kernel == "decode" || kernel == "accumulate";
  if (cast && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return Status::invalid("the cast kernels take dtype float16 or bfloat16 (the wire type)");
  }
  const WireType wire = dtype == DType::kBFloat16 ? WireType::kBFloat16 : WireType::kFloat16;
  const std::size_t esize = dtype_size(dtype);
  DeviceGuard guard;
  DDLFAST_RETURN_IF_ERROR(guard.set(device));
  CudaStream stream;
  DDLFAST_RETURN_IF_ERROR(stream.create());
  CudaEvent start, stop;
  DDLFAST_RETURN_IF_ERROR(start.create(true));
  DDLFAST_RETURN_IF_ERROR(stop.create(true));
  const std::size_t wide = elements * (cast ? 4 : esize);  // float32 side of the casts
  DeviceAllocation a, b;
  DDLFAST_RETURN_IF_ERROR(a.allocate(wide, stream.get(), false));
  DDLFAST_RETURN_IF_ERROR(b.allocate(wide, stream.get(), false));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a.data(), 0, wide, stream.get()));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.data(), 0, wide, stream.get()));

  std::vector<CopySpec> specs;
  constexpr std::size_t kPackArrays = 64;
  for (std::size_t i = 0; i < kPackArrays; ++i) {
    const std::size_t begin = wide * i / kPackArrays, end = wide * (i + 1) / kPackArrays;
    specs.push_back({a.data() + begin, b.data() + begin, end - begin});
  }
  std::size_t moved = 0;
  auto once = [&]() -> Status {
    if (kernel == "copy") {
      moved = 2 * elements * esize;
      DDLFAST_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(a.data(), b.data(), elements * esize, cudaMemcpyDeviceToDevice, stream.get()));
      return Status::ok();
    }
    if (kernel == "reduce") {
      moved = 3 * elements * esize;
      return cuda_reduce(dtype, a.data(), b.data(), elements, 1, stream.get());
    }
    if (kernel == "encode") {
      moved = elements * (4 + 2);
      return cuda_encode(wire, a.data(), reinterpret_cast<const float*>(b.data()), elements, stream.get());
    }
    if (kernel == "decode") {
      moved = elements * (2 + 4);
      return cuda_decode(wire, reinterpret_cast<float*>(a.data()), b.data(), elements, stream.get());
    }
    if (kernel == "accumulate") {
      moved = elements * (4 + 2 + 4);
      return cuda_accumulate(wire, reinterpret_cast<float*>(a.data()), b.data(), elements, 1, stream.get());
    }
    if (kernel == "pack") {
      moved = 2 * wide;
      return cuda_copy_batch(specs.data(), specs.size(), stream.get());
    }
    return Status::invalid("unknown kernel '" + kernel + "'; use copy, reduce, encode, decode, accumulate or pack");
  };
  DDLFAST_RETURN_IF_ERROR(once());  // warm-up: first-launch costs stay out of the timing
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream.get()));
  for (int i = 0; i < repeats; ++i) DDLFAST_RETURN_IF_ERROR(once());
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream.get()));
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
  float milliseconds = 0.0f;
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&milliseconds, start.get(), stop.get()));
  out->seconds = milliseconds / 1000.0 / repeats;
  out->bytes_moved = moved;
  return Status::ok();
}

}  // namespace ddlfast
