"""An engine's log file: rotation, and the failure report serve prints from it.

An engine's first lines are rarely its error: vLLM opens with deprecation
warnings, and its real error is a traceback near the end, often followed by
the tracebacks of the processes that only noticed (vLLM: "Engine core
initialization failed. See root cause above"). So the report names the
engine's errors first, in the order they were raised, then the log's tail:

* a Python traceback's exception (the line after its last frame, with the
  indented lines that continue it), each distinct one once, the last
  :data:`MAX_ERRORS`; a log prefix that a traceback's lines carry (vLLM's
  ``(EngineCore pid=7) ERROR 12-06 10:00:00 [core.py:9]``) is taken off;
* where no traceback is found, the last line that reads as an error and not
  as a warning or an info line.
"""

from __future__ import annotations

import os
import re

#: An engine log past this size is rotated (one ``.1`` kept) when the engine next starts.
LOG_ROTATE_BYTES = 16 * 1024 * 1024
#: At most this many distinct errors lead a report (the last ones raised).
MAX_ERRORS = 4
#: Lines of an exception's message kept after its first line (pydantic's go on below it).
MAX_CONTINUATION = 3

_TRACEBACK = "Traceback (most recent call last):"
_ERRORISH = re.compile(r"error|exception|fatal|traceback|killed|abort", re.IGNORECASE)
_NOT_AN_ERROR = re.compile(r"\b(DEBUG|INFO|WARNING|WARN)\b|Warning\b|^\s*warnings\.warn")
#: The lines Python prints between a chained exception and the next traceback.
_CHAIN = (
    "During handling of the above exception",
    "The above exception was the direct cause",
)


def rotate_log(path: str) -> None:
    """Keep one old copy of an engine log that grew past :data:`LOG_ROTATE_BYTES`."""
    try:
        if os.path.getsize(path) > LOG_ROTATE_BYTES:
            os.replace(path, path + ".1")
    except FileNotFoundError:
        pass


def engine_errors(lines: list[str]) -> list[str]:
    """The errors in an engine's output (see the module docstring), oldest first;
    an exception whose message goes on over several lines is one entry, its
    lines joined by newlines."""
    found: list[str] = []
    for i, line in enumerate(lines):
        at = line.find(_TRACEBACK)
        if at < 0:
            continue
        error = _exception_after(lines, i + 1, line[:at])
        if error and error not in found:
            found.append(error)
    if not found:
        last = next(
            (
                line.strip()
                for line in reversed(lines)
                if _ERRORISH.search(line) and not _NOT_AN_ERROR.search(line)
            ),
            "",
        )
        return [last] if last else []
    return found[-MAX_ERRORS:]


def _exception_after(lines: list[str], start: int, prefix: str) -> str:
    """The exception that ends the traceback whose frames begin at ``start``:
    the first line (less ``prefix``) that is not indented, with the indented
    lines after it."""
    body: list[str] = []
    for line in lines[start:]:
        if prefix and not line.startswith(prefix):
            if body:
                break
            continue  # another process' line, interleaved with this traceback
        text = line[len(prefix) :]
        if not body:
            if text[:1].isspace() or not text.strip():
                continue  # a frame, its source line, its ^^^ marker
            if text.startswith(_CHAIN) or text.startswith(_TRACEBACK):
                return ""  # a frame list cut short: the next traceback has the exception
            body.append(text.strip())
        elif text[:1].isspace() and text.strip() and len(body) <= MAX_CONTINUATION:
            body.append(text.strip())
        else:
            break
    return "\n".join(body)


def read_start(path: str, offset: int) -> list[str]:
    """The non-blank lines an engine wrote to ``path`` from ``offset`` on (its
    latest start). Raises ``OSError`` when the log cannot be read."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [line for line in text.splitlines() if line.strip()]


def failure_report(path: str, offset: int, tail: int = 15) -> tuple[str, str]:
    """``(error, report)`` for an engine that failed, from its log ``path``
    since ``offset``: ``error`` is the one line that says what went wrong
    (the first of its errors, the root cause where later ones only noticed
    it; "" when none is found), ``report`` its errors and then the last
    ``tail`` lines of its output, indented, for serve's terminal."""
    try:
        lines = read_start(path, offset)
    except OSError as exc:
        return "", f"    (log {path} unreadable: {exc.strerror})"
    if not lines:
        return "", "    (the engine wrote nothing)"
    errors = engine_errors(lines)
    out: list[str] = []
    if errors:
        out.append("its error:" if len(errors) == 1 else "its errors, in the order raised:")
        for error in errors:
            first, *rest = error.split("\n")
            out += [f"  {first}", *(f"    {r}" for r in rest)]
    shown = lines[-tail:]
    out.append(
        f"the last {len(shown)} lines of its output:" if len(lines) > len(shown) else "its output:"
    )
    out += [f"  {line}" for line in shown]
    summary = " ".join(errors[0].split("\n")) if errors else ""
    if len(summary) > 300:
        summary = summary[:297] + "..."
    return summary, "\n".join("    " + line for line in out)
