"""What the torch test programs share: the harness (harness.py: failures per case, gathered, "<n> failures" on
rank 0, exit status 1 on every rank if any rank failed), with torch on one thread."""

from __future__ import annotations

import torch
from harness import case, comm, fail, failures, rank, report_and_exit, world

torch.set_num_threads(1)

__all__ = ["case", "comm", "fail", "failures", "rank", "report_and_exit", "world"]
