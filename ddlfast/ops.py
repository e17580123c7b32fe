"""The reduction ops, in one table: names as the API takes them, codes as the core takes them
(ReduceOp in src/common/dtype.h). Their exact rules (nan, signed zeros, overflow, wrapping) are in
docs/numerics.md."""

from __future__ import annotations

from ddlfast.errors import DdlfastError

OPS = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4}
# Ops a compressed wire (fp16/bf16/auto) can carry exactly as documented: min/max are the wire rounding of the
# exact result (rounding is monotonic); a product would be rounded at every hop, so it is refused.
WIRE_OPS = ("sum", "average", "min", "max")
# Ops error feedback and user codecs apply to: they reduce by summing.
SUMMING_OPS = ("sum", "average")


def check_op(op: object, rank: int) -> None:
    """Raise a DdlfastError naming the valid ops when `op` is not one of them."""
    if not isinstance(op, str) or op not in OPS:
        raise DdlfastError(f"op={op!r} on rank {rank} is not one of {', '.join(OPS)}")
