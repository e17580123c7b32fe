#include "common/cuda/cuda_device.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/cuda/cuda_check.h"

namespace ddlfast {
namespace {

constexpr int kMaxCachedDevices = 64;

struct CachedShape {
  std::atomic<int> sm_count{0};  // 0: not queried yet
  std::atomic<int> threads_per_sm{0};
};

std::array<CachedShape, kMaxCachedDevices>& shape_cache() {
  static std::array<CachedShape, kMaxCachedDevices> cache;
  return cache;
}

bool is_default_stream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}

}  // namespace

int cuda_device_count(std::string* why_none) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    if (why_none) *why_none = cuda_status(error, "cudaGetDeviceCount").message();
    return 0;
  }
  if (count == 0 && why_none) *why_none = "the CUDA runtime reports no devices";
  return count;
}

Status current_launch_shape(LaunchShape* out) {
  int device = 0;
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CachedShape* cached = device < kMaxCachedDevices ? &shape_cache()[device] : nullptr;
  if (cached && cached->sm_count.load(std::memory_order_relaxed) > 0) {
    out->sm_count = cached->sm_count.load(std::memory_order_relaxed);
    out->threads_per_sm = cached->threads_per_sm.load(std::memory_order_relaxed);
    return Status::ok();
  }
  LaunchShape shape;
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&shape.sm_count, cudaDevAttrMultiProcessorCount, device));
  DDLFAST_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&shape.threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  if (cached) {
    cached->threads_per_sm.store(shape.threads_per_sm, std::memory_order_relaxed);
    cached->sm_count.store(shape.sm_count, std::memory_order_relaxed);
  }
  *out = shape;
  return Status::ok();
}

unsigned grid_blocks(const LaunchShape& shape, std::size_t work_items, int threads_per_block) {
  const std::size_t per_sm = std::max(1, shape.threads_per_sm / threads_per_block);
  const std::size_t full = static_cast<std::size_t>(std::max(1, shape.sm_count)) * per_sm;
  const std::size_t needed = (work_items + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min(full, needed)));
}

Status pointer_location(const void* pointer, MemoryKind* kind, int* device) {
  cudaPointerAttributes attributes;
  std::memset(&attributes, 0, sizeof attributes);
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, pointer));
  switch (attributes.type) {
    case cudaMemoryTypeDevice: *kind = MemoryKind::kDevice; break;
    case cudaMemoryTypeManaged: *kind = MemoryKind::kManaged; break;
    case cudaMemoryTypeHost: *kind = MemoryKind::kHost; break;
    default: *kind = MemoryKind::kUnregisteredHost; break;
  }
  *device = *kind == MemoryKind::kUnregisteredHost ? -1 : attributes.device;
  return Status::ok();
}

Status stream_device(cudaStream_t stream, int* device) {
  if (is_default_stream(stream)) {
    *device = -1;
    return Status::ok();
  }
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, device));
  return Status::ok();
}

Status copy_blocking(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return Status::ok();
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  // cudaMemcpy may return before a copy from pageable host memory or between device buffers has landed; work on
  // ddlfast's non-blocking streams is not ordered after it. Seen on an H100: the GPU ring read inputs a test had
  // just copied up.
  DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  return Status::ok();
}

elementwise::NanRule host_nan_rule() {
  // volatile: computed by this CPU at run time, not folded by the compiler
  // (which would use its own canonical NaN).
  volatile float inf32 = std::numeric_limits<float>::infinity();
  volatile double inf64 = std::numeric_limits<double>::infinity();
  const float nan32 = inf32 - inf32;
  const double nan64 = inf64 - inf64;
  elementwise::NanRule rule;
  std::memcpy(&rule.default_nan32, &nan32, sizeof nan32);
  std::memcpy(&rule.default_nan64, &nan64, sizeof nan64);
  return rule;
}

}  // namespace ddlfast
