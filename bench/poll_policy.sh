#!/usr/bin/env bash
# The transport's polling policy before and after (issue 13), on one venv's MPI, quiet and under CPU load.
#
# Builds the core twice from this tree (CUDA off) into build/poll-policy/<venv>/: `after` as it is, `before` with
# src/transport/mpi_transport.cc from $REF (default: where this branch left main: a sched_yield every 64 polls).
# Then, ROUNDS times, runs `python -m ddlfast.bench` (ddlfast beside MPI_Allreduce, alternating per iteration) with each build, quiet and
# with HOGS busy-loop processes (`python3 -c "while True: pass"`, started here and killed by PID after each run),
# and prints each (load, build, size)'s ratio busbw_ddlfast / busbw_mpi over the rounds: median and range.
#
#   DDLFAST_VENV=.venv-ompi bash bench/poll_policy.sh          # the venv set up by scripts/setup.sh for that MPI
#   ROUNDS=5 RANKS=4 SIZES=1MiB,4MiB HOGS=2 bash bench/poll_policy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/mpi_choice.sh
. scripts/mpi_choice.sh
VENV=$(cd "$VENV" && pwd)
PY=$VENV/bin/python
REF=${REF:-$(git merge-base HEAD main)}
ROUNDS=${ROUNDS:-3}
RANKS=${RANKS:-2}
SIZES=${SIZES:-1MiB,4MiB,64MiB}
HOGS=${HOGS:-2}
OUT=$ROOT/build/poll-policy/$(basename "$VENV")
mkdir -p "$OUT/results"

build() {  # build NAME: a staged copy of the package with its own core
  local tree=$OUT/$1/tree
  rm -rf "$tree"
  mkdir -p "$tree"
  cp -r CMakeLists.txt src "$tree/"
  mkdir "$tree/ddlfast"
  cp ddlfast/*.py ddlfast/*.pyx ddlfast/*.pxd "$tree/ddlfast/"
  rm -f "$tree/ddlfast/_mpi_build.py"  # this tree's record may name another venv's MPI
  # No CUDA here; without this stub the editable install's finder would load the source tree's _cuda module.
  echo 'raise ImportError("a staged CPU-only build")' >"$tree/ddlfast/_cuda.py"
  if [ "$1" = before ]; then git show "$REF:src/transport/mpi_transport.cc" >"$tree/src/transport/mpi_transport.cc"; fi
  cmake -S "$tree" -B "$OUT/$1/cmake" -G Ninja -DPython_EXECUTABLE="$PY" -DMPI_C_COMPILER="$VENV/bin/mpicc" \
    -DDDLFAST_CUDA=off -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$tree/ddlfast" >"$OUT/$1/build.log" 2>&1
  cmake --build "$OUT/$1/cmake" --parallel 2 >>"$OUT/$1/build.log" 2>&1 || { tail -30 "$OUT/$1/build.log"; exit 1; }
}
build before
build after

hogs=()
stop_hogs() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done; hogs=(); }
trap stop_hogs EXIT INT TERM
read -r -a flags <<<"$("$PY" tests/mpi/launcher.py)"
# From inside the staged tree: `python -m` puts the working directory first on sys.path.
echo "# $(cd "$OUT/after/tree" && "$PY" -m ddlfast.info --short)"
echo "# ranks $RANKS, sizes $SIZES, $ROUNDS rounds, load = $HOGS busy loops; before = $REF's mpi_transport.cc"
for round in $(seq "$ROUNDS"); do
  for load in quiet loaded; do
    for build in before after; do
      if [ "$load" = loaded ]; then
        for _ in $(seq "$HOGS"); do python3 -c "while True: pass" & hogs+=($!); done
      fi
      result=$OUT/results/$round-$load-$build.txt
      echo "# round $round $load $build: load average $(cut -d' ' -f1 /proc/loadavg)" >"$result"
      (cd "$OUT/$build/tree" && timeout 600 "$VENV/bin/mpiexec" "${flags[@]}" -n "$RANKS" "$PY" -m ddlfast.bench \
        --sizes "$SIZES") >>"$result" 2>&1 || echo "# failed: see $result"
      stop_hogs
    done
  done
done
"$PY" - "$OUT/results" <<'EOF'
import pathlib, statistics, sys
from collections import defaultdict
ratios, times = defaultdict(list), defaultdict(list)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.txt")):
    _, load, build = path.stem.split("-")
    for line in path.read_text(errors="replace").splitlines():
        fields = [field for field in line.split() if field != "|"]
        if len(fields) >= 12 and fields[0].isdigit() and not line.startswith("#"):
            ratios[load, build, int(fields[0])].append(float(fields[11]))
            times[load, build, int(fields[0])].append((float(fields[5]), float(fields[8])))
print(f"{'load':7} {'build':7} {'bytes':>9} | ratio median [min, max] | ddlfast us median | MPI us median | runs")
for key in sorted(ratios, key=lambda k: (k[0] != "quiet", k[2], k[1] != "before")):
    r, t = ratios[key], times[key]
    print(f"{key[0]:7} {key[1]:7} {key[2]:>9} | {statistics.median(r):6.2f} [{min(r):.2f}, {max(r):.2f}]"
          f"       | {statistics.median(x for x, _ in t):15.0f} | {statistics.median(y for _, y in t):13.0f} | {len(r)}")
EOF
