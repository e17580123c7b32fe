"""PyTorch's own distributed test class (torch.testing._internal.distributed.distributed_test) against the
"ddlfast" backend beside gloo, under mpiexec (harness.py, run.py).

CI runs run.CI_TESTS (the collectives, groups, point-to-point, timeouts, sparse allreduce and DDP's main paths; a
few minutes); DDLFAST_TORCH_DIST_ALL=1 runs the whole class (about 300 tests; most that need GPUs or 8 ranks skip
under both backends). ddlfast must pass every test gloo passes."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal imports it

from tests.torch_dist.run import CI_TESTS, run_backend, run_in_gloos_place, summary  # noqa: E402

RANKS = 3  # torch's own CI runs this class at 2 and 3 ranks; its group tests want 8 (they skip here)
JOB_TIMEOUT_S = 1800.0


@pytest.mark.mpi
def test_ddlfast_passes_what_gloo_passes() -> None:
    tests = [] if os.environ.get("DDLFAST_TORCH_DIST_ALL") == "1" else list(CI_TESTS)
    gloo = run_backend("gloo", RANKS, tests, JOB_TIMEOUT_S, log=lambda _: None)
    ours = run_in_gloos_place("ddlfast", RANKS, tests, JOB_TIMEOUT_S)
    report = summary("gloo", gloo) + "\n" + summary("ddlfast", ours)
    print(report)
    missing = sorted(t for t, r in gloo.items()
                     if r["outcome"] == "passed" and ours.get(t, {}).get("outcome") != "passed")
    details = "\n".join(f"--- {t}\n{ours.get(t, {}).get('detail', 'no outcome')[-2000:]}" for t in missing)
    assert not missing, f"{report}\npass under gloo but not under ddlfast: {missing}\n{details}"
    passed = {t for t, r in ours.items() if r["outcome"] == "passed"}
    # What this harness exists for: the group's timeout= ("Timed out"), sparse COO allreduce, DDP with
    # create_graph=True, all_gather_coalesced, monitored_barrier: they must run (not skip) and pass.
    assert {"test_barrier_timeout_global", "test_sparse_all_reduce_sum", "test_ddp_create_graph",
            "test_all_gather_coalesced_simple", "test_monitored_barrier_gloo"} <= passed, report
    assert len(passed) >= len(tests) // 2 if tests else len(passed) >= 80, report
