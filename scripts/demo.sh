#!/usr/bin/env bash
# README command 1: set everything up, then run the main job on 4 ranks:
# data-parallel training (NumPy and PyTorch) and the bench beside MPI_Allreduce.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RANKS=${RANKS:-4}
.venv/bin/mpiexec -n "$RANKS" .venv/bin/python -m ddlfast.demo "$@"
