"""The torch conventions that need no second rank (issue 25 item 3): op= names from mpi4py and torch, the one
host intake for torch CPU tensors, and no torch import (nor profiler cost) for users who do not import torch.
tests/mpi/test_torch_way.py runs them across ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mpi4py import MPI

from ddlfast.buffers.host import broadcast_target, host_buffer
from ddlfast.errors import DdlfastError
from ddlfast.ops import canonical_op, check_op


@pytest.mark.parametrize(("op", "name"), [(MPI.SUM, "sum"), (MPI.MIN, "min"), (MPI.MAX, "max"),
                                          (MPI.PROD, "product"), ("average", "average")])
def test_mpi_ops_have_ddlfast_names(op: object, name: str) -> None:
    assert canonical_op(op) == name
    assert check_op(op, 0) == name


def test_torch_reduce_ops_have_ddlfast_names() -> None:
    dist = pytest.importorskip("torch.distributed")
    ops = dist.ReduceOp
    for op, name in ((ops.SUM, "sum"), (ops.AVG, "average"), (ops.MIN, "min"), (ops.MAX, "max"),
                     (ops.PRODUCT, "product")):
        assert check_op(op, 0) == name


@pytest.mark.parametrize("op", [MPI.BAND, MPI.LOR, "mean", None, 3])
def test_other_ops_are_refused_with_the_accepted_ones(op: object) -> None:
    with pytest.raises(DdlfastError, match=r"rank 2 is not one of sum, average, min, max, product .*MPI\.SUM"):
        check_op(op, 2)


def test_torch_bitwise_op_is_refused() -> None:
    dist = pytest.importorskip("torch.distributed")
    with pytest.raises(DdlfastError, match="ReduceOp.SUM, AVG"):
        check_op(dist.ReduceOp.BAND, 0)


def test_torch_cpu_tensors_share_memory_through_the_intake() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float32, requires_grad=True)
    buffer = host_buffer(tensor, "array 0 on rank 0")
    assert buffer.count == 6 and buffer.pointer == tensor.data_ptr()
    buffer.array[...] = 7  # the collective writes here: the tensor sees it
    assert torch.equal(tensor.detach(), torch.full((6,), 7.0))
    target = broadcast_target(torch.zeros(3, dtype=torch.bfloat16), "broadcast on rank 0")
    assert target.dtype.name == "bfloat16" and target.nbytes == 6


def test_torch_tensors_are_checked_like_arrays() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(DdlfastError, match="not C-contiguous"):
        host_buffer(torch.zeros(4, 4).t(), "array 0 on rank 0")
    with pytest.raises(DdlfastError, match="array 0 on rank 0 is a torch tensor of torch.float8_e4m3fn with no NumPy"):
        host_buffer(torch.zeros(2, dtype=torch.float8_e4m3fn), "array 0 on rank 0")


def test_no_torch_import_without_torch() -> None:
    program = ("import sys, numpy as np, ddlfast; ddlfast.allreduce(np.ones(4)); ddlfast.broadcast(np.ones(2)); "
               "ddlfast.allreduce(np.ones(2), op=ddlfast.api.MPI.SUM); print(sorted(m for m in sys.modules "
               "if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
