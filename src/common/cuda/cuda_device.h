// Device facts ddlfast asks for: how many GPUs there are (and why none), how
// large a grid fills one, and which device a pointer or a stream belongs to.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "common/status.h"
#include "common/nan_rule.h"

namespace ddlfast {

// Never fails: with no usable device (no driver, no GPU, CUDA_VISIBLE_DEVICES
// empty) the count is 0 and `why_none` says why.
int cuda_device_count(std::string* why_none);

struct LaunchShape {
  int sm_count = 1;
  int threads_per_sm = 2048;
};

// For the calling thread's current device; queried once per device.
Status current_launch_shape(LaunchShape* out);

// Blocks for a grid-stride kernel over `work_items` items: enough to fill
// every SM at full occupancy, never more than the work needs.
unsigned grid_blocks(const LaunchShape& shape, std::size_t work_items, int threads_per_block);

enum class MemoryKind : int { kUnregisteredHost = 0, kHost = 1, kDevice = 2, kManaged = 3 };

// Where `pointer` lives; `device` is -1 for unregistered host memory.
Status pointer_location(const void* pointer, MemoryKind* kind, int* device);

// The device a stream belongs to; -1 for the default streams (legacy,
// per-thread), which act on whatever device is current.
Status stream_device(cudaStream_t stream, int* device);

// A blocking copy in any direction (tests and tools, not the data path).
Status copy_blocking(void* dst, const void* src, std::size_t bytes);

// The host CPU's NaN for invalid operations, measured (x86: negative quiet
// NaN; Arm: positive), so the kernels produce the CPU kernels' bits.
elementwise::NanRule host_nan_rule();

}  // namespace ddlfast
