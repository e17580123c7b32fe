"""DDP step time on the "ddlfast" torch.distributed backend vs gloo, in the same job (rounds interleaved so a
shared machine's drift hits every route alike; medians over the ranks' slowest): the torch issue's MLP
(bench/overlap_torch.py's model), and the same MLP with a BatchNorm1d after each hidden layer with
broadcast_buffers on and off. For the BatchNorm routes it also prints what DDP's per-forward buffer sync costs on
each backend: broadcasts per forward (gloo: one per dtype bucket of `dist._broadcast_coalesced`; ddlfast: one
packed broadcast), bytes, milliseconds.
Run: mpiexec -n 2 python -m bench.ddp_backend [--batch 64 --steps 7 --width 2048]"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import ddlfast.torch as dt
from bench.overlap_torch import model_25m
from ddlfast.integrations import torch_backend
from ddlfast.overlap import median_times


def with_batchnorm(model: torch.nn.Sequential) -> torch.nn.Sequential:
    """The MLP with a BatchNorm1d after each hidden Linear: buffers for DDP to broadcast every forward."""
    layers: list[torch.nn.Module] = []
    modules = list(model)
    for i, module in enumerate(modules):
        layers.append(module)
        if isinstance(module, torch.nn.Linear) and i + 1 < len(modules):
            layers.append(torch.nn.BatchNorm1d(module.out_features))
    return torch.nn.Sequential(*layers)


class BufferSyncMeter:
    """Counts and times DDP's buffer broadcasts (dist._broadcast_coalesced, which DDP looks up at each call), by
    process group."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.broadcasts: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self._original = dist._broadcast_coalesced

    def __enter__(self) -> BufferSyncMeter:
        def counted(group: dist.ProcessGroup, tensors: list[torch.Tensor], bucket_bytes: int, src: int) -> None:
            key = id(group)
            start = time.perf_counter()
            self._original(group, tensors, bucket_bytes, src)
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
            self.calls[key] = self.calls.get(key, 0) + 1
            # torch's C++ sends one broadcast per dtype bucket (buckets under the cap); the ddlfast backend one
            # packed broadcast per PACK_BYTES (counted where it is issued).
            if not isinstance(group, torch_backend.ProcessGroupDdlfast):
                self.broadcasts[key] = self.broadcasts.get(key, 0) + len({t.dtype for t in tensors})
            self.bytes[key] = self.bytes.get(key, 0) + sum(t.numel() * t.element_size() for t in tensors)

        broadcast = self._ddlfast_broadcast = torch_backend.ProcessGroupDdlfast.broadcast

        def counted_broadcast(group: torch_backend.ProcessGroupDdlfast, *args: object) -> object:
            self.broadcasts[id(group)] = self.broadcasts.get(id(group), 0) + 1
            return broadcast(group, *args)

        dist._broadcast_coalesced = counted
        torch_backend.ProcessGroupDdlfast.broadcast = counted_broadcast
        return self

    def __exit__(self, *exc: object) -> None:
        dist._broadcast_coalesced = self._original
        torch_backend.ProcessGroupDdlfast.broadcast = self._ddlfast_broadcast

    def reset(self) -> None:
        for table in (self.calls, self.broadcasts, self.bytes, self.seconds):
            table.clear()


def ddp_step(model: torch.nn.Module, group: dist.ProcessGroup, broadcast_buffers: bool, inputs: torch.Tensor,
             targets: torch.Tensor) -> Callable[[], None]:
    ddp = DDP(copy.deepcopy(model), process_group=group, broadcast_buffers=broadcast_buffers)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dt.init_process_group(backend="ddlfast")
    groups = {"ddlfast": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    plain = model_25m(width=args.width)
    normed = with_batchnorm(plain)
    inputs, targets = torch.randn(args.batch, 512), torch.randint(0, 10, (args.batch,))
    steps: dict[str, Callable[[], None]] = {}
    for backend, group in groups.items():
        steps[f"MLP, {backend}"] = ddp_step(plain, group, True, inputs, targets)
        for buffers in (True, False):
            steps[f"MLP+BN, {backend}, broadcast_buffers={buffers}"] = ddp_step(normed, group, buffers, inputs,
                                                                                targets)
    with BufferSyncMeter() as meter:
        times = median_times(steps, args.steps, args.warmup, comm)
        runs = args.steps + args.warmup  # forwards of each backend's broadcast_buffers=True BatchNorm route
        per_step = {backend: (meter.broadcasts.get(id(g), 0) / runs, meter.bytes.get(id(g), 0) / runs,
                              meter.seconds.get(id(g), 0.0) / runs) for backend, g in groups.items()}
    if comm.Get_rank() == 0:
        parameters = sum(p.numel() for p in plain.parameters())
        print(f"{parameters / 1e6:.1f}M parameters, {comm.Get_size()} ranks, batch {args.batch}/rank, "
              f"{args.threads} torch thread(s); median [min-max] of {args.steps} steps, rounds interleaved")
        medians = {name: float(np.median(values)) for name, values in times.items()}
        for name, values in times.items():
            gloo = medians[name.replace("ddlfast", "gloo")]
            print(f"  {name:44s} {medians[name] * 1e3:8.1f} ms  [{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}]"
                  f"  {gloo / medians[name]:5.2f}x gloo")
        for backend, (count, nbytes, seconds) in per_step.items():
            print(f"  buffer sync per forward on {backend}: {count:.0f} broadcast(s), {nbytes / 1024:.1f} KiB, "
                  f"{seconds * 1e3:.2f} ms (this rank)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
