// MPI's fault-tolerance extension (ULFM: MPIX_Comm_revoke, MPIX_Comm_get_failed), where the MPI has it: Open MPI 5
// builds it in (mpi-ext.h, OMPI_HAVE_MPI_EXT_FTMPI) and turns it on for jobs launched with `mpirun --with-ft ulfm`.
// The transport uses it in one place (MpiTransport::abandon_and_tell): when MPI itself reports a dead rank, the
// transport revokes its communicators instead of running a stall census, so every survivor's pending and later
// operations on them fail at once (MPI_ERR_REVOKED) and the survivors can shrink and go on (ddlfast/ulfm.py).
// Without the extension (MPICH, older Open MPI) every function here is a no-op and nothing changes.
#pragma once

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
#define DDLFAST_HAVE_ULFM 1
#else
#define DDLFAST_HAVE_ULFM 0
#endif

namespace ddlfast {

// Whether MPI knows of a failed rank of `comm`, or `comm` was revoked (another survivor found one).
inline bool ulfm_failure_known(MPI_Comm comm) {
#if DDLFAST_HAVE_ULFM
  if (comm == MPI_COMM_NULL) return false;
  int revoked = 0;
  if (MPIX_Comm_is_revoked(comm, &revoked) == MPI_SUCCESS && revoked) return true;
  MPI_Group failed = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(comm, &failed) != MPI_SUCCESS) return false;
  int count = 0;
  MPI_Group_size(failed, &count);
  MPI_Group_free(&failed);
  return count > 0;
#else
  (void)comm;
  return false;
#endif
}

// Whether `code` is one of ULFM's error classes (a dead peer, a revoked communicator).
inline bool ulfm_error(int code) {
#if DDLFAST_HAVE_ULFM
  int error_class = code;
  MPI_Error_class(code, &error_class);
  return error_class == MPIX_ERR_PROC_FAILED || error_class == MPIX_ERR_PROC_FAILED_PENDING ||
         error_class == MPIX_ERR_REVOKED;
#else
  (void)code;
  return false;
#endif
}

inline void ulfm_revoke(MPI_Comm comm) {
#if DDLFAST_HAVE_ULFM
  if (comm != MPI_COMM_NULL) MPIX_Comm_revoke(comm);
#else
  (void)comm;
#endif
}

}  // namespace ddlfast
