"""Runs on every rank: reduce_scatter() and allgather() of one host array on their fast path (ddlfast/engine/
fast_path.py: the agreement and the collective in one call into the core, carried inside the agreement's
messages up to the latency path's reach, the ring's half past it), and its faults.

1. Every op x every dtype through reduce_scatter(x), reduce_scatter(x, out=) and reduce_scatter_async(x), at
   the carried path's edges and past its reach (the ring), against NumPy references (ops_cases.py's); allgather
   of every dtype at the same edges, bit-identical on every rank.
2. Ranks on different paths with the same layout: one rank on the general path (an ndarray subclass, a fused
   call of one array, a misaligned out=), the others on the fast path, carried and past the reach: right numbers.
3. Faults on one rank after the plan was cached: another count, op, name, dtype, collective, a size across the
   reach, a bad out= (size, read-only, overlapping the input). Every rank raises DdlfastError, nothing is
   written, the context works afterwards.
4. broadcast() on its fast path, carried and along the ring: results, a rank on the general path beside it, and
   faults (broadcast_cases).

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from harness import report_results
from latency_cases import untouched_after_error
from mpi4py import MPI
from ops_cases import DTYPES, OPS, check_result, inputs_for, reference

import ddlfast
from ddlfast.api import _context_for
from ddlfast.config import MAX_CARRIED_SHARD_BYTES, load_settings
from ddlfast.engine.small import broadcast_route

LIMIT = 4096  # DDLFAST_SMALL_BYTES


class Subclass(np.ndarray):
    """An ndarray the fast path leaves to the general path (type(array) is not np.ndarray)."""


def reach_bytes(comm: MPI.Intracomm) -> int:
    """The largest whole input the reduce-scatter carries (the latency path's reach for an allreduce, at most
    MAX_CARRIED_SHARD_BYTES)."""
    return min(_context_for(comm)._state.latency_reach(load_settings()), MAX_CARRIED_SHARD_BYTES)


def ring_count(comm: MPI.Intracomm, itemsize: int) -> int:
    """The smallest multiple of the world size whose bytes lie past the reach."""
    world = comm.Get_size()
    count = reach_bytes(comm) // itemsize + 1
    return count + (-count) % world


def result_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    results = []
    case = 20_000
    for name, dtype in DTYPES.items():
        edge = LIMIT // dtype.itemsize // world * world
        counts = [world, 13 * world, edge, edge + world]
        if name in ("float32", "int64", "float16"):
            counts.append(ring_count(comm, dtype.itemsize))
        for op in OPS:
            for count in counts:
                if count > 100_000 and op not in ("sum", "average"):
                    continue
                case += 1
                inputs = inputs_for(name, op, world, count, case)
                block = slice(rank * (count // world), (rank + 1) * (count // world))
                # one rank reduces nothing: its input comes back bit for bit (nan payloads too)
                want = (inputs[0] if world == 1 else reference(name, op, inputs))[block]
                mine = inputs[rank].copy()
                for api in ("plain", "out", "async"):
                    label = f"reduce_scatter {op} {name}[{count}] {api}"
                    try:
                        if api == "plain":
                            got = ddlfast.reduce_scatter(mine, op=op)
                        elif api == "out":
                            got = np.full(count // world, 7, dtype)
                            returned = ddlfast.reduce_scatter(mine, op=op, out=got)
                            if returned is not got:
                                results.append((label, "did not return out="))
                                continue
                        else:
                            got = ddlfast.reduce_scatter_async(mine, op=op).wait()
                        failure = check_result(name, op, got, want, identity=world == 1)
                        if failure is None and not np.array_equal(mine.view(np.uint8), inputs[rank].view(np.uint8)):
                            failure = "the input changed"
                    except ddlfast.DdlfastError as error:
                        failure = f"raised {error}"
                    results.append((label, failure))
    for name, dtype in [*DTYPES.items(), ("int8", np.dtype(np.int8))]:
        for count in (1, 3, LIMIT // dtype.itemsize // world, LIMIT // dtype.itemsize // world + 1,
                      reach_bytes(comm) // dtype.itemsize // world + 1):
            mine = (np.arange(count) % 251 + 17 * rank).astype(np.int64).astype(dtype)
            want = np.concatenate([(np.arange(count) % 251 + 17 * q).astype(np.int64).astype(dtype)
                                   for q in range(world)])
            for api in ("plain", "out"):
                out = None if api == "plain" else np.zeros(count * world, dtype)
                got = ddlfast.allgather(mine, out=out)
                failure = None if np.array_equal(got.view(np.uint8), want.view(np.uint8)) else "wrong bytes"
                if failure is None and len(set(comm.allgather(got.tobytes()))) != 1:
                    failure = "bits differ across ranks"
                results.append((f"allgather {name}[{count}] {api}", failure))
    return results


def mixed_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """One rank on the general path, the others on the fast path, the same layout: both must carry alike."""
    return [result for count in (64 * comm.Get_size(), ring_count(comm, 4)) for result in mixed_at(comm, count)]


def mixed_at(comm: MPI.Intracomm, count: int) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    odd = world - 1
    results = []
    x = (np.arange(count) % 31 + rank).astype(np.float32)
    want = sum((np.arange(count) % 31 + q).astype(np.float32) for q in range(world))
    block = slice(rank * (count // world), (rank + 1) * (count // world))
    staging = np.empty(count // world + 1, np.float32)
    misaligned = staging.view(np.uint8)[1:1 + 4 * (count // world)].view(np.float32)  # staged by the general path
    for label, general in (("an ndarray subclass", lambda: ddlfast.reduce_scatter(x.view(Subclass))),
                           ("fused_reduce_scatter([x])", lambda: ddlfast.fused_reduce_scatter([x])[0]),
                           ("a misaligned out=", lambda: ddlfast.reduce_scatter(x, out=misaligned))):
        try:
            got = general() if rank == odd else ddlfast.reduce_scatter(x)
            failure = None if np.array_equal(np.asarray(got), want[block]) else f"got {np.asarray(got)[:4]}"
        except ddlfast.DdlfastError as error:
            failure = f"raised {error}"
        results.append((f"reduce_scatter[{count}], {label} on rank {odd}", failure))
    gathered_want = np.concatenate([(np.arange(count // world) % 31 + q).astype(np.float32) for q in range(world)])
    mine = (np.arange(count // world) % 31 + rank).astype(np.float32)
    for label, general in (("an ndarray subclass", lambda: ddlfast.allgather(mine.view(Subclass))),
                           ("fused_allgather([x])", lambda: ddlfast.fused_allgather([mine])[0])):
        try:
            got = general() if rank == odd else ddlfast.allgather(mine)
            failure = None if np.array_equal(np.asarray(got), gathered_want) else "wrong values"
        except ddlfast.DdlfastError as error:
            failure = f"raised {error}"
        results.append((f"allgather[{count // world}], {label} on rank {odd}", failure))
    return results


def fault_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    if comm.Get_size() < 2:
        return []
    return [result for count in (100 * comm.Get_size(), ring_count(comm, 4)) for result in faults_at(comm, count)]


def faults_at(comm: MPI.Intracomm, count: int) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    odd = world - 1
    carried = count == 100 * world
    where = "carried" if carried else "past the reach"
    x = np.arange(count, dtype=np.float32) + rank
    out = np.zeros(count // world, np.float32)
    gathered = np.zeros(count * world, np.float32)
    for _ in range(3):  # the plans are cached before anything differs
        ddlfast.reduce_scatter(x, out=out)
        ddlfast.allgather(x, out=gathered)
    out[:] = 0
    gathered[:] = 0
    longer = np.arange(count + world, dtype=np.float32)
    across = np.zeros(ring_count(comm, 4) if carried else 100 * world, np.float32)
    readonly = np.zeros(count // world, np.float32)
    readonly.flags.writeable = False
    cases = [
        ("another count", lambda: ddlfast.reduce_scatter(longer if rank == odd else x), "disagree"),
        ("another op", lambda: ddlfast.reduce_scatter(x, op="max" if rank == odd else "min", out=out), "disagree"),
        ("another name", lambda: ddlfast.reduce_scatter(x, out=out, name=7 if rank == odd else 6), "name"),
        ("another dtype", lambda: ddlfast.reduce_scatter(x.astype(np.float64) if rank == odd else x), "disagree"),
        ("an allreduce against it", lambda: ddlfast.allreduce(x.copy()) if rank == odd
         else ddlfast.reduce_scatter(x, out=out), "different collectives"),
        ("an allgather against it", lambda: ddlfast.allgather(x, out=gathered) if rank == odd
         else ddlfast.reduce_scatter(x, out=out), "different collectives"),
        ("an allgather of another count", lambda: ddlfast.allgather(longer if rank == odd else x), "disagree"),
        ("a size across the reach", lambda: ddlfast.reduce_scatter(across if rank == odd else x), "disagree"),
        ("an out= of another size", lambda: ddlfast.reduce_scatter(
            x, out=np.zeros(count // world + 1, np.float32) if rank == odd else out), f"rank {odd}"),
        ("a read-only out=", lambda: ddlfast.reduce_scatter(x, out=readonly if rank == odd else out),
         f"rank {odd}", "writable"),
        ("an out= overlapping the input", lambda: ddlfast.reduce_scatter(
            x, out=x[:count // world] if rank == odd else out), f"rank {odd}", "overlaps"),
        ("an allgather out= of another size", lambda: ddlfast.allgather(
            x, out=gathered[:-1] if rank == odd else gathered), f"rank {odd}"),
    ]
    results = [untouched_after_error(comm, f"{label} on one rank ({where})",
                                     {"x": x, "out": out, "gathered": gathered}, call, *needles)
               for label, call, *needles in cases]
    got = ddlfast.reduce_scatter(x)
    want = sum(np.arange(count, dtype=np.float32) + q for q in range(world))[
        rank * (count // world):(rank + 1) * (count // world)]
    results.append((f"works after the faults ({where})", None if np.array_equal(got, want) else f"got {got[:4]}"))
    return results


RING_CHUNK = 4096  # DDLFAST_CHUNK_BYTES while broadcasts take the ring: several chunks per hop


def ring_broadcast_count(comm: MPI.Intracomm) -> int:
    """The smallest float32 count past the reach whose broadcast takes the ring (from (P - 1) chunks)."""
    return max(reach_bytes(comm), (comm.Get_size() - 1) * RING_CHUNK) // 4 + 1


def broadcast_route_here(comm: MPI.Intracomm, nbytes: int) -> str:
    """The engine's own route for a broadcast of `nbytes` (engine/small.broadcast_route)."""
    route = broadcast_route(_context_for(comm)._state, nbytes, load_settings())
    return "mpi" if route is None else "carried" if route[1] else "ring"


def broadcast_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """broadcast() on its fast path (fast_path.BroadcastPlan, either route in one call into the core: carried in
    the agreement's messages, or along the ring past the reach): every root, odd byte counts at the limit's edges,
    the reach and past it, bit-identical everywhere; then for each route one rank on the general path beside the
    fast path, and faults on one rank after the plan was cached (another root, a size across the limit, a
    read-only array, another collective)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    results = []
    os.environ["DDLFAST_CHUNK_BYTES"] = str(RING_CHUNK)
    try:
        for dtype in (np.dtype(np.int8), np.dtype(np.float16), np.dtype(np.complex64)):
            ring = ring_broadcast_count(comm) * 4 // dtype.itemsize + 1
            for count in (1, 3, LIMIT // dtype.itemsize - 1, LIMIT // dtype.itemsize, LIMIT // dtype.itemsize + 1,
                          reach_bytes(comm) // dtype.itemsize, ring):  # carried in shared memory up to the reach
                for root in sorted({0, world - 1}):
                    want = (np.arange(count) % 113 + root).astype(dtype)
                    array = want.copy() if rank == root else np.zeros(count, dtype)
                    failure = None if ddlfast.broadcast(array, root=root) is array else "did not return the array"
                    if failure is None and array.tobytes() != want.tobytes():
                        failure = "bytes differ from root's"
                    if failure is None and len(set(comm.allgather(array.tobytes()))) != 1:
                        failure = "bits differ across ranks"
                    results.append((f"broadcast {dtype.name}[{count}] root {root}", failure))
            if world > 1 and broadcast_route_here(comm, ring * dtype.itemsize) != "ring":
                results.append((f"broadcast {dtype.name}[{ring}]", "does not take the ring"))
        if world > 1:
            for count in (100, ring_broadcast_count(comm)):
                results += broadcast_faults_at(comm, count)
    finally:
        del os.environ["DDLFAST_CHUNK_BYTES"]
    return results


def broadcast_faults_at(comm: MPI.Intracomm, count: int) -> list[tuple[str, str | None]]:
    """A broadcast of `count` float32 on its route: one rank on the general path, then faults on one rank."""
    rank, world = comm.Get_rank(), comm.Get_size()
    where = broadcast_route_here(comm, count * 4)
    results = []
    odd = world - 1
    x = np.arange(count, dtype=np.float32) + rank
    for label, general in (("an ndarray subclass", lambda: ddlfast.broadcast(x.view(Subclass), root=0)),
                           ("a NumPy integer root", lambda: ddlfast.broadcast(x, root=np.int64(0)))):
        x[:] = np.arange(count, dtype=np.float32) + rank
        try:
            general() if rank == odd else ddlfast.broadcast(x, root=0)
            failure = None if np.array_equal(x, np.arange(count, dtype=np.float32)) else f"got {x[:4]}"
        except ddlfast.DdlfastError as error:
            failure = f"raised {error}"
        results.append((f"broadcast ({where}), {label} on rank {odd}", failure))
    for _ in range(3):
        ddlfast.broadcast(x, root=0)
    big = np.zeros(LIMIT // 4 + 1 if where == "carried" else count - 1, np.float32)
    frozen = x.copy()
    frozen.flags.writeable = False
    cases = [
        ("another root", lambda: ddlfast.broadcast(x, root=1 if rank == odd else 0), "root"),
        ("another size", lambda: ddlfast.broadcast(big if rank == odd else x, root=0), "disagree"),
        ("a read-only array", lambda: ddlfast.broadcast(frozen if rank == odd else x, root=0), "read-only"),
        ("an allgather against it", lambda: ddlfast.allgather(x) if rank == odd else ddlfast.broadcast(x, root=0),
         "different collectives"),
    ]
    results += [untouched_after_error(comm, f"broadcast ({where}), {label} on one rank", {"x": x, "big": big}, call,
                                      *needles) for label, call, *needles in cases]
    y = np.full(count, rank, np.float32)
    ddlfast.broadcast(y, root=odd)
    results.append((f"broadcast ({where}) works after the faults", None if np.all(y == odd) else f"got {y[:4]}"))
    return results


def main() -> int:
    os.environ["DDLFAST_SMALL_BYTES"] = str(LIMIT)
    comm = MPI.COMM_WORLD
    return report_results(comm, result_cases(comm) + mixed_cases(comm) + fault_cases(comm) + broadcast_cases(comm))


if __name__ == "__main__":
    sys.exit(main())
