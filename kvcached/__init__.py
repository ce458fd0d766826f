"""kvcached: an elastic KV cache for LLM serving.

Engines reserve virtual address space for their whole KV cache; physical device
memory is mapped under it page by page while blocks are in use, and several
engines on one GPU share that memory through a per-GPU ledger.
"""

__all__ = ["__version__"]

# The one place the version is written: pyproject.toml reads it from here
# ([tool.setuptools.dynamic]), so an install's metadata and this source agree.
__version__ = "0.2.0"
