"""kvcached's logger: every line starts with ``[kvcached]`` so users and tests can
find them in an engine's log."""

from __future__ import annotations

import logging

_ROOT = "kvcached"
_configured = False


def get_logger(name: str = _ROOT) -> logging.Logger:
    """A child of the ``kvcached`` logger, set up on first use from
    ``KVCACHED_LOG_LEVEL``; it writes to stderr unless the application already
    configured a handler for ``kvcached``."""
    global _configured
    root = logging.getLogger(_ROOT)
    if not _configured:
        _configured = True
        from kvcached.config import get_config

        root.setLevel(get_config().log_level)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(
                logging.Formatter("[kvcached] %(levelname)s %(asctime)s %(message)s", "%H:%M:%S")
            )
            root.addHandler(handler)
            root.propagate = False
    if name == _ROOT or name.startswith(_ROOT + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{_ROOT}.{name}")
