// Recursive doubling (the butterfly) for any rank count, as data: whom a rank
// exchanges with, step by step. The latency path and the per-call agreement
// run it (transport/agreement_exchange.cc). Pure (no I/O), so every rank's
// schedule can be checked in one process by the tests.
//
// With p = 2^L + rest (0 <= rest < 2^L), the first 2*rest ranks fold in
// pairs before the butterfly: even rank 2i gives its value to 2i+1 and waits
// for the result, which 2i+1 sends back after the last step. The other 2^L
// ranks exchange with the partner whose butterfly index differs in bit s at
// step s, so after L steps every rank holds the reduction over all ranks, and
// every pair of ranks is connected through the exchanges (what the agreement
// needs: a mismatch anywhere reaches every rank).
//
// Bits: both partners of an exchange combine (lower rank's value, higher rank's
// value) in that order, so each pair computes the same bits, whatever the op.
#pragma once

#include <vector>

namespace ddlfast {

enum class ButterflyRole : int {
  kFoldOut = 0,   // gives its value to `partner`, gets the result back at the end
  kFoldIn = 1,    // takes `partner`'s value first and sends the result back at the end
  kExchange = 2,  // only the butterfly's steps
};

struct Butterfly {
  ButterflyRole role = ButterflyRole::kExchange;
  int fold_partner = -1;           // kFoldOut, kFoldIn: the other rank of the pair
  std::vector<int> step_partners;  // communicator ranks, one per butterfly step (empty for kFoldOut)
};

Butterfly butterfly(int rank, int size);

}  // namespace ddlfast
