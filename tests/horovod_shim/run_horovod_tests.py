"""Run Horovod's own test/parallel/test_torch.py against ddlfast.horovod.torch, a batch of tests per
`mpiexec -n N` (a batch that hangs is rerun one test per mpiexec, so a hang costs only its test), and print one
line per test: passed / failed / skipped on every rank, with the first failure's message.

    python tests/horovod_shim/run_horovod_tests.py /path/to/horovod/test/parallel/test_torch.py -n 2 [-k expr]

The file is Horovod's, unmodified, from a Horovod checkout (its test/utils/common.py must sit beside it as in the
repository); nothing is fetched. `import horovod.torch` resolves to ddlfast.horovod.torch through the stand-in
package in this folder.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SHIM = Path(__file__).resolve().parent
REPO = SHIM.parent.parent


def test_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{cls.name}::{f.name}" for cls in tree.body if isinstance(cls, ast.ClassDef)
            for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]


def run_batch(path: Path, tests: list[str], ranks: int, timeout: float) -> dict[str, tuple[str, str]] | None:
    """{test: (outcome, detail)} for tests run in one `mpiexec -n ranks`; None when the batch did not finish in
    time (its tests are then run one by one). Outcome: passed, failed or skipped (on every rank)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("DDLFAST_TIMEOUT_S", "30")
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "rank")
        ids = ", ".join(repr(f"{path}::{t}") for t in tests)
        script = ("import os, sys, pytest; "
                  "r = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0')); "
                  f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {ids}, '--junitxml={report}' + r + '.xml']))")
        try:
            subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-c", script], cwd=path.parent, env=env,
                           capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        per_rank: list[dict[str, tuple[str, str]]] = []
        for r in range(ranks):
            file = f"{report}{r}.xml"
            seen: dict[str, tuple[str, str]] = {}
            if os.path.exists(file):
                for case in ET.parse(file).getroot().iter("testcase"):
                    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                    if bad is not None:
                        seen[case.get("name", "")] = ("failed", f"rank {r}: "
                                                      f"{(bad.get('message') or '').splitlines()[0][:200]}")
                    elif case.find("skipped") is not None:
                        seen[case.get("name", "")] = ("skipped", (case.find("skipped").get("message") or "")[:120])
                    else:
                        seen[case.get("name", "")] = ("passed", "")
            per_rank.append(seen)
    outcomes = {}
    for test in tests:
        name = test.split("::")[-1]
        mine = [seen.get(name, ("failed", f"rank {r} has no result")) for r, seen in enumerate(per_rank)]
        failed = [m for m in mine if m[0] == "failed"]
        outcomes[test] = failed[0] if failed else mine[0] if all(m[0] == "skipped" for m in mine) else ("passed", "")
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path)
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("-k", default=None, help="a regular expression on test names")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    parser.add_argument("--batch", type=int, default=12, help="tests per mpiexec")
    parser.add_argument("--known", default="", help="comma list of tests whose failure is expected (reported as "
                        "'known', not counted as a failure)")
    args = parser.parse_args()
    path = args.test_file.resolve()
    tests = [t for t in test_names(path) if args.k is None or re.search(args.k, t)]
    totals: dict[str, int] = {}
    for start in range(0, len(tests), args.batch):
        batch = tests[start:start + args.batch]
        outcomes = run_batch(path, batch, args.ranks, args.timeout * len(batch) / 2)
        if outcomes is None:  # something hung past the stall limit: one by one
            outcomes = {}
            for test in batch:
                alone = run_batch(path, [test], args.ranks, args.timeout)
                outcomes[test] = alone[test] if alone else ("timeout", f"did not finish in {args.timeout:.0f} s")
        failed = [t for t in batch if outcomes[t][0] == "failed"]
        if len(failed) > 1:  # a failure can leave the ranks at different collectives: the rest of the batch then
            for test in failed[1:]:  # fails with it, so each later failure is run again on its own
                alone = run_batch(path, [test], args.ranks, args.timeout)
                outcomes[test] = alone[test] if alone else ("timeout", f"did not finish in {args.timeout:.0f} s")
        known = set(filter(None, args.known.split(",")))
        for test in batch:
            outcome, detail = outcomes[test]
            if outcome in ("failed", "timeout") and test.split("::")[-1] in known:
                outcome = "known"
            totals[outcome] = totals.get(outcome, 0) + 1
            print(f"{outcome:8} {test.split('::')[-1]} {detail}", flush=True)
    print(f"{args.ranks} ranks: " + ", ".join(f"{n} {k}" for k, n in sorted(totals.items())), flush=True)
    return 0 if not totals.get("failed") and not totals.get("timeout") else 1


if __name__ == "__main__":
    sys.exit(main())
