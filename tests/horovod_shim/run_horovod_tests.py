"""Run Horovod's own test/parallel/test_torch.py against ddlfast.horovod.torch, one test per `mpiexec -n N` (a
test that hangs or breaks the job costs only itself), and print one line per test: passed / failed / skipped on
every rank, with the first failure's last line.

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


def run_one(path: Path, test: str, ranks: int, timeout: float) -> tuple[str, str]:
    """('passed' | 'failed' | 'skipped' | 'timeout', detail)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("DDLFAST_TIMEOUT_S", "30")
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "rank")
        script = ("import os, sys, pytest; "
                  "r = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0')); "
                  f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '{path}::{test}', "
                  f"'--junitxml={report}' + r + '.xml']))")
        try:
            subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-c", script], cwd=path.parent, env=env,
                           capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", f"did not finish in {timeout:.0f} s"
        outcomes, details = [], []
        for r in range(ranks):
            file = f"{report}{r}.xml"
            if not os.path.exists(file):
                outcomes.append("failed")
                details.append(f"rank {r} wrote no report")
                continue
            case = ET.parse(file).getroot().find(".//testcase")
            if case is None:
                outcomes.append("failed")
                details.append(f"rank {r}: no test case")
            elif case.find("failure") is not None or case.find("error") is not None:
                element = case.find("failure") if case.find("failure") is not None else case.find("error")
                outcomes.append("failed")
                details.append(f"rank {r}: {(element.get('message') or '').splitlines()[0][:200]}")
            elif case.find("skipped") is not None:
                outcomes.append("skipped")
                details.append((case.find("skipped").get("message") or "")[:120])
            else:
                outcomes.append("passed")
    if "failed" in outcomes:
        return "failed", next(d for o, d in zip(outcomes, details, strict=True) if o == "failed")
    if all(o == "skipped" for o in outcomes):
        return "skipped", details[0] if details else ""
    return "passed", ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path)
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("-k", default=None, help="a regular expression on test names")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    args = parser.parse_args()
    path = args.test_file.resolve()
    tests = [t for t in test_names(path) if args.k is None or re.search(args.k, t)]
    totals: dict[str, int] = {}
    for test in tests:
        outcome, detail = run_one(path, test, args.ranks, args.timeout)
        totals[outcome] = totals.get(outcome, 0) + 1
        print(f"{outcome:8} {test.split('::')[-1]} {detail}", flush=True)
    print(f"{args.ranks} ranks: " + ", ".join(f"{n} {k}" for k, n in sorted(totals.items())), flush=True)
    return 0 if not totals.get("failed") and not totals.get("timeout") else 1


if __name__ == "__main__":
    sys.exit(main())
