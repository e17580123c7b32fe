"""The engine's trust defects of issue 22 on real ranks (tests/mpi/programs/trust_engine_cases.py has the cases):
fused reduce-scatter/allgather of several arrays above DDLFAST_SMALL_BYTES, validation of many arrays, broadcasts
and object collectives in bounded pieces, the average of signed zeros on every path, and faults on one rank."""

from __future__ import annotations

import numpy as np
import pytest

from ddlfast.engine import control
from ddlfast.engine.shards import _check_outputs_apart
from ddlfast.errors import DdlfastError
from tests.mpi.launcher import run_mpi

# The big-message paths with many chunks (4 KiB chunks, a 1 KiB small-message limit), beside the defaults.
SMALL_CHUNKS = {"DDLFAST_SMALL_BYTES": "1KiB", "DDLFAST_CHUNK_BYTES": "4KiB"}


def run_cases(ranks: int, *sections: str, env: dict | None = None) -> None:
    result = run_mpi(ranks, "trust_engine_cases.py", *sections, timeout=600, env=env)
    assert " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fused_shards_above_the_small_limit(ranks: int) -> None:
    """Several arrays of one dtype, mixed dtypes, uneven counts=, out=, async, fp16/bf16 on the wire: each rank
    cuts the ring's messages where the others do (they used to fail with 'Message truncated')."""
    run_cases(ranks, "shards")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3])
def test_fused_shards_with_many_chunks(ranks: int) -> None:
    run_cases(ranks, "shards", env=SMALL_CHUNKS)


@pytest.mark.mpi
def test_fused_shards_on_a_2x2_torus() -> None:
    run_cases(4, "shards", env={"DDLFAST_RING_DIMS": "2x2"})


@pytest.mark.mpi
@pytest.mark.parametrize("env", [None, SMALL_CHUNKS], ids=["default", "small-chunks"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_average_of_signed_zeros_on_every_path(ranks: int, env: dict | None) -> None:
    run_cases(ranks, "zeros", env=env)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_average_of_signed_zeros_on_gpu_arrays(ranks: int) -> None:
    """The GPU executor on emulated device lanes (no GPU needed): its small path and its ring."""
    run_cases(ranks, "gpu")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_in_bounded_pieces(ranks: int) -> None:
    run_cases(ranks, "pieces")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_faults_on_one_rank(ranks: int) -> None:
    run_cases(ranks, "faults")


@pytest.mark.mpi
def test_twenty_thousand_arrays_complete() -> None:
    """Validation is one sorted sweep: 20,000 arrays take well under a second to check (no time is asserted)."""
    run_cases(2, "many")


def test_pieces_cover_every_byte_once() -> None:
    for nbytes in (0, 1, 999, 1000, 1001, 5000):
        pieces = control._pieces(nbytes, 1000)
        assert pieces[0][0] == 0 and pieces[-1][1] == nbytes
        assert all(stop - start <= 1000 for start, stop in pieces)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    assert control.MAX_MESSAGE_BYTES < 2**31  # an MPI-3 int count


def test_output_overlaps_are_found_in_one_sweep() -> None:
    base = np.zeros(100, np.float32)
    inputs = [base[0:10], base[0:10], base[50:60]]  # inputs may repeat: they are only read
    _check_outputs_apart([np.zeros(5, np.float32), np.zeros(5, np.float32)], inputs, 0)
    with pytest.raises(DdlfastError, match="out 1 on rank 3 overlaps array 2"):
        _check_outputs_apart([np.zeros(5, np.float32), base[55:58]], inputs, 3)
    with pytest.raises(DdlfastError, match="out 0 on rank 0 overlaps out 1"):
        other = np.zeros(10, np.float32)
        _check_outputs_apart([other[0:6], other[4:8]], inputs, 0)
    with pytest.raises(DdlfastError, match="out 0 on rank 0 overlaps array 0"):
        _check_outputs_apart([base[9:12]], inputs, 0)
    _check_outputs_apart([np.zeros(0, np.float32), base[20:30]], inputs, 0)  # empty outputs share nothing
