"""Overlap of ddlfast's gradient hooks with backward, on a ~25M-parameter
model: step time of DDP + ddlfast.torch.allreduce_hook and of
ddlfast.torch.distribute vs compute only vs compute + one blocking
fused_allreduce after backward (medians, same run).
Run: mpiexec -n 2 python bench/overlap_torch.py [--device cuda]"""

from __future__ import annotations

import argparse
import sys

import torch
from mpi4py import MPI

import ddlfast.torch as dt
from ddlfast.overlap import measure_overlap


def model_25m(width: int = 2048, depth: int = 6) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(512, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def set_up(parser: argparse.ArgumentParser
           ) -> tuple[argparse.Namespace, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """What both PyTorch benches share: their options, torch's threads, torch.distributed (for the DDP routes;
    MASTER_ADDR from the environment when set), the model (rank 0's on every rank) and one batch."""
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share the GPUs: rank %% count)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", MPI.COMM_WORLD.Get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dt.init_process_group("gloo")
    torch.manual_seed(0)
    model = model_25m(width=args.width).to(device)
    dt.broadcast_parameters(model)
    return (args, model, torch.randn(args.batch, 512, device=device),
            torch.randint(0, 10, (args.batch,), device=device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mib", type=float, default=8)
    args, model, inputs, targets = set_up(parser)
    comm = MPI.COMM_WORLD
    parameters = sum(p.numel() for p in model.parameters())
    result = measure_overlap(model, inputs, targets, steps=args.steps, warmup=2,
                             bucket_bytes=int(args.bucket_mib * 2**20), comm=comm)
    if comm.Get_rank() == 0:
        print(f"model: {parameters / 1e6:.1f}M parameters ({parameters * 4 / 2**20:.0f} MiB of gradients), "
              f"{comm.Get_size()} ranks, batch {args.batch}/rank, {args.threads} torch thread(s), "
              f"buckets {args.bucket_mib} MiB, median of {args.steps} steps")
        for name, seconds in result.routes_s.items():
            print(f"  {name:30s} {seconds * 1e3:8.1f} ms")
        for route in ("DDP + allreduce_hook", "ddlfast.torch.distribute"):
            print(f"  {result.describe(route)}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
