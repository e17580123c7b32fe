# The CPU kernel variants by name (included by _core.pyx and _testing.pyx, whose kernel entries take a path).
from ddlfast._core cimport KernelTable, avx2_kernels, best_kernels, scalar_kernels

from ddlfast.errors import DdlfastError


cdef list available_kernel_paths():
    """Names of the CPU kernel variants this build and CPU can run, best first."""
    cdef const KernelTable* avx2 = avx2_kernels()
    paths = []
    if avx2 != NULL:
        paths.append(avx2.name.decode())
    paths.append(scalar_kernels().name.decode())
    return paths


cdef const KernelTable* kernel_table(path) except NULL:
    """The kernels of `path` (None: the best this CPU runs)."""
    if path is None:
        return &best_kernels()
    if path == scalar_kernels().name.decode():
        return &scalar_kernels()
    if avx2_kernels() != NULL and path == avx2_kernels().name.decode():
        return avx2_kernels()
    raise DdlfastError(f"kernel path {path!r} is not available; have {available_kernel_paths()}")
