"""pytest-benchmark under mpiexec: every rank runs the same benchmarks in the same order, rank 0 reports.

    mpiexec -n 4 python -m pytest bench/ -p no:cacheprovider --benchmark-only

Ranks other than 0 keep benchmarking (a rank that ran each function once, as --benchmark-disable does, would leave
the others waiting in the collective) but print nothing and save nothing: their terminal reporter is removed and the
--benchmark-save/--benchmark-autosave/--benchmark-json/--benchmark-histogram/--benchmark-compare options are cleared.
A failure on such a rank is still printed, to stderr, prefixed with its rank. DDLFAST_BENCH_ALL_RANKS=1 keeps every
rank's full output.
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()
WORLD = MPI.COMM_WORLD.Get_size()
QUIET = RANK != 0 and os.environ.get("DDLFAST_BENCH_ALL_RANKS", "") in ("", "0")

_RANK_ZERO_ONLY = {
    "benchmark_save": None,
    "benchmark_autosave": False,
    "benchmark_save_data": False,
    "benchmark_json": None,
    "benchmark_histogram": None,
    "benchmark_compare": None,
    "benchmark_compare_fail": None,
    "benchmark_cprofile_dump": None,
}


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    # Before pytest_configure, where pytest-benchmark reads its options.
    if QUIET:
        for name, value in _RANK_ZERO_ONLY.items():
            if hasattr(config.option, name):
                setattr(config.option, name, value)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    # After the terminal plugin registered its reporter: as with -p no:terminal, nothing goes to stdout.
    if QUIET:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if QUIET and report.failed:
        print(f"[rank {RANK}] {report.when} FAILED {report.nodeid}\n{report.longreprtext}", file=sys.stderr)


def pytest_report_header(config: pytest.Config) -> list[str]:
    import ddlfast

    info = ddlfast.build_info()
    return [
        f"ddlfast bench: world size {WORLD} (run under mpiexec -n P; rank 0 reports, times are rank 0's timer, "
        "extra_info.max_rank_median_us is the median of the slowest rank's time)",
        f"ddlfast build: kernel {info.get('kernel_selected')}, MPI {' '.join(str(info.get('mpi_library')).split())}",
    ]


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    import ddlfast

    machine_info["mpi_world_size"] = WORLD
    machine_info["ddlfast_build_info"] = ddlfast.build_info()
