#!/usr/bin/env bash
# ASan + UBSan build of the compiled core, then the unit tests, a small
# multi-rank fuzz (with faults) and the failure paths against it. Exits
# non-zero on any sanitizer report.
#
#   bash scripts/sanitize.sh                  # build + tests/unit + 3-rank fuzz
#   bash scripts/sanitize.sh -k kernels       # extra arguments go to pytest
#   SANITIZE_MPI=0 bash scripts/sanitize.sh   # skip the multi-rank step
#
# The normal editable install is left alone: CMake configures its own build
# folder (build/sanitize/cmake, -DDDLFAST_SANITIZE=ON, CUDA off) and writes the
# instrumented _core into build/sanitize/stage/ddlfast next to a copy of the
# Python package; the tests run from a copy of tests/ in build/sanitize/stage
# with PYTHONPATH pointing there, so `import ddlfast` finds the staged package
# first (the editable install's finder comes after sys.path), in pytest and in
# every mpiexec rank. The script checks that it did.
#
# The Python interpreter is not instrumented, so libasan (and libubsan) are
# preloaded. Leak detection is off: CPython, NumPy and MPICH keep memory alive
# until exit by design and would drown any report (leaks are the soak test's
# job: tests/mpi/test_soak.py). UBSan aborts on the first report
# (-fno-sanitize-recover=undefined in CMakeLists.txt), ASan halts on the first;
# every report is also written under build/sanitize/reports and any file there
# fails the run, so a report cannot be lost in a subprocess whose exit status
# is swallowed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/mpi_choice.sh
. scripts/mpi_choice.sh  # the venv (DDLFAST_VENV) and its MPI
VENV=$(cd "$VENV" && pwd)
PYTHON=$VENV/bin/python
OUT=${DDLFAST_SANITIZE_DIR:-$ROOT/build/sanitize}
STAGE=$OUT/stage
start=$(date +%s)

# ---- build -------------------------------------------------------------------------------------------------------
rm -rf "$STAGE"
mkdir -p "$STAGE/ddlfast"
(cd ddlfast && find . -type f \( -name '*.py' -o -name '*.pxd' -o -name '*.pyx' -o -name '*.pxi' -o -name '*.xml' \) \
  -not -path '*/__pycache__/*' -exec cp --parents {} "$STAGE/ddlfast/" \;)  # the subpackages and the platforms too
cp -r tests "$STAGE/tests"
cp -r docs "$STAGE/docs"  # tests check the documented tables
cp pyproject.toml "$STAGE/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
cmake -S "$ROOT" -B "$OUT/cmake" -G Ninja --log-level=WARNING \
  -DPython_EXECUTABLE="$PYTHON" \
  -DMPI_C_COMPILER="$VENV/bin/mpicc" \
  -DDDLFAST_SANITIZE=ON -DDDLFAST_CUDA=off \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$STAGE/ddlfast" >"$OUT/configure.log" 2>&1 \
  || { cat "$OUT/configure.log"; exit 1; }
cmake --build "$OUT/cmake" --parallel "${SANITIZE_JOBS:-2}" >"$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; echo "sanitize: build failed (log: $OUT/build.log)" >&2; exit 1; }
so=$(ls "$STAGE"/ddlfast/_core*.so)
# Not `nm | grep -q` under pipefail: grep exits at its first match and nm, still writing, dies of SIGPIPE.
symbols=$(nm -D "$so")
if ! grep -q __asan_init <<<"$symbols" || ! grep -q __ubsan_handle <<<"$symbols"; then
  echo "sanitize: $so is not instrumented with ASan and UBSan" >&2
  exit 1
fi
# The staged record of the build (ddlfast/_mpi_build.py, copied from the main build) must name the modules this
# build made, or `import ddlfast` refuses them as stale (ddlfast/mpi_check.py).
"$PYTHON" - "$STAGE/ddlfast" <<'EOF'
import pathlib
import sys

package = pathlib.Path(sys.argv[1])
record = package / "_mpi_build.py"
if record.exists():
    built = {path.name: path.stat().st_size for name in ("_core", "_cuda", "_testing", "_testing_cuda")
             for path in package.glob(f"{name}.*.so")}
    lines = [line for line in record.read_text().splitlines() if not line.startswith("MODULES =")]
    record.write_text("\n".join([*lines, f"MODULES = {built!r}"]) + "\n")
EOF
built=$(date +%s)
echo "sanitize: built $so in $((built - start)) s"

# ---- run -------------------------------------------------------------------------------------------------------
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export LD_PRELOAD
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:exitcode=86:strict_string_checks=1:check_initialization_order=1:\
detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$STAGE
export DDLFAST_CUDA=off  # what this build is (tests/unit/test_build_info.py reads it)
export PATH="$VENV/bin:$PATH"
LOG=$OUT/run.log
: >"$LOG"

status=0
step() {  # runs "$@" with its output shown and kept in $LOG; remembers the first failure
  local code=0
  "$@" 2>&1 | tee -a "$LOG" || code=${PIPESTATUS[0]}
  if [ "$status" = 0 ] && [ "$code" != 0 ]; then status=$code; fi
  return 0
}

cd "$STAGE"
step "$PYTHON" -c "
import ddlfast._core as core
assert core.__file__.startswith('$STAGE/'), f'imported {core.__file__}, not the sanitized build'
print('sanitize: testing', core.__file__, core.selected_kernel_path())"
# --capture=sys: a sanitizer writes to file descriptor 2 and may abort the process; pytest's default fd capture
# would swallow the report with the process.
# The tests of the repository tree itself (the paths the docs name, the sdist's contents, the simulator's sources,
# the rounding emulation in bench/, the layers of docs/architecture.md against src/) run in the main run: the stage
# holds only the package and the tests.
[ "$status" = 0 ] && step "$PYTHON" -m pytest tests/unit -q -p no:cacheprovider --capture=sys -x \
  --ignore tests/unit/test_doc_paths.py --ignore tests/unit/test_packaging.py --ignore tests/unit/test_simulate.py \
  --ignore tests/unit/test_rounding_error.py --ignore tests/unit/test_architecture.py "$@"
if [ "$status" = 0 ] && [ "${SANITIZE_MPI:-1}" != 0 ]; then
  # Every shape, dtype, compression and settings path on real ranks, kept short (ASan is ~3x slower).
  # SANITIZE_FUZZ_ARGS adds fuzz_cases.py options, e.g. "--misaligned 0".
  # shellcheck disable=SC2086
  read -r -a launcher_flags <<<"$("$PYTHON" tests/mpi/launcher.py)"  # e.g. Open MPI's --oversubscribe
  DDLFAST_TIMEOUT_S=120 step mpiexec "${launcher_flags[@]}" -n 3 "$PYTHON" tests/mpi/programs/fuzz_cases.py \
    --seed "${SANITIZE_FUZZ_SEED:-1}" --cases "${SANITIZE_FUZZ_CASES:-150}" --large 30000 --faults 0.1 \
    ${SANITIZE_FUZZ_ARGS:-}
  if [ "$status" = 0 ] && ! grep -q "(core: $STAGE/" "$LOG"; then
    echo "sanitize: the ranks did not load the sanitized core" >&2
    status=1
  fi
  # The failure paths: a collective abandoned mid-way (receives cancelled, the others told), a stall census.
  for case in error-then-calls stall-then-calls; do
    [ "$status" = 0 ] && DDLFAST_TIMEOUT_S=3 DDLFAST_ABORT_ON_STALL=0 step mpiexec -n 3 "$PYTHON" \
      tests/mpi/programs/faults.py "$case"
  done
fi
if grep -E -q "ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY: [A-Za-z]*Sanitizer" "$LOG"; then
  echo "sanitize: FAILED, sanitizer reports:" >&2
  grep -E -A3 "ERROR: (Address|Leak)Sanitizer|runtime error:" "$LOG" | head -60 >&2
  echo "(full output: $LOG)" >&2
  exit 1
fi
if [ "$status" != 0 ]; then
  echo "sanitize: FAILED (exit status $status; output: $LOG)" >&2
  exit "$status"
fi
echo "sanitize: clean (ASan + UBSan): tests/unit, the 3-rank fuzz and the failure paths in $(($(date +%s) - start)) s"
