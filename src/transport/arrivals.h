// Who the others waited for (ddlfast.stragglers()).
//
// Each rank measures, on its own clock, how long it waited in each
// collective's agreement: from its arrival to the agreement's completion. The
// rank that arrived last waited least, and the others waited for it. That wait
// rides in the header of the next collective's agreement, reduced on the way
// to the least wait with its rank (one packed key, so min() is MINLOC with ties
// to the lower rank) and the most wait. The butterfly hands every rank the same
// reduction, so every rank keeps the same log, without a message more and
// without comparing clocks across hosts: only differences of waits are used.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace ddlfast {

// The two numbers an agreement's header carries about the previous collective.
struct ArrivalWaits {
  std::uint64_t least_key = kNone;  // wait in microseconds << kRankBits | rank: min() is MINLOC
  std::uint64_t most_us = 0;
  static constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();
  static constexpr int kRankBits = 24;  // 16 M ranks; the wait keeps 40 bits of microseconds (12 days)

  static ArrivalWaits of_rank(std::uint64_t wait_us, int rank) {
    const std::uint64_t capped = std::min<std::uint64_t>(wait_us, (std::uint64_t{1} << (64 - kRankBits)) - 2);
    return {capped << kRankBits | static_cast<std::uint64_t>(rank), capped};
  }
  void combine(const ArrivalWaits& other) {
    least_key = std::min(least_key, other.least_key);
    most_us = std::max(most_us, other.most_us);
  }
  bool known() const { return least_key != kNone; }
  int last_rank() const { return static_cast<int>(least_key & ((std::uint64_t{1} << kRankBits) - 1)); }
  std::uint64_t least_us() const { return least_key >> kRankBits; }
};

struct ArrivalRecord {
  std::uint64_t sequence = 0;  // the collective these waits were measured in
  int last_rank = -1;          // who waited least: the others waited for it
  std::uint64_t least_us = 0;
  std::uint64_t most_us = 0;  // most - least: how long it held the earliest rank
};

// The last kCapacity collectives' records, the same on every rank; and the warning of
// DDLFAST_STRAGGLER_WARN_S, decided here so that no Python runs per call to decide it.
class ArrivalLog {
 public:
  static constexpr std::size_t kCapacity = 4096;
  static constexpr std::size_t kWarnWindow = 100;  // collectives the warning's sum runs over

  explicit ArrivalLog(int ranks) : held_in_window_(static_cast<std::size_t>(ranks), 0), warned_(ranks, 0) {}

  void add(std::uint64_t sequence, const ArrivalWaits& waits) {
    if (!waits.known()) return;
    const ArrivalRecord record{sequence, waits.last_rank(), waits.least_us(), waits.most_us};
    if (records_.size() < kCapacity) {
      records_.push_back(record);
    } else {
      records_[next_] = record;
    }
    next_ = (next_ + 1) % kCapacity;
    if (warn_us_ == 0) return;
    window(record, +1);
    if (++in_window_ > kWarnWindow) window(at(kWarnWindow), -1);  // the record that left the window
    const auto rank = static_cast<std::size_t>(record.last_rank);
    if (rank < held_in_window_.size() && !warned_[rank] && held_in_window_[rank] > warn_us_) {
      warned_[rank] = 1;
      warning_rank_ = record.last_rank;
      warning_held_us_ = held_in_window_[rank];
    }
  }

  // The last `count` records (fewer when fewer were kept), oldest first.
  std::vector<ArrivalRecord> last(std::size_t count) const {
    count = std::min(count, records_.size());
    std::vector<ArrivalRecord> out;
    out.reserve(count);
    for (std::size_t back = count; back > 0; --back) out.push_back(at(back - 1));
    return out;
  }

  // warn_us > 0: once a rank has held the others more than warn_us within the last kWarnWindow collectives
  // (counting only collectives where it held them more than noise_us), take_warning() names it, once per rank.
  void set_warning(std::uint64_t warn_us, std::uint64_t noise_us) {
    warn_us_ = warn_us;
    noise_us_ = noise_us;
    in_window_ = 0;
    std::fill(held_in_window_.begin(), held_in_window_.end(), 0);
  }
  // The rank to warn about (-1: none), and its hold in the window; cleared by the call.
  int take_warning(std::uint64_t* held_us) {
    const int rank = warning_rank_;
    *held_us = warning_held_us_;
    warning_rank_ = -1;
    return rank;
  }
  bool warning_pending() const { return warning_rank_ >= 0; }

 private:
  // The record `back` places before the newest (0: the newest).
  const ArrivalRecord& at(std::size_t back) const { return records_[(next_ + kCapacity * 2 - 1 - back) % kCapacity]; }
  void window(const ArrivalRecord& record, int sign) {
    const std::uint64_t held = record.most_us - record.least_us;
    const auto rank = static_cast<std::size_t>(record.last_rank);
    if (held <= noise_us_ || rank >= held_in_window_.size()) return;
    held_in_window_[rank] = sign > 0 ? held_in_window_[rank] + held : held_in_window_[rank] - held;
  }

  std::vector<ArrivalRecord> records_;
  std::size_t next_ = 0;
  std::uint64_t in_window_ = 0;  // records added since the warning was set
  std::uint64_t warn_us_ = 0;
  std::uint64_t noise_us_ = 0;
  std::vector<std::uint64_t> held_in_window_;
  std::vector<char> warned_;
  int warning_rank_ = -1;
  std::uint64_t warning_held_us_ = 0;
};

}  // namespace ddlfast
