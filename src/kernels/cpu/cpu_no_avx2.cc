// Built instead of cpu_avx2.cc when the compiler cannot target AVX2 (e.g. on Arm).
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
const KernelTable* avx2_kernels() { return nullptr; }
}  // namespace ddlfast
