"""The 16-bit DDP hooks' error on real gradients: ddlfast.torch.fp16_hook against torch's own fp16_compress_hook
(real ranks: torch's gloo for DDP and for torch's hook).

    .venv/bin/mpiexec -n 4 .venv/bin/python bench/fp16_hook_error.py [--steps 20] [--seeds 0,1,2] [--bucket-kib 4,1024]

Rank 0 prints, per DDP bucket cap (4 KiB: a bucket per parameter, the biases below DDLFAST_SMALL_BYTES; 1024 KiB:
the whole model in one bucket), the median over the seeds and each seed's number of:

- gradients: both hooks average the same buckets, paired, along the fp32 trajectory (a hook that runs both on a
  copy of each bucket and hands DDP the exact average), ||hook - exact|| / ||exact|| over every bucket of every
  step, `exact` the float64 average. This is the hooks' error itself.
- parameters: ||params - fp32 params|| / ||fp32 params - initial params|| after training with each hook alone
  (the distance travelled in the denominator, so the number measures the updates, not the weights' size). The
  trajectories part where a rounding flips a ReLU or a step, and from there grow apart at the training's own
  rate, so this number jumps with the seed and the step count for both hooks alike (--seeds shows it).

and whether every rank holds the same bits.

No `from __future__ import annotations` here: DDP checks a hook's annotations by identity."""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddlfast.torch as dt  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
HOOKS = {"ddlfast fp16_hook": dt.fp16_hook, "torch fp16_compress_hook": default_hooks.fp16_compress_hook}


def model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + RANK + 100_000 * seed)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def train(ddp: DDP, steps: int, seed: int) -> np.ndarray:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(step, seed)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return np.concatenate([p.detach().numpy().ravel() for p in ddp.parameters()]).astype(np.float64)


class PairedHooks:
    """A DDP hook that averages each bucket with every hook of HOOKS on a copy of it, keeps their squared errors
    against the exact average, and hands DDP the exact average (so every step's buckets are the fp32 run's)."""

    def __init__(self) -> None:
        self.squared_errors = dict.fromkeys(HOOKS, 0.0)
        self.squared_exact = 0.0
        self.same_on_every_rank = True
        self.state = dt.HookState()

    def hook(self, _: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        mine = buffer.detach().clone()
        exact = np.mean(COMM.allgather(mine.numpy().astype(np.float64)), axis=0)
        self.squared_exact += float(np.sum(exact**2))
        for name, hook in HOOKS.items():
            buffer.copy_(mine)
            got = hook(self.state if name.startswith("ddlfast") else None, bucket).wait().numpy().astype(np.float64)
            self.squared_errors[name] += float(np.sum((got - exact) ** 2))
            self.same_on_every_rank &= all(np.array_equal(got, other) for other in COMM.allgather(got))
        buffer.copy_(torch.from_numpy(exact.astype(np.float32)))
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future


def one_run(bucket_kib: int, steps: int, seed: int) -> tuple[dict[str, float], dict[str, float], bool]:
    """(gradient errors, parameter distances, every rank the same bits) of each hook for one cap and seed."""
    initial = np.concatenate([p.detach().numpy().ravel() for p in model().parameters()]).astype(np.float64)
    paired = PairedHooks()
    ddp = DDP(model(), bucket_cap_mb=bucket_kib / 1024)
    ddp.register_comm_hook(None, paired.hook)
    exact = train(ddp, steps, seed)
    gradients = {name: float(np.sqrt(error / paired.squared_exact)) for name, error in paired.squared_errors.items()}
    travelled = np.linalg.norm(exact - initial)
    same = paired.same_on_every_rank
    parameters = {}
    for name, hook in HOOKS.items():
        ddp = DDP(model(), bucket_cap_mb=bucket_kib / 1024)
        ddp.register_comm_hook(dt.HookState() if name.startswith("ddlfast") else None, hook)
        got = train(ddp, steps, seed)
        same &= all(np.array_equal(got, other) for other in COMM.allgather(got))
        parameters[name] = float(np.linalg.norm(got - exact) / travelled)
    return gradients, parameters, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2", help="the data's seeds, comma-separated")
    parser.add_argument("--bucket-kib", default="4,1024", help="DDP bucket caps (KiB), comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dt.init_process_group("gloo")
    seeds = [int(s) for s in args.seeds.split(",")]
    for bucket_kib in (int(b) for b in args.bucket_kib.split(",")):
        runs = [one_run(bucket_kib, args.steps, seed) for seed in seeds]
        if RANK != 0:
            continue
        print(f"P={WORLD} buckets {bucket_kib} KiB, {args.steps} steps, seeds {args.seeds}"
              f"{'' if all(same for _, _, same in runs) else ' (RANKS DIFFER)'}")
        for index, what in ((0, "gradients"), (1, "parameters")):
            cells = [f"{name} {np.median([run[index][name] for run in runs]):.3e} "
                     f"[{' '.join(f'{run[index][name]:.2e}' for run in runs)}]" for name in HOOKS]
            print(f"  {what + ':':<12} median [per seed]  {';  '.join(cells)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
