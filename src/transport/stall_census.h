// What MpiTransport's stall census (transport/stall_census.cc) and the rest of the transport share: the census's
// timing and tags, what an ask says of its sender, and the texts its messages are made of. Internal to
// transport/.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "transport/mpi_transport.h"

namespace ddlfast {

// How long a stalled rank waits for census answers, and an answering rank for the verdict.
constexpr double kCensusSeconds = 2.0;
constexpr int kAskTag = 1;
constexpr int kReplyTag = 2;
constexpr int kVerdictTag = 3;
// What a census ask says of its sender: it passed the stall limit, or it abandoned a collective after an error.
constexpr std::int64_t kAskAfterStall = 0;
constexpr std::int64_t kAskAfterFailure = 1;
constexpr std::int64_t kAskAfterInterrupt = 2;  // a signal (Ctrl-C) interrupted its wait

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// What a rank waits in, as a census reports it: "collective #4", "a point-to-point receive from rank 0 with tag 7".
inline std::string wait_text(std::int64_t kind, std::int64_t peer, std::int64_t tag, std::int64_t sequence) {
  if (kind != MpiTransport::kWaitReceive && kind != MpiTransport::kWaitSend) {
    return "collective #" + std::to_string(sequence);
  }
  const bool receive = kind == MpiTransport::kWaitReceive;
  const std::string whom = peer < 0 ? std::string("any rank") : "rank " + std::to_string(peer);
  return std::string("a point-to-point ") + (receive ? "receive from " : "send to ") + whom + " with tag " +
         std::to_string(tag);
}

// "0-776,778-1023": runs of consecutive ranks as ranges, so a census at 1024 ranks names the missing ones in a
// line, not in 4 KB of numbers (issue 23).
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t end = i;
    while (end + 1 < ranks.size() && ranks[end + 1] == ranks[end] + 1) ++end;
    text += (text.empty() ? "" : ",") + std::to_string(ranks[i]);
    if (end > i) text += (end > i + 1 ? "-" : ",") + std::to_string(ranks[end]);
    i = end + 1;
  }
  return text;
}

inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", seconds);
  return text;
}

}  // namespace ddlfast
