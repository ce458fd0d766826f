"""What a vLLM server's log must not contain, and its kvcached lines."""

from __future__ import annotations

import re

#: What must not appear in a server's log before its stop signal.
ERROR_SIGNATURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("cuda error", re.compile(r"CUDA error|cudaError|CUDA_ERROR_")),
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)),
    ("engine dead", re.compile(r"EngineDeadError|Engine core .*(died|failed)")),
    ("kvcached error", re.compile(r"\[kvcached\]\s+(ERROR|CRITICAL)")),
    ("patch failure", re.compile(r"\[kvcached\].*patch.*(fail|refus)", re.IGNORECASE)),
)

#: Log records vLLM writes with a traceback although nothing is wrong: the chat
#: template warm-up fails without a tokenizer (``--skip-tokenizer-init``).
BENIGN_TRACEBACK_RECORDS: tuple[re.Pattern[str], ...] = (
    re.compile(r"Chat template warmup failed"),
)

# vLLM prefixes every line of a multi-line record with the same header:
# "(EngineCore pid=5945) WARNING 12-02 16:10:03 [base.py:380] message".
_RECORD_HEADER = re.compile(
    r"^\((?P<proc>[^)]*?) pid=(?P<pid>\d+)\)\s+(?P<level>[A-Z]+)\s+\S+\s+\S+\s+"
    r"\[(?P<where>[^\]]+)\]\s?(?P<msg>.*)$"
)


def find_error_signatures(log_text: str) -> list[str]:
    """Each error signature found in ``log_text``, as ``"name: line"``. A
    traceback inside a log record listed in :data:`BENIGN_TRACEBACK_RECORDS` is
    not one."""
    found: list[str] = []
    lines = log_text.splitlines()
    record_key: tuple[str, str, str, str] | None = None
    record_first_msg = ""
    for line in lines:
        header = _RECORD_HEADER.match(line)
        if header:
            key = (header["proc"], header["pid"], header["level"], header["where"])
            if key != record_key:
                record_key, record_first_msg = key, header["msg"]
        else:
            record_key, record_first_msg = None, ""
        for name, pattern in ERROR_SIGNATURES:
            if not pattern.search(line):
                continue
            benign = (
                name == "traceback"
                and header is not None
                and any(b.search(record_first_msg) for b in BENIGN_TRACEBACK_RECORDS)
            )
            if not benign:
                found.append(f"{name}: {line.strip()[:300]}")
    return found


def kvcached_lines(log_text: str) -> list[str]:
    """The log's ``[kvcached]`` lines (a native server has none)."""
    return [line for line in log_text.splitlines() if "[kvcached]" in line]
