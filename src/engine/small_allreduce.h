// The small-message handoff of both executors (EngineOptions::small_bytes with SmallPath::kMpi): the buffer's
// segments copied into one contiguous host buffer, the transport's own allreduce, average's division on the
// host, and the result copied back. The host executor reads its memory directly (and reduces in place when the
// buffer is one segment); the GPU executor copies in and out on its inbound lane, waiting at `marker` for each.
#pragma once

#include "common/dtype.h"
#include "common/status.h"
#include "engine/device_lanes.h"
#include "engine/engine_options.h"
#include "engine/segmented_buffer.h"
#include "transport/transport.h"

namespace ddlfast {

// `lanes` nullptr: `data` is host memory. `op` reaches the transport (kAverage as kSum: `divisor` divides after).
Status small_allreduce(Transport& transport, const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor,
                       const EngineOptions& options, DeviceLanes* lanes = nullptr, int marker = 0);

}  // namespace ddlfast
