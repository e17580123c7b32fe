// What every agreement message carries ahead of its payload, whichever way it travels: the butterfly's
// point-to-point messages (agreement_exchange.cc) or the slots of a segment shared by every rank of one host
// (shared_agreement.cc). One header, one fingerprint and one comparison, so both forms decide alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/arrivals.h"

namespace ddlfast {
namespace agreement_wire {

struct Header {
  std::uint64_t fingerprint;
  std::uint64_t flags;
  std::uint64_t payload_bytes;
  std::uint64_t form;     // kWhole, kHalving or kGathered
  ArrivalWaits previous;  // the previous collective's waits, reduced so far
};
constexpr std::size_t kHeaderBytes = sizeof(Header);
static_assert(kHeaderBytes == 48, "the payload stays 16-byte aligned behind the header");
constexpr std::uint64_t kMismatch = 1;
constexpr std::uint64_t kWhole = 0;     // every step sends the whole partial result
constexpr std::uint64_t kHalving = 1;   // recursive halving, then doubling (shared memory: scatter, then gather)
constexpr std::uint64_t kGathered = 2;  // shared memory, AgreedReduction::disjoint: each rank's own block copied
constexpr const char* kSmallAllreduce = "the small allreduce (its agreement in the same messages)";
constexpr const char* kAgreement = "the agreement on the collective's arguments";

// splitmix64: the sequence number and the layout digest mixed into one fingerprint.
inline std::uint64_t mix(std::uint64_t sequence, std::uint64_t digest) {
  std::uint64_t z = digest + 0x9e3779b97f4a7c15ULL * (sequence + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline void write_header(char* message, std::uint64_t fingerprint, bool mismatch, std::size_t payload_bytes,
                         std::uint64_t form, const ArrivalWaits& previous) {
  const Header header{fingerprint, mismatch ? kMismatch : 0, payload_bytes, form, previous};
  std::memcpy(message, &header, kHeaderBytes);
}

inline ArrivalWaits waits_in(const char* message) {
  ArrivalWaits waits;
  std::memcpy(&waits, message + offsetof(Header, previous), sizeof(waits));
  return waits;
}

// Whether a received message shows a disagreement: another fingerprint, payload size or form, or a mismatch its
// sender already saw.
inline bool disagrees(const char* message, std::uint64_t fingerprint, std::size_t payload_bytes, std::uint64_t form) {
  Header header;
  std::memcpy(&header, message, kHeaderBytes);
  return header.fingerprint != fingerprint || header.payload_bytes != payload_bytes || header.form != form ||
         (header.flags & kMismatch) != 0;
}

}  // namespace agreement_wire
}  // namespace ddlfast
