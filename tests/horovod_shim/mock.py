"""Horovod's test/utils/common.py imports the `mock` package; the standard library's unittest.mock is the same API."""

import sys
from unittest import mock as _mock

sys.modules[__name__] = _mock
