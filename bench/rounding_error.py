"""The 16-bit wire's error at scale without a cluster: an exact emulation of the engine's arithmetic.

`emulate(inputs, dims, direct, wire)` runs the schedule the core runs (the phases, steps and block ranges of
`ddlfast._testing.ring_schedule`, i.e. src/algo/ring_schedule.h) for every rank at once, in NumPy, with the host
executor's rounding points (src/engine/host_steps.h, src/engine/direct_phase.h):

    ring reduce-scatter step    the sender rounds its range to the wire type; the receiver adds the decoded
                                values to its own (unrounded) float32 values: own + incoming
    direct reduce-scatter       every other rank's contribution rounded to the wire type once (the owner's own
                                too under reproducible=True), added in float32 in coordinate order 0..d-1 at
                                the block's owner
    allgather                   the owner rounds its reduced block to the wire type once; copies thereafter

so at P <= 8 its bits equal a real run's (tests/mpi/test_rounding_emulation.py checks this), and at P = 1024 it
says what a real run would compute. op='sum' on float32 data; `wire` None is the uncompressed float32 path.
float16/bfloat16 data (`dtype`, uncompressed): a ring step adds own + incoming in float32 and rounds to the
type; a direct reduce-scatter adds all d contributions in float32 and rounds the sum once (both executors:
sums_halves_in_float32 in src/engine/direct_phase.h).

The report (a table, not a test; tests/unit/test_rounding_error.py asserts bounds at small p):

    .venv/bin/python bench/rounding_error.py [--ranks 8,64,256,1024] [--elements 16384] [--wire fp16]
    .venv/bin/python bench/rounding_error.py --dtype bfloat16    # bfloat16 gradients, uncompressed

For each p: the norm-wise relative error ||result - exact|| / ||exact|| of each schedule on gradients drawn from
N(0, 1e-3) with 0.1 % outliers 100 times larger, where `exact` is the float64 sum (exact to far below the 16-bit
wire's error: each float32 input has 24 bits, and float64 holds 53), beside the error of one rounding of the
exact sum to the wire type; and the cost model's time of each on the emulated 2-host cluster at 1 Gbit/s
(ddlfast/topology/cost_model.py, 64 MiB of float32 gradients: 32 MiB on the wire).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddlfast import _testing  # noqa: E402
from ddlfast.topology.cost_model import Cluster, Link, choose_algorithm, predict  # noqa: E402

WIRE_TYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
DATA_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
WIRE_BYTES = 32 << 20  # 64 MiB of float32 gradients on a 16-bit wire


def gradients(ranks: int, elements: int, seed: int = 0, outliers: float = 1e-3) -> np.ndarray:
    """float32 [ranks, elements]: N(0, 1e-3) (standard deviation 1e-3), a fraction `outliers` of them 100x."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((ranks, elements)) * 1e-3
    mask = rng.random((ranks, elements)) < outliers
    values[mask] *= 100.0
    return values.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _schedules(dims: tuple[int, ...], count: int, direct: tuple[int, ...]) -> tuple:
    """Every rank's schedule (phases, owned), from the core's own schedule code."""
    world = int(np.prod(dims))
    return tuple(_testing.ring_schedule(dims, rank, count, direct=direct) for rank in range(world))


def _round(values: np.ndarray, wire: type | None) -> np.ndarray:
    return values if wire is None else values.astype(wire).astype(np.float32)


def _by_count(ranges: Sequence[tuple[int, int]]) -> dict[int, np.ndarray]:
    """Ranks grouped by the length of their range (the near-equal split gives at most two lengths)."""
    groups: dict[int, list[int]] = {}
    for rank, (_, n) in enumerate(ranges):
        groups.setdefault(n, []).append(rank)
    return {n: np.array(ranks) for n, ranks in groups.items() if n}


def _columns(offsets: np.ndarray, n: int) -> np.ndarray:
    return offsets[:, None] + np.arange(n)[None, :]


def emulate(inputs: np.ndarray, dims: Sequence[int], direct: Sequence[int] = (), wire: str | None = None,
            dtype: str = "float32", reproducible: bool = False) -> np.ndarray:
    """Every rank's result [P, n] of an allreduce (sum) of inputs [P, n] on ring `dims`, with a direct
    reduce-scatter where direct[i] is 1, and `wire` ('fp16', 'bf16' or None) on every dimension; the inputs are
    taken as `dtype` ('float32', or 'float16'/'bfloat16' without a wire) and so is the result. `reproducible`:
    the core's reproducible=True arithmetic, whose direct reduce-scatter rounds the owner's own contribution too."""
    world, count = inputs.shape
    dims = tuple(int(d) for d in dims)
    if int(np.prod(dims)) != world:
        raise ValueError(f"dims {dims} do not multiply to {world} ranks")
    if wire is not None and dtype != "float32":
        raise ValueError("wire compression needs float32 data")
    wire_type = WIRE_TYPES[wire] if wire is not None else None
    data = np.array(inputs, dtype=DATA_TYPES[dtype], copy=True)
    if world == 1 or count == 0:
        return data
    schedules = _schedules(dims, count, tuple(int(d) for d in direct))
    for index in range(len(schedules[0][0])):
        phases = [schedules[rank][0][index] for rank in range(world)]
        if phases[0].get("direct"):
            _direct_phase(data, phases, wire_type, reproducible)
        else:
            _ring_phase(data, phases, wire_type, phases[0]["kind"] == "reduce_scatter")
    return data


def _ring_phase(data: np.ndarray, phases: list[dict], wire: type | None, reduces: bool) -> None:
    successors = np.array([phase["successor"] for phase in phases])
    for step in range(len(phases[0]["steps"])):
        sends = [phase["steps"][step][0] for phase in phases]
        receives = [phase["steps"][step][1] for phase in phases]
        send_offsets = np.array([offset for offset, _ in sends])
        receive_offsets = np.array([offset for offset, _ in receives])
        moved = []
        for n, senders in _by_count(sends).items():
            rows = senders[:, None]
            values = _round(data[rows, _columns(send_offsets[senders], n)], wire)
            if not reduces and step == 0 and wire is not None:
                data[rows, _columns(send_offsets[senders], n)] = values  # the owner keeps what the others get
            moved.append((n, senders, values))
        for n, senders, values in moved:  # every send of the step read before any receive lands
            targets = successors[senders]
            rows, columns = targets[:, None], _columns(receive_offsets[targets], n)
            if reduces:  # own + incoming, in float32, rounded to the data's type
                data[rows, columns] = data[rows, columns].astype(np.float32) + values.astype(np.float32)
            else:
                data[rows, columns] = values


def _direct_phase(data: np.ndarray, phases: list[dict], wire: type | None, reproducible: bool) -> None:
    owned = [phase["blocks"][phase["coordinate"]] for phase in phases]
    peers = np.array([phase["peers"] for phase in phases])
    coordinates = np.array([phase["coordinate"] for phase in phases])
    offsets = np.array([offset for offset, _ in owned])
    results = []
    for n, owners in _by_count(owned).items():
        columns = _columns(offsets[owners], n)
        total = None
        for j in range(peers.shape[1]):  # coordinate order, in float32, rounded to the data's type once, below
            values = data[peers[owners, j][:, None], columns]
            own = (coordinates[owners] == j)[:, None] & (not reproducible)  # the owner's own values, as they are
            term = np.where(own, values, _round(values, wire)).astype(np.float32)
            total = term if total is None else total + term
        results.append((owners, columns, total))
    for owners, columns, total in results:
        data[owners[:, None], columns] = total


# -- the report --------------------------------------------------------------------------------------------------


def relative_error(result: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(result.astype(np.float64) - exact) / np.linalg.norm(exact))


def one_rounding(exact: np.ndarray, wire: str) -> float:
    """The error of rounding the exact sum once to the wire type (or data type): the least any 16-bit result can
    have."""
    return relative_error(exact.astype(np.float32).astype({**WIRE_TYPES, **DATA_TYPES}[wire]), exact)


def two_host_cluster(ranks: int) -> Cluster:
    """The emulated 2-host cluster: p/2 ranks per host, shared memory inside, 1 Gbit/s Ethernet between."""
    return Cluster(hosts=2, ranks_per_host=ranks // 2, intra=Link(alpha=1e-6, beta=1e-10),
                   inter=Link(alpha=2e-5, beta=8e-9), gamma=2.5e-10)


def schedules_for(ranks: int, wire: str | None) -> list[tuple[str, tuple[int, ...], tuple[int, ...], bool]]:
    """(name, dims, direct, reproducible) of each schedule in the table; 'default' is what DDLFAST_ALGORITHM=auto
    picks for 64 MiB on the 2-host cluster with the wire on both dimensions (`wire` None: 16-bit data,
    uncompressed)."""
    host = ranks // 2
    compressed = (wire is not None,) * 2
    default = choose_algorithm(two_host_cluster(ranks), (host, 2), WIRE_BYTES, "auto", compressed=compressed)
    return [
        ("ring flat", (ranks,), (), False),
        (f"ring {host}x2", (host, 2), (), False),
        ("direct flat", (ranks,), (1,), False),
        ("direct flat (reproducible)", (ranks,), (1,), True),
        (f"direct {host}x2", (host, 2), (1, 1), False),
        (f"default: {default}", tuple(default.dims), tuple(default.direct), False),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,64,256,1024")
    parser.add_argument("--elements", type=int, default=16384)
    parser.add_argument("--wire", default="fp16", choices=sorted(WIRE_TYPES))
    parser.add_argument("--dtype", default="float32", choices=sorted(DATA_TYPES),
                        help="float16/bfloat16: gradients of that type, uncompressed (--wire is ignored)")
    args = parser.parse_args()
    wire = args.wire if args.dtype == "float32" else None
    print(f"# {args.dtype} data, wire {wire}; norm-wise relative error vs the float64 sum; N(0, 1e-3) + 0.1 % "
          "outliers x100; "
          f"{args.elements} elements; time: the cost model's, 64 MiB float32 on 2 hosts at 1 Gbit/s")
    print(f"{'p':>5}  {'schedule':<34} {'error':>10} {'x one rounding':>15} {'model ms':>9}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        inputs = gradients(ranks, args.elements).astype(DATA_TYPES[args.dtype])
        exact = inputs.astype(np.float64).sum(axis=0)
        single = one_rounding(exact, wire or args.dtype)
        print(f"{ranks:>5}  {'one rounding of the exact sum':<34} {single:10.3e} {1.0:15.2f} {'':>9}")
        cluster = two_host_cluster(ranks)
        for name, dims, direct, reproducible in schedules_for(ranks, wire):
            result = emulate(inputs, dims, direct, wire, args.dtype, reproducible)[0]
            error = relative_error(result, exact)
            seconds = predict(cluster, dims, WIRE_BYTES, direct).seconds
            print(f"{ranks:>5}  {name:<34} {error:10.3e} {error / single:15.2f} {seconds * 1e3:9.1f}", flush=True)


if __name__ == "__main__":
    main()
