"""What the "ddlfast" backend's test programs share: the process group on ddlfast, failures collected per rank,
and the report ("<n> failures" on rank 0, exit status 1 on every rank if any rank failed; case_runner.py)."""

from __future__ import annotations

import case_runner
import torch.distributed as dist
from case_runner import case, comm, fail, failures, rank, world

import ddlfast.torch as dt

__all__ = ["case", "comm", "fail", "failures", "rank", "report_and_exit", "world"]
dt.init_process_group(backend="ddlfast")


def report_and_exit() -> None:
    case_runner.report_and_exit(before_exit=dist.destroy_process_group)
