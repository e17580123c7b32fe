// How a rank waits for an MPI request it polls with MPI_Test: spin, then yield,
// then sleep, by wall time since the wait began.
//
// Why time and not a poll count: the old rule (sched_yield every 64 polls)
// yielded after ~10 us. Under Linux CFS a yield from a rank whose peer is
// runnable on the same core hands that core away for a whole scheduler slice
// (milliseconds), so on a busy machine every ring step paid a slice: 2 ranks
// at 1-4 MiB were 5-10x slower than MPI_Allreduce on Open MPI (issue 13).
// A ring step's message usually lands within tens of microseconds when the
// peer is running, so we spin through that (kDefaultSpinUs, or what the
// transport chose: none when ranks outnumber cores, DDLFAST_SPIN_US when set;
// MpiTransport::set_spin_us), and give the core away only when the wait is
// clearly long: the peer is descheduled or late, and spinning would only
// steal its core. Waits of a whole timeslice and more then sleep briefly
// between polls instead of yielding, which keeps a rank that waits on a slow
// peer (or a dead one, until the stall limit) from burning a core.
#pragma once

#include <sched.h>
#include <time.h>

#include <chrono>

namespace ddlfast {

class PollBackoff {
 public:
  static constexpr double kDefaultSpinUs = 200.0;  // spin this long before the first yield
  static constexpr double kYieldUntilUs = 10000.0;   // then yield on every poll up to this wait
  static constexpr long kSleepNs = 20000;            // then sleep this long between polls

  explicit PollBackoff(double spin_us = kDefaultSpinUs)
      : spin_us_(spin_us), start_(std::chrono::steady_clock::now()) {}

  // Call after each poll that found nothing done. Returns false while still
  // spinning, true once it gave the core away (then check the stall limit).
  bool idle() {
    const double waited = waited_us();
    if (waited < spin_us_) return false;
    if (waited < kYieldUntilUs) {
      sched_yield();
    } else {
      const timespec pause{0, kSleepNs};
      nanosleep(&pause, nullptr);
    }
    return true;
  }

  // Seconds since the wait began (for the stall limit), and when it began.
  double waited_s() const { return waited_us() * 1e-6; }
  std::chrono::steady_clock::time_point started() const { return start_; }

 private:
  double waited_us() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_).count();
  }

  double spin_us_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace ddlfast
