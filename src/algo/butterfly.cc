#include "algo/butterfly.h"

namespace ddlfast {

Butterfly butterfly(int rank, int size) {
  Butterfly plan;
  int power = 1;
  while (power * 2 <= size) power *= 2;
  const int rest = size - power;
  int index = rank - rest;  // this rank's butterfly index (ranks past the folded pairs)
  if (rank < 2 * rest) {
    plan.fold_partner = rank ^ 1;
    if (rank % 2 == 0) {
      plan.role = ButterflyRole::kFoldOut;
      return plan;
    }
    plan.role = ButterflyRole::kFoldIn;
    index = rank / 2;
  }
  for (int mask = 1; mask < power; mask *= 2) {
    const int partner = index ^ mask;
    plan.step_partners.push_back(partner < rest ? 2 * partner + 1 : partner + rest);
  }
  return plan;
}

}  // namespace ddlfast
