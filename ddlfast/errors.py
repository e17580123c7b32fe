"""Exceptions raised by ddlfast."""


class DdlfastError(RuntimeError):
    """Anything ddlfast refuses or fails to do; the message says what and on which rank."""


class DdlfastTimeoutError(DdlfastError):
    """A collective did not complete within DDLFAST_TIMEOUT_S (some rank never joined)."""
