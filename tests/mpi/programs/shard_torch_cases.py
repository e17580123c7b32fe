"""Runs on every rank: reduce_scatter and allgather of torch CPU tensors (through their NumPy view): the
results are torch tensors of the input's dtype (bfloat16 too), out= tensors are filled and returned."""

from __future__ import annotations

import torch
from harness import failures, rank, report_and_exit, world

import ddlfast


def check(name: str, condition: bool, detail: object) -> None:
    if not condition:
        failures.append(f"rank {rank} {name}: {detail}")


t = torch.arange(4 * world, dtype=torch.float32).reshape(2 * world, 2) * (rank + 1)
out = ddlfast.reduce_scatter(t)
want = torch.arange(4 * world, dtype=torch.float32).reshape(2 * world, 2)[2 * rank:2 * rank + 2] * sum(
    range(1, world + 1))
check("float32 reduce_scatter", isinstance(out, torch.Tensor) and torch.equal(out, want), out)
b = torch.ones(world * 3, dtype=torch.bfloat16) * (rank + 1)
out = ddlfast.reduce_scatter(b, op="average")
check("bfloat16 average", out.dtype == torch.bfloat16 and torch.equal(
    out, torch.full((3,), (world + 1) / 2, dtype=torch.bfloat16)), out)
gathered = ddlfast.allgather(torch.tensor([rank, rank], dtype=torch.int64))
check("int64 allgather", torch.equal(gathered, torch.arange(world).repeat_interleave(2)), gathered)
target = torch.zeros(2 * world, dtype=torch.int64)
returned = ddlfast.allgather(torch.tensor([rank, rank]), out=target)
check("allgather out=", returned is target and torch.equal(target, gathered), target)
report_and_exit()
