"""Exceptions raised by ddlfast."""


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
