"""The per-rank disagreement messages, built without MPI from what each rank would send."""

from __future__ import annotations

import numpy as np

from ddlfast.agreement import describe, disagreement_message


def host_layout(dtype: object, shape: tuple, op: str = "sum") -> tuple:
    return (op, (4,), ((np.dtype(dtype), shape),), ("none",), False)


def gpu_layout(dtype: str, shape: tuple) -> tuple:
    return ("sum", (4,), ((f"cuda {dtype}", shape),), ("none",), False)


def test_shape_difference_names_the_odd_rank() -> None:
    layouts = [host_layout(np.float32, (1000,))] * 4
    layouts[1] = host_layout(np.float32, (1007,))
    message = disagreement_message([describe(layout) for layout in layouts])
    assert "ranks 0,2,3 passed float32[1000]" in message and "rank 1 passed float32[1007]" in message


def test_gpu_and_host_arrays_mixed_across_ranks_are_described() -> None:
    layouts = [gpu_layout("float32", (10,)), host_layout(np.float32, (10,))]
    message = disagreement_message([describe(layout) for layout in layouts])
    assert "cuda float32" in message and "rank 1 passed float32[10]" in message
