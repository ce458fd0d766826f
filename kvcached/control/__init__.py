"""The control layer: instances, their snapshots and limits, and what kvctl reads."""
