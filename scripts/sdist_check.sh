#!/usr/bin/env bash
# CI step (scripts/test.sh runs it when CI=true): the path of a user who installs from an sdist. Builds the sdist
# (`python -m build --sdist`), installs it into a fresh venv that holds only pip's mpich and mpi4py (the pins in
# requirements.txt) and runs a 2-rank allreduce from the installed package, outside the source tree, against a
# NumPy reference. DDLFAST_CUDA=off keeps it fast (the CUDA sources are compile-checked by the main run); about
# 2-3 minutes on 2 cores. VENV (default .venv) is the set-up venv that builds the sdist.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pin() { grep -E "^$1==" requirements.txt; }

"$VENV/bin/python" -m build --sdist --no-isolation --outdir "$work/dist" . >"$work/sdist.log" 2>&1 || {
  cat "$work/sdist.log"; echo "ddlfast: building the sdist failed (log above)" >&2; exit 1; }
sdist=$(ls "$work"/dist/ddlfast-*.tar.gz)
listing=$(tar tzf "$sdist")
for needed in CMakeLists.txt LICENSE src/engine/ring_phases.h ddlfast/_core.pyx ddlfast/_common.pxi; do
  grep -q "^ddlfast-[^/]*/$needed\$" <<<"$listing" || { echo "ddlfast: the sdist lacks $needed" >&2; exit 1; }
done

"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$(pin mpich)" "$(pin mpi4py)"
# With build isolation, as `pip install ddlfast` does: the build tools come from pyproject.toml's requirements.
env -u DDLFAST_MPICC DDLFAST_CUDA=off "$work/venv/bin/python" -m pip install --quiet "$sdist" \
  >"$work/install.log" 2>&1 || { cat "$work/install.log"; echo "ddlfast: installing the sdist failed" >&2; exit 1; }

cat >"$work/two_ranks.py" <<'PROGRAM'
import numpy as np
from mpi4py import MPI

import ddlfast

rank = ddlfast.rank()
assert ddlfast.size() == 2, ddlfast.size()
array = np.arange(1000, dtype=np.float64) * (rank + 1)
ddlfast.allreduce(array)
expected = np.arange(1000, dtype=np.float64) * 3  # 1x + 2x, exact in float64
assert np.array_equal(array, expected), "the allreduce differs from the NumPy reference"
assert len(set(MPI.COMM_WORLD.allgather(array.tobytes()))) == 1, "ranks hold different bits"
if rank == 0:
    print(f"ddlfast {ddlfast.__version__} from {ddlfast.__file__}: 2-rank allreduce ok")
PROGRAM
cd "$work"  # not the source tree: the installed package must be the one imported
output=$("$work/venv/bin/mpiexec" -n 2 "$work/venv/bin/python" two_ranks.py)
echo "$output"
case "$output" in
  *"$work/venv/"*"2-rank allreduce ok"*) ;;
  *) echo "ddlfast: the 2-rank allreduce did not run from the installed sdist" >&2; exit 1 ;;
esac
echo "ddlfast: sdist check took $(($(date +%s) - start)) s"
