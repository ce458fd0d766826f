"""Byte sizes as people write them (``512M``, ``2G``, ``1.5g``) and back."""

from __future__ import annotations

import re

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

_SUFFIX = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse ``"512M"``, ``"2G"``, ``"1.5g"``, ``"4GiB"`` or a plain byte count.

    Suffixes are binary (``1K`` is 1024 bytes). Raises ``ValueError`` with the
    text and the accepted forms on anything else, including negative sizes.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(
            f"{text!r} is not a size: write bytes (1048576) or a number with "
            "K, M, G or T (512M, 2G, 1.5g)"
        )
    number, suffix = match.groups()
    return int(float(number) * _SUFFIX[suffix.lower()])


def format_bytes(n: int | float) -> str:
    """``1536 * MIB`` -> ``"1.50 GiB"``; exact below 1 KiB."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
