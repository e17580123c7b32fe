"""Elastic training under ULFM (tests/mpi/test_elastic.py): ranks train a small model for STEPS steps with
ddlfast.elastic, committing every COMMIT_EVERY steps, while the ranks named by the kill specs SIGKILL themselves
at chosen points. Each survivor writes its final parameters and the membership history it lived through
(the step it resumed from and the new size, per loss) to OUT/rank<r>.npz; the test computes the reference.

Usage: elastic_train.py OUT KILLS, KILLS a comma-separated list of RANK:POINT:STEP (RANK as numbered at the start):
  between    dies at the top of STEP, outside any collective
  agreement  sleeps 0.3 s at the top of STEP, then dies (the others wait in STEP's agreement)
  ring       dies 5 ms into STEP's allreduce of 2 MiB (mid-ring)
  async      dies 5 ms after submitting STEP's allreduce_async (STEP % 3 == 2: that step is asynchronous)
  commit     dies in the commit after STEP, before its barrier, after 0.3 s (the others wait in the barrier, which
             cannot complete without it; a kill timed from the commit instead landed anywhere later, even after
             the last step)
  sync       dies inside the first sync after a loss (the recovery itself), as it starts that sync's broadcast:
             after the agreement on the commits, before the state moves, so the others wait for it in the
             broadcast; STEP is ignored

The model is exact arithmetic on integer-valued float64 (sums of small integers), so that any summation order
gives the same bits and the reference can be computed by NumPy alone: elastic_reference() below, which the test
imports.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

STEPS = 30
COMMIT_EVERY = 5
ELEMENTS = 1 << 18  # 2 MiB of float64: far above DDLFAST_SMALL_BYTES, the ring


def initial_params() -> np.ndarray:
    return np.arange(ELEMENTS, dtype=np.float64) % 4093


def gradient(params: np.ndarray, step: int, rank: int, size: int) -> np.ndarray:
    """Integers in [-8, 8]: rank `rank` of `size` at `step` (its data shard)."""
    return np.mod(params * (rank + 1) + step * 7 + size * 3, 17) - 8


def apply(params: np.ndarray, summed: np.ndarray) -> None:
    np.mod(params + summed, 4093, out=params)


def elastic_reference(history: list[tuple[int, int]], start_size: int) -> np.ndarray:
    """The parameters after STEPS steps when the world had `start_size` ranks until the first (resume step, new
    size) of `history`, and so on: NumPy alone, each step's sum over the ranks of that world."""
    params = initial_params()
    sizes = [(0, start_size), *history]
    for step in range(STEPS):
        size = [n for resumed, n in sizes if resumed <= step][-1]
        apply(params, sum(gradient(params, step, r, size) for r in range(size)))
    return params


def die(after: float) -> None:
    def kill() -> None:
        time.sleep(after)
        print(f"DEATH {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if after == 0:
        kill()
        while True:  # SIGKILL to itself: never returns
            time.sleep(1)
    threading.Thread(target=kill, daemon=True).start()


def main() -> None:
    import ddlfast
    import ddlfast.elastic

    out, kills_text = sys.argv[1], sys.argv[2]
    start_rank = ddlfast.rank()
    start_size = ddlfast.size()
    kills = {}
    for spec in kills_text.split(","):
        victim, point, step = spec.split(":")
        if int(victim) == start_rank:
            kills[point] = int(step)
    history: list[tuple[int, int]] = []
    recovered_at: list[float] = []  # when a loss was reported; the next completed step is printed after it

    class State(ddlfast.elastic.NumpyState):
        def commit(self) -> None:
            if kills.get("commit") == self.step:
                time.sleep(0.3)
                die(0)
            super().commit()

        def broadcast(self, root: int) -> None:
            if "sync" in kills and ddlfast.size() < start_size:  # the recovery's sync: dies at a fixed point in it
                die(0)
            super().broadcast(root)

    state = State(params=initial_params(), step=0)
    state.on_membership_change(lambda error: (history.append((state.step, error.size)),
                                              recovered_at.append(time.time())))

    @ddlfast.elastic.run
    def train(state: State) -> None:
        while state.step < STEPS:
            step = state.step
            if kills.get("between") == step:
                die(0)
            if kills.get("agreement") == step:
                time.sleep(0.3)
                die(0)
            grad = gradient(state.params, step, ddlfast.rank(), ddlfast.size())
            if step % 3 == 2:
                handle = ddlfast.allreduce_async(grad)
                if kills.get("async") == step:
                    die(0.005)
                handle.wait()
            else:
                if kills.get("ring") == step:
                    die(0.005)
                ddlfast.allreduce(grad)
            apply(state.params, grad)
            state.step += 1
            if recovered_at:
                print(f"RESUMED {recovered_at.pop():.3f} {time.time():.3f} rank {start_rank}", flush=True)
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    np.savez(os.path.join(out, f"rank{start_rank}.npz"), params=state.params,
             history=np.array(history, dtype=np.int64).reshape(-1, 2), size=ddlfast.size(), rank=ddlfast.rank(),
             start_size=start_size)
    print(f"rank {start_rank} -> {ddlfast.rank()} of {ddlfast.size()}: done, history {history}", flush=True)


if __name__ == "__main__":
    main()
