"""kvcached: an elastic KV cache for LLM serving.

Engines reserve virtual address space for their whole KV cache; physical device
memory is mapped under it page by page while blocks are in use, and several
engines on one GPU share that memory through a per-GPU ledger.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvcached")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.2.0"

__all__ = ["__version__"]
