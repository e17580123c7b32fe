#!/usr/bin/env bash
# The C++ under src/ against .clang-format (clang-format from pip, pinned in requirements.txt): every file but
# those listed below, which predate the check and are formatted when next edited on their own (a formatting pass
# over files other branches are changing would only make merges harder). Remove a file from the list once
# `.venv/bin/clang-format -i FILE` was run on it. Run by scripts/test.sh beside ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-${VENV:-.venv}/bin/clang-format}
not_yet_formatted="
  src/algo/ring_schedule.cc
  src/common/cuda/cuda_check.cc
  src/common/cuda/cuda_check.h
  src/common/cuda/cuda_device.h
  src/common/half.h
  src/common/status.h
  src/engine/cuda/device_runtime.cc
  src/engine/cuda/fence.cc
  src/engine/device_ring_allreduce.cc
  src/engine/exact_arithmetic.cc
  src/engine/exact_arithmetic.h
  src/engine/latency_allreduce.h
  src/engine/ring_allreduce.h
  src/engine/ring_phases.h
  src/kernels/cpu/combine_generic.h
  src/kernels/cpu/cpu_avx2.cc
  src/kernels/cpu/cpu_scalar.cc
  src/kernels/cpu/exact_generic.h
  src/kernels/cuda/cuda_kernels.h
  src/kernels/cuda/cuda_reduce.cu
  src/testing/emulated_lanes.h
  src/testing/kernel_bench.h
  src/transport/poll_backoff.h
"
files=()
while IFS= read -r file; do
  case "$not_yet_formatted" in *" $file"$'\n'*) continue ;; esac
  files+=("$file")
done < <(git ls-files --cached --others --exclude-standard 'src/*.h' 'src/*.cc' 'src/*.cu' 'src/*.cuh')
"$CLANG_FORMAT" --dry-run --Werror "${files[@]}"
echo "ddlfast: clang-format: ${#files[@]} files under src/ formatted"
