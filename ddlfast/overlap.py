"""How much communication ddlfast hides behind backward in PyTorch, and what a step costs on each route.

The same training step on fresh copies of one model: compute only (no communication), compute + one blocking
fused_allreduce after backward, ddlfast.torch.distribute (buckets on the wire during backward), and, when
torch.distributed is initialised, DDP with ddlfast.torch.allreduce_hook. Rounds run the routes in turn, so a
shared machine's drift hits all alike; each route's time is the median over ranks' slowest.

hidden = (blocking - route) / (blocking - compute), reported only when the communication (blocking - compute) is
large enough against the step to be measured; otherwise `describe()` says so instead of printing a percentage.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

import ddlfast
import ddlfast.torch as dt

# Communication below this share of the compute step (or below 1 ms) is within the noise of a step time.
MEASURABLE_FRACTION = 0.1
MEASURABLE_S = 1e-3


@dataclass
class OverlapResult:
    compute_s: float
    blocking_s: float
    hooks_s: float  # ddlfast.torch.distribute
    routes_s: dict[str, float] = field(default_factory=dict)  # every route measured, by name

    @property
    def communication_s(self) -> float:
        return self.blocking_s - self.compute_s

    @property
    def measurable(self) -> bool:
        return self.communication_s >= max(MEASURABLE_S, MEASURABLE_FRACTION * self.compute_s)

    def hidden(self, route_s: float) -> float:
        """Fraction of the communication hidden by a route that took route_s per step (NaN if not measurable)."""
        return (self.blocking_s - route_s) / self.communication_s if self.measurable else float("nan")

    @property
    def hidden_fraction(self) -> float:
        return self.hidden(self.hooks_s)

    def describe(self, route: str) -> str:
        """One line a user can read about `route`'s step against blocking communication."""
        route_s = self.routes_s[route]
        if not self.measurable:
            return (f"communication ({self.communication_s * 1e3:.1f} ms a step) is too small against the "
                    f"{self.compute_s * 1e3:.1f} ms compute step to measure how much of it {route} hides; "
                    f"{route} step {route_s * 1e3:.1f} ms vs blocking {self.blocking_s * 1e3:.1f} ms")
        hidden = self.hidden(route_s)
        if hidden < 0:
            return (f"{route} hides none of the {self.communication_s * 1e3:.1f} ms of communication: its step is "
                    f"{(route_s - self.blocking_s) * 1e3:.1f} ms slower than blocking (per-bucket overhead, or no "
                    "free core for the communication thread)")
        return (f"{route} hides {min(hidden, 1.0) * 100:.0f}% of the {self.communication_s * 1e3:.1f} ms of "
                "communication behind backward")


def training_steps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                   bucket_bytes: int | None = None, comm: MPI.Intracomm | None = None,
                   ddp_hooks: dict[str, Callable] | None = None) -> dict[str, Callable[[], None]]:
    """One training step per route, each on its own copy of `model`. ddp_hooks: {name: hook or None (DDP's own
    allreduce)} for DDP routes (torch.distributed must be initialised)."""
    comm = comm or MPI.COMM_WORLD
    context = ddlfast.default_context() if comm is MPI.COMM_WORLD else ddlfast.Context(comm)

    def step_of(m: torch.nn.Module, optimizer: torch.optim.Optimizer,
                after_backward: Callable[[], None] = lambda: None) -> Callable[[], None]:
        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(m(inputs), targets).backward()
            after_backward()
            optimizer.step()
        return step

    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=1e-4)

    steps: dict[str, Callable[[], None]] = {}
    plain = copy.deepcopy(model)
    steps["compute only"] = step_of(plain, sgd(plain))
    blocking = copy.deepcopy(model)
    steps["blocking fused_allreduce"] = step_of(blocking, sgd(blocking), lambda: context.fused_allreduce(
        [p.grad if p.grad.is_cuda else p.grad.numpy() for p in blocking.parameters()], op="average"))
    for name, hook in (ddp_hooks or {}).items():
        ddp = torch.nn.parallel.DistributedDataParallel(  # DDP's buckets as large as ddlfast's
            copy.deepcopy(model), bucket_cap_mb=(bucket_bytes or 25 * 2**20) / 2**20)
        if hook is not None:
            ddp.register_comm_hook(dt.HookState(context=context), hook)
        steps[name] = step_of(ddp, sgd(ddp))
    hooked = copy.deepcopy(model)
    reducer = dt.distribute(hooked, bucket_bytes=bucket_bytes, context=context)
    steps["ddlfast.torch.distribute"] = step_of(hooked, dt.DistributedOptimizer(sgd(hooked), reducer))
    return steps


def timed(step: Callable[[], None], comm: MPI.Intracomm) -> float:
    """Seconds `step` took on the slowest rank."""
    synchronize_cuda()
    comm.Barrier()
    start = time.perf_counter()
    step()
    synchronize_cuda()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def synchronize_cuda() -> None:
    """A step on the GPU ends when its kernels have run, not when the host has queued them."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_times(steps: dict[str, Callable[[], None]], rounds: int, warmup: int,
                 comm: MPI.Intracomm) -> dict[str, list[float]]:
    """Every route's step times (after warm-up), rounds interleaved."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + rounds):
        for name, step in steps.items():
            elapsed = timed(step, comm)
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def measure_overlap(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, steps: int = 5,
                    warmup: int = 2, bucket_bytes: int | None = None, comm: MPI.Intracomm | None = None
                    ) -> OverlapResult:
    comm = comm or MPI.COMM_WORLD
    ddp = {"DDP + allreduce_hook": dt.allreduce_hook} if torch.distributed.is_initialized() else {}
    times = median_times(training_steps(model, inputs, targets, bucket_bytes=bucket_bytes, comm=comm,
                                        ddp_hooks=ddp), steps, warmup, comm)
    medians = {name: float(np.median(values)) for name, values in times.items()}
    return OverlapResult(compute_s=medians["compute only"], blocking_s=medians["blocking fused_allreduce"],
                         hooks_s=medians["ddlfast.torch.distribute"], routes_s=medians)
