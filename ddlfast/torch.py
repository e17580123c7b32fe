"""`ddlfast.torch`: the PyTorch integration under its public name. The code lives in
ddlfast/integrations/torch.py; this module is that module (one module object, so `ddlfast.torch.X` and
`ddlfast.integrations.torch.X` are the same thing)."""

import sys

from ddlfast.integrations import torch as _integration

sys.modules[__name__] = _integration
