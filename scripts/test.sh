#!/usr/bin/env bash
# README command 2: set everything up, then run the whole test suite
# (unit tests, multi-rank tests under mpiexec, lint, CUDA compile check, sanitizers).
# DDLFAST_MPI=system (or a path to an mpicc) runs it on a system MPI (scripts/setup.sh, docs/mpi.md);
# the sanitizer step then runs only with SANITIZE_SYSTEM_MPI=1 (it is checked on the wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/mpi_choice.sh
. scripts/mpi_choice.sh
# Where nvcc exists the CUDA sources must compile: build with DDLFAST_CUDA=on so a
# missing CUDA build is an error here, not a silent CPU-only build.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export DDLFAST_CUDA=${DDLFAST_CUDA:-on}
fi
with_mpi_choice bash scripts/setup.sh
"$VENV/bin/ruff" check ddlfast tests bench
# TESTS: what pytest runs (default all of tests/); .ci/run gives a subset for its second MPI.
# shellcheck disable=SC2086
PATH="$(cd "$VENV" && pwd)/bin:$PATH" "$VENV/bin/python" -m pytest ${TESTS:-tests} -q -ra "$@"
# The core again under ASan + UBSan: the unit tests and a 3-rank fuzz (scripts/sanitize.sh says how).
if [ "$MPI_KIND" = wheel ] || [ "${SANITIZE_SYSTEM_MPI:-0}" = 1 ]; then
  with_mpi_choice bash scripts/sanitize.sh
fi
