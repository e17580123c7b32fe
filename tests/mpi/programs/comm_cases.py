"""The module API with comm= on communicators other than COMM_WORLD (mpi4py 4 communicators are unhashable).

Runs on every rank of COMM_WORLD. Sub-communicators: split by rank parity, a Dup, and a split that reverses
the rank order. On each: allreduce (the MPI_Allreduce hand-off and the ring), fused_allreduce, broadcast,
allreduce_async, fused_allreduce_async and topology(comm=...). References are computed from the split rule
(which world ranks are members, in which order), not from the communicator; results must equal them and be
identical bits on every member. Then the contexts of dropped communicators must be freed, a rank outside a
split (COMM_NULL) must get a DdlfastError, and COMM_WORLD must keep working. Prints "rank R: N failures".
"""

from __future__ import annotations

import gc
import hashlib

import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast import api
from ddlfast.errors import DdlfastError

world = MPI.COMM_WORLD
me, p = world.Get_rank(), world.Get_size()
failures: list[str] = []


def check(condition: bool, what: str) -> None:
    if not condition:
        failures.append(what)


def data(world_rank: int, case: str, dtype: str, count: int) -> np.ndarray:
    """Small integers (exact in every dtype, so any summation order gives the same sum)."""
    seed = [world_rank, sum(map(ord, case)), count]
    return np.random.default_rng(seed).integers(-50, 50, count).astype(dtype)


def same_bits(comm: MPI.Intracomm, arrays: list[np.ndarray], what: str) -> None:
    digest = hashlib.sha1(b"".join(a.tobytes() for a in arrays)).hexdigest()
    check(len(set(comm.allgather(digest))) == 1, f"{what}: members hold different bits")


def run_cases(name: str, comm: MPI.Intracomm, members: list[int]) -> None:
    """members: the world ranks of comm, in comm's rank order (from the split rule)."""
    check(comm.Get_size() == len(members) and members[comm.Get_rank()] == me, f"{name}: membership")
    check(ddlfast.size(comm) == len(members) and ddlfast.rank(comm) == members.index(me), f"{name}: rank/size")
    for count, dtype in ((300, "float32"), (100_000, "float32"), (70_000, "int64")):  # hand-off and ring
        case = f"{name}-allreduce-{count}-{dtype}"
        array = data(me, case, dtype, count)
        result = ddlfast.allreduce(array, comm=comm)
        expected = np.sum([data(r, case, dtype, count) for r in members], axis=0, dtype=dtype)
        check(result is array and np.array_equal(array, expected), f"{case}: wrong result")
        same_bits(comm, [array], case)

    case = f"{name}-fused"
    shapes = ((17,), (300, 40), (5,), (64, 1024))
    dtypes = ("float64", "float32", "int32", "float32")
    layout = list(enumerate(zip(shapes, dtypes, strict=True)))
    arrays = [data(me, f"{case}{i}", dtype, int(np.prod(shape))).reshape(shape) for i, (shape, dtype) in layout]
    ddlfast.fused_allreduce(arrays, comm=comm)
    for i, (shape, dtype) in layout:
        expected = np.sum([data(r, f"{case}{i}", dtype, int(np.prod(shape))) for r in members], axis=0,
                          dtype=dtype).reshape(shape)
        check(np.array_equal(arrays[i], expected), f"{case}: array {i} wrong")
    same_bits(comm, arrays, case)

    case = f"{name}-broadcast"
    root = comm.Get_size() - 1
    array = data(me, case, "float32", 5000)
    ddlfast.broadcast(array, root=root, comm=comm)
    check(np.array_equal(array, data(members[root], case, "float32", 5000)), f"{case}: not the root's data")

    case = f"{name}-async"
    single = data(me, case, "float64", 50_000)
    many = [data(me, f"{case}{i}", "float32", n) for i, n in enumerate((10, 40_000, 3))]
    first = ddlfast.allreduce_async(single, comm=comm)
    second = ddlfast.fused_allreduce_async(many, comm=comm, op="average")
    check(first.wait() is single, f"{case}: allreduce_async returned another object")
    second.wait()
    expected = np.sum([data(r, case, "float64", 50_000) for r in members], axis=0)
    check(np.array_equal(single, expected), f"{case}: allreduce_async wrong")
    for i, n in enumerate((10, 40_000, 3)):
        total = np.sum([data(r, f"{case}{i}", "float32", n).astype(np.float64) for r in members], axis=0)
        check(np.allclose(many[i], total / len(members), rtol=1e-6, atol=1e-5), f"{case}: average {i} wrong")
    same_bits(comm, [single, *many], case)

    info = ddlfast.topology(comm=comm)
    check(info.placement.size == len(members), f"{name}: topology() describes {info.placement.size} ranks")
    check(ddlfast.topology(comm=comm) is info, f"{name}: topology() is decided once per communicator")


parity = world.Split(color=me % 2, key=me)
run_cases("parity", parity, [r for r in range(p) if r % 2 == me % 2])
dup = world.Dup()
run_cases("dup", dup, list(range(p)))
backwards = world.Split(color=0, key=p - me)
run_cases("backwards", backwards, list(reversed(range(p))))
run_cases("parity-again", parity, [r for r in range(p) if r % 2 == me % 2])  # the same context, reused
check(len(api._by_comm) == 3, f"{len(api._by_comm)} contexts for 3 communicators")

# A dropped communicator's context is closed and forgotten; a new communicator (perhaps at the same id) works.
closed = api._by_comm[id(dup)][1]
del dup
gc.collect()
check(len(api._by_comm) == 2, f"{len(api._by_comm)} contexts after dropping one of 3 communicators")
try:
    closed.allreduce(np.ones(3))
    check(False, "the dropped communicator's context still runs collectives")
except DdlfastError as error:
    check("closed" in str(error), f"closed context: {error}")
for round_ in range(3):  # short-lived communicators, one per call
    again = world.Dup()
    run_cases(f"fresh-dup-{round_}", again, list(range(p)))
    del again
    gc.collect()
check(len(api._by_comm) == 2, f"{len(api._by_comm)} contexts after three short-lived communicators")

# A rank outside a split holds COMM_NULL: a clear error on that rank alone, the others carry on.
outside = world.Split(color=MPI.UNDEFINED if me == 0 else 1, key=me)
if me == 0:
    try:
        ddlfast.allreduce(np.ones(3), comm=outside)
        check(False, "comm=COMM_NULL accepted")
    except DdlfastError as error:
        check("COMM_NULL" in str(error), f"COMM_NULL message: {error}")
elif p > 1:
    run_cases("without-rank-0", outside, list(range(1, p)))
try:
    ddlfast.allreduce(np.ones(3), comm="world")
    check(False, "comm='world' accepted")
except DdlfastError:
    pass

array = data(me, "world", "float32", 1000)
ddlfast.allreduce(array)  # the default context, untouched by all of the above
check(np.array_equal(array, np.sum([data(r, "world", "float32", 1000) for r in range(p)], axis=0)), "world")
failures = [f for f in failures if f]
print(f"rank {me}: {len(failures)} failures" + "".join(f"\n  {f}" for f in failures), flush=True)
raise SystemExit(1 if failures else 0)
