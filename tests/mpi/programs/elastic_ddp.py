"""DistributedDataParallel on the "ddlfast" torch.distributed backend under ULFM (tests/mpi/test_elastic.py): 4
ranks train with ddlfast.elastic.run and TorchState, committing every COMMIT_EVERY steps; rank VICTIM sleeps 0.3 s
at the top of step KILL_STEP and SIGKILLs itself, so the others wait for it in DDP's gradient allreduce. run() then
rebuilds torch's default process group on the survivors (a new store on the new rank 0, which is a new process
when the victim was rank 0), and the training function builds its DDP anew on it.

Usage: elastic_ddp.py OUT VICTIM KILL_STEP. Each survivor writes its final parameters and the membership history
to OUT/rank<r>.npz; the test computes the reference (ddp_reference).

The model is elastic_train.py's exact arithmetic as a torch module: the loss -(w * c).sum() with c the integer
"gradient" of elastic_train.gradient() at the rank's shard, a DDP comm hook that sums (no division by the size),
SGD with lr 1, then w mod 4093: every summation order gives the same bits, so NumPy alone computes the reference.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

if __package__:  # imported by the test (for ddp_reference)
    from .elastic_train import COMMIT_EVERY, gradient
else:  # run as a program: its folder is on sys.path
    from elastic_train import COMMIT_EVERY, gradient

STEPS = 20
ELEMENTS = 1 << 15  # 256 KiB of float64 per bucket: far above DDLFAST_SMALL_BYTES, the ring


def initial_params() -> np.ndarray:
    return np.arange(ELEMENTS, dtype=np.float64) % 4093


def ddp_reference(history: list[tuple[int, int]], start_size: int) -> np.ndarray:
    """The parameters after STEPS steps, the world's size changing at each (resume step, size) of `history`."""
    params = initial_params()
    sizes = [(0, start_size), *history]
    for step in range(STEPS):
        size = [n for resumed, n in sizes if resumed <= step][-1]
        params = np.mod(params + sum(gradient(params, step, r, size) for r in range(size)), 4093)
    return params


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(initial_params()))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return -(self.w * c).sum()


def sum_hook(_, bucket):  # noqa: ANN001, ANN202
    """DDP's gradient allreduce as a plain sum on the default (ddlfast) group. (Unannotated: DDP refuses any
    annotation but its own classes, and this module's annotations are strings.)"""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def main() -> None:
    import ddlfast
    import ddlfast.elastic
    import ddlfast.torch as dt

    out, victim, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dt.init_process_group(backend="ddlfast")
    start_rank = ddlfast.rank()
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    state = ddlfast.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    history: list[tuple[int, int]] = []
    state.on_membership_change(lambda error: history.append((state.step, error.size)))

    @ddlfast.elastic.run
    def train(state: ddlfast.elastic.TorchState) -> None:
        # Built here, on the current default group: run() calls this again after a loss, on the rebuilt group.
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        ddp.register_comm_hook(None, sum_hook)
        assert dist.get_world_size() == ddlfast.size() and dist.get_rank() == ddlfast.rank()
        while state.step < STEPS:
            if start_rank == victim and state.step == kill_step:
                time.sleep(0.3)
                print(f"DEATH {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            c = gradient(model.w.detach().numpy(), state.step, ddlfast.rank(), ddlfast.size())
            ddp(torch.from_numpy(c)).backward()
            optimizer.step()
            with torch.no_grad():
                model.w.remainder_(4093)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    np.savez(os.path.join(out, f"rank{start_rank}.npz"), params=model.w.detach().numpy(),
             history=np.array(history, dtype=np.int64).reshape(-1, 2), size=dist.get_world_size(),
             rank=dist.get_rank())
    print(f"rank {start_rank} -> {dist.get_rank()} of {dist.get_world_size()}: done, history {history}", flush=True)


if __name__ == "__main__":
    main()
