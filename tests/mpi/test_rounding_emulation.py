"""The rounding emulation (bench/rounding_error.py) is exact: its bits equal real runs' on every ring shape of
P, every ring/direct choice per dimension, uncompressed and on the fp16/bf16 wire, and for reproducible=True; and
the fp16 DDP hook's average is nearer the exact one than torch's fp16_compress_hook's at every P, by the API's
choice and on the flat ring and direct reduce-scatter (tests/mpi/programs/rounding_cases.py). Its numbers at small
p: tests/unit/test_rounding_error.py."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 8])
def test_emulation_bits_equal_real_runs(ranks: int) -> None:
    result = run_mpi(ranks, "rounding_cases.py", timeout=300)
    assert " 0 failures" in result.stdout, result.stdout
