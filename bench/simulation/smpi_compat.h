// Force-included (-include) into every translation unit of the simulation
// driver: MPI calls that SimGrid's SMPI (3.32) does not implement, mapped to
// ones it does, so the engine's sources build unchanged.
#pragma once

#include <mpi.h>

// SMPI aborts in MPI_Comm_idup ("Not yet implemented"). The blocking duplicate
// gives the same communicator; the request is MPI_REQUEST_NULL, which MPI_Test
// reports as complete at once. (The stall limit on context creation is off in
// the simulation anyway.)
static inline int ddlfast_sim_comm_idup(MPI_Comm comm, MPI_Comm* copy, MPI_Request* request) {
  *request = MPI_REQUEST_NULL;
  return MPI_Comm_dup(comm, copy);
}
#define MPI_Comm_idup ddlfast_sim_comm_idup

// Polling. The engine waits by polling MPI_Test and, once a wait is long by the wall clock, yielding or
// sleeping 20 us between polls (transport/poll_backoff.h). Under SMPI the wall clock says nothing about
// simulated time (at 1024 ranks every wait is "long"), and smpirun runs with smpi/test:0 so a poll itself
// costs no simulated time: here each yield or sleep of a wait is a simulated pause of 2 % of the simulated time
// this rank has waited so far (at least 0.2 us, at most 20 us). A message is then noticed within ~2 % (or 0.2 us)
// of its arrival, like a spinning rank, while a long wait still takes only a few hundred polls to simulate.
#include <sched.h>
#include <time.h>

extern "C" int smpi_nanosleep(const struct timespec* tp, struct timespec* t);

// When this rank's current wait began (simulated seconds; < 0: not waiting). One per rank: SMPI privatizes
// globals, and `inline` makes it one variable across the translation units.
inline double ddlfast_sim_wait_start = -1.0;

static inline int ddlfast_sim_test(MPI_Request* request, int* flag, MPI_Status* status) {
  if (*request == MPI_REQUEST_NULL) {  // SMPI (3.32) leaves *flag unset here; the standard says complete
    *flag = 1;
    return MPI_SUCCESS;
  }
  const int code = MPI_Test(request, flag, status);
  if (*flag) {
    ddlfast_sim_wait_start = -1.0;
  } else if (ddlfast_sim_wait_start < 0) {
    ddlfast_sim_wait_start = MPI_Wtime();
  }
  return code;
}
#define MPI_Test ddlfast_sim_test

static inline int ddlfast_sim_pause() {
  const double waited = ddlfast_sim_wait_start < 0 ? 0.0 : MPI_Wtime() - ddlfast_sim_wait_start;
  double pause = 0.02 * waited;
  pause = pause < 2e-7 ? 2e-7 : (pause > 2e-5 ? 2e-5 : pause);
  const struct timespec interval{0, static_cast<long>(pause * 1e9)};
  return smpi_nanosleep(&interval, nullptr);
}
#undef nanosleep
#define nanosleep(interval, remaining) ((void)(interval), (void)(remaining), ddlfast_sim_pause())
#define sched_yield ddlfast_sim_pause
