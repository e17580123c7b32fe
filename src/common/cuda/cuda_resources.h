// RAII owners of the CUDA objects ddlfast creates: the current-device guard,
// streams, events, pinned host and device memory. Each is created through a
// method returning Status (constructors cannot), is move-only, and releases
// its object in the destructor. Kept in one header: each is a few lines.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "common/cuda/cuda_check.h"

namespace ddlfast {

// Makes `device` current for a scope and restores the previous device.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  Status set(int device) {
    int current = 0;
    DDLFAST_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
    if (current != device) {
      DDLFAST_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      if (previous_ < 0) previous_ = current;
    }
    return Status::ok();
  }

 private:
  int previous_ = -1;
};

class CudaStream {
 public:
  CudaStream() = default;
  CudaStream(CudaStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& other) noexcept {
    std::swap(stream_, other.stream_);
    return *this;
  }
  ~CudaStream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  // Non-blocking: never implicitly ordered with the legacy default stream, so
  // ordering with the caller's work is always explicit (events). At the
  // device's greatest priority: a ring step's reduce kernel is short and the
  // pipeline waits on it, so it should get the next free multiprocessor ahead
  // of the caller's compute (on an H100 with default-priority streams, a
  // 64 MiB collective and matrix products on another stream took 23.2 ms
  // together, against 14.3 and 12.0 ms alone).
  Status create() {
    int least = 0, greatest = 0;
    DDLFAST_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    DDLFAST_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    return Status::ok();
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  ~CudaEvent() {
    if (event_) cudaEventDestroy(event_);
  }
  Status create(bool timing = false) {
    DDLFAST_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return Status::ok();
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Page-locked host memory: the staging area for device<->host copies that
// overlap with kernels and with MPI.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  Status allocate(std::size_t bytes) {
    void* data = nullptr;
    DDLFAST_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&data, bytes == 0 ? 1 : bytes, cudaHostAllocPortable));
    *this = PinnedBuffer();
    data_ = data;
    bytes_ = bytes;
    return Status::ok();
  }
  char* data() const { return static_cast<char*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Device memory. Pooled: from the stream-ordered allocator, so allocating
// and freeing are ordered on `stream` and never synchronize the device (as
// cudaFree does). Not pooled: cudaMalloc, for memory that CUDA-aware MPI may
// share with other processes (CUDA IPC does not cover default-pool memory).
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  DeviceAllocation(DeviceAllocation&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        stream_(other.stream_),
        pooled_(other.pooled_) {}
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(stream_, other.stream_);
    std::swap(pooled_, other.pooled_);
    return *this;
  }
  ~DeviceAllocation() { release(); }
  Status allocate(std::size_t bytes, cudaStream_t stream, bool pooled) {
    release();
    void* data = nullptr;
    cudaError_t error = cudaErrorNotSupported;
    if (pooled) error = cudaMallocAsync(&data, bytes == 0 ? 1 : bytes, stream);
    pooled_ = error == cudaSuccess;
    if (!pooled_) {
      if (pooled) cudaGetLastError();  // pools unsupported here: plain allocation
      error = cudaMalloc(&data, bytes == 0 ? 1 : bytes);
    }
    if (error != cudaSuccess) return cuda_status(error, "allocating ddlfast's device buffer");
    data_ = data;
    bytes_ = bytes;
    stream_ = stream;
    return Status::ok();
  }
  char* data() const { return static_cast<char*>(data_); }
  std::size_t bytes() const { return bytes_; }
  bool pooled() const { return pooled_; }

 private:
  void release() {
    if (data_) {
      if (pooled_) {
        cudaFreeAsync(data_, stream_);
      } else {
        cudaFree(data_);
      }
    }
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  bool pooled_ = false;
};

}  // namespace ddlfast
