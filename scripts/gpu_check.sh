#!/usr/bin/env bash
# The GPU check (issue 31) in one command, on a machine with an NVIDIA GPU, CUDA (nvcc), PyTorch and CuPy but no
# MPI library and no network (the device image this project is lent):
#
#   bash scripts/gpu_check.sh [OUT]            OUT: where the logs and results go (default gpu-check-out)
#
# It installs pip's MPI from wheels carried in .whl/ (fetch them beforehand on a machine with network, for the
# GPU machine's Python, e.g. 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2
# ), into the Python that holds torch and CuPy (PYTHON, default python3), builds ddlfast there with its CUDA
# kernels for sm_90 (DDLFAST_CUDA=on: no silent build without them), then runs the steps named in STEPS, each
# bounded in time, its output appended to OUT/gpu_check.log and one line per step to OUT/summary.txt:
#   info       the device, the driver, nvcc, the Python packages
#   install    the MPI wheels (skipped when already installed)
#   build      ddlfast with CUDA (seconds when up to date); `python -m ddlfast.info`
#   tests      pytest tests/cuda (the device-only tests run here), then the emulated-lane MPI tests beside them
#   bandwidth  the reduce, cast and pack kernels against the device's copy bandwidth at 256 MiB
#   gpubench   bench/gpu_pipeline.py at P=2 and 4: GPU path vs host copies 1-256 MiB, overlap with products,
#              CUDA traces (OUT/traces.tgz)
#   crossover  the same at 1-16 MiB with the GPU ring forced (DDLFAST_GPU_RING_MIN_BYTES=0)
#   memcheck   compute-sanitizer memcheck on a 2-rank GPU ring run (tests/cuda/programs/device_ring_cases.py)
#   racecheck  compute-sanitizer racecheck, the same
#   hostbench  python -m ddlfast.bench at P=8 and 16 beside MPI_Allreduce (a core per rank)
#   overlap    bench/overlap_torch.py --device cuda at P=2: DDP hook and ddlfast.torch.distribute on the GPU
#   torchstep  bench/torch_step.py at P=4 and 8 on the CPU
#   basebuild  BASE (another ddlfast tree, e.g. `git archive REF | tar -x -C .base`) built in place, host only
#   hostab     python -m ddlfast.bench at P in HOST_PS (default 2 3 4 8 16) for this tree and BASE, alternating,
#              ROUNDS rounds with the order swapped each round (a core per rank); bench/latency_paths.py at 4 KiB
#              for P=2 and 4 likewise. Without BASE, this tree alone. HOST_COLLECTIVES (default allreduce): the
#              bench's --collective values to run, each in turn.
# DEADLINE (seconds, default none): steps that would start later than that after the script began are skipped.
# MPIEXEC (default: the mpiexec beside PYTHON) starts hostab's ranks, with any flags it needs.
# Exit status: the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
PY=$("$PYTHON" -c 'import sys; print(sys.executable)')
BIN=$(dirname "$PY")
MPIEXEC=${MPIEXEC:-$BIN/mpiexec}
STEPS=${STEPS:-info install build tests bandwidth gpubench crossover memcheck hostbench overlap torchstep racecheck}
LOG=$OUT/gpu_check.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
failed=0
began=$(date +%s)

# step NAME SECONDS COMMAND...: run it bounded, log it, print its last lines.
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  if [ -n "${DEADLINE:-}" ] && [ $((start - began)) -ge "$DEADLINE" ]; then
    echo "----- $name: skipped at $((start - began)) s (DEADLINE $DEADLINE)" | tee -a "$OUT/summary.txt" >>"$LOG"
    return
  fi
  echo "===== $name: $*" >>"$LOG"
  timeout -k 10 "$limit" "$@" >"$OUT/.step.log" 2>&1
  rc=$?
  cat "$OUT/.step.log" >>"$LOG"
  echo "----- $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt" >>"$LOG"
  tail -n "${TAIL:-12}" "$OUT/.step.log"
  rm -f "$OUT/.step.log"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}


for s in $STEPS; do
  case $s in
  info)
    step info 60 bash -c "nvidia-smi; nvcc --version | tail -2; uname -r; nproc; free -g | head -2;
      echo THP \$(cat /sys/kernel/mm/transparent_hugepage/enabled);
      $PY -c 'import sys, numpy, torch, cupy; print(sys.version); print(\"numpy\", numpy.__version__, \"torch\",
      torch.__version__, \"cupy\", cupy.__version__, torch.cuda.get_device_name(0))'"
    ;;
  install)
    if "$PY" -c 'import mpi4py, sys; sys.exit(mpi4py.__version__ != "4.1.2")' 2>/dev/null && [ -x "$BIN/mpicc" ]; then
      echo "install: mpich and mpi4py already there" | tee -a "$OUT/summary.txt"
    else
      # setuptools too where the image's is older than pyproject.toml's build requirement (77).
      wheels=(.whl/mpich-*.whl .whl/mpi4py-*.whl)
      "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' ||
        wheels+=(.whl/setuptools-*.whl)
      step install 120 "$PY" -m pip install --quiet --no-index --no-deps --force-reinstall "${wheels[@]}"
    fi
    ;;
  build)
    # In place (the modules land in ddlfast/, PYTHONPATH above finds them): no pip, no build isolation.
    step build 400 env DDLFAST_CUDA=on DDLFAST_MPICC="$BIN/mpicc" "$PY" setup.py -q build_ext --inplace
    step info_ddlfast 60 "$PY" -m ddlfast.info
    ;;
  tests)
    TAIL=30 step tests 230 "$PY" -m pytest tests/cuda -v -ra -p no:cacheprovider -n 8 --timeout 200
    ;;
  bandwidth)
    step bandwidth 120 "$PY" tests/cuda/programs/kernel_bandwidth.py 0 256
    ;;
  gpubench)
    mkdir -p /tmp/gpu-traces
    for p in 2 4; do
      TAIL=8 step "gpubench_P$p" 180 "$BIN/mpiexec" -n "$p" "$PY" bench/gpu_pipeline.py --sizes 1,16,64,256 --iters 5 \
        --trace /tmp/gpu-traces --json "/tmp/gpu-traces/gpu_pipeline_P$p.json"
    done
    tar -C /tmp/gpu-traces -czf "$OUT/traces.tgz" .
    ;;
  crossover)
    # The staged GPU ring against host copies around DDLFAST_GPU_RING_MIN_BYTES (default 4 MiB): the ring forced.
    for p in 2 4; do
      TAIL=8 step "crossover_P$p" 180 env DDLFAST_GPU_RING_MIN_BYTES=0 "$BIN/mpiexec" -n "$p" "$PY" \
        bench/gpu_pipeline.py --sizes 1,2,4,8,16 --iters 5
    done
    ;;
  memcheck | racecheck)
    step "$s" 180 "$BIN/mpiexec" -n 2 compute-sanitizer --tool "$s" --error-exitcode 9 --print-limit 20 \
      "$PY" tests/cuda/programs/device_ring_cases.py --cases "${SANITIZER_CASES:-6}"
    ;;
  hostbench)
    for p in 8 16; do
      TAIL=14 step "hostbench_P$p" 150 "$BIN/mpiexec" -n "$p" "$PY" -m ddlfast.bench \
        --sizes 4KiB,64KiB,1MiB,16MiB,64MiB
    done
    ;;
  overlap)
    step overlap_cuda 150 "$BIN/mpiexec" -n 2 "$PY" bench/overlap_torch.py --device cuda --steps 7
    ;;
  torchstep)
    for p in 4 8; do
      step "torchstep_P$p" 120 "$BIN/mpiexec" -n "$p" "$PY" bench/torch_step.py
    done
    ;;
  basebuild)
    step basebuild 300 bash -c "cd '${BASE:?BASE names the other tree}' &&
      DDLFAST_CUDA=off DDLFAST_MPICC='$BIN/mpicc' '$PY' setup.py -q build_ext --inplace"
    ;;
  hostab)
    trees=("$PWD")
    [ -n "${BASE:-}" ] && trees+=("$(cd "$BASE" && pwd)")
    for round in $(seq 1 "${ROUNDS:-2}"); do
      order=("${trees[@]}")
      [ $((round % 2)) = 0 ] && [ "${#trees[@]}" = 2 ] && order=("${trees[1]}" "${trees[0]}")
      for collective in ${HOST_COLLECTIVES:-allreduce}; do
        for p in ${HOST_PS:-2 3 4 8 16}; do
          for tree in "${order[@]}"; do
            # From the tree itself: `python -m` puts the working directory first on the path.
            TAIL=14 step "hostab_r${round}_${collective}_P${p}_$(basename "$tree")" 120 env -C "$tree" \
              PYTHONPATH="$tree" bash -c "'$PY' -c 'import ddlfast; print(ddlfast.__file__)' && \
              $MPIEXEC -n $p '$PY' -m ddlfast.bench --collective $collective \
              --sizes ${HOST_SIZES:-4KiB,8KiB,16KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB}"
          done
        done
      done
      for p in 2 4; do
        for tree in "${order[@]}"; do
          # shellcheck disable=SC2086  # MPIEXEC: a command and its flags
          TAIL=8 step "latency_r${round}_P${p}_$(basename "$tree")" 90 env -C "$tree" PYTHONPATH="$tree" \
            $MPIEXEC -n "$p" "$PY" bench/latency_paths.py --sizes 4KiB
        done
      done
    done
    ;;
  *)
    echo "gpu_check.sh: unknown step $s" >&2
    failed=$((failed + 1))
    ;;
  esac
done
echo "===== summary ($failed failed)"
cat "$OUT/summary.txt"
exit "$failed"
