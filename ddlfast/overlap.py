"""How much communication ddlfast.torch hides behind backward.

Three ways to run the same training step, each on a fresh copy of the model:
compute only (no communication), compute + one blocking fused_allreduce after
backward, and ddlfast.torch hooks (buckets on the wire during backward).
hidden = (blocking - hooks) / (blocking - compute).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

import ddlfast
import ddlfast.torch as dt


@dataclass
class OverlapResult:
    compute_s: float
    blocking_s: float
    hooks_s: float

    @property
    def communication_s(self) -> float:
        return self.blocking_s - self.compute_s

    @property
    def hidden_fraction(self) -> float:
        if self.communication_s <= 0:
            return float("nan")
        return (self.blocking_s - self.hooks_s) / self.communication_s


def _median_step(step: Callable[[], None], steps: int, warmup: int, comm: MPI.Intracomm) -> float:
    times = []
    for i in range(warmup + steps):
        comm.Barrier()
        start = time.perf_counter()
        step()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmup:
            times.append(elapsed)
    return float(np.median(times))


def measure_overlap(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, steps: int = 5,
                    warmup: int = 2, bucket_bytes: int | None = None, comm: MPI.Intracomm | None = None
                    ) -> OverlapResult:
    comm = comm or MPI.COMM_WORLD
    loss_fn = torch.nn.functional.cross_entropy

    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)

    def compute_only() -> None:
        plain_opt.zero_grad(set_to_none=False)
        loss_fn(plain(inputs), targets).backward()
        plain_opt.step()

    blocking_model = copy.deepcopy(model)
    blocking_opt = torch.optim.SGD(blocking_model.parameters(), lr=1e-4)
    for p in blocking_model.parameters():
        p.grad = torch.zeros_like(p)
    grads = [p.grad.numpy() for p in blocking_model.parameters()]

    def blocking() -> None:
        blocking_opt.zero_grad(set_to_none=False)
        loss_fn(blocking_model(inputs), targets).backward()
        ddlfast.fused_allreduce(grads, op="average", comm=comm)
        blocking_opt.step()

    hooked = copy.deepcopy(model)
    reducer = dt.distribute(hooked, bucket_bytes=bucket_bytes, context=ddlfast.default_context()
                            if comm is MPI.COMM_WORLD else ddlfast.Context(comm))
    hooked_opt = dt.DistributedOptimizer(torch.optim.SGD(hooked.parameters(), lr=1e-4), reducer)

    def with_hooks() -> None:
        hooked_opt.zero_grad()
        loss_fn(hooked(inputs), targets).backward()
        hooked_opt.step()

    result = OverlapResult(
        compute_s=_median_step(compute_only, steps, warmup, comm),
        blocking_s=_median_step(blocking, steps, warmup, comm),
        hooks_s=_median_step(with_hooks, steps, warmup, comm),
    )
    reducer.remove()
    return result
