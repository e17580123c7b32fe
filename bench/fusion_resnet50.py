"""ResNet-50-shaped gradients (161 float32 arrays): ddlfast.fused_allreduce vs
one comm.Allreduce per array vs one comm.Allreduce on a single buffer of the
same bytes, alternating in one run. Run: mpiexec -n 4 python bench/fusion_resnet50.py"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resnet50_shapes import resnet50_shapes  # noqa: E402

import ddlfast  # noqa: E402


def timed(comm: MPI.Intracomm, action) -> float:
    comm.Barrier()
    start = MPI.Wtime()
    action()
    return comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    shapes = resnet50_shapes()
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    pristine = [g.copy() for g in grads]
    single = np.concatenate([g.ravel() for g in grads])
    single_pristine = single.copy()
    # Gradients written straight into bucket views (DDP's gradient_as_bucket_view, ddlfast.torch's layout):
    # one large allocation, which NumPy backs with transparent huge pages like the single buffer.
    bucket = ddlfast.FusedBuffer(shapes, dtype=np.float32)

    def reset() -> None:
        for g, p in zip(grads, pristine, strict=True):
            g[...] = p
        single[...] = single_pristine
        for view, p in zip(bucket.views, pristine, strict=True):
            view[...] = p

    def per_array() -> None:
        for g in grads:
            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)

    samples: dict[str, list[float]] = {"ddlfast fused_allreduce": [], "MPI per array": [], "MPI single buffer": [],
                                       "ddlfast FusedBuffer views": []}
    for iteration in range(args.iters + 1):
        for name, action in (("ddlfast fused_allreduce", lambda: ddlfast.fused_allreduce(grads)),
                             ("MPI per array", per_array),
                             ("MPI single buffer", lambda: comm.Allreduce(MPI.IN_PLACE, single, op=MPI.SUM)),
                             ("ddlfast FusedBuffer views", lambda: bucket.allreduce())):
            reset()
            elapsed = timed(comm, action)
            if iteration > 0:  # the first round warms up buffers and agreement caches
                samples[name].append(elapsed)
    reset()
    ddlfast.fused_allreduce(grads)
    comm.Allreduce(MPI.IN_PLACE, single, op=MPI.SUM)
    fused_result = np.concatenate([g.ravel() for g in grads])
    ok = np.allclose(fused_result, single, rtol=1e-5, atol=1e-5)
    reset()
    bucket.allreduce()
    comm.Allreduce(MPI.IN_PLACE, single, op=MPI.SUM)
    ok = ok and np.allclose(bucket.flat, single, rtol=1e-5, atol=1e-5)
    if rank == 0:
        total = sum(int(np.prod(s)) for s in shapes)
        print(f"ResNet-50 gradients: {len(shapes)} float32 arrays, {total:,} elements "
              f"({total * 4 / 2**20:.1f} MiB), {world} ranks, median of {args.iters}")
        medians = {name: float(np.median(values)) for name, values in samples.items()}
        for name, value in medians.items():
            print(f"  {name:<26} {value * 1e3:9.2f} ms")
        fused = medians["ddlfast fused_allreduce"]
        print(f"  fused vs per-array MPI:     {medians['MPI per array'] / fused:.2f}x faster (target >= 1.3x)")
        print(f"  fused / single-buffer MPI:  {fused / medians['MPI single buffer']:.2f}x the time (target <= 1.15x)")
        views = medians["ddlfast FusedBuffer views"]
        print(f"  bucket views vs per-array MPI: {medians['MPI per array'] / views:.2f}x faster, "
              f"{views / medians['MPI single buffer']:.2f}x the single-buffer MPI time")
        print(f"  results agree with MPI: {ok}")
    return 0 if comm.allreduce(ok, op=MPI.LAND) else 1


if __name__ == "__main__":
    sys.exit(main())
