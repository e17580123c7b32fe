"""Buffer adapters: user arrays (NumPy, torch CPU tensors, CUDA arrays) turned into (pointer, count, dtype) for
the core, with the one table of dtypes and element sizes."""
