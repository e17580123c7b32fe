"""The reduction ops, in one table: names as the API takes them, codes as the core takes them
(ReduceOp in src/common/dtype.h). Their exact rules (nan, signed zeros, overflow, wrapping) are in
docs/numerics.md. `op=` also takes mpi4py's and torch.distributed's op objects (canonical_op); neither module is
imported for it: an op object of theirs means its module already is."""

from __future__ import annotations

import sys

from ddlfast.errors import DdlfastError

OPS = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4}
# Ops a compressed wire (fp16/bf16/auto) can carry exactly as documented: min/max are the wire rounding of the
# exact result (rounding is monotonic); a product would be rounded at every hop, so it is refused.
WIRE_OPS = ("sum", "average", "min", "max")
# Ops error feedback and user codecs apply to: they reduce by summing.
SUMMING_OPS = ("sum", "average")
# The same ops under mpi4py's and torch.distributed.ReduceOp's attribute names.
_MPI_NAMES = {"SUM": "sum", "MIN": "min", "MAX": "max", "PROD": "product"}
_TORCH_NAMES = {"SUM": "sum", "AVG": "average", "MIN": "min", "MAX": "max", "PRODUCT": "product"}


def canonical_op(op: object) -> object:
    """ddlfast's name for `op` when it is mpi4py's MPI.SUM/MIN/MAX/PROD or a torch.distributed.ReduceOp member
    (SUM, AVG, MIN, MAX, PRODUCT); anything else as it is (check_op then refuses what is not a name)."""
    if isinstance(op, str):
        return op
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(op, mpi.Op):
        for attribute, name in _MPI_NAMES.items():
            if op == getattr(mpi, attribute):
                return name
        return op
    distributed = sys.modules.get("torch.distributed")
    reduce_op = getattr(distributed, "ReduceOp", None) if distributed is not None else None
    if reduce_op is not None and isinstance(op, (reduce_op, reduce_op.RedOpType)):
        for attribute, name in _TORCH_NAMES.items():
            if op == getattr(reduce_op, attribute):
                return name
    return op


def check_op(op: object, rank: int) -> str:
    """ddlfast's name for `op` (canonical_op); a DdlfastError naming the valid ops when it has none."""
    name = canonical_op(op)
    if not isinstance(name, str) or name not in OPS:
        raise DdlfastError(f"op={op!r} on rank {rank} is not one of {', '.join(OPS)} (or mpi4py's MPI.SUM, "
                           "MPI.MIN, MPI.MAX, MPI.PROD, or torch.distributed.ReduceOp.SUM, AVG, MIN, MAX, PRODUCT)")
    return name
