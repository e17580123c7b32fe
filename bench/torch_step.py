"""PyTorch step time, every route in the same run (medians, rounds interleaved so a shared machine's drift hits
all routes alike): compute only; compute + one blocking fused_allreduce after backward; DDP on gloo; DDP +
ddlfast.torch.allreduce_hook; DDP + fp16_hook; ddlfast.torch.distribute. Then the per-bucket overhead of the
async path (submit -> wait) beside a blocking call at 4 KiB and 1 MiB.
Run: mpiexec -n 2 python -m bench.torch_step [--batch 64 --steps 7]"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from mpi4py import MPI

import ddlfast
import ddlfast.torch as dt
from bench.overlap_torch import set_up
from ddlfast.overlap import median_times, timed, training_steps

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb, for the ddlfast.torch route too
DDP_ROUTES = {"DDP gloo": None, "DDP + allreduce_hook": dt.allreduce_hook, "DDP + fp16_hook": dt.fp16_hook}


def bucket_overhead(nbytes: int, iters: int, comm: MPI.Intracomm) -> tuple[float, float]:
    """Median seconds of a blocking fused_allreduce and of fused_allreduce_async + wait, one bucket."""
    array = np.ones(nbytes // 4, np.float32)
    blocking, asynchronous = [], []
    for _ in range(iters):
        blocking.append(timed(lambda: ddlfast.fused_allreduce([array], op="average"), comm))
        asynchronous.append(timed(lambda: ddlfast.fused_allreduce_async([array], op="average").wait(), comm))
    return float(np.median(blocking)), float(np.median(asynchronous))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    args, model, inputs, targets = set_up(parser)
    comm = MPI.COMM_WORLD
    steps = training_steps(model, inputs, targets, bucket_bytes=BUCKET_BYTES, ddp_hooks=DDP_ROUTES)
    times = median_times(steps, args.steps, args.warmup, comm)
    overhead = {size: bucket_overhead(size, 30, comm) for size in (4096, 2**20)}
    if comm.Get_rank() == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(f"{parameters / 1e6:.1f}M parameters, {comm.Get_size()} ranks, batch {args.batch}/rank, "
              f"{args.threads} torch thread(s); median [min-max] of {args.steps} steps, rounds interleaved")
        gloo = float(np.median(times["DDP gloo"]))
        for name, values in times.items():
            median = float(np.median(values))
            print(f"  {name:26s} {median * 1e3:8.1f} ms  [{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}]"
                  f"  {gloo / median:5.2f}x DDP gloo")
        for size, (blocking, asynchronous) in overhead.items():
            print(f"  one {size // 1024} KiB bucket: blocking {blocking * 1e6:.0f} us, async submit->wait "
                  f"{asynchronous * 1e6:.0f} us (+{(asynchronous - blocking) * 1e6:.0f} us per bucket)")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
