"""ddlfast.elastic with torch under ULFM (tests/mpi/test_elastic.py): 4 ranks train a linear model with
ddlfast.torch's gradient hooks and DistributedOptimizer (SGD with momentum), TorchState committing every 4 steps;
rank 2 dies at the top of step 9 (the others wait in its gradient allreduce). Each survivor writes its final
weights and the membership history to OUT/rank<r>.npz; the test computes the reference (torch_reference)."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch

STEPS = 14
COMMIT_EVERY = 4
FEATURES = 16
LR, MOMENTUM = 0.05, 0.9


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + size)
    x = torch.randn(8, FEATURES, generator=generator, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def torch_reference(history: list[tuple[int, int]], start_size: int) -> np.ndarray:
    """The weights after STEPS steps of SGD with momentum on the rank average of the gradients, the world's size
    changing at each (resume step, size) of `history` (the momentum as committed there: the same steps)."""
    weight = torch.zeros(1, FEATURES, dtype=torch.float64)
    buffer = None
    sizes = [(0, start_size), *history]
    for step in range(STEPS):
        size = [n for resumed, n in sizes if resumed <= step][-1]
        grads = []
        for rank in range(size):
            w = weight.clone().requires_grad_(True)
            x, y = batch(step, rank, size)
            ((x @ w.T - y) ** 2).mean().backward()
            grads.append(w.grad)
        grad = sum(grads) / size
        buffer = grad.clone() if buffer is None else buffer * MOMENTUM + grad
        weight -= LR * buffer
    return weight.numpy()


def main() -> None:
    import ddlfast
    import ddlfast.elastic
    import ddlfast.torch as dt

    out = sys.argv[1]
    start_rank, start_size = ddlfast.rank(), ddlfast.size()
    model = torch.nn.Linear(FEATURES, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    reducer = dt.distribute(model)
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), reducer)
    state = ddlfast.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    history: list[tuple[int, int]] = []
    state.on_membership_change(lambda error: history.append((state.step, error.size)))

    @ddlfast.elastic.run
    def train(state: ddlfast.elastic.TorchState) -> None:
        while state.step < STEPS:
            if start_rank == 2 and state.step == 9:
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            x, y = batch(state.step, ddlfast.rank(), ddlfast.size())
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    np.savez(os.path.join(out, f"rank{start_rank}.npz"), weight=model.weight.detach().numpy(),
             history=np.array(history, dtype=np.int64).reshape(-1, 2), start_size=start_size)
    print(f"rank {start_rank}: done, history {history}", flush=True)


if __name__ == "__main__":
    main()
