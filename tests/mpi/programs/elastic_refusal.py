"""Without MPI's fault tolerance (MPICH, or Open MPI without --with-ft ulfm) ddlfast.elastic refuses, saying what
to launch with, and ddlfast itself works as ever (tests/mpi/test_elastic.py)."""

import numpy as np

import ddlfast
import ddlfast.elastic

x = np.ones(3000, np.float32)
ddlfast.allreduce(x)
assert x[0] == ddlfast.size()
try:
    ddlfast.elastic.NumpyState(params=x)
except ddlfast.DdlfastError as error:
    print(f"REFUSED rank {ddlfast.rank()}: {error}", flush=True)
try:
    ddlfast.elastic.run(lambda state: None)(None)
    print("NOT REFUSED", flush=True)
except ddlfast.DdlfastError:
    pass
