"""Command-line entry points: ``kvcached`` and ``kvctl``."""
