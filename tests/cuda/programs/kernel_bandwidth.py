"""The kernels' throughput against the device's own device-to-device copy, at 256 MiB (the issue's
measure: reduce and cast kernels at >= 80% of copy bandwidth). Prints one line per kernel.

    python tests/cuda/programs/kernel_bandwidth.py [device] [MiB]
"""

from __future__ import annotations

import sys

from ddlfast import _testing_cuda
from ddlfast.buffers.dtypes import DTYPE_CODES

KERNELS = [("copy", "float32"), ("reduce", "float32"), ("reduce", "float16"), ("reduce", "bfloat16"),
           ("reduce", "float64"), ("reduce", "int32"), ("encode", "float16"), ("decode", "float16"),
           ("accumulate", "float16"), ("encode", "bfloat16"), ("decode", "bfloat16"), ("accumulate", "bfloat16"),
           ("pack", "float32")]
SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4}


def measure(device: int = 0, mebibytes: int = 256, repeats: int = 20) -> dict[tuple[str, str], float]:
    """Bytes moved per second for each kernel; the casts are sized by their float32 side."""
    results = {}
    for kernel, dtype in KERNELS:
        cast = kernel in ("encode", "decode", "accumulate")
        elements = (mebibytes << 20) // (4 if cast else SIZES[dtype])
        seconds, moved = _testing_cuda.time_kernel(device, kernel, DTYPE_CODES[dtype], elements, repeats)
        results[(kernel, dtype)] = moved / seconds
    return results


if __name__ == "__main__":
    device = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    mebibytes = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    results = measure(device, mebibytes)
    copy = results[("copy", "float32")]
    for (kernel, dtype), rate in results.items():
        print(f"{kernel:>10} {dtype:>8}: {rate / 1e9:8.1f} GB/s  {rate / copy:6.1%} of copy")
