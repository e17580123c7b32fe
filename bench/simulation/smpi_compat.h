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

// Time. Every wait of the engine is bounded and paced by std::chrono::steady_clock (the stall limit, the
// census window, the poll backoff: transport/poll_backoff.h). Under SMPI the wall clock says nothing about
// simulated time: at 1024 ranks one simulated microsecond costs milliseconds of wall time, so a 2 s census
// window closed before any answer could arrive. Here steady_clock is MPI_Wtime, the simulated clock, in every
// translation unit of the driver (the standard headers that use steady_clock are included first, unchanged).
#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

struct ddlfast_sim_clock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<ddlfast_sim_clock>;
  static constexpr bool is_steady = true;
  static time_point now() { return time_point(duration(static_cast<rep>(MPI_Wtime() * 1e9))); }
};
namespace std::chrono {
using ddlfast_sim_steady_clock = ::ddlfast_sim_clock;
}
#define steady_clock ddlfast_sim_steady_clock

// Polling. smpirun runs with smpi/test:1e-7, so a poll costs 0.1 us of simulated time (a spinning rank's poll
// rate); each yield or sleep of a wait (poll_backoff.h) is a simulated pause of 2 % of the simulated time this
// rank has waited so far, from 0.2 us to 1 ms. A message is then noticed within ~2 % (or 0.2 us) of its
// arrival, like a spinning rank, while a long wait (a stall limit, a census window) takes only a few hundred
// polls to simulate.
extern "C" int smpi_nanosleep(const struct timespec* tp, struct timespec* t);

// When this rank's current wait began (simulated seconds; < 0: not waiting), defined in driver.cc. One per
// rank: SMPI privatizes globals (not an `inline` variable: that would be a GNU unique symbol, one for all ranks;
// build.sh passes -fno-gnu-unique for the engine's own inline statics).
extern double ddlfast_sim_wait_start;

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
  pause = pause < 2e-7 ? 2e-7 : (pause > 1e-3 ? 1e-3 : pause);
  const struct timespec interval{0, static_cast<long>(pause * 1e9)};
  return smpi_nanosleep(&interval, nullptr);
}
#undef nanosleep
#define nanosleep(interval, remaining) ((void)(interval), (void)(remaining), ddlfast_sim_pause())
#define sched_yield ddlfast_sim_pause
