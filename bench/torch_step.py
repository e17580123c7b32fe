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
from bench.overlap_torch import model_25m
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
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    dt.init_process_group("gloo")
    torch.manual_seed(0)
    model = model_25m(width=args.width)
    dt.broadcast_parameters(model)
    inputs, targets = torch.randn(args.batch, 512), torch.randint(0, 10, (args.batch,))
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
