"""PyTorch's own distributed test class against a backend, under mpiexec: the driver of harness.py.

    python tests/torch_dist/run.py --backend ddlfast [--ranks 3] [--tests a,b] [--json out.json]
    python tests/torch_dist/run.py --backend gloo --backend ddlfast      # both, and what differs

It starts harness.py jobs until every test has an outcome: a job that ends early (a broken ddlfast context, a
crash, a hang that the harness's watchdog ended) is followed by one that starts after the test it was in, which
counts as failed ("crashed"). Prints per backend how many passed, failed and were skipped, the failed tests, and
with two backends the tests that pass under the first but not under the second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.mpi.launcher import mpi_command  # noqa: E402

HARNESS = Path(__file__).with_name("harness.py")
# The tests that run in CI (tests/torch_dist/test_torch_distributed.py): the collectives, groups, point-to-point,
# and DDP's main paths, a few minutes on 2 cores; DDLFAST_TORCH_DIST_ALL=1 runs the whole class instead.
CI_TESTS = (
    "test_get_rank", "test_get_backend", "test_destroy_group", "test_barrier", "test_barrier_timeout_global",
    "test_barrier_timeout_full_group", "test_all_reduce_sum", "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex", "test_all_reduce_max", "test_all_reduce_full_group_product",
    "test_all_reduce_coalesced_sum", "test_sparse_all_reduce_sum", "test_broadcast", "test_reduce_sum",
    "test_reduce_full_group_min", "test_all_gather", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_all_gather_object_default_pg", "test_gather", "test_scatter",
    "test_send_recv", "test_send_recv_any_source", "test_isend", "test_irecv", "test_batch_isend_irecv_gloo",
    "test_send_recv_torch_profiler", "test_DistributedDataParallelCPU", "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync_allreduce_hook", "test_get_future", "test_static_graph_api_cpu",
    "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
)


def run_backend(backend: str, ranks: int, tests: list[str], job_timeout: float, log=print, as_gloo: bool = True
                ) -> dict[str, dict]:
    """{test: {"outcome", "detail"}} for every test (all of the class when `tests` is empty)."""
    results: dict[str, dict] = {}
    remaining = list(tests)
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "results.jsonl"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        while True:
            out.write_text("")
            command = [*mpi_command(ranks), sys.executable, str(HARNESS), "--backend", backend, "--results",
                       str(out), "--tests", ",".join(remaining),
                       *(["--as-gloo"] if as_gloo else [])]
            started = time.monotonic()
            try:
                job = subprocess.run(command, capture_output=True, text=True, timeout=job_timeout, env=env)
                tail = (job.stdout + job.stderr)[-3000:]
            except subprocess.TimeoutExpired as expired:
                tail = f"the job ran past {job_timeout:.0f} s\n" + str(expired.stdout or "")[-1000:]
            current = None
            for line in out.read_text().splitlines():
                entry = json.loads(line)
                if "start" in entry:
                    current = entry["start"]
                else:
                    results[entry["test"]] = {"outcome": entry["outcome"], "detail": entry["detail"]}
                    log(f"{backend} {entry['outcome']:8} {entry['test']}")
                    current = None
            if current is not None:
                results[current] = {"outcome": "failed", "detail": "crashed or hung; the job's end:\n" + tail}
                log(f"{backend} crashed  {current} ({time.monotonic() - started:.0f} s into the job)")
            if not remaining:  # the first job ran the whole class: its order is the rest
                remaining = _all_tests(results, current)
            remaining = [t for t in remaining if t not in results]
            if not remaining or (current is None and job_timeout and _ran_nothing(out)):
                break
    return results


def run_in_gloos_place(backend: str, ranks: int, tests: list[str], job_timeout: float, as_gloo: bool = True
                       ) -> dict[str, dict]:
    """run_backend, and for a backend other than gloo standing in for gloo (harness.py --as-gloo), its failures
    again in its own name: a test that passes so (test_get_backend compares the name) counts as passed."""
    results = run_backend(backend, ranks, tests, job_timeout, as_gloo=as_gloo)
    failed = [t for t, r in results.items() if r["outcome"] == "failed"]
    if backend == "gloo" or not as_gloo or not failed:
        return results
    print(f"{backend}: {len(failed)} failed in gloo's place; again in its own name")
    again = run_backend(backend, ranks, failed, job_timeout, as_gloo=False)
    for test, result in again.items():
        if result["outcome"] == "passed":
            results[test] = {"outcome": "passed", "detail": "passed in its own name (failed in gloo's place)"}
    return results


def _all_tests(results: dict, current: str | None) -> list[str]:
    """The class's tests in the harness's order (it runs them sorted)."""
    probe = subprocess.run([sys.executable, "-c", (
        "import os; os.environ.setdefault('BACKEND', 'gloo'); os.environ.setdefault('WORLD_SIZE', '3');"
        "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
        "print(','.join(sorted(n for n in dir(D._DistTestBase) if n.startswith('test_'))))")],
        capture_output=True, text=True, check=True)
    return probe.stdout.strip().split(",")


def _ran_nothing(out: Path) -> bool:
    return not out.read_text().strip()


def summary(backend: str, results: dict[str, dict]) -> str:
    counts = {k: sum(1 for r in results.values() if r["outcome"] == k) for k in ("passed", "failed", "skipped")}
    failed = sorted(t for t, r in results.items() if r["outcome"] == "failed")
    return (f"{backend}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped of "
            f"{len(results)}" + ("\n  failed: " + ", ".join(failed) if failed else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", choices=["ddlfast", "gloo"], required=True)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--tests", default="", help="comma-separated names; 'ci' for the CI subset; default all")
    parser.add_argument("--job-timeout", type=float, default=3600.0)
    parser.add_argument("--own-skips", action="store_true",
                        help="import the class for the backend itself (torch then skips its gloo-only tests for "
                             "ddlfast); default: as for gloo, so both backends run the same tests")
    parser.add_argument("--json", help="write {backend: {test: outcome}} here")
    args = parser.parse_args()
    tests = list(CI_TESTS) if args.tests == "ci" else [t for t in args.tests.split(",") if t]
    everything = {b: run_in_gloos_place(b, args.ranks, tests, args.job_timeout, as_gloo=not args.own_skips)
                  for b in args.backend}
    for backend, results in everything.items():
        print(summary(backend, results))
    if len(everything) == 2:
        first, second = args.backend
        only = sorted(t for t, r in everything[first].items()
                      if r["outcome"] == "passed" and everything[second].get(t, {}).get("outcome") != "passed")
        print(f"pass under {first} but not under {second}: {len(only)}" + ("\n  " + ", ".join(only) if only else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
