"""Runs on every rank: ddlfast.torch under the common PyTorch recipes, each against a reference built from every
rank's own gradients (allgathered, averaged in NumPy): accumulation (no_sync, backward_passes_per_step), a
second backward, synchronize + clipping + skip_synchronize, GradScaler, sparse gradients, zero_grad's default,
LR schedulers and state_dict, buffer broadcast, unused parameters. Prints "<n> failures" on rank 0."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from case_runner import comm, fail, rank, report_and_exit, world

import ddlfast
import ddlfast.torch as dt


class WithUnused(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.unused = torch.nn.Linear(3, 3)  # never gets a gradient (last in parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def net(unused: bool = False, batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(7)
    layers: list[torch.nn.Module] = [torch.nn.Linear(12, 32), torch.nn.ReLU()]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    model = torch.nn.Sequential(*layers)
    return WithUnused(model) if unused else model


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank
    return torch.randn(n, 12, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


def local_grads(model: torch.nn.Module, loss: torch.Tensor) -> list[np.ndarray]:
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return [np.zeros(tuple(p.shape), np.float32) if g is None else g.to_dense().numpy().copy()
            for g, p in zip(grads, params, strict=True)]


def rank_average(grads: list[np.ndarray]) -> list[np.ndarray]:
    return [np.mean(a, axis=0) for a in zip(*comm.allgather(grads), strict=True)]


def check_grads(case: str, model: torch.nn.Module, expected: list[np.ndarray]) -> None:
    got = [np.zeros(tuple(p.shape), np.float32) if p.grad is None else p.grad.to_dense().numpy().copy()
           for p in model.parameters()]
    for i, (g, want) in enumerate(zip(got, expected, strict=True)):
        if not np.allclose(g, want, rtol=1e-5, atol=1e-6):
            fail(case, f"gradient {i} differs from the reference by {np.abs(g - want).max():.3g}")
    everyone = comm.allgather(got)
    if not all(np.array_equal(a, b) for other in everyone for a, b in zip(everyone[0], other, strict=True)):
        fail(case, "gradients differ across ranks")


def check_equal_across_ranks(case: str, tensors: list[torch.Tensor], what: str) -> None:
    mine = np.concatenate([t.detach().reshape(-1).double().numpy() for t in tensors])
    if not all(np.array_equal(mine, other) for other in comm.allgather(mine)):
        fail(case, f"{what} differ across ranks")


def case(function: Callable[[], None]) -> Callable[[], None]:
    try:
        function()
    except Exception as error:  # noqa: BLE001 - reported as a failure of this case
        fail(function.__name__, f"raised {type(error).__name__}: {error}")
    return function


# ---- accumulation --------------------------------------------------------------------------------------------

@case
def accumulation_no_sync() -> None:
    model = net()
    reducer = dt.distribute(model, bucket_bytes=2048, first_bucket_bytes=512)
    l1, l2 = loss_of(model, 1), loss_of(model, 2)
    g1, g2 = local_grads(model, l1), local_grads(model, l2)
    expected = rank_average([a + b for a, b in zip(g1, g2, strict=True)])
    with reducer.no_sync():
        l1.backward()
    if any(b.handle is not None for b in reducer.buckets):
        fail("accumulation_no_sync", "a bucket went on the wire inside no_sync()")
    l2.backward()
    reducer.synchronize()
    check_grads("accumulation_no_sync", model, expected)
    reducer.remove()


@case
def accumulation_backward_passes_per_step() -> None:
    model = net()
    reducer = dt.distribute(model, bucket_bytes=2048, first_bucket_bytes=512, backward_passes_per_step=3)
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer)
    for step in range(2):
        optimizer.zero_grad()
        losses = [loss_of(model, 10 * step + i) for i in range(3)]
        grads = [local_grads(model, loss) for loss in losses]
        expected = rank_average([sum(parts) for parts in zip(*grads, strict=True)])
        for loss in losses:
            loss.backward()
        reducer.synchronize()
        check_grads(f"backward_passes_per_step step {step}", model, expected)
        optimizer.step()
    check_equal_across_ranks("backward_passes_per_step", list(model.parameters()), "parameters")
    reducer.remove()


@case
def second_backward_is_an_error() -> None:
    model = net()
    reducer = dt.distribute(model)
    loss_of(model, 1).backward()
    try:
        loss_of(model, 2).backward()
    except ddlfast.DdlfastError as error:
        if "no_sync" not in str(error):
            fail("second_backward_is_an_error", f"unhelpful message: {error}")
    else:
        fail("second_backward_is_an_error", "a second backward() before step() did not raise")
    reducer.discard()
    reducer.remove()


# ---- synchronize, clipping, AMP ------------------------------------------------------------------------------

@case
def synchronize_clip_step() -> None:
    for skip in (False, True):
        model = net()
        reference = copy.deepcopy(model)
        reducer = dt.distribute(model, bucket_bytes=2048, first_bucket_bytes=512)
        optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), reducer)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
        for step in range(3):
            optimizer.zero_grad()
            loss = loss_of(model, step)
            averaged = rank_average(local_grads(model, loss))
            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            if skip:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()  # synchronize() already ran: the averaged gradients apply exactly once
            for p, g in zip(reference.parameters(), averaged, strict=True):
                p.grad = torch.from_numpy(g)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
            reference_opt.step()
        name = f"synchronize_clip_step(skip_synchronize={skip})"
        for p, want in zip(model.parameters(), reference.parameters(), strict=True):
            if not torch.allclose(p, want, rtol=1e-5, atol=1e-6):
                fail(name, "parameters differ from the single-process reference")
        if all(float(p.grad.abs().sum()) == 0 for p in model.parameters()):
            fail(name, "gradients were zeroed")
        check_equal_across_ranks(name, list(model.parameters()), "parameters")
        reducer.remove()


@case
def grad_scaler() -> None:
    model = net()
    reference = copy.deepcopy(model)
    reducer = dt.distribute(model)
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), reducer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = loss_of(model, 3)
    averaged = rank_average(local_grads(model, loss))
    scaler.scale(loss).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()
    with torch.no_grad():
        for p, g in zip(reference.parameters(), averaged, strict=True):
            p -= 0.5 * torch.from_numpy(g)
    for p, want in zip(model.parameters(), reference.parameters(), strict=True):
        if not torch.allclose(p, want, rtol=1e-5, atol=1e-6):
            fail("grad_scaler", "parameters differ from the reference")
    reducer.remove()


# ---- sparse gradients ----------------------------------------------------------------------------------------

class Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.embedding = torch.nn.Embedding(50, 6, sparse=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


@case
def sparse_gradients() -> None:
    model = Bag()
    reducer = dt.distribute(model)
    dense = dt.DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), reducer)
    sparse = dt.DistributedOptimizer(torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.1), reducer)
    for step in range(2):
        dense.zero_grad()
        sparse.zero_grad()
        gen = torch.Generator().manual_seed(step * 10 + rank)
        tokens = torch.randint(0, 50 if rank == 0 else 10, (4, 5), generator=gen)
        loss = model(tokens).square().mean()
        expected = rank_average(local_grads(model, loss))
        loss.backward()
        reducer.synchronize()
        if not model.embedding.weight.grad.is_sparse:
            fail("sparse_gradients", "the embedding's gradient is no longer sparse")
        check_grads(f"sparse_gradients step {step}", model, expected)
        dense.step()
        sparse.step()  # SparseAdam refuses dense gradients
    check_equal_across_ranks("sparse_gradients", list(model.parameters()), "parameters")
    reducer.remove()


@case
def undeclared_sparse_gradient_is_an_error() -> None:
    weight = torch.nn.Parameter(torch.randn(10, 4))
    model = torch.nn.ParameterList([weight])
    reducer = dt.distribute(model)
    weight.grad = None  # (a dense .grad, such as the bucket view, makes torch itself accumulate densely)
    try:
        torch.nn.functional.embedding(torch.tensor([1, 2]), weight, sparse=True).sum().backward()
    except ddlfast.DdlfastError as error:
        if "sparse_as_dense" not in str(error) or "0" not in str(error):
            fail("undeclared_sparse", f"unhelpful message: {error}")
    else:
        fail("undeclared_sparse", "a sparse gradient was accepted silently")
    reducer.remove()
    reducer = dt.distribute(model, sparse_as_dense=True)
    weight.grad = None
    tokens = torch.tensor([rank, 5])
    loss = torch.nn.functional.embedding(tokens, weight, sparse=True).sum()
    expected = rank_average(local_grads(model, loss))
    loss.backward()
    reducer.synchronize()
    check_grads("sparse_as_dense", model, expected)
    reducer.remove()


# ---- the optimizer as torch sees it --------------------------------------------------------------------------

@case
def optimizer_is_an_optimizer() -> None:
    model = net()
    reducer = dt.distribute(model)
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.8, momentum=0.9), reducer)
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(optimizer, torch.optim.SGD):
        fail("optimizer", "DistributedOptimizer is not a torch.optim.Optimizer / SGD")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    lrs = []
    for step in range(5):
        optimizer.zero_grad()
        loss_of(model, step).backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    if not np.allclose(lrs, [0.8, 0.4, 0.4, 0.2, 0.2]):
        fail("optimizer", f"StepLR gave learning rates {lrs}")
    if any(p.grad is not None for p in model.parameters()) is False:
        fail("optimizer", "no gradients after step")
    optimizer.zero_grad()
    if any(p.grad is not None for p in model.parameters()):
        fail("optimizer", "zero_grad() did not default to set_to_none=True")
    saved = copy.deepcopy(optimizer.state_dict())
    other = net()
    other.load_state_dict(model.state_dict())
    other_reducer = dt.distribute(other)
    restored = dt.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9), other_reducer)
    restored.load_state_dict(saved)
    for m, opt in ((model, optimizer), (other, restored)):
        loss_of(m, 9).backward()
        opt.step()
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        if not torch.equal(a, b):
            fail("optimizer", "a step after load_state_dict differs from the original optimizer's")
    reducer.remove()
    other_reducer.remove()


@case
def closure_optimizer() -> None:
    """LBFGS calls the closure several times and decides on its loss: against one process minimising the mean of
    every rank's loss."""
    model = net()
    reference = copy.deepcopy(model)
    reducer = dt.distribute(model)
    optimizer = dt.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), reducer)
    reference_opt = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=5)
    x, y = batch(5)
    shards = comm.allgather((x, y))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def reference_closure() -> torch.Tensor:
        reference_opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(reference(a), b) for a, b in shards) / world
        loss.backward()
        return loss

    for _ in range(2):
        optimizer.step(closure)
        reference_opt.step(reference_closure)
    for p, want in zip(model.parameters(), reference.parameters(), strict=True):
        if not torch.allclose(p, want, rtol=1e-4, atol=1e-5):
            fail("closure_optimizer", f"LBFGS differs from the reference by {(p - want).abs().max():.3g}")
    check_equal_across_ranks("closure_optimizer", list(model.parameters()), "parameters")
    reducer.remove()


# ---- buffers -------------------------------------------------------------------------------------------------

@case
def buffers_follow_rank_0() -> None:
    for broadcast in (True, False):
        model = net(batchnorm=True)
        reducer = dt.distribute(model, broadcast_buffers=broadcast)
        optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer)
        seen: list[list[np.ndarray]] = []
        model.register_forward_pre_hook(  # runs after the reducer's: what forward starts from
            lambda module, inputs, seen=seen: seen.append([b.numpy().copy() for b in module.buffers()]))
        after_rank0 = None
        drift = False
        for step in range(4):
            optimizer.zero_grad()
            loss_of(model, step).backward()
            optimizer.step()
            everyone = comm.allgather(seen[-1])
            equal = all(np.array_equal(a, b) for other in everyone for a, b in zip(everyone[0], other, strict=True))
            drift |= not equal
            if broadcast and not equal:
                fail("buffers", f"step {step}: ranks start forward from different BatchNorm statistics")
            if broadcast and after_rank0 is not None and not all(
                    np.array_equal(a, b) for a, b in zip(seen[-1], after_rank0, strict=True)):
                fail("buffers", f"step {step}: forward did not start from rank 0's statistics")
            after_rank0 = comm.bcast([b.numpy().copy() for b in model.buffers()], root=0)
        if not broadcast and world > 1 and not drift:
            fail("buffers", "broadcast_buffers=False: expected the statistics to drift apart")
        reducer.remove()


# ---- unused parameters ---------------------------------------------------------------------------------------

@case
def unused_parameters_do_not_stall() -> None:
    for find in (False, True):
        name = f"unused(find_unused_parameters={find})"
        model = net(unused=True)
        # Bucket 0 holds the unused layer (buckets are filled in reverse order of parameters()).
        reducer = dt.distribute(model, bucket_bytes=2048, first_bucket_bytes=64, find_unused_parameters=find)
        first = next(model.parameters())  # the last gradient backward produces
        on_wire = []
        first.register_post_accumulate_grad_hook(
            lambda p, on_wire=on_wire, reducer=reducer: on_wire.append(
                sum(b.handle is not None for b in reducer.buckets)))
        optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer)
        for step in range(2):
            optimizer.zero_grad()
            loss = loss_of(model, step)
            expected = rank_average(local_grads(model, loss))
            loss.backward()
            if not all(b.handle is not None for b in reducer.buckets):
                fail(name, "buckets still wait for step() after backward")
            reducer.synchronize()
            check_grads(f"{name} step {step}", model, expected)
            optimizer.step()
        if find and not on_wire[-1] >= len(reducer.buckets) - 1:
            fail(name, f"only {on_wire[-1]} of {len(reducer.buckets)} buckets on the wire during backward")
        check_equal_across_ranks(name, list(model.parameters()), "parameters")
        reducer.remove()


report_and_exit()
