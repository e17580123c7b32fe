"""Runs on every rank: a seeded fuzz of the "ddlfast" torch.distributed backend's collectives.

`mpiexec -n P python torch_fuzz_cases.py SEED CASES FAULT_CHANCE`. Each case is drawn from
`numpy.random.default_rng([seed, world, index])` on every rank alike: the collective (all_reduce with each op,
all_gather_into_tensor, all_gather, reduce_scatter_tensor, broadcast from a random root, all_reduce_coalesced),
blocking or async_op=True, the dtype (float32/64, float16, bfloat16, int32/64), a shape from empty to past
DDLFAST_SMALL_BYTES, and tensors that require grad (read detached, as gloo does). Every rank regenerates every
rank's input, so the reference is computed independently here with NumPy; results must be bit-identical on every
rank. With FAULT_CHANCE, one rank in a case passes another dtype or shape: every rank must raise, naming that
rank, and the next case must run on the same process group. Prints "<n> failures" on rank 0.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from backend_common import comm, fail, rank, report_and_exit, world
from harness import close_to_reference

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations of the calls exercised here
SEED, CASES, FAULT_CHANCE = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
REDUCE = {"sum": (dist.ReduceOp.SUM, np.sum), "average": (dist.ReduceOp.AVG, np.mean),
          "min": (dist.ReduceOp.MIN, np.min), "max": (dist.ReduceOp.MAX, np.max),
          "product": (dist.ReduceOp.PRODUCT, np.prod)}
KINDS = ("all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "broadcast", "coalesced")


def contribution(index: int, owner: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank `owner`'s input (small integers, or values whose sums and products stay exact in every dtype)."""
    rng = np.random.default_rng([SEED, index, owner])
    values = rng.integers(-3, 4, size=shape)
    if dtype.is_floating_point:
        values = values * 0.5 if dtype in (torch.float16, torch.bfloat16) else values + rng.random(shape)
    return torch.from_numpy(np.asarray(values)).to(dtype)


def as_float64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).numpy()


def run_case(index: int) -> None:
    rng = np.random.default_rng([SEED, world, index])
    kind = str(rng.choice(KINDS))
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    op = str(rng.choice(list(REDUCE))) if kind in ("all_reduce", "coalesced") else "sum"
    if op == "average" and not dtype.is_floating_point:
        op = "sum"  # torch's AVG is for floating types
    if op == "product" and dtype in (torch.float16, torch.bfloat16):
        op = "max"  # keep products exact in the reference
    rows = int(rng.choice([0, 1, 3, 7, world, 2 * world, 600 * world]))  # the last is past DDLFAST_SMALL_BYTES
    shape = (rows, int(rng.choice([1, 2, 5]))) if rng.random() < 0.5 else (rows,)
    if kind == "reduce_scatter_tensor":
        shape = (world * max(1, rows // world), *shape[1:])
    root = int(rng.integers(world))
    asynchronous = bool(rng.random() < 0.3)
    requires_grad = bool(dtype.is_floating_point and rng.random() < 0.2)
    fault_rng = np.random.default_rng([SEED, world, index, 7])
    fault = (str(fault_rng.choice(["dtype", "shape"])), int(fault_rng.integers(world))) \
        if world > 1 and fault_rng.random() < FAULT_CHANCE else None
    name = f"case {index}: {kind} {dtype} {shape} op={op} root={root} async={asynchronous} grad={requires_grad}"
    my_shape, my_dtype = shape, dtype
    if fault and fault[1] == rank:
        if fault[0] == "dtype":
            my_dtype = torch.float64 if dtype != torch.float64 else torch.int32
        else:
            my_shape = (shape[0] + 1, *shape[1:])
    inputs = [contribution(index, r, shape, dtype) for r in range(world)]
    mine = contribution(index, rank, my_shape, my_dtype).requires_grad_(requires_grad and my_dtype.is_floating_point)
    stacked = np.stack([as_float64(t) for t in inputs]) if inputs[0].numel() else np.zeros((world, *shape))

    def wait(work: object) -> None:
        if asynchronous:
            work.wait()

    try:
        if kind == "all_reduce":
            tensor = mine.detach().clone().requires_grad_(requires_grad) if requires_grad else mine.clone()
            wait(dist.all_reduce(tensor, op=REDUCE[op][0], async_op=asynchronous))
            got, want = [tensor], [REDUCE[op][1](stacked, axis=0)]
        elif kind == "coalesced":
            second = contribution(index + 10_000, rank, (5,), my_dtype)  # torch checks one dtype on the caller
            tensors = [mine.clone(), second]
            wait(dist.all_reduce_coalesced(tensors, op=REDUCE[op][0], async_op=asynchronous))
            seconds = np.stack([as_float64(contribution(index + 10_000, r, (5,), dtype)) for r in range(world)])
            got, want = tensors, [REDUCE[op][1](stacked, axis=0), REDUCE[op][1](seconds, axis=0)]
        elif kind == "all_gather_into_tensor":
            out = torch.empty((world * shape[0], *shape[1:]), dtype=dtype)
            wait(dist.all_gather_into_tensor(out, mine, async_op=asynchronous))
            got, want = [out], [stacked.reshape(world * shape[0], *shape[1:])]
        elif kind == "all_gather":  # outputs of the input's dtype: torch checks that on the caller, before ddlfast
            outs = [torch.empty(shape, dtype=my_dtype) for _ in range(world)]
            wait(dist.all_gather(outs, mine, async_op=asynchronous))
            got, want = outs, list(stacked)
        elif kind == "reduce_scatter_tensor":
            out = torch.empty((shape[0] // world, *shape[1:]), dtype=dtype)
            wait(dist.reduce_scatter_tensor(out, mine, async_op=asynchronous))
            block = shape[0] // world
            got, want = [out], [stacked.sum(axis=0)[rank * block:(rank + 1) * block]]
        else:  # broadcast
            tensor = mine.detach().clone()
            wait(dist.broadcast(tensor, src=root, async_op=asynchronous))
            got, want = [tensor], [stacked[root]]
    except Exception as error:  # noqa: BLE001 - checked below
        if fault is None:
            fail(name, f"raised {type(error).__name__}: {error}")
        elif f"rank {fault[1]}" not in str(error):
            fail(name, f"fault {fault} raised without naming the ranks' difference: {error}")
        return
    if fault is not None:
        fail(name, f"fault {fault[0]} on rank {fault[1]} was not detected")
        return
    exact = kind in ("all_gather_into_tensor", "all_gather", "broadcast") or op in ("min", "max") \
        or not dtype.is_floating_point
    tolerance = 0.0 if exact else {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-5)
    for i, (tensor, expected) in enumerate(zip(got, want, strict=True)):
        close_to_reference(name, i, as_float64(tensor), expected, tolerance, tolerance * world)
        flat = tensor.detach().contiguous().view(-1)
        bits = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        if kind != "reduce_scatter_tensor" and len(set(comm.allgather(bits))) != 1:
            fail(name, f"result {i} differs in bits across ranks")


for case_index in range(CASES):
    run_case(case_index)
report_and_exit()
