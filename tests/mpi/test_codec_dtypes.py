"""A codec's dtype mistake is refused like any bad input (issue 25 item 4): TopKCodec declares float32, so float64
arrays (on every rank alike: the agreement itself sees nothing wrong) raise DdlfastError on every rank before
anything moves, and the context stays usable. Before, compress() raised after the agreement and the context
ended with DdlfastBrokenError."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.launcher import run_mpi

PROGRAM = '''
import numpy as np
import ddlfast
from ddlfast.compression import TopKCodec

rank = ddlfast.rank()
grads = [np.ones(100, dtype=np.float64)]
try:
    ddlfast.fused_allreduce(grads, compression=TopKCodec(0.1))
except ddlfast.DdlfastBrokenError as error:
    raise SystemExit(f"rank {rank}: the context broke: {error}")
except ddlfast.DdlfastError as error:
    assert "is float64, but TopKCodec takes float32 arrays" in str(error), str(error)
else:
    raise SystemExit(f"rank {rank}: not refused")
after = np.full(8, rank + 1.0, dtype=np.float32)
ddlfast.fused_allreduce([after, np.zeros(3, np.float32)], compression=TopKCodec(1.0))  # the context still works
assert np.array_equal(after, np.full(8, 3.0, dtype=np.float32)), after
print(f"rank {rank} ok")
'''


@pytest.mark.mpi
def test_codec_dtype_mistake_is_refused_on_every_rank(tmp_path: Path) -> None:
    program = tmp_path / "codec_dtype.py"
    program.write_text(PROGRAM)
    result = run_mpi(2, str(program), timeout=120, env={"DDLFAST_TIMEOUT_S": "30"})
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout, result.stdout + result.stderr
