#!/usr/bin/env bash
# README command 2: set everything up, then run the whole test suite
# (unit tests, multi-rank tests under mpiexec, lint, CUDA compile check, sanitizers).
# DDLFAST_MPI=system (or a path to an mpicc) runs it on a system MPI (scripts/setup.sh, docs/mpi.md);
# the sanitizer step then runs only with SANITIZE_SYSTEM_MPI=1 (it is checked on the wheel).
# In CI (CI=true) the sdist is then built, installed into a fresh venv and run on 2 ranks (scripts/sdist_check.sh),
# and the engine runs at 16 simulated ranks under SimGrid SMPI (scripts/test_simulation.sh; DDLFAST_SIMULATION=0/1).
# Then, in CI (CI=true) or with DDLFAST_SECOND_MPI=1, the unit tests and a multi-rank subset again on a second
# MPI, Open MPI, in a copy of the tree (scripts/test_second_mpi.sh); DDLFAST_SECOND_MPI=0 turns that off.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
second_mpi=${DDLFAST_SECOND_MPI:-}
simulation=${DDLFAST_SIMULATION:-}
unset DDLFAST_SECOND_MPI DDLFAST_SIMULATION  # ddlfast refuses DDLFAST_* variables it does not know
case "$second_mpi" in
  "") if [ "${CI:-}" = true ]; then second_mpi=1; else second_mpi=0; fi ;;
  0|1) ;;
  *) echo "ddlfast: DDLFAST_SECOND_MPI must be 0 or 1, not '$second_mpi'" >&2; exit 1 ;;
esac
case "$simulation" in
  "") if [ "${CI:-}" = true ]; then simulation=1; else simulation=0; fi ;;
  0|1) ;;
  *) echo "ddlfast: DDLFAST_SIMULATION must be 0 or 1, not '$simulation'" >&2; exit 1 ;;
esac
# shellcheck source=scripts/mpi_choice.sh
. scripts/mpi_choice.sh
# Where nvcc exists the CUDA sources must compile: build with DDLFAST_CUDA=on so a
# missing CUDA build is an error here, not a silent CPU-only build.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export DDLFAST_CUDA=${DDLFAST_CUDA:-on}
fi
with_mpi_choice bash scripts/setup.sh
"$VENV/bin/ruff" check ddlfast tests bench examples
"$VENV/bin/mypy"  # the files and the settings: pyproject.toml [tool.mypy]
VENV=$VENV bash scripts/check_format.sh
PATH="$(cd "$VENV" && pwd)/bin:$PATH" "$VENV/bin/python" -m pytest tests -q -ra "$@"
# The core again under ASan + UBSan: the unit tests and a 3-rank fuzz (scripts/sanitize.sh says how).
if [ "$MPI_KIND" = wheel ] || [ "${SANITIZE_SYSTEM_MPI:-0}" = 1 ]; then
  with_mpi_choice bash scripts/sanitize.sh
fi
echo "ddlfast: main run ($MPI_CHOICE) took $(($(date +%s) - start)) s"
# In CI: the sdist, installed into a fresh venv with pip's mpich and mpi4py, runs a 2-rank allreduce (~75 s).
if [ "${CI:-}" = true ]; then
  VENV=$VENV bash scripts/sdist_check.sh
fi
# The engine at 16 simulated ranks under SimGrid SMPI (scripts/test_simulation.sh, docs/scale.md).
if [ "$simulation" = 1 ]; then
  VENV="$VENV" bash scripts/test_simulation.sh
else
  echo "ddlfast: simulation stage skipped (runs in CI, CI=true, or with DDLFAST_SIMULATION=1)"
fi
if [ "$second_mpi" = 1 ]; then
  bash scripts/test_second_mpi.sh
  echo "ddlfast: whole test run took $(($(date +%s) - start)) s"
fi
