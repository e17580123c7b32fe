#!/usr/bin/env bash
# README command 1: set everything up, then run the main job on 4 ranks:
# data-parallel training (NumPy and PyTorch) and the bench beside MPI_Allreduce.
# DDLFAST_MPI=system (or a path to an mpicc) runs it on a system MPI (scripts/setup.sh, docs/mpi.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/mpi_choice.sh
. scripts/mpi_choice.sh
with_mpi_choice bash scripts/setup.sh
RANKS=${RANKS:-4}
read -r -a flags <<<"$("$VENV/bin/python" tests/mpi/launcher.py)"  # e.g. Open MPI's --oversubscribe
"$VENV/bin/mpiexec" "${flags[@]}" -n "$RANKS" "$VENV/bin/python" -m ddlfast.demo "$@"
