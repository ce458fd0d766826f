"""An engine's log file: rotation, and the failure report serve prints from it.

An engine's first lines are rarely its error: vLLM opens with deprecation
warnings, and its real error is a traceback near the end, often followed by
the tracebacks of the processes that only noticed (vLLM: "Engine core
initialization failed. See root cause above"). So the report names the
engine's errors first, in the order they were raised, then the log's tail,
and the one line that stands for the failure is the root cause
(:func:`root_cause`), not the last error. The errors are:

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
#: The most of a start's output read for a report: its end.
READ_LIMIT = 1 << 20

_TRACEBACK = "Traceback (most recent call last):"
_ERRORISH = re.compile(r"error|exception|fatal|traceback|killed|abort", re.IGNORECASE)
_NOT_AN_ERROR = re.compile(r"\b(DEBUG|INFO|WARNING|WARN)\b|Warning\b|^\s*warnings\.warn")
#: How a process that only noticed an error points at it (vLLM: "See root cause above").
_POINTS_ABOVE = re.compile(r"\b(see|check)\b[^.]*\babove\b|\(above\)", re.IGNORECASE)
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
    return [error for error, _chained in _errors(lines)]


def root_cause(lines: list[str]) -> str:
    """The error that the last one goes back to: from the last error, back over
    each that only noticed the one before it (Python chained them, or its
    message points "above", or quotes that error's message); "" when none."""
    found = _errors(lines)
    if not found:
        return ""
    i = len(found) - 1
    while i > 0:
        error, chained = found[i]
        before = found[i - 1][0].split("\n")[0]
        message = before.split(": ", 1)[-1]
        if chained or _POINTS_ABOVE.search(error) or (len(message) > 8 and message in error):
            i -= 1
        else:
            break
    return found[i][0]


def _errors(lines: list[str]) -> list[tuple[str, bool]]:
    """``(error, chained)``: each distinct traceback's exception, the last
    :data:`MAX_ERRORS`, and whether Python printed it as caused by (or raised
    while handling) the one before; else the last error line, alone."""
    found: list[tuple[str, bool]] = []
    for i, line in enumerate(lines):
        at = line.find(_TRACEBACK)
        if at < 0:
            continue
        error = _exception_after(lines, i + 1, line[:at])
        if error and all(error != seen for seen, _ in found):
            chained = any(m in before for before in lines[max(0, i - 2) : i] for m in _CHAIN)
            found.append((error, chained))
    if not found:
        last = next(
            (
                line.strip()
                for line in reversed(lines)
                if _ERRORISH.search(line) and not _NOT_AN_ERROR.search(line)
            ),
            "",
        )
        return [(last, False)] if last else []
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


def read_start(path: str, offset: int, limit: int = READ_LIMIT) -> list[str]:
    """The non-blank lines an engine wrote to ``path`` from ``offset`` on (its
    latest start), at most the last ``limit`` bytes of them: an engine that
    served for days before it died wrote far more than its end. Raises
    ``OSError`` when the log cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(offset, size - limit)
        f.seek(start)
        text = f.read(limit).decode(errors="replace")
    lines = text.splitlines()
    if start > offset and lines:
        lines = lines[1:]  # begun mid-line
    return [line for line in lines if line.strip()]


def failure_report(path: str, offset: int, tail: int = 15) -> tuple[str, str]:
    """``(error, report)`` for an engine that failed, from its log ``path``
    since ``offset``: ``error`` is the one line that says what went wrong
    (:func:`root_cause`; "" when no error is found), ``report`` its errors and
    then the last ``tail`` lines of its output, indented, for serve's terminal."""
    try:
        lines = read_start(path, offset)
    except OSError as exc:
        return "", f"    (log {path} unreadable: {exc.strerror})"
    if not lines:
        return "", "    (the engine wrote nothing)"
    errors = engine_errors(lines)
    cause = root_cause(lines)
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
    summary = " ".join(cause.split("\n"))
    if len(summary) > 300:
        summary = summary[:297] + "..."
    return summary, "\n".join("    " + line for line in out)
