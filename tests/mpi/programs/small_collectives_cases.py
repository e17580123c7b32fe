"""Runs on every rank: barrier, broadcast of every fixed-size dtype, broadcast_async, broadcast_object,
allgather_object; their bad input (object dtype, a root out of range on one rank, roots that differ across
ranks, an unpicklable object on one rank, an object one rank cannot unpickle), each of which must raise
DdlfastError on every rank naming the problem; then every collective (allreduce with every op, fused, broadcast,
objects, barrier) on the two halves of a split communicator, with correct results.

Expected values are regenerated from seeds on every rank; every result is also compared across ranks by hash.
Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

import ml_dtypes
import numpy as np
from harness import report_results
from mpi4py import MPI
from ops_cases import OPS, expect_error, run_op  # run_op: the op x dtype checks, on a split comm

import ddlfast
from ddlfast.api import _context_for
from ddlfast.config import MAX_CARRIED_SHARD_BYTES, load_settings
from ddlfast.engine.small import broadcast_route

BROADCAST_DTYPES = [np.dtype(t) for t in (np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32,
                                          np.int64, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                                          np.complex128)]
BROADCAST_DTYPES += [np.dtype(ml_dtypes.bfloat16), np.dtype([("id", np.int32), ("xy", np.float64, (2,))])]
SHAPES = [(), (0,), (1,), (7, 3), (1000,)]


def root_values(dtype: np.dtype, shape: tuple, seed: int) -> np.ndarray:
    """Root's array: random bytes that are valid values of the dtype."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape).copy()


def digest(value: object) -> str:
    data = value.tobytes() if isinstance(value, np.ndarray) else repr(value).encode()
    return hashlib.sha256(data).hexdigest()


def same_everywhere(comm: MPI.Intracomm, value: object) -> bool:
    return len(set(comm.allgather(digest(value)))) == 1


def fail_on_rank(rank: int) -> str:
    """Unpickling calls this: it fails on one rank only (as a class that rank cannot import would)."""
    if MPI.COMM_WORLD.Get_rank() == rank:
        raise ImportError(f"no module for rank {rank}")
    return "loaded"


class FailsOnRank:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __reduce__(self):
        return (fail_on_rank, (self.rank,))


def barrier_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """After barrier() returns on any rank, every rank has written its marker before calling barrier()."""
    rank, world = comm.Get_rank(), comm.Get_size()
    folder = comm.bcast(tempfile.mkdtemp(prefix="ddlfast-barrier-") if rank == 0 else None)
    results = []
    for round_ in range(3):
        if rank == (round_ % world):  # one rank arrives late
            for _ in range(200):
                os.sched_yield()
        with open(os.path.join(folder, f"{round_}-{rank}"), "w") as marker:
            marker.write("here")
        ddlfast.barrier(comm=comm)
        missing = [r for r in range(world) if not os.path.exists(os.path.join(folder, f"{round_}-{r}"))]
        results.append((f"barrier round {round_}", f"markers of ranks {missing} missing" if missing else None))
    ddlfast.barrier(comm=comm)
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def broadcast_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    results = []
    seed = 0
    for dtype in BROADCAST_DTYPES:
        for shape in SHAPES:
            for root in sorted({0, world - 1}):
                seed += 1
                want = root_values(dtype, shape, seed)
                array = want.copy() if rank == root else np.zeros(shape, dtype)
                returned = ddlfast.broadcast(array, root=root, comm=comm)
                failure = None
                if returned is not array:
                    failure = "broadcast did not return the array it filled"
                elif array.tobytes() != want.tobytes():
                    failure = "bytes differ from root's"
                elif not same_everywhere(comm, array):
                    failure = "results differ across ranks"
                results.append((f"broadcast {dtype}{list(shape)} root {root}", failure))
    # several outstanding asynchronous broadcasts, from different roots; wait() returns each array
    wants = [root_values(np.dtype(np.int16), (257,), 1000 + i) for i in range(4)]
    arrays = [w.copy() if rank == i % world else np.zeros_like(w) for i, w in enumerate(wants)]
    handles = [ddlfast.broadcast_async(a, root=i % world, comm=comm) for i, a in enumerate(arrays)]
    got = [h.wait() for h in handles]
    ok = all(g is a for g, a in zip(got, arrays, strict=True)) and all(
        np.array_equal(a, w) for a, w in zip(arrays, wants, strict=True))
    results.append(("broadcast_async x4", None if ok else "wrong arrays or values"))
    blocking = np.arange(5, dtype=np.uint8) if rank == 0 else np.zeros(5, np.uint8)
    handle = ddlfast.broadcast_async(blocking, comm=comm)
    ddlfast.barrier(comm=comm)  # a blocking call queues behind the asynchronous one
    results.append(("broadcast_async then barrier",
                    None if np.array_equal(handle.wait(), np.arange(5, dtype=np.uint8)) else "wrong values"))
    return results


def object_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    results = []
    big = np.random.default_rng(5).random(70000)  # 560 kB of pickle
    for root in sorted({0, world - 1}):
        for label, value in (("dict", {"lr": 0.1, "step": 7, "state": [np.arange(5), {"m": (1, 2)}]}),
                             ("None", None), ("large array", big), ("string", "é" * 1000)):
            obj = value if rank == root else ("not root's", lambda: None)  # others' objects are never pickled
            got = ddlfast.broadcast_object(obj, root=root, comm=comm)
            failure = None if digest(got) == digest(value) and same_everywhere(comm, got) else f"got {got!r:.80}"
            results.append((f"broadcast_object {label} root {root}", failure))
    mine = {"rank": rank, "values": list(range(rank * 1000)), "name": "r" * rank}
    got = ddlfast.allgather_object(mine, comm=comm)
    want = [{"rank": r, "values": list(range(r * 1000)), "name": "r" * r} for r in range(world)]
    results.append(("allgather_object (sizes differ per rank)", None if got == want else f"got {got!r:.120}"))
    got = ddlfast.allgather_object(None if rank % 2 else big, comm=comm)
    ok = all((g is None) if r % 2 else np.array_equal(g, big) for r, g in enumerate(got)) and len(got) == world
    results.append(("allgather_object None and large", None if ok else "wrong list"))
    return results


def bad_input_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    last = world - 1
    results = [
        ("object dtype on every rank", expect_error(
            comm, lambda: ddlfast.broadcast(np.array([1, "a"], dtype=object), comm=comm), "broadcast_object")),
        ("object dtype on one rank", expect_error(
            comm, lambda: ddlfast.broadcast(np.zeros(2, object if rank == last else np.int64), comm=comm),
            f"rank {last}", "Python objects")),
        ("read-only on one rank", expect_error(
            comm, lambda: ddlfast.broadcast(_read_only_on(rank, last), comm=comm), "read-only", f"rank {last}")),
        ("root out of range on one rank", expect_error(
            comm, lambda: ddlfast.broadcast(np.zeros(3, np.int8), root=world if rank == last else 0, comm=comm),
            f"root {world}", "outside")),
        ("negative root everywhere", expect_error(
            comm, lambda: ddlfast.broadcast(np.zeros(3, np.int8), root=-1, comm=comm), "outside")),
        ("broadcast_object root out of range on one rank", expect_error(
            comm, lambda: ddlfast.broadcast_object(1, root=world + 3 if rank == last else 0, comm=comm), "outside")),
        ("broadcast_async root out of range on one rank", expect_error(
            comm, lambda: ddlfast.broadcast_async(np.zeros(2, np.uint8), root=world if rank == 0 else 0,
                                                  comm=comm).wait(), "outside")),
        ("unpicklable object on broadcast_object's root", expect_error(
            comm, lambda: ddlfast.broadcast_object((lambda: None) if rank == last else 1, root=last, comm=comm),
            "cannot be pickled", f"rank {last}")),
        ("unpicklable object on one rank of allgather_object", expect_error(
            comm, lambda: ddlfast.allgather_object((lambda: 1) if rank == last else rank, comm=comm),
            "cannot be pickled", f"rank {last}")),
        ("an object one rank cannot unpickle (allgather_object)", expect_error(
            comm, lambda: ddlfast.allgather_object(FailsOnRank(0), comm=comm), "rank 0: ImportError")),
    ]
    if world > 1:  # root itself never unpickles: it returns its own object
        results.append(("an object one rank cannot unpickle (broadcast_object)", expect_error(
            comm, lambda: ddlfast.broadcast_object(FailsOnRank(last), comm=comm), f"rank {last}: ImportError")))
        results.append(("roots differ across ranks", expect_error(
            comm, lambda: ddlfast.broadcast(np.zeros(3, np.int16), root=rank % 2, comm=comm), "disagree on root")))
        results.append(("broadcast_object roots differ across ranks", expect_error(
            comm, lambda: ddlfast.broadcast_object("x", root=0 if rank else 1, comm=comm), "disagree on root")))
        results.append(("broadcast vs broadcast_object", expect_error(
            comm, lambda: (ddlfast.broadcast(np.zeros(3, np.int16), comm=comm) if rank == 0
                           else ddlfast.broadcast_object(3, comm=comm)), "disagree on array 0")))
        results.append(("barrier vs allgather_object", expect_error(
            comm, lambda: ddlfast.barrier(comm=comm) if rank == 0 else ddlfast.allgather_object(1, comm=comm),
            "different collectives")))
    check = np.full(4, 9, np.int8) if rank == 0 else np.zeros(4, np.int8)
    ddlfast.broadcast(check, comm=comm)
    results.append(("context works after the refusals", None if (check == 9).all() else f"got {check}"))
    return results


def _read_only_on(rank: int, last: int) -> np.ndarray:
    array = np.zeros(3)
    if rank == last:
        array.flags.writeable = False
    return array


def split_cases(world_comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """Every collective on each half of a split communicator (each half runs its own, at the same time)."""
    rank, world = world_comm.Get_rank(), world_comm.Get_size()
    color = rank * 2 // world
    sub = world_comm.Split(color, rank)
    results = []
    where = f"half {color} ({sub.Get_size()} ranks)"
    case = 50000 + 1000 * color
    for name in ("float32", "float16", "bfloat16", "int64"):
        for op in OPS:
            for api in ("allreduce", "fused"):
                case += 1
                try:
                    failure = run_op(name, op, 301, api, case, sub)
                except ddlfast.DdlfastError as error:
                    failure = f"raised {error}"
                results.append((f"{where}: {op} {name} {api}", failure))
    sub_rank, sub_size = sub.Get_rank(), sub.Get_size()
    array = np.arange(6, dtype=np.complex64) * (color + 1) if sub_rank == sub_size - 1 else np.zeros(6, np.complex64)
    ddlfast.broadcast(array, root=sub_size - 1, comm=sub)
    ok = np.array_equal(array, np.arange(6, dtype=np.complex64) * (color + 1))
    results.append((f"{where}: broadcast", None if ok else f"got {array}"))
    handle = ddlfast.broadcast_async(np.full(3, color, np.int8) if sub_rank == 0 else np.zeros(3, np.int8), comm=sub)
    results.append((f"{where}: broadcast_async", None if (handle.wait() == color).all() else "wrong values"))
    got = ddlfast.broadcast_object({"half": color} if sub_rank == 0 else None, comm=sub)
    results.append((f"{where}: broadcast_object", None if got == {"half": color} else f"got {got}"))
    got = ddlfast.allgather_object(rank, comm=sub)
    want = [r for r in range(world) if r * 2 // world == color]
    results.append((f"{where}: allgather_object", None if got == want else f"got {got}, want {want}"))
    ddlfast.barrier(comm=sub)
    results.append((f"{where}: bad root", expect_error(
        sub, lambda: ddlfast.broadcast(np.zeros(2), root=sub_size, comm=sub), "outside")))
    context = ddlfast.Context(sub)  # an explicit context on the half
    values = np.full(5, float(sub_rank), np.float64)
    context.allreduce(values, op="max")
    results.append((f"{where}: Context(sub).allreduce max", None if (values == sub_size - 1).all() else f"{values}"))
    context.barrier()
    got = context.allgather_object(sub_rank)
    results.append((f"{where}: Context(sub).allgather_object", None if got == list(range(sub_size)) else f"{got}"))
    context.close()
    sub.Free()
    return results


def ring_broadcasts_here(comm: MPI.Intracomm, nbytes: int) -> bool:
    """Whether a broadcast of nbytes takes the ring now (engine/small.broadcast_route, as the bench's path
    column)."""
    route = broadcast_route(_context_for(comm)._state, nbytes, load_settings())
    return route is not None and not route[1]


def ring_broadcast_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """Broadcasts past the sizes carried in the agreement (MAX_CARRIED_SHARD_BYTES) and from (P - 1) chunks up run
    on the ring (engine/small.ring_broadcasts); with DDLFAST_ALGORITHM=mpi through MPI's broadcast: every root, odd
    sizes and several chunks (4 KiB chunks), blocking and asynchronous, against root's bytes on every rank; then,
    after the ring's layout was cached, faults on one rank (another root, a size across the threshold, a read-only
    array): DdlfastError on every rank, no array written."""
    rank, world = comm.Get_rank(), comm.Get_size()
    chunk = 4096
    os.environ["DDLFAST_CHUNK_BYTES"] = str(chunk)
    edge = max(1, world - 1) * chunk
    past = MAX_CARRIED_SHARD_BYTES + 1
    results = []
    try:
        for nbytes, algorithm in ((past, "auto"), (past + 13, "auto"), (past + 5 * edge + 4099, "auto"),
                                  (past, "mpi"), (edge, "mpi")):
            os.environ["DDLFAST_ALGORITHM"] = algorithm
            if world > 1 and ring_broadcasts_here(comm, nbytes) != (algorithm == "auto"):
                results.append((f"broadcast of {nbytes} B, {algorithm}", "not the route this case is for"))
            for root in range(world):
                want = np.frombuffer(hashlib.sha256(f"{nbytes} {root}".encode()).digest() * (nbytes // 32 + 1),
                                     np.uint8)[:nbytes].copy()
                array = want.copy() if rank == root else np.full(nbytes, 7, np.uint8)
                if root % 2:
                    returned = ddlfast.broadcast_async(array, root=root, comm=comm).wait()
                else:
                    returned = ddlfast.broadcast(array, root=root, comm=comm)
                failure = None if returned is array and array.tobytes() == want.tobytes() else "bytes differ"
                if failure is None and not same_everywhere(comm, array):
                    failure = "results differ across ranks"
                results.append((f"broadcast of {nbytes} B ({algorithm}) root {root}", failure))
        os.environ["DDLFAST_ALGORITHM"] = "auto"
        if world < 2:
            return results
        last = world - 1
        x = np.arange(past + 2 * edge, dtype=np.uint8)
        for _ in range(2):
            ddlfast.broadcast(x, root=0, comm=comm)
        shorter = np.zeros(edge - 1, np.uint8)
        frozen = np.zeros_like(x)
        frozen.flags.writeable = False
        for label, call, needles in (
                ("another root", lambda: ddlfast.broadcast(x, root=1 if rank == last else 0, comm=comm), ["root"]),
                ("a size below the ring's", lambda: ddlfast.broadcast(shorter if rank == last else x, comm=comm),
                 ["disagree"]),
                ("a read-only array", lambda: ddlfast.broadcast(frozen if rank == last else x, comm=comm),
                 ["read-only", f"rank {last}"])):
            before = (x.copy(), shorter.copy())
            failure = expect_error(comm, call, *needles)
            if failure is None and not (np.array_equal(x, before[0]) and np.array_equal(shorter, before[1])):
                failure = f"rank {rank} wrote although the call failed"
            results.append((f"ring broadcast, {label} on rank {last}", failure))
        y = np.full(past, rank, np.uint8)
        ddlfast.broadcast(y, root=last, comm=comm)
        results.append(("ring broadcast after the faults", None if np.all(y == last) else "wrong values"))
    finally:
        del os.environ["DDLFAST_CHUNK_BYTES"]
        os.environ.pop("DDLFAST_ALGORITHM", None)
    return results


def main() -> int:
    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    results = barrier_cases(comm) + broadcast_cases(comm) + ring_broadcast_cases(comm) + object_cases(comm)
    results += bad_input_cases(comm)
    if world > 1:
        os.environ["DDLFAST_SMALL_BYTES"] = "0"
        results += split_cases(comm)
    return report_results(comm, results)


if __name__ == "__main__":
    sys.exit(main())
