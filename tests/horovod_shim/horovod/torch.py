"""`horovod.torch` is ddlfast.horovod.torch (the same module object)."""

import sys

import ddlfast.horovod.torch as _dropin

sys.modules[__name__] = _dropin
