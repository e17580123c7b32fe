"""Runs on every rank: reduce_scatter and allgather (plain, fused, async, uneven counts, compressed) on GPU
arrays, which go through pinned host copies and the host engine; checked bit for bit against NumPy (inputs
are small integers, whose sums every dtype holds exactly) and, for allgather, for identical bits on every rank.
Torch CUDA tensors get a new result tensor on their device; other GPU arrays without out= are refused.

With --emulated (no GPU needed): host memory stands in for device memory (tests/cuda/emulated_gpu.py), which
checks the Context's GPU wiring; on a GPU the same cases run for real. Prints "<n> failures" on rank 0."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys

import numpy as np

import ddlfast
from ddlfast.buffers import device as device_arrays
from tests.mpi.programs.harness import comm, failures, rank, report, world

# A hang prints every thread's stack and ends this rank, so the test fails with a trace, not pytest's timeout.
faulthandler.dump_traceback_later(150, exit=True)

if "--emulated" in sys.argv:
    from tests.cuda import emulated_gpu
    from tests.cuda.emulated_gpu import HostArray as DeviceArray

    emulated_gpu.install()
else:
    from tests.cuda.device_array import DeviceArray

device = rank % device_arrays.device_count()


def values(owner: int, case: int, dtype: type, n: int) -> np.ndarray:
    return np.random.default_rng([owner, case]).integers(-8, 9, n).astype(dtype)


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    want = want.astype(got.dtype)
    if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        failures.append(f"rank {rank} {name}: got {got.tolist()[:8]}, want {want.tolist()[:8]}")


def same_everywhere(name: str, got: np.ndarray) -> None:
    if len(set(comm.allgather(hashlib.sha256(got.tobytes()).hexdigest()))) != 1:
        failures.append(f"rank {rank} {name}: bits differ across ranks")


def reduced(case: int, dtype: type, n: int) -> np.ndarray:
    return np.sum([values(r, case, dtype, n).astype(np.float64) for r in range(world)], axis=0)


def plain_cases(case: int) -> int:
    for dtype in (np.float32, np.int64, np.float16):
        case += 1
        n = 5 * world
        host = values(rank, case, dtype, n)
        x, out = DeviceArray(host, device), DeviceArray(np.zeros(5, dtype), device)
        if ddlfast.reduce_scatter(x, out=out) is not out:
            failures.append(f"rank {rank} reduce_scatter {np.dtype(dtype)}: did not return out=")
        check(f"reduce_scatter {np.dtype(dtype)}", out.get(), reduced(case, dtype, n)[5 * rank:5 * rank + 5])
        check(f"reduce_scatter {np.dtype(dtype)} input unchanged", x.get(), host)
        gathered = DeviceArray(np.zeros(3 * world, dtype), device)
        ddlfast.allgather(DeviceArray(np.full(3, rank, dtype), device), out=gathered)
        check(f"allgather {np.dtype(dtype)}", gathered.get(), np.repeat(np.arange(world), 3))
        same_everywhere(f"allgather {np.dtype(dtype)}", gathered.get())
    return case


def fused_cases(case: int) -> int:
    case += 1
    counts = [[2 * world, 0, *([1] * (world - 2))][:world] if world > 1 else [3], None]
    sizes = [sum(counts[0]) if world > 1 else 3, 4 * world]
    arrays = [DeviceArray(values(rank, case * 10 + i, np.float32, n), device) for i, n in enumerate(sizes)]
    outs = [DeviceArray(np.zeros(counts[0][rank], np.float32), device), DeviceArray(np.zeros(4, np.float32), device)]
    ddlfast.fused_reduce_scatter_async(arrays, counts=counts, out=outs).wait()
    lo, hi = sum(counts[0][:rank]), sum(counts[0][:rank + 1])
    check("fused reduce_scatter uneven", outs[0].get(), reduced(case * 10, np.float32, sizes[0])[lo:hi])
    check("fused reduce_scatter even", outs[1].get(), reduced(case * 10 + 1, np.float32, sizes[1])[4 * rank:][:4])
    # float32 through the fp16 wire (the ring path): every rank holds the same, once-rounded bits.
    os.environ["DDLFAST_SMALL_BYTES"] = "0"
    mine = values(rank, case, np.float32, 33) + np.float32(1 / 3)
    gathered = DeviceArray(np.zeros(33 * world, np.float32), device)
    ddlfast.allgather_async(DeviceArray(mine, device), out=gathered, compression="fp16").wait()
    want = np.concatenate([values(r, case, np.float32, 33) + np.float32(1 / 3) for r in range(world)])
    check("allgather fp16 wire", gathered.get(), want.astype(np.float16).astype(np.float32) if world > 1 else want)
    same_everywhere("allgather fp16 wire", gathered.get())
    os.environ.pop("DDLFAST_SMALL_BYTES")
    return case


def refusals() -> None:
    x = DeviceArray(np.ones(2 * world, np.float32), device)
    for name, call, needle in (
        ("no out= for a plain GPU array", lambda: ddlfast.reduce_scatter(x), "pass out="),
        ("a host out= for a GPU array", lambda: ddlfast.reduce_scatter(x, out=np.zeros(2, np.float32)),
         "not a CUDA array"),
        ("a GPU out= of the wrong size", lambda: ddlfast.reduce_scatter(x, out=DeviceArray(np.zeros(3, np.float32))),
         "the result is float32[2]"),
    ):
        try:
            call()
        except ddlfast.DdlfastError as error:
            if needle not in str(error):
                failures.append(f"rank {rank} {name}: message lacks {needle!r}: {error}")
        else:
            failures.append(f"rank {rank} {name}: no DdlfastError")


def torch_cases(case: int) -> None:
    try:
        import torch
    except ImportError:
        return
    if "--emulated" in sys.argv or not torch.cuda.is_available():
        return
    case += 1
    host = values(rank, case, np.float32, 6 * world).reshape(2 * world, 3)
    tensor = torch.from_numpy(host).to(f"cuda:{device}")
    result = ddlfast.reduce_scatter(tensor, op="sum")
    if not (isinstance(result, torch.Tensor) and result.device == tensor.device and result.shape == (2, 3)):
        failures.append(f"rank {rank} torch reduce_scatter: got {type(result)} {getattr(result, 'shape', None)}")
    else:
        check("torch reduce_scatter", result.cpu().numpy().reshape(-1),
              reduced(case, np.float32, 6 * world)[6 * rank:6 * rank + 6])
    gathered = ddlfast.allgather(torch.full((2,), rank, dtype=torch.int64, device=f"cuda:{device}"))
    check("torch allgather", gathered.cpu().numpy(), np.repeat(np.arange(world), 2))


def main() -> int:
    case = 0
    for small in ("0", "1MiB"):  # the ring, and MPI's own collectives
        os.environ["DDLFAST_SMALL_BYTES"] = small
        case = plain_cases(case)
    os.environ.pop("DDLFAST_SMALL_BYTES")
    case = fused_cases(case)
    refusals()
    torch_cases(case)
    return report()


if __name__ == "__main__":
    sys.exit(main())
