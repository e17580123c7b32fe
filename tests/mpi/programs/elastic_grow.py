"""Growing back under ULFM (tests/mpi/test_elastic.py): 4 ranks train elastic_train.py's exact model with
`ddlfast.elastic.run(regrow=True)`; rank VICTIM dies 5 ms into the allreduce of step KILL_STEP (mid-ring). The
3 survivors spawn a replacement that runs this program again, joins them (as the last rank), receives the state
through the sync, and the 4 ranks finish together. Each survivor writes OUT/rank<r>.npz (r: its first rank), the
replacement OUT/replacement<r>.npz (r: its rank); the test checks every one against elastic_reference().

Usage: elastic_grow.py OUT VICTIM KILL_STEP
"""

from __future__ import annotations

import os
import sys

import numpy as np
from elastic_train import COMMIT_EVERY, STEPS, apply, die, gradient, initial_params
from mpi4py import MPI


def main() -> None:
    import ddlfast
    import ddlfast.elastic

    out, victim, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    replacement = MPI.Comm.Get_parent() != MPI.COMM_NULL
    start_rank = ddlfast.rank()  # a replacement joins the survivors here
    state = ddlfast.elastic.NumpyState(params=initial_params(), step=0)
    history: list[tuple[int, int]] = []
    state.on_membership_change(lambda error: history.append((state.step, ddlfast.size())))

    @ddlfast.elastic.run(regrow=True)
    def train(state: ddlfast.elastic.NumpyState) -> None:
        while state.step < STEPS:
            step = state.step
            grad = gradient(state.params, step, ddlfast.rank(), ddlfast.size())
            if not replacement and start_rank == victim and step == kill_step:
                die(0.005)
            ddlfast.allreduce(grad)
            apply(state.params, grad)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    name = f"replacement{ddlfast.rank()}" if replacement else f"rank{start_rank}"
    np.savez(os.path.join(out, f"{name}.npz"), params=state.params,
             history=np.array(history, dtype=np.int64).reshape(-1, 2), size=ddlfast.size(), rank=ddlfast.rank())
    print(f"{name} -> {ddlfast.rank()} of {ddlfast.size()}: done, history {history}", flush=True)


if __name__ == "__main__":
    main()
