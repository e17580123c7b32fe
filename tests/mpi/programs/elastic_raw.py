"""Under ULFM (tests/mpi/test_elastic.py), without ddlfast.elastic.run:

  caught       rank 2 dies 5 ms into a 32 MiB allreduce (the ring: past the shared-memory reach), or, where that
               finished first, in one of the barriers the ranks then loop on; the survivors catch RanksLostError
               themselves and carry on: the context must be consistent (ddlfast.size()/rank() the new world's, a
               ring allreduce and the small path right).
  creation     the same, but rank 2 dies while the ranks create their context (in the first allreduce), at the
               creation's agreement: its communicators exist, the others wait for it in that agreement (some learn
               of the death from MPI, some only from another rank's revoke). The survivors create the context on
               themselves, and that allreduce raises RanksLostError. (A kill timed from the start landed anywhere:
               also while Open MPI 5.0.11 creates a communicator, where its failure handler can crash a survivor,
               docs/elastic.md.)
  divergent    no rank dies; each rank commits a rank-dependent state: sync() must refuse on every rank. Then
               run(regrow=True) must refuse under an initialized torch.distributed.
  identical    no rank dies; the ranks commit the same state holding a set of strings and an object with the
               default repr (each process iterates the set in its own hash seed's order, and holds the object at
               its own address): sync() must find the commits identical on every rank.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import ddlfast
import ddlfast.elastic

mode = sys.argv[1]
start_rank = ddlfast.rank()
if mode in ("caught", "creation"):
    x = np.full(1 << 22, start_rank + 1.0)
    if mode == "caught":
        ddlfast.barrier()  # the context exists
    if start_rank == 2 and mode == "caught":
        threading.Thread(target=lambda: (time.sleep(0.005), os.kill(os.getpid(), signal.SIGKILL)),
                         daemon=True).start()
    if start_rank == 2 and mode == "creation":
        import ddlfast.context

        def dying_layout(settings):  # what the creation agrees on: asked just before its agreement
            os.kill(os.getpid(), signal.SIGKILL)

        ddlfast.context.creation_layout = dying_layout
    try:
        ddlfast.allreduce(x)
        # The loss must reach every survivor in some collective whatever the timing (4 MiB once rode in shared
        # memory and finished, barrier included, within the 5 ms on every rank: CI saw it).
        while True:
            ddlfast.barrier()
    except ddlfast.RanksLostError as error:
        assert error.lost == (2,) and error.size == 3 and error.old_size == 4, (error.lost, error.size)
        assert (error.size, error.rank) == (ddlfast.size(), ddlfast.rank())
        print(f"rank {start_rank}: LOST {error.lost}", flush=True)
    assert ddlfast.size() == 3 and ddlfast.rank() == [0, 1, None, 2][start_rank]
    for n in (1 << 19, 100):  # the ring, then the latency path
        y = np.arange(n, dtype=np.float64) * (ddlfast.rank() + 1)
        ddlfast.allreduce(y)
        np.testing.assert_array_equal(y, np.arange(n, dtype=np.float64) * 6)
    everyone = ddlfast.allgather_object(start_rank)
    assert everyone == [0, 1, 3], everyone
    print(f"rank {start_rank}: CONSISTENT", flush=True)
elif mode == "divergent":
    state = ddlfast.elastic.NumpyState(params=np.zeros(1000), step=0)
    state.sync()
    state.params[:] = start_rank  # a rank-dependent commit
    state.commit()
    try:
        state.sync()
        print(f"rank {start_rank}: NOT REFUSED", flush=True)
    except ddlfast.DdlfastError as error:
        assert "differ" in str(error), error
        print(f"rank {start_rank}: REFUSED {error}", flush=True)
    ddlfast.barrier()  # the context is still usable
    # run(regrow=True) refuses where torch.distributed is initialized (its groups cannot be regrown).
    import ddlfast.torch as dt

    dt.init_process_group(backend="ddlfast")
    try:
        ddlfast.elastic.run(regrow=True)(lambda state: None)(state)
        print(f"rank {start_rank}: REGROW NOT REFUSED", flush=True)
    except ddlfast.DdlfastError as error:
        assert "regrow=True" in str(error) and "torch.distributed" in str(error), error
        print(f"rank {start_rank}: REGROW REFUSED", flush=True)
elif mode == "identical":
    class Config:  # the default repr: <Config object at 0x...>, another address in each process
        def __init__(self) -> None:
            self.lr = 0.1
            self.schedules = {"warmup", "cosine", "ema", "clip"}

    words = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}
    state = ddlfast.elastic.NumpyState(params=np.zeros(1000), step=0, vocabulary=words, config=Config(),
                                       counts={word: len(word) for word in words})
    state.sync()  # rank 0's state everywhere, unpickled into each process's own sets and objects
    state.step += 1
    state.commit()
    try:
        state.sync()
        print(f"rank {start_rank}: SYNCED", flush=True)
    except ddlfast.DdlfastError as error:
        print(f"rank {start_rank}: NOT SYNCED {error}", flush=True)
