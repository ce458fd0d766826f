"""kvcached: an elastic KV cache for LLM serving.

Engines reserve virtual address space for their whole KV cache; physical device
memory is mapped under it page by page while blocks are in use, and several
engines on one GPU share that memory through a per-GPU ledger.
"""

__all__ = ["__version__"]

_SOURCE_VERSION = "0.2.0"  # running from a source tree that was not installed


def __getattr__(name: str) -> str:
    # Lazy: importlib.metadata costs tens of milliseconds, and the SGLang .pth
    # hook imports this package at every interpreter start where
    # ENABLE_KVCACHED is set (pip and tokenizer subprocesses included).
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("kvcached")
        except PackageNotFoundError:
            value = _SOURCE_VERSION
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
