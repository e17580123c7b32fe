"""Runs on every rank: ddlfast.torch hooks give the same gradients as
averaging every rank's gradients by hand, unused parameters do not hang,
broadcast_parameters makes all ranks equal, and training stays in sync."""

from __future__ import annotations

import numpy as np
import torch
from harness import comm, failures, rank, report_and_exit

import ddlfast.torch as dt

torch.manual_seed(100 + rank)  # different initial weights on purpose
torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(20, 64)
        self.b = torch.nn.Linear(64, 64)
        self.unused = torch.nn.Linear(3, 3)  # never gets a gradient
        self.c = torch.nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


model = Net()
dt.broadcast_parameters(model, root=0)
gathered = comm.allgather([p.detach().numpy().copy() for p in model.parameters()])
if any(not np.array_equal(gathered[0][i], gathered[rank][i]) for i in range(len(gathered[0]))):
    failures.append(f"rank {rank}: parameters differ after broadcast_parameters")

reducer = dt.distribute(model, bucket_bytes=8 * 1024, first_bucket_bytes=1024)  # several buckets
if len(reducer.buckets) < 3:
    failures.append(f"rank {rank}: expected several buckets, got {len(reducer.buckets)}")
optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), reducer)

for step in range(5):
    torch.manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    # The reference: this rank's own gradients, averaged over ranks by hand.
    local = torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True, retain_graph=True)
    local = [g.numpy().copy() if g is not None else np.zeros(p.shape, np.float32)
             for g, p in zip(local, model.parameters(), strict=True)]
    expected = [np.mean(arrays, axis=0) for arrays in zip(*comm.allgather(local), strict=True)]
    loss.backward()
    reducer.synchronize()
    for i, (p, want) in enumerate(zip(model.parameters(), expected, strict=True)):
        if not np.allclose(p.grad.numpy(), want, rtol=1e-5, atol=1e-6):
            failures.append(f"rank {rank} step {step}: gradient {i} differs from the averaged reference")
    optimizer.step()  # synchronize() already ran: step() applies the averaged gradients once
    params = comm.allgather(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))
    if not all(np.array_equal(params[0], other) for other in params):
        failures.append(f"rank {rank} step {step}: parameters diverged across ranks")

# zero_grad(set_to_none=True) replaces grads: the hooks copy them into the buckets.
optimizer.zero_grad(set_to_none=True)
torch.nn.functional.mse_loss(model(torch.ones(2, 20) * (rank + 1)), torch.zeros(2, 5)).backward()
optimizer.step()
params = comm.allgather(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))
if not all(np.array_equal(params[0], other) for other in params):
    failures.append(f"rank {rank}: parameters diverged after set_to_none")

report_and_exit()
