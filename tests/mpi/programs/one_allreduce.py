"""One allreduce of a small array; used to see how the environment is handled."""

import numpy as np

import ddlfast

array = np.arange(10, dtype=np.float32)
ddlfast.allreduce(array)
assert np.allclose(array, np.arange(10) * ddlfast.size())
print("ok")
