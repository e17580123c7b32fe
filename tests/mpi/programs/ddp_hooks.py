"""Runs on every rank: real DistributedDataParallel on gloo (set up by ddlfast.torch.init_process_group) with
ddlfast's communication hooks against DDP's own allreduce: the same parameters after a few steps (bit-identical
at 2 ranks, fp32 rounding beyond), with no_sync, find_unused_parameters and static_graph; the fp16 hook's error
is at most torch's fp16_compress_hook's; a failed collective fails backward() on every rank.
Prints "<n> failures" on rank 0."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from harness import comm, fail, rank, report_and_exit, world
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddlfast.torch as dt

torch.set_num_threads(1)
dt.init_process_group("gloo")


class Net(torch.nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 64)
        self.unused = torch.nn.Linear(5, 5) if extra else None
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        out = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return out + self.unused(x[:, :5]).sum() if use_unused else out


def data(step: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen) * scale, torch.randint(0, 4, (8,), generator=gen)


def train(hook: object, state: object = None, *, steps: int = 3, accumulate: bool = False,
          find_unused: bool = False, static_graph: bool = False) -> np.ndarray:
    ddp = DDP(Net(find_unused), bucket_cap_mb=0.01, find_unused_parameters=find_unused, static_graph=static_graph)
    if hook is not None:
        ddp.register_comm_hook(state if state is not None else dt.HookState(), hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        if accumulate:
            with ddp.no_sync():
                x, y = data(1000 + step)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = data(step)
        # With find_unused_parameters, rank 0 uses the extra layer on odd steps only (unused elsewhere).
        use = find_unused and rank == 0 and step % 2 == 1
        torch.nn.functional.cross_entropy(ddp(x, use), y).backward()
        optimizer.step()
    return np.concatenate([p.detach().numpy().ravel() for p in ddp.parameters()])


def same(case: str, got: np.ndarray, want: np.ndarray) -> None:
    if world == 2:
        if not np.array_equal(got, want):
            fail(case, f"not bit-identical to DDP's allreduce (max difference {np.abs(got - want).max():.3g})")
    elif not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        fail(case, f"differs from DDP's allreduce by {np.abs(got - want).max():.3g}")
    if not all(np.array_equal(got, other) for other in comm.allgather(got)):
        fail(case, "parameters differ across ranks")


for options in ({}, {"accumulate": True}, {"find_unused": True}, {"static_graph": True}):
    name = "allreduce_hook " + ", ".join(options) if options else "allreduce_hook"
    try:
        same(name, train(dt.allreduce_hook, **options), train(None, **options))
    except Exception as error:  # noqa: BLE001 - reported as a failure of this case
        fail(name, f"raised {type(error).__name__}: {error}")


def bucket_grads(hook: object, state: object) -> np.ndarray:
    """One backward on badly scaled data (gradients spanning many binades), all gradients flattened."""
    ddp = DDP(Net(), bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    x, y = data(7, scale=30.0)
    (torch.nn.functional.cross_entropy(ddp(x), y) * 1e-3).backward()
    return np.concatenate([p.grad.numpy().ravel() for p in ddp.parameters() if p.grad is not None])


exact = bucket_grads(None, None)
errors = {}
for name, hook, state in (("ddlfast fp16_hook", dt.fp16_hook, dt.HookState()),
                          ("ddlfast bf16_hook", dt.bf16_hook, dt.HookState()),
                          ("torch fp16_compress_hook", default_hooks.fp16_compress_hook, None)):
    got = bucket_grads(hook, state)
    errors[name] = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    if not all(np.array_equal(got, other) for other in comm.allgather(got)):
        fail(name, "gradients differ across ranks")
if errors["ddlfast fp16_hook"] > errors["torch fp16_compress_hook"]:
    fail("fp16", f"relative error {errors['ddlfast fp16_hook']:.3g} above torch's fp16_compress_hook's "
                 f"{errors['torch fp16_compress_hook']:.3g}")
if not 0 < errors["ddlfast bf16_hook"] < 1e-2:
    fail("bf16", f"relative error {errors['ddlfast bf16_hook']:.3g}")
if rank == 0:
    print("relative gradient error vs fp32: " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))

# Error feedback: residuals kept per DDP bucket (bucket.index()), training stays near fp32 and equal on all ranks.
state = dt.HookState(compression="fp16", error_feedback=True)
got, want = train(dt.allreduce_hook, state), train(None)
if len(state._residuals) < 2 or sorted(state._residuals) != list(range(len(state._residuals))):
    fail("error_feedback", f"residuals keyed {sorted(state._residuals)}, expected one per DDP bucket index")
if not np.allclose(got, want, rtol=1e-2, atol=1e-3):
    fail("error_feedback", f"parameters {np.abs(got - want).max():.3g} from fp32 DDP")
if not all(np.array_equal(got, other) for other in comm.allgather(got)):
    fail("error_feedback", "parameters differ across ranks")

# A collective that fails (ranks disagree on compression) fails backward() on every rank, through DDP. (A layout
# no earlier case used: ranks agree on arguments once per new layout.)
ddp = DDP(torch.nn.Linear(16, 7))
ddp.register_comm_hook(dt.HookState(compression="fp16" if rank == 0 else None), dt.allreduce_hook)
try:
    x, _ = data(0)
    ddp(x).square().mean().backward()
except RuntimeError as error:
    if "ranks disagree on compression" not in str(error):
        fail("error", f"backward raised without ddlfast's message: {error}")
else:
    fail("error", "a failed ddlfast collective did not fail backward()")

report_and_exit(before_exit=dist.destroy_process_group)
