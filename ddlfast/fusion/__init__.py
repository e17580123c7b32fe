"""Fusion: bucket assignment (a pure function), the pack policy shared by the host and GPU executors, and the
host's pool of fused buffers."""
