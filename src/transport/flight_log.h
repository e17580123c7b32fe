// The flight recorder's per-call facts, kept where they are known for free: every collective passes one
// agreement (MpiTransport::agree), which numbers it, times its arrival, its wait for the other ranks and its
// verdict. The Python side adds what only it knows (the layout behind the fingerprint, the call site) by the
// fingerprint and the site id it passes in, and renders the file (ddlfast/engine/flight.py). A fixed ring of
// plain entries: nothing is allocated per call.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddlfast {

// A collective's state in its entry (ddlfast/engine/flight.py names them).
enum FlightState : int {
  kFlightAgreeing = 0,
  kFlightRunning = 1,
  kFlightDone = 2,
  kFlightFailed = 3,
  kFlightMismatch = 4
};

struct FlightEntry {
  std::uint64_t sequence = 0;
  std::uint64_t fingerprint = 0;  // the digest the caller agreed on (its layout, with its name mixed in)
  std::int64_t site = -1;         // the caller's id of its Python call site (-1: none)
  double arrived_s = 0;           // steady clock, seconds
  double agreed_s = 0;
  double ended_s = 0;
  double wait_s = 0;            // arrival to the agreement's completion
  int state = kFlightAgreeing;  // a FlightState
};

class FlightLog {
 public:
  // capacity 0: off (begin() records nothing).
  void resize(std::size_t capacity) {
    entries_.assign(capacity, FlightEntry{});
    next_ = 0;
    count_ = 0;
    latest_ = nullptr;
  }
  std::size_t capacity() const { return entries_.size(); }

  // The site the next agreement's entry gets (set by the binding just before the call).
  void set_site(std::int64_t site) { site_ = site; }

  // `arrived_s` and `agreed_s`: the agreement's own clock reads (seconds()), so the recorder adds no read but end's.
  void begin(std::uint64_t sequence, std::uint64_t fingerprint, double arrived_s) {
    if (entries_.empty()) return;
    FlightEntry& entry = entries_[next_];
    entry = FlightEntry{sequence, fingerprint, site_, arrived_s, 0, 0, 0, kFlightAgreeing};
    site_ = -1;
    latest_ = &entry;
    next_ = (next_ + 1) % entries_.size();
    if (count_ < entries_.size()) ++count_;
  }
  void agreed(double wait_s, bool agreed, double agreed_s) {
    if (latest_ == nullptr) return;
    latest_->agreed_s = agreed_s;
    latest_->wait_s = wait_s;
    latest_->state = agreed ? kFlightRunning : kFlightMismatch;
    if (!agreed) latest_->ended_s = latest_->agreed_s;
  }
  // The latest collective ended (done or failed); a mismatch stays a mismatch. `with_agreement`: its data rode in
  // the agreement's messages (the latency path), so it ended when the agreement did: no clock read more.
  void end(bool ok, bool with_agreement = false) {
    if (latest_ == nullptr || latest_->state == kFlightMismatch || latest_->ended_s != 0) return;
    latest_->ended_s = with_agreement && latest_->agreed_s != 0 ? latest_->agreed_s : now();
    latest_->state = ok ? kFlightDone : kFlightFailed;
  }

  // The latest `last` kept entries (all: 0), oldest first.
  std::vector<FlightEntry> entries(std::size_t last = 0) const {
    const std::size_t count = last == 0 || last > count_ ? count_ : last;
    std::vector<FlightEntry> out;
    out.reserve(count);
    if (count == 0) return out;
    const std::size_t first = (next_ + entries_.size() - count) % entries_.size();
    for (std::size_t i = 0; i < count; ++i) out.push_back(entries_[(first + i) % entries_.size()]);
    return out;
  }

  static double seconds(std::chrono::steady_clock::time_point when) {
    return std::chrono::duration<double>(when.time_since_epoch()).count();
  }
  static double now() { return seconds(std::chrono::steady_clock::now()); }

 private:
  std::vector<FlightEntry> entries_;
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  FlightEntry* latest_ = nullptr;
  std::int64_t site_ = -1;
};

}  // namespace ddlfast
