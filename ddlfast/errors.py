"""Exceptions raised by ddlfast, and how their messages name ranks."""

from __future__ import annotations

from collections.abc import Collection


def ranks_text(ranks: Collection[int]) -> str:
    """'rank 3' or 'ranks 0,2': the ranks a message names, in the order given."""
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


class DdlfastError(RuntimeError):
    """Anything ddlfast refuses or fails to do; the message says what and on which rank."""


class DdlfastBrokenError(DdlfastError):
    """The communicator is out of step: a collective was abandoned with messages in flight (a stall, an MPI
    error, a close mid-wait). The context refuses all later work; abort the job or create a new Context."""


class DdlfastTimeoutError(DdlfastBrokenError):
    """A collective did not complete within DDLFAST_TIMEOUT_S (some rank never joined)."""


class DdlfastConsistentError(DdlfastError):
    """Raised on every rank alike at the same point of a collective, with nothing left in flight (the ranks'
    arguments disagree, or a wire overflow was counted on every rank): the context stays usable."""


class RanksLostError(DdlfastError):
    """Ranks died during (or before) this collective, and MPI's fault tolerance (ULFM, `mpirun --with-ft ulfm`)
    let the survivors go on: the collective was abandoned without touching the caller's arrays afterwards, and the
    context now runs on the survivors alone (docs/elastic.md). `lost`: the ranks lost, numbered as they were before
    the failure; `size` and `rank`: the new world's size and this rank in it. Restore the state from the last
    commit before going on (ddlfast.elastic does that): ranks may have completed different numbers of
    collectives before they learned of the loss."""

    def __init__(self, message: str, lost: tuple[int, ...] = (), size: int = 0, rank: int = 0, old_size: int = 0
                 ) -> None:
        super().__init__(message)
        self.lost, self.size, self.rank, self.old_size = lost, size, rank, old_size
