#!/usr/bin/env bash
# README command 2: set everything up, then run the whole test suite
# (unit tests, multi-rank tests under mpiexec, lint, CUDA compile check).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check ddlfast tests bench
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pytest tests -q -ra "$@"
