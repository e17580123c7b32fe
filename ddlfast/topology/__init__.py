"""Topology: where the ranks are (placement), how fast their links are (probe), and the ring shape the cost
model picks for them. `ddlfast.topology()` (the function, ddlfast/api.py) reports what a context chose."""
