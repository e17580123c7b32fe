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

// Polling. A poll costs 0.1 us of simulated time (smpirun's smpi/test:1e-7), the same for every poll:
// smpirun also passes smpi/grow-injected-times:no, because SMPI (3.32) otherwise multiplies that cost by a
// counter that is one static for the whole simulation (every rank's failed MPI_Test raises it, any rank's
// success resets it): a rank's poll cost then grew with the number of ranks polling, and a case's time depended
// on the cases before it (the 256-rank agreement: 0.496 ms instead of 0.058; docs/scale.md).
//
// Waiting. Where the stall limit is off (every timed run; the driver sets ddlfast_sim_blocking_waits), a pause
// of the engine's wait (a yield or sleep of poll_backoff.h) blocks in MPI_Waitany on the requests this rank
// found pending since its last post: the rank resumes the simulated instant the first of them completes, as a
// spinning rank would, at two simcalls per wait instead of hundreds of polls. The completed request's handle is
// set to MPI_REQUEST_NULL in the engine's own storage, which the next MPI_Test reports as complete. Requests of
// non-blocking collectives and receives from MPI_ANY_SOURCE (the census's) are never waited on here: SMPI's
// MPI_Waitany would take a collective's request for a finished one. With the stall limit on (the census
// runs), or nothing to wait on, a pause is a simulated sleep of 2 % of the simulated time this rank has waited
// so far, from 0.2 us to 1 ms: a message is noticed within ~2 % of its arrival while a long wait (a stall limit,
// a census window) takes only a few hundred polls to simulate.
extern "C" int smpi_nanosleep(const struct timespec* tp, struct timespec* t);

// Per-rank state, defined in driver.cc. SMPI privatizes globals, one copy per rank (not `inline` variables:
// those would be GNU unique symbols, one for all ranks; build.sh passes -fno-gnu-unique for the engine's own).
constexpr int kSimPendingMax = 64;
extern double ddlfast_sim_wait_start;               // when this rank's current wait began (< 0: not waiting)
extern bool ddlfast_sim_blocking_waits;             // the stall limit is off: a pause may block
extern MPI_Request* ddlfast_sim_pending[];          // requests found pending since the last post, pause or success
extern int ddlfast_sim_pending_count;
extern MPI_Request ddlfast_sim_unwaitable[];        // collectives' and any-source receives' handles (a ring)
extern int ddlfast_sim_unwaitable_next;

static inline void ddlfast_sim_unwaitable_add(MPI_Request request) {
  ddlfast_sim_unwaitable[ddlfast_sim_unwaitable_next] = request;
  ddlfast_sim_unwaitable_next = (ddlfast_sim_unwaitable_next + 1) % kSimPendingMax;
}

// A completed collective's handle leaves the ring: SMPI reuses a freed request's handle for a later one, which
// would then be taken for a collective's (polled instead of waited on: a poll's 0.1 us more or less, by
// allocation history).
static inline void ddlfast_sim_unwaitable_remove(MPI_Request request) {
  for (int i = 0; i < kSimPendingMax; ++i) {
    if (ddlfast_sim_unwaitable[i] == request) ddlfast_sim_unwaitable[i] = MPI_REQUEST_NULL;
  }
}

static inline bool ddlfast_sim_waitable(MPI_Request request) {
  for (int i = 0; i < kSimPendingMax; ++i) {
    if (ddlfast_sim_unwaitable[i] == request) return false;
  }
  return true;
}

// A post may move the engine's request storage (a growing vector): forget every pointer taken before it.
static inline int ddlfast_sim_posted(int code) {
  ddlfast_sim_pending_count = 0;
  return code;
}

static inline int ddlfast_sim_test(MPI_Request* request, int* flag, MPI_Status* status) {
  if (*request == MPI_REQUEST_NULL) {  // SMPI (3.32) leaves *flag unset here; the standard says complete
    *flag = 1;
    return MPI_SUCCESS;
  }
  const MPI_Request handle = *request;
  const int code = MPI_Test(request, flag, status);
  if (*flag) {
    ddlfast_sim_unwaitable_remove(handle);
    ddlfast_sim_wait_start = -1.0;
    ddlfast_sim_pending_count = 0;  // a pointer taken before may belong to a wait that has ended
  } else {
    if (ddlfast_sim_wait_start < 0) ddlfast_sim_wait_start = MPI_Wtime();
    bool known = false;
    for (int i = 0; i < ddlfast_sim_pending_count; ++i) known = known || ddlfast_sim_pending[i] == request;
    if (!known && ddlfast_sim_pending_count < kSimPendingMax && ddlfast_sim_waitable(handle)) {
      ddlfast_sim_pending[ddlfast_sim_pending_count++] = request;
    }
  }
  return code;
}

static inline int ddlfast_sim_pause() {
  if (ddlfast_sim_blocking_waits && ddlfast_sim_pending_count > 0) {
    MPI_Request handles[kSimPendingMax];
    for (int i = 0; i < ddlfast_sim_pending_count; ++i) handles[i] = *ddlfast_sim_pending[i];
    int index = MPI_UNDEFINED;
    MPI_Waitany(ddlfast_sim_pending_count, handles, &index, MPI_STATUS_IGNORE);
    if (index != MPI_UNDEFINED) *ddlfast_sim_pending[index] = handles[index];  // MPI_REQUEST_NULL: complete
    ddlfast_sim_pending_count = 0;
    if (index != MPI_UNDEFINED) return 0;
  }
  const double waited = ddlfast_sim_wait_start < 0 ? 0.0 : MPI_Wtime() - ddlfast_sim_wait_start;
  double pause = 0.02 * waited;
  pause = pause < 2e-7 ? 2e-7 : (pause > 1e-3 ? 1e-3 : pause);
  const struct timespec interval{0, static_cast<long>(pause * 1e9)};
  return smpi_nanosleep(&interval, nullptr);
}
#undef nanosleep
#define nanosleep(interval, remaining) ((void)(interval), (void)(remaining), ddlfast_sim_pause())
#define sched_yield ddlfast_sim_pause

// The transport spins before its first pause when this machine has a core per rank of a host
// (MpiTransport::choose_spin): that would make the simulation depend on the machine running it (a spin polls
// every 0.1 us of simulated time for 200 us). A simulated rank has no core of its own: no spin, ever.
static inline int ddlfast_sim_getaffinity(pid_t, size_t size, cpu_set_t* set) {
  CPU_ZERO_S(size, set);
  return 0;
}
#define sched_getaffinity ddlfast_sim_getaffinity

static inline int ddlfast_sim_irecv(void* buffer, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm,
                                    MPI_Request* request) {
  const int code = ddlfast_sim_posted(MPI_Irecv(buffer, count, type, source, tag, comm, request));
  if (source == MPI_ANY_SOURCE) ddlfast_sim_unwaitable_add(*request);
  return code;
}

// The non-blocking collectives (the small-message handoffs): never waited on by ddlfast_sim_pause.
static inline int ddlfast_sim_collective(int code, MPI_Request* request) {
  ddlfast_sim_unwaitable_add(*request);
  return ddlfast_sim_posted(code);
}
// SMPI (3.32) returns wrong sums from MPI_Iallreduce with MPI_IN_PLACE above a few KiB (NaN on every rank for
// 64 KiB of floats at 64 ranks; its blocking MPI_Allreduce is right): the in-place form (the engine's handoff to
// MPI, MpiTransport::native_allreduce) runs the blocking call, with the algorithm smpirun selected, and its
// request is MPI_REQUEST_NULL, complete at once.
static inline int ddlfast_sim_iallreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op,
                                         MPI_Comm comm, MPI_Request* request) {
  if (send == MPI_IN_PLACE) {
    *request = MPI_REQUEST_NULL;
    return ddlfast_sim_posted(MPI_Allreduce(MPI_IN_PLACE, receive, count, type, op, comm));
  }
  return ddlfast_sim_collective(MPI_Iallreduce(send, receive, count, type, op, comm, request), request);
}
static inline int ddlfast_sim_ireduce_scatter(const void* send, void* receive, const int* counts, MPI_Datatype type,
                                              MPI_Op op, MPI_Comm comm, MPI_Request* request) {
  return ddlfast_sim_collective(MPI_Ireduce_scatter(send, receive, counts, type, op, comm, request), request);
}
static inline int ddlfast_sim_iallgather(const void* send, int send_count, MPI_Datatype send_type, void* receive,
                                         int receive_count, MPI_Datatype receive_type, MPI_Comm comm,
                                         MPI_Request* request) {
  return ddlfast_sim_collective(
      MPI_Iallgather(send, send_count, send_type, receive, receive_count, receive_type, comm, request), request);
}
static inline int ddlfast_sim_iallgatherv(const void* send, int send_count, MPI_Datatype send_type, void* receive,
                                          const int* counts, const int* displacements, MPI_Datatype receive_type,
                                          MPI_Comm comm, MPI_Request* request) {
  return ddlfast_sim_collective(MPI_Iallgatherv(send, send_count, send_type, receive, counts, displacements,
                                                receive_type, comm, request),
                                request);
}

#undef MPI_Test
#define MPI_Test ddlfast_sim_test
#undef MPI_Isend
#define MPI_Isend(...) ddlfast_sim_posted(MPI_Isend(__VA_ARGS__))
#undef MPI_Irecv
#define MPI_Irecv ddlfast_sim_irecv
#undef MPI_Iallreduce
#define MPI_Iallreduce ddlfast_sim_iallreduce
#undef MPI_Ireduce_scatter
#define MPI_Ireduce_scatter ddlfast_sim_ireduce_scatter
#undef MPI_Iallgather
#define MPI_Iallgather ddlfast_sim_iallgather
#undef MPI_Iallgatherv
#define MPI_Iallgatherv ddlfast_sim_iallgatherv
