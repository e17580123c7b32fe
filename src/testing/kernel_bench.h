// Device throughput of ddlfast's kernels beside the device's own
// device-to-device copy, timed with CUDA events on a private stream: the
// issue's "kernels reach >= 80% of copy bandwidth" measurement.
#pragma once

#include <cstddef>
#include <string>

#include "common/dtype.h"
#include "common/status.h"

namespace ddlfast {

struct KernelTiming {
  double seconds = 0.0;          // per run, averaged over the timed runs
  std::size_t bytes_moved = 0;   // bytes read plus bytes written by one run
};

// kernel: "copy" (cudaMemcpyAsync), "reduce", "encode", "decode",
// "accumulate" or "pack" (64 arrays into one bucket). `elements` counts the
// elements of `dtype` (float32 for the casts; the wire side is fp16 or bf16
// as dtype says: kFloat16 or kBFloat16).
Status bench_kernel(int device, const std::string& kernel, DType dtype, std::size_t elements, int repeats,
                    KernelTiming* out);

}  // namespace ddlfast
