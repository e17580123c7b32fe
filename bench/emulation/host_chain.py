"""A host-aware canonical order for reproducible=True (prototype, 2 hosts, block placement), measured by
bench/emulation/measure.py's 'chain' variant.

reproducible=True sums every element in rank order, ((x_0 + x_1) + x_2) + ... + x_{P-1}, each addition rounded
to float32. Today it runs as one flat direct reduce-scatter, so each rank sends the blocks of every owner on the
other host across the host link: P/4 times the ring's bytes there at 2 hosts. The same order, host by host:

  1. host 0 (ranks 0..H-1): reproducible reduce_scatter on the host: rank i holds block i of
     S_0 = (x_0 + ... + x_{H-1}) in rank order, float32 (the canonical order's first H-1 additions);
  2. host 0's blocks go to rank H, the first rank of host 1 (N float32 values across the link, once);
  3. rank H adds its own: y = S_0 + x_H (one float32 addition per element: the canonical order's next);
     host 1 runs reproducible reduce_scatter with y in place of x_H: rank H+i holds block i of the full sum;
  4. rank H+i sends its block to rank i (N values back across the link), and each host allgathers its blocks.

Each step's additions are the canonical order's, in its order, so the bits equal reproducible=True's on any
ring shape (measure.py --check compares them bit for bit); the host link carries N values each way, the ring's
bytes. The array runs as `pieces` pieces, one after the other, with non-blocking sends between the hosts, so
while host 1 sums piece k and sends it back, host 0 already sums piece k+1 and sends it over (the link carries
both directions at once). Uncompressed float32 sums only: on the fp16/bf16 wire step 3 would round y, which the
canonical order does not.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import ddlfast


class HostChain:
    """Collective: every rank of `comm` (2 hosts of `per_host` ranks each, block placement) creates one."""

    def __init__(self, comm: MPI.Comm, per_host: int) -> None:
        if comm.size != 2 * per_host:
            raise ValueError(f"the prototype runs on 2 hosts of {per_host} ranks, not {comm.size} ranks")
        self.comm = comm
        self.per_host = per_host
        self.host, self.local = divmod(comm.rank, per_host)
        self.host_comm = comm.Split(self.host, comm.rank)
        self.context = ddlfast.Context(self.host_comm)  # holds host_comm weakly: kept alive by self

    def allreduce(self, buffer: np.ndarray, pieces: int = 4) -> None:
        """buffer <- the sum over every rank, in place, with reproducible=True's bits (float32, sum)."""
        h, n = self.per_host, buffer.size
        if buffer.dtype != np.float32 or n % h:
            raise ValueError("the prototype sums float32 arrays whose size the per-host rank count divides")
        while n % (h * pieces):
            pieces -= 1
        piece = n // pieces
        block = piece // h
        views = [buffer[k * piece:(k + 1) * piece] for k in range(pieces)]
        finals = np.empty((pieces, block), np.float32)  # this rank's block of each piece's sum
        sends: list[MPI.Request] = []
        if self.host == 0:
            partials = []  # kept alive until their sends complete
            for k in range(pieces):
                partials.append(self.context.reduce_scatter(views[k], reproducible=True))  # block `local` of S_0
                sends.append(self.comm.Isend(partials[-1], dest=h, tag=1000 + k))
            for k in range(pieces):
                self.comm.Recv(finals[k], source=h + self.local, tag=2000 + k)
        else:
            partial = np.empty(piece, np.float32)
            for k in range(pieces):
                if self.local == 0:
                    for i in range(h):
                        self.comm.Recv(partial[i * block:(i + 1) * block], source=i, tag=1000 + k)
                    np.add(partial, views[k], out=views[k])  # y = S_0 + x_H: float32, the canonical order
                finals[k] = self.context.reduce_scatter(views[k], reproducible=True)
                sends.append(self.comm.Isend(finals[k], dest=self.local, tag=2000 + k))
        MPI.Request.Waitall(sends)
        gathered = self.context.allgather(finals)  # [rank 0's pieces, rank 1's pieces, ...] of the host
        buffer.reshape(pieces, h, block)[...] = gathered.reshape(h, pieces, block).transpose(1, 0, 2)
