"""Collectives are numbered as users count them (issue 25 item 4): the context's creation agreement is not one of
theirs, so the user's first call is "collective #1" in an error, in a stall census, and in the flight records;
the second is #2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.launcher import run_mpi

PROGRAM = '''
import sys
import numpy as np
import ddlfast
from ddlfast import api

rank = ddlfast.rank()
case = sys.argv[1]
if case == "mismatch":  # bad input on one rank in the first call: every rank names collective #1
    x = np.ones(10, np.float32)
    try:
        ddlfast.fused_allreduce([x, x] if rank == 1 else [x, np.ones(10, np.float32)])
    except ddlfast.DdlfastConsistentError as error:
        assert str(error).startswith("collective #1 could not run: rank 1: arrays 0 and 1"), str(error)
    else:
        raise SystemExit(f"rank {rank}: no error")
    ddlfast.allreduce(np.ones(4, np.float32))  # the second call is #2: in the flight records too
    records = api.default_context()._state.flight.records()
    assert [r["sequence"] for r in records][-2:] == [1, 2], records
    print(f"rank {rank} ok")
else:  # a stall in the first call: the census names collective #1
    if rank == 1:
        api.default_context()  # it creates the context, then never calls: rank 0 stalls in its first collective
        import time
        time.sleep(6)
        print(f"rank {rank} ok")
    else:
        api.default_context()
        try:
            ddlfast.allreduce(np.ones(4, np.float32))
        except ddlfast.DdlfastError as error:
            assert "in collective #1" in str(error), str(error)
            print(f"rank {rank} ok")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["mismatch", "stall"])
def test_the_first_call_is_collective_1(tmp_path: Path, case: str) -> None:
    program = tmp_path / "collective_numbers_program.py"
    program.write_text(PROGRAM)
    result = run_mpi(2, str(program), case, timeout=120, env={"DDLFAST_TIMEOUT_S": "2"})
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout, result.stdout + result.stderr
