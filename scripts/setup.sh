#!/usr/bin/env bash
# Sets everything up from a fresh clone: .venv at the repository root with
# MPI (pip's mpich wheel), mpi4py and the build tools, then builds ddlfast
# (C++ core, Cython module, CUDA kernels where nvcc is found). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Reinstall only when the requirements changed since the last successful run.
stamp=.venv/.ddlfast-requirements
if ! cmp -s requirements.txt "$stamp" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  cp requirements.txt "$stamp"
fi
# --no-build-isolation: build against exactly the mpi4py/MPI in .venv.
.venv/bin/python -m pip install --quiet --no-build-isolation --no-deps -e . >/tmp/ddlfast-build.log 2>&1 || {
  cat /tmp/ddlfast-build.log
  echo "ddlfast: build failed (log above)" >&2
  exit 1
}
.venv/bin/python -c "import ddlfast; i = ddlfast.build_info(); print('ddlfast built:', i['kernel_selected'], '| CUDA', i['cuda'], '|', i['mpi_library'])"
