"""Runs on every rank: DistributedDataParallel, unchanged, on the "ddlfast" torch.distributed backend.
- plain DDP equals single-process training on the global batch (computed on every rank), parameters identical
  on every rank;
- no_sync, find_unused_parameters and static_graph give the parameters DDP gives on a gloo group of the same
  ranks (bit-identical at 2 ranks, fp32 rounding beyond);
- broadcast_buffers: every forward starts from rank 0's buffers;
- a failed collective in backward (ranks bucket differently) raises on every rank, through DDP;
- argv[1] == "join": join() with uneven inputs (DDP agrees on ranks with a MAX allreduce: needs "max" in
  ddlfast) against a single-process reference of DDP's join semantics.
Prints "<n> failures" on rank 0."""

from __future__ import annotations

import copy
import sys

import numpy as np
import torch
import torch.distributed as dist
from backend_common import comm, fail, rank, report_and_exit, world
from torch.nn.parallel import DistributedDataParallel as DDP

from ddlfast.integrations import torch_backend

which = sys.argv[1] if len(sys.argv) > 1 else "core"
STEPS = 3


class Net(torch.nn.Module):
    """A small MLP; `extra` adds a layer that only some ranks' forwards use (an unused parameter elsewhere)."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                        torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.extra = torch.nn.Linear(5, 4) if extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        return self.body(x) + self.extra(x[:, :5]) if use_extra else self.body(x)


def data(step: int, of_rank: int = rank) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + of_rank)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def flat(model: torch.nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])


def same_everywhere(case: str, values: np.ndarray) -> None:
    if not all(np.array_equal(values, other) for other in comm.allgather(values)):
        fail(case, "parameters differ across ranks")


def train(group: object, *, accumulate: bool = False, find_unused: bool = False, static_graph: bool = False
          ) -> np.ndarray:
    ddp = DDP(Net(find_unused), bucket_cap_mb=0.01, process_group=group, find_unused_parameters=find_unused,
              static_graph=static_graph)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        if accumulate:
            with ddp.no_sync():
                x, y = data(1000 + step)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = data(step)
        use = find_unused and rank == 0 and step % 2 == 1  # the extra layer: rank 0, odd steps only
        torch.nn.functional.cross_entropy(ddp(x, use), y).backward()
        optimizer.step()
    return flat(ddp)


def single_process() -> np.ndarray:
    """The same steps on one process over the global batch (every rank's data): DDP's average of the ranks'
    mean losses is the mean loss over the global batch, as the ranks' batches are of equal size."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = [data(step, r) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return flat(model)


def run(case: str, function: object) -> None:
    try:
        function()
    except Exception as error:  # noqa: BLE001 - reported as this case's failure
        fail(case, f"raised {type(error).__name__}: {error}")


if which == "core":
    gloo = dist.new_group(list(range(world)), backend="gloo")

    def plain() -> None:
        got, want = train(None), single_process()
        if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            fail("plain", f"differs from single-process training by {np.abs(got - want).max():.3g}")
        same_everywhere("plain", got)

    run("plain", plain)

    for options in ({"accumulate": True}, {"find_unused": True}, {"static_graph": True}):
        name = ", ".join(options)

        def against_gloo(name: str = name, options: dict = options) -> None:
            got, want = train(None, **options), train(gloo, **options)
            if world == 2 and not np.array_equal(got, want):
                fail(name, f"not bit-identical to DDP on gloo (max difference {np.abs(got - want).max():.3g})")
            elif not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                fail(name, f"differs from DDP on gloo by {np.abs(got - want).max():.3g}")
            same_everywhere(name, got)

        run(name, against_gloo)

    def broadcast_buffers() -> None:
        """Each forward starts from rank 0's buffers (here all zero), then updates them with the local batch."""
        model = torch.nn.Sequential(torch.nn.Linear(16, 6), torch.nn.BatchNorm1d(6))
        ddp = DDP(model)
        with torch.no_grad():
            model[1].running_mean.fill_(float(rank))  # rank 0's: zeros
            model[1].running_var.fill_(1.0 + rank)
            model[1].num_batches_tracked.fill_(5 * rank)
        x, _ = data(50)
        calls = []
        original = torch_backend.ProcessGroupDdlfast.broadcast
        torch_backend.ProcessGroupDdlfast.broadcast = lambda *a: calls.append(len(a[1])) or original(*a)
        try:
            ddp(x).sum().backward()
        finally:
            torch_backend.ProcessGroupDdlfast.broadcast = original
        if calls != [3]:  # running_mean, running_var (float32) and num_batches_tracked (int64) in one broadcast
            fail("broadcast_buffers", f"DDP's buffer sync made broadcasts of {calls} tensors, not one of 3")
        hidden = model[0](x).detach()
        want_mean = 0.1 * hidden.mean(0)  # momentum 0.1 from rank 0's zeros
        want_var = 0.9 * 1.0 + 0.1 * hidden.var(0, unbiased=True)
        if not (torch.allclose(model[1].running_mean, want_mean, atol=1e-6)
                and torch.allclose(model[1].running_var, want_var, atol=1e-6)
                and model[1].num_batches_tracked.item() == 1):
            fail("broadcast_buffers", f"running_mean {model[1].running_mean[:2].tolist()}, expected "
                 f"{want_mean[:2].tolist()}; num_batches_tracked {model[1].num_batches_tracked.item()}")

    run("broadcast_buffers", broadcast_buffers)

    def broadcast_coalesced_in_chunks() -> None:
        """Past PACK_BYTES per broadcast, DDP's tensors go in several packed broadcasts, each delivered whole."""
        tensors = [torch.full((10 + i,), float(rank + i)) for i in range(5)] + [torch.tensor([rank, 7 * rank])]
        saved = torch_backend.PACK_BYTES
        torch_backend.PACK_BYTES = 100
        try:
            dist._broadcast_coalesced(dist.group.WORLD, tensors, 2**20, world - 1)
        finally:
            torch_backend.PACK_BYTES = saved
        want = [torch.full((10 + i,), float(world - 1 + i)) for i in range(5)] + [torch.tensor([world - 1,
                                                                                               7 * (world - 1)])]
        if not all(torch.equal(t, w) for t, w in zip(tensors, want, strict=True)):
            fail("broadcast in chunks", f"got {[t.tolist() for t in tensors]}")

    run("broadcast in chunks", broadcast_coalesced_in_chunks)

    def sync_batchnorm_statistics() -> None:
        """SyncBatchNorm's kernels are CUDA-only in torch; on the CPU its collectives are checked: the ranks'
        (mean, var, count) through all_gather_into_tensor combine to the global batch's statistics."""
        x, _ = data(60)
        local = torch.stack([x.mean(0), x.var(0, unbiased=False), torch.full((16,), float(len(x)))])
        gathered = torch.empty(world * 3, 16)
        dist.all_gather_into_tensor(gathered, local)
        stats = gathered.view(world, 3, 16)
        count = stats[:, 2].sum(0)
        mean = (stats[:, 0] * stats[:, 2]).sum(0) / count
        var = ((stats[:, 1] + (stats[:, 0] - mean) ** 2) * stats[:, 2]).sum(0) / count
        everything = torch.cat([data(60, r)[0] for r in range(world)])
        if not (torch.allclose(mean, everything.mean(0), atol=1e-5)
                and torch.allclose(var, everything.var(0, unbiased=False), atol=1e-5)):
            fail("sync batchnorm statistics", "differ from the global batch's")
        if torch.cuda.is_available():
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
                torch.nn.Linear(16, 6), torch.nn.BatchNorm1d(6))).cuda()
            ddp = DDP(model)
            ddp(x.cuda()).sum().backward()
            same_everywhere("SyncBatchNorm", model[1].running_mean.cpu().numpy())

    run("sync batchnorm", sync_batchnorm_statistics)

    def failure_in_backward() -> None:
        """Rank 0 alone looks for unused parameters, so its reducer allreduces an int32 map of used parameters
        where the others allreduce the next step's gradients: backward raises on every rank, through DDP's C++
        reducer and the Work's future."""
        ddp = DDP(Net(), find_unused_parameters=rank == 0)
        x, y = data(70)
        try:
            for _ in range(2):
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        except RuntimeError as error:
            if "rank 0 passed" not in str(error):  # the agreement's account of who passed what
                fail("failure in backward", f"raised without ddlfast's message: {error}")
        else:
            fail("failure in backward", "backward() returned")

    run("failure in backward", failure_in_backward)

if which == "join":
    def join_uneven() -> None:
        """Rank r has 2 + r batches; joined ranks contribute zeros, divided by the initial world size."""
        model = Net()
        ddp = DDP(copy.deepcopy(model))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.join():
            for step in range(2 + rank):
                optimizer.zero_grad()
                x, y = data(step)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
        reference = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2 + world - 1):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for r in range(world):
                if step < 2 + r:
                    model.zero_grad()
                    x, y = data(step, r)
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    grads = [g + p.grad / world for g, p in zip(grads, model.parameters(), strict=True)]
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            reference.step()
        got, want = flat(ddp), flat(model)
        if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            fail("join", f"differs from the reference by {np.abs(got - want).max():.3g}")
        same_everywhere("join", got)

    run("join", join_uneven)

report_and_exit()
