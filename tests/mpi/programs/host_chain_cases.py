"""Runs on every rank: the host-aware canonical order (bench/emulation/host_chain.py, the world cut into two
"hosts" of P/2 ranks) gives reproducible=True's bits, and both equal an independent NumPy computation of the
canonical order (rank order, float32 additions), on random float32 data of sizes above and below the
small-message limit. Exits non-zero on any failure."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from harness import comm, failures, rank, report_and_exit, world  # a sibling program

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "emulation"))

from host_chain import HostChain  # noqa: E402

import ddlfast  # noqa: E402

cases = 0


def main() -> None:
    global cases
    chain = HostChain(comm, world // 2)
    for n in (world * 5, world * 40_000):  # below and above DDLFAST_SMALL_BYTES
        everyone = [np.random.default_rng([n, r]).standard_normal(n).astype(np.float32) * 10.0 ** (r % 3)
                    for r in range(world)]
        canonical = everyone[0].copy()
        for x in everyone[1:]:
            canonical = canonical + x  # float32 + float32: one rounding each
        got = everyone[rank].copy()
        chain.allreduce(got)
        reproducible = ddlfast.allreduce(everyone[rank].copy(), reproducible=True)
        for name, result in (("host chain", got), ("reproducible=True", reproducible)):
            cases += 1
            if not np.array_equal(result.view(np.uint32), canonical.view(np.uint32)):
                wrong = np.flatnonzero(result.view(np.uint32) != canonical.view(np.uint32))
                failures.append(f"rank {rank} n={n} {name}: {wrong.size} elements differ from the canonical order")
    report_and_exit(f"{cases} cases, ")


if __name__ == "__main__":
    main()
