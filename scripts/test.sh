#!/usr/bin/env bash
# README command 2: set everything up, then run the whole test suite
# (unit tests, multi-rank tests under mpiexec, lint, CUDA compile check, sanitizers).
set -euo pipefail
cd "$(dirname "$0")/.."
# Where nvcc exists the CUDA sources must compile: build with DDLFAST_CUDA=on so a
# missing CUDA build is an error here, not a silent CPU-only build.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export DDLFAST_CUDA=${DDLFAST_CUDA:-on}
fi
bash scripts/setup.sh
.venv/bin/ruff check ddlfast tests bench
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pytest tests -q -ra "$@"
# The core again under ASan + UBSan: the unit tests and a 3-rank fuzz (scripts/sanitize.sh says how).
bash scripts/sanitize.sh
