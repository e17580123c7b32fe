"""Runs on every rank: a seeded fuzz of the Horovod drop-in (ddlfast.horovod.torch).

`mpiexec -n P python horovod_fuzz_cases.py SEED CASES FAULT_CHANCE`. Each case is drawn from
`numpy.random.default_rng([seed, world, index])` on every rank alike: the call (allreduce, grouped_allreduce, three
named asynchronous allreduces negotiated and fused, reducescatter, allgather, broadcast, alltoall), the op (Average,
Sum, Min, Max, Product), prescale_factor and postscale_factor, the dtype (float32/64, float16, int16/32/64) and a
shape from one element to past DDLFAST_SMALL_BYTES. Every rank regenerates every rank's input, so the reference is
computed here with NumPy, as Horovod defines each call (integers scaled in float64 and truncated, integer averages
toward zero); results must be bit-identical on every rank. With FAULT_CHANCE, one rank changes one thing that
changes a result or is wrong (the op, a scale factor, the dtype, the shape, the root, splits that do not add up):
every rank must raise, naming that rank, and the next case must run. Prints "<n> failures" on rank 0.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from harness import close_to_reference, comm, fail, rank, report_and_exit, same_everywhere, world

import ddlfast.horovod.torch as hvd

SEED, CASES, FAULT_CHANCE = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int16, torch.int32, torch.int64)
OPS = {hvd.Average: "average", hvd.Sum: "sum", hvd.Min: "min", hvd.Max: "max", hvd.Product: "product"}
KINDS = ("allreduce", "grouped_allreduce", "named", "reducescatter", "allgather", "broadcast", "alltoall")
REDUCING = ("allreduce", "grouped_allreduce", "named", "reducescatter")
SCALES = (1.0, 0.5, 2.0, 3.0)


def contribution(index: int, part: int, owner: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank `owner`'s input: small integers (halves in floating types), whose sums, products and scalings by the
    factors above are exact in every dtype here."""
    rng = np.random.default_rng([SEED, index, part, owner])
    values = rng.integers(-3, 4, size=shape).astype(np.float64)
    if dtype.is_floating_point:
        values = values * 0.5
    return torch.from_numpy(values).to(dtype)


def scaled(values: np.ndarray, factor: float, integer: bool) -> np.ndarray:
    """Horovod's scaling: integers in float64, truncated toward zero."""
    return np.trunc(values * factor) if integer else values * factor


def reduced(stack: np.ndarray, op: int, pre: float, post: float, *, integer: bool) -> np.ndarray:
    stack = scaled(stack, pre, integer)
    if op == hvd.Average:
        total = stack.sum(axis=0)
        value = np.trunc(total / world) if integer else total / world
    else:
        value = {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod}[op](stack, axis=0)
    return scaled(value, post, integer)


def as_float64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).numpy()


def draw_fault(rng: np.random.Generator, kind: str) -> str | None:
    choices = ["dtype", "shape"] + (["op", "prescale", "postscale"] if kind in REDUCING else []) + \
        (["root"] if kind == "broadcast" else []) + (["splits"] if kind == "alltoall" else [])
    return str(rng.choice(choices)) if world > 1 and rng.random() < FAULT_CHANCE else None


def run_case(index: int) -> None:
    rng = np.random.default_rng([SEED, world, index])
    kind = str(rng.choice(KINDS))
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    op = int(rng.choice(list(OPS)))
    if op == hvd.Product and world > 3:
        op = hvd.Max  # 3**P stays exact in float16 only for small P
    pre, post = float(rng.choice(SCALES)), float(rng.choice(SCALES))
    if dtype == torch.float16 and op == hvd.Product:
        pre = post = 1.0
    rows = int(rng.choice([1, 3, world, 2 * world, 700 * world]))  # the last is past DDLFAST_SMALL_BYTES
    shape = (rows, int(rng.choice([1, 3]))) if rng.random() < 0.5 else (rows,)
    root = int(rng.integers(world))
    fault_rng = np.random.default_rng([SEED, world, index, 7])
    fault = draw_fault(fault_rng, kind)
    faulty = int(fault_rng.integers(world))
    name = (f"case {index}: {kind} {dtype} {shape} op={OPS[op]} prescale={pre} postscale={post} root={root} "
            f"fault={fault} on rank {faulty if fault else '-'}")
    my = {"dtype": dtype, "shape": shape, "op": op, "prescale": pre, "postscale": post, "root": root}
    if fault is not None and rank == faulty:
        my[fault] = {  # allgather's first dimension may differ per rank (Horovod's allgatherv): another dimension
            "dtype": torch.float64 if dtype != torch.float64 else torch.int32,
            "shape": (*shape, 2) if kind == "allgather" else (shape[0] + 1, *shape[1:]),
            "op": hvd.Sum if op != hvd.Sum else hvd.Max, "prescale": pre * 2, "postscale": post * 2,
            "root": (root + 1) % world, "splits": True}[fault]
    integer = not dtype.is_floating_point
    parts = 3 if kind in ("grouped_allreduce", "named") else 1
    every = [[contribution(index, p, r, shape, dtype) for r in range(world)] for p in range(parts)]
    mine = [contribution(index, p, rank, my["shape"], my["dtype"]) for p in range(parts)]
    stacks = [np.stack([as_float64(t) for t in part]) for part in every]
    try:
        got, want = run(kind, index, mine, my, stacks, integer, shape)
    except Exception as error:  # noqa: BLE001 - checked below
        if fault is None:
            fail(name, f"raised {type(error).__name__}: {error}")
        elif f"rank {faulty}" not in str(error) and f"ranks {faulty}" not in str(error) and \
                not any(f"{faulty}," in part or f",{faulty}" in part for part in str(error).split("rank")):
            fail(name, f"raised without naming rank {faulty}: {error}")
        return
    finally:
        comm.Barrier()  # a case's failure on one rank must not let another rank run ahead into the next case
    if fault is not None:
        fail(name, "the fault was not detected")
        return
    average = kind in REDUCING and op == hvd.Average and not integer
    tolerance = {torch.float16: 2e-3}.get(dtype, 1e-6) if average else 0.0
    for i, (tensor, expected) in enumerate(zip(got, want, strict=True)):
        close_to_reference(name, i, as_float64(tensor), expected, tolerance, tolerance)
        # Each rank receives its own part of a reducescatter or an alltoall.
        if kind not in ("reducescatter", "alltoall") and not same_everywhere(tensor.detach().numpy()):
            fail(name, f"result {i} differs in bits across ranks")


def run(kind: str, index: int, mine: list[torch.Tensor], my: dict, stacks: list[np.ndarray], integer: bool,
        shape: tuple[int, ...]) -> tuple[list, list]:
    """One case's call on this rank's arguments; (results, NumPy references)."""
    if kind == "allreduce":
        got = [hvd.allreduce(mine[0], op=my["op"], prescale_factor=my["prescale"], postscale_factor=my["postscale"])]
    elif kind == "grouped_allreduce":
        got = hvd.grouped_allreduce(mine, op=my["op"], prescale_factor=my["prescale"], postscale_factor=my["postscale"])
    elif kind == "named":  # submitted in another order on every rank, matched by name, fused
        calls = [(hvd.Sum, 1.0, 1.0), (my["op"], my["prescale"], my["postscale"]), (hvd.Max, 1.0, 1.0)]
        order = [(p + rank) % len(mine) for p in range(len(mine))]
        handles = {p: hvd.allreduce_async(mine[p], name=f"fuzz.{index}.{p}", op=calls[p][0],
                                          prescale_factor=calls[p][1], postscale_factor=calls[p][2]) for p in order}
        results, errors = [], []
        for p in range(len(mine)):  # every handle waited for, also after an error
            try:
                results.append(hvd.synchronize(handles[p]))
            except RuntimeError as error:
                errors.append(error)
        if errors:
            raise errors[0]
        return results, [reduced(stacks[p], *calls[p], integer=integer) for p in range(len(mine))]
    elif kind == "reducescatter":
        got = [hvd.reducescatter(mine[0], op=my["op"], prescale_factor=my["prescale"],
                                 postscale_factor=my["postscale"])]
        rows = shape[0]
        start = sum(rows // world + (1 if r < rows % world else 0) for r in range(rank))
        count = rows // world + (1 if rank < rows % world else 0)
        full = reduced(stacks[0], my["op"], my["prescale"], my["postscale"], integer=integer)
        return got, [full[start:start + count]]
    elif kind == "allgather":
        return [hvd.allgather(mine[0])], [np.concatenate(list(stacks[0]))]
    elif kind == "broadcast":
        return [hvd.broadcast(mine[0], root_rank=my["root"])], [stacks[0][my["root"]]]
    else:  # alltoall: rank r sends rows to each rank, splits that differ per rank
        rows = shape[0]
        splits = [rows // world] * world
        splits[-1] += rows - sum(splits)
        if my.get("splits"):  # splits that do not add up to the faulty rank's rows (other splits are legal)
            splits[0] += 1
        received, _ = hvd.alltoall(mine[0], torch.tensor(splits, dtype=torch.int32))
        sent_by = []
        for r in range(world):
            their = [rows // world] * world
            their[-1] += rows - sum(their)
            offset = sum(their[:rank])
            sent_by.append(stacks[0][r][offset:offset + their[rank]])
        return [received], [np.concatenate(sent_by)]
    return got, [reduced(stacks[p], my["op"], my["prescale"], my["postscale"], integer=integer)
                 for p in range(len(got))]


hvd.init()
torch.set_num_threads(1)
for case_index in range(CASES):
    run_case(case_index)
report_and_exit()
