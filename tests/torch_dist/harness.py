"""One rank of PyTorch's own distributed test class (torch.testing._internal.distributed.distributed_test) under
mpiexec, against one backend ("ddlfast" or "gloo").

torch runs that class with one fresh set of processes per test (MultiProcessTestCase); here every MPI rank runs
the tests in turn, each between an init_process_group and a destroy_process_group of its own (a FileStore in a
fresh file), and the ranks compare outcomes after each test on a communicator of the harness's own. Rank 0
appends one JSON line per test to the results file: {"test", "outcome": passed|failed|skipped, "detail"}; a
"start" line ahead of each, so that run.py knows which test a job that died or hung was in. A job stops early
(exit 3) when a test leaves the ddlfast context broken, and run.py starts the next job after that test.

    mpiexec -n 3 python tests/torch_dist/harness.py --backend ddlfast --results out.jsonl [--tests a,b,...]

--as-gloo: torch's class skips many tests for any backend but gloo ("Only gloo backend supports timeouts"), and
its test bodies branch on the name (`if BACKEND == "gloo":` builds the CPU model). With --as-gloo the class runs
as for gloo, but every process group it creates (init_process_group, new_group, new_subgroups with backend gloo
or none) is a --backend group: --backend stands in for gloo, so "passes everything gloo passes" is measured on
the same tests. A test that compares the backend's name (test_get_backend) then fails for the name alone: run.py
runs what fails so again in the backend's own name.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import json
import os
import shutil
import sys
import tempfile
import traceback
import unittest
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

# Per test, every rank: a hung test is ended with its stacks instead of holding the job (run.py records it).
TEST_LIMIT_S = 180.0
# The ddlfast stall limit and gloo's timeout while the tests run: a test that fails on one rank leaves the others
# waiting in a collective; they must give up long before TEST_LIMIT_S.
PG_TIMEOUT_S = 30


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=["ddlfast", "gloo"])
    parser.add_argument("--results", required=True)
    parser.add_argument("--tests", default="", help="comma-separated test names (default: every test)")
    parser.add_argument("--as-gloo", action="store_true",
                        help="import the class as for gloo, so that the tests torch runs for gloo alone (timeouts, "
                             "sparse allreduce, ...) run too, against --backend")
    args = parser.parse_args()

    control = MPI.COMM_WORLD.Dup()  # the harness's own: never shared with a backend
    rank, size = control.Get_rank(), control.Get_size()
    temp_dir = control.bcast(tempfile.mkdtemp(prefix="ddlfast-torch-dist-") if rank == 0 else None)
    if rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp_dir, sub), exist_ok=True)
    control.Barrier()
    os.environ.update(BACKEND="gloo" if args.as_gloo else args.backend, WORLD_SIZE=str(size), TEMP_DIR=temp_dir,
                      MASTER_ADDR="localhost",
                      INIT_METHOD="file://" + os.path.join(temp_dir, "init_dir", "shared_init_file"))
    os.environ.setdefault("DDLFAST_TIMEOUT_S", str(PG_TIMEOUT_S))

    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed import distributed_test as torch_tests

    if args.as_gloo and args.backend != "gloo":
        _stand_in_for_gloo(dist, args.backend)
    if args.backend == "ddlfast":
        import ddlfast.torch  # noqa: F401 - registers the backend

    skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}

    class DistributedTestCase(torch_tests.DistributedTest._DistTestBase, TestCase):
        """_DistTestBase's tests, with torch's file barrier replaced by an MPI barrier of the harness."""

        rank = 0
        file_name = ""

        @property
        def world_size(self) -> str:
            return str(size)

        @property
        def init_method(self) -> str:
            return "file://" + self.file_name

        @property
        def destroy_pg_upon_exit(self) -> bool:
            return False

        def _barrier(self, *_args: object, **_kwargs: object) -> None:
            control.Barrier()

    names = [n for n in args.tests.split(",") if n] or sorted(
        n for n in dir(DistributedTestCase) if n.startswith("test_"))
    out = open(args.results, "a") if rank == 0 else None  # noqa: SIM115 - one file for the whole job

    def record(line: dict) -> None:
        if out is not None:
            out.write(json.dumps(line) + "\n")
            out.flush()

    any_broken = False
    for index, name in enumerate(names):
        record({"start": name})
        store_file = os.path.join(temp_dir, "init_dir", f"store_{os.getpid() if rank == 0 else 0}_{index}")
        store_file = control.bcast(store_file)
        faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True)
        outcome, detail = _run_one(DistributedTestCase, name, rank, store_file, skip_codes, dist, torch_tests,
                                   args.backend)
        faulthandler.cancel_dump_traceback_later()
        broken = _ddlfast_broken() if args.backend == "ddlfast" else False
        outcomes = control.gather((outcome, detail, broken))
        any_broken = control.bcast(any(b for _, _, b in outcomes) if rank == 0 else None)
        if rank == 0:
            kinds = {o for o, _, _ in outcomes}  # as torch's harness: a skip on any rank skips the test
            final = "failed" if "failed" in kinds else "skipped" if "skipped" in kinds else "passed"
            details = [f"rank {r}: {d}" for r, (o, d, _) in enumerate(outcomes) if d]
            record({"test": name, "outcome": final, "detail": "\n".join(details)[-4000:]})
        if any_broken:
            break
    control.Barrier()
    if rank == 0:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return 3 if any_broken else 0


def _stand_in_for_gloo(dist: Any, backend: str) -> None:
    """Every group torch's tests create with backend "gloo" (or the default) becomes a `backend` group."""

    def swap(function: Callable, position: int) -> Callable:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            if len(args) > position:
                if args[position] in (None, "gloo"):
                    args = (*args[:position], backend, *args[position + 1:])
            elif kwargs.get("backend") in (None, "gloo"):
                kwargs["backend"] = backend
            return function(*args, **kwargs)

        return run

    dist.init_process_group = swap(dist.init_process_group, 0)
    dist.new_group = swap(dist.new_group, 2)
    dist.new_subgroups = swap(dist.new_subgroups, 3)


def _run_one(case_class: type, name: str, rank: int, store_file: str, skip_codes: dict, dist, torch_tests,
             backend: str) -> tuple[str, str]:
    """(outcome, detail) of one test on this rank."""
    case = case_class(name)
    case.rank = rank
    case.file_name = store_file
    timeout = torch_tests.CUSTOM_PG_TIMEOUT.get(name, PG_TIMEOUT_S)
    try:
        dist.init_process_group(init_method=case.init_method, backend=backend,
                                world_size=int(case.world_size), rank=rank,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - recorded as the test's failure
        return "failed", "init_process_group: " + traceback.format_exc()[-2000:]
    result = unittest.TestResult()
    case._barrier()
    case.run(result)
    case._barrier()  # as torch's _run: a rank whose test waits out a timeout is not left alone in its group
    with_errors = result.errors + result.failures
    outcome, detail = "passed", ""
    if result.skipped:
        outcome, detail = "skipped", result.skipped[0][1]
    elif with_errors:
        text = with_errors[0][1]
        code = _exit_code(text)
        if code is not None and code in skip_codes:
            outcome, detail = "skipped", skip_codes[code]
        elif code == 0:
            outcome = "passed"
        else:
            outcome, detail = "failed", text[-3000:]
    elif result.unexpectedSuccesses:
        outcome, detail = "failed", "unexpected success"
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a failed teardown fails the test
        if outcome != "failed":
            outcome, detail = "failed", "destroy_process_group: " + traceback.format_exc()[-2000:]
    return outcome, detail


def _exit_code(traceback_text: str) -> int | None:
    """The code of a SystemExit that ended the test (torch's skip decorators exit with TEST_SKIPS codes)."""
    last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else ""
    if last.startswith("SystemExit"):
        value = last.partition(":")[2].strip()
        return int(value) if value.lstrip("-").isdigit() else 0
    return None


def _ddlfast_broken() -> bool:
    """Whether the default ddlfast context is broken (then no later test can run in this job)."""
    from ddlfast import api

    try:
        context = api._context_for(MPI.COMM_WORLD)
    except Exception:  # noqa: BLE001 - a context that cannot be had is as good as broken
        return True
    return context.broken_reason is not None


if __name__ == "__main__":
    sys.exit(main())
