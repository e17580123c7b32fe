"""ddlfast.bench as nccl-tests users expect it (issue 25 item 6): -b/-e/-f sweeps beside --sizes, rows streamed
as they are measured, the closing lines, --json-file beside the table; --sizes and --json as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddlfast import bench
from ddlfast.errors import DdlfastError
from tests.mpi.launcher import mpi_command


@pytest.mark.parametrize(("begin", "end", "factor", "sizes"), [
    ("8", "64", 2, [8, 16, 32, 64]),
    ("4KiB", "64KiB", 4, [4096, 16384, 65536]),
    ("1KiB", "5KiB", 2, [1024, 2048, 4096]),  # the end need not be on the sweep
    ("1MiB", None, None, [1 << 20]),
    (None, "2KiB", None, [2048]),
])
def test_sweep_sizes(begin: str | None, end: str | None, factor: int | None, sizes: list[int]) -> None:
    assert bench.sweep_sizes(begin, end, factor) == sizes


@pytest.mark.parametrize(("begin", "end", "factor", "message"), [
    ("64", "8", 2, "-e 64B is below -b|-e 8B is below -b 64B"),
    ("8", "64", 1, "factor must be an integer >= 2"),
    (None, None, 2, "-f needs -b and/or -e"),
    ("lots", "64", 2, "-b='lots' is not a byte size"),
])
def test_sweep_sizes_refuses(begin: str | None, end: str | None, factor: int | None, message: str) -> None:
    with pytest.raises(DdlfastError, match=message):
        bench.sweep_sizes(begin, end, factor)


def test_rows_reach_on_row_as_they_are_measured() -> None:
    seen: list[int] = []
    rows = bench.run_bench([64, 128, 256], iters=1, warmup=0,
                           on_row=lambda row: seen.append(row["size_bytes"]))
    assert seen == [64, 128, 256] == [row["size_bytes"] for row in rows]


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_both_libraries_run_on_one_buffer(monkeypatch: pytest.MonkeyPatch, collective: str) -> None:
    """Every timed call, ddlfast's and MPI's, gets the same buffer (where two buffers sit in memory moved the
    4-16 MiB rows by up to 30 %), and the last results still reach --check: a wrong result is still caught."""
    given: list[tuple[str, int]] = []
    real_calls = bench._calls

    def recording_calls(*args, **kwargs):
        ours, theirs = real_calls(*args, **kwargs)

        def record(name, call):
            def run(out):
                given.append((name, out.__array_interface__["data"][0]))
                return call(out)
            return run
        return record("ddlfast", ours), record("mpi", theirs)

    monkeypatch.setattr(bench, "_calls", recording_calls)
    rows = bench.run_bench([4096, 3 << 20], iters=3, warmup=1, check=True, collective=collective)
    assert [row["check"] for row in rows] == ["ok", "ok"]
    assert [name for name, _ in given] == ["ddlfast", "mpi"] * 8
    assert all(given[i][1] == given[i + 1][1] for i in range(0, len(given), 2))

    def wrong_calls(*args, **kwargs):  # ddlfast's call writes a wrong value after its collective
        ours, theirs = real_calls(*args, **kwargs)

        def spoiled(out):
            ours(out)
            out[0] += 1

        return spoiled, theirs

    monkeypatch.setattr(bench, "_calls", wrong_calls)
    rows = bench.run_bench([4096], iters=2, warmup=0, check=True, collective=collective)
    assert rows[0]["check"] == "FAIL" and rows[0]["wrong"] >= 1


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [*mpi_command(2), sys.executable, "-m", "ddlfast.bench", "--iters", "2", "--warmup", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ))


@pytest.mark.mpi
def test_cli_sweep_streams_rows_then_closes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_cli("-b", "1KiB", "-e", "4KiB", "-f", "2", "--check", "--dtype", "int64", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if not line.startswith("#")]
    assert [int(line.split()[0]) for line in rows] == [1024, 2048, 4096]
    closing = lines[lines.index(rows[-1]) + 1:]
    assert closing[0] == "# out of bounds values : 0 wrong elements in 0 rows (OK)"
    assert all(line.split()[-2:] == ["0", "ok"] for line in rows)  # #wrong, check
    assert closing[1].startswith("# avg bus bandwidth") and closing[1].endswith("GB/s")
    assert "# vs nccl-tests:" in result.stdout
    document = json.loads(out.read_text())
    assert [row["size_bytes"] for row in document["rows"]] == [1024, 2048, 4096]
    assert [row["wrong"] for row in document["rows"]] == [0, 0, 0]


@pytest.mark.mpi
def test_cli_sizes_and_json_as_before() -> None:
    result = run_cli("--sizes", "1KiB,2KiB", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)  # one JSON document, nothing else on stdout
    assert [row["size_bytes"] for row in document["rows"]] == [1024, 2048]
    both = run_cli("--sizes", "1KiB", "-b", "1KiB")
    assert both.returncode == 2 and "give --sizes or -b/-e/-f, not both" in both.stderr


@pytest.mark.mpi
@pytest.mark.parametrize(("collective", "op", "dtype"), [
    ("allreduce", "min", "float32"), ("allreduce", "max", "float16"), ("allreduce", "product", "float64"),
    ("reduce_scatter", "product", "int32"), ("allreduce", "max", "bfloat16"), ("reduce_scatter", "min", "bfloat16"),
])
def test_cli_every_op_is_checked_against_the_same_mpi_op(collective: str, op: str, dtype: str) -> None:
    result = run_cli("--collective", collective, "--op", op, "--dtype", dtype, "--sizes", "4KiB,64KiB", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"op=MPI.{ {'min': 'MIN', 'max': 'MAX', 'product': 'PROD'}[op] })" in result.stdout
    assert "# check: ddlfast matches" in result.stdout and result.stdout.count(" ok") == 2
