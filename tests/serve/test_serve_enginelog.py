"""serve's failure report leads with the engine's real error, not with its
first lines: a real vLLM 0.32 CPU log (a start that failed: deprecation
warnings first, the root cause in a worker's traceback, then the tracebacks of
the processes that only noticed), a chained exception, pydantic's message over
several lines, and an engine that prints no traceback at all."""

from __future__ import annotations

from pathlib import Path

from kvcached.serve.enginelog import engine_errors, failure_report, read_start, root_cause

VLLM_LOG = Path(__file__).with_name("data") / "vllm-0.32-cpu-failed-start.log"
ROOT = "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."


def test_a_real_vllm_failure_names_the_root_cause_first():
    error, report = failure_report(str(VLLM_LOG), 0)
    assert error == ROOT
    lines = report.splitlines()
    assert lines[0] == "    its errors, in the order raised:"
    assert lines[1] == f"      {ROOT}"
    # the processes that noticed come after it, each once (vLLM prints two of them twice)
    assert lines[2].startswith("      RuntimeError: Worker failed with error 'No common block")
    assert lines[3].startswith("      RuntimeError: Engine core initialization failed.")
    assert lines[4] == "    the last 15 lines of its output:"
    assert len(lines) == 5 + 15
    before_tail = "\n".join(lines[:5])
    assert "DeprecationWarning" not in before_tail and "$ " not in before_tail
    assert "DeprecationWarning" in VLLM_LOG.read_text().splitlines()[3]  # they lead the log


def test_only_the_latest_start_is_read(tmp_path):
    log = tmp_path / "m.log"
    log.write_text("Traceback (most recent call last):\n  File x\nOSError: an old start's\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("starting\nfatal: port 8000 is taken\n")
    assert failure_report(str(log), offset)[0] == "fatal: port 8000 is taken"
    assert failure_report(str(log), 0)[0] == "OSError: an old start's"


def test_an_exception_message_over_several_lines_is_kept_whole():
    lines = [
        "/x/api_server.py:24: DeprecationWarning: deprecated",
        "  warnings.warn(",
        "Traceback (most recent call last):",
        '  File "/x/arg_utils.py", line 1955, in create_model_config',
        "    return ModelConfig(",
        "           ^^^^^^^^^^^^",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, User-specified max_model_len (100000) is greater than the derived one",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
        "/x/resource_tracker.py:254: UserWarning: leaked shared_memory objects",
    ]
    assert engine_errors(lines) == [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "Value error, User-specified max_model_len (100000) is greater than the derived one\n"
        "For further information visit https://errors.pydantic.dev/2.14/v/value_error"
    ]


def test_a_log_prefix_on_every_line_and_interleaved_processes():
    p = "(EngineCore pid=7) ERROR 12-06 10:00:00 [core.py:9] "
    lines = [
        f"{p}Traceback (most recent call last):",
        f'{p}  File "/x/core.py", line 9, in run',
        "(APIServer pid=6) INFO 12-06 10:00:00 [api.py:1] waiting for the engine",
        f"{p}    raise MemoryError()",
        f"{p}MemoryError: out of KV cache",
        "(APIServer pid=6) ERROR 12-06 10:00:01 [api.py:2] the engine core died",
    ]
    assert engine_errors(lines) == ["MemoryError: out of KV cache"]


def test_without_a_traceback_the_last_error_line_that_is_not_a_warning(tmp_path):
    lines = [
        "engine: starting",
        "WARNING: failed to raise the ulimit (error: not permitted)",
        "engine: error: the model cannot be loaded",
        "engine: shutting down",
        "/x/tracker.py:254: UserWarning: leaked objects",
    ]
    assert engine_errors(lines) == ["engine: error: the model cannot be loaded"]
    assert engine_errors(["engine: starting", "engine: bye"]) == []
    log = tmp_path / "m.log"
    log.write_text("\n".join(lines[:2]) + "\n")
    error, report = failure_report(str(log), 0)
    assert error == "" and report.splitlines()[0] == "    its output:"
    assert failure_report(str(tmp_path / "none.log"), 0)[1].startswith("    (log ")


def test_a_long_log_is_read_from_its_end(tmp_path):
    """An engine that served for long before it died: the report reads the
    end of its output, not all of it."""
    log = tmp_path / "m.log"
    with open(log, "w") as f:
        f.write("Traceback (most recent call last):\n  File x\nKeyError: an old request's\n")
        f.write("INFO: a request served\n" * 5000)
        f.write("Traceback (most recent call last):\n  File y\nMemoryError: the end\n")
    lines = read_start(str(log), 0, limit=4096)
    assert lines[-1] == "MemoryError: the end"
    assert all(line == "INFO: a request served" for line in lines[:-3])  # no partial first line
    assert len(lines) < 200
    # within 1 MiB, both: the failure is the last, which points at no earlier one
    assert engine_errors(read_start(str(log), 0)) == [
        "KeyError: an old request's",
        "MemoryError: the end",
    ]
    assert failure_report(str(log), 0)[0] == "MemoryError: the end"


def test_the_root_cause_is_what_the_last_error_goes_back_to():
    def tb(error: str, chained: bool = False) -> list[str]:
        head = ["The above exception was the direct cause of the following exception:"]
        return [*(head if chained else []), "Traceback (most recent call last):", "  File x", error]

    cases = [
        # vLLM's: a later error quotes the first, the last points "above"
        (
            tb("ValueError: bad block size 16")
            + tb("RuntimeError: Worker failed with error 'bad block size 16'")
            + tb("RuntimeError: init failed. See root cause above."),
            "ValueError: bad block size 16",
        ),
        (
            tb("OSError: disk full") + tb("RuntimeError: could not save", chained=True),
            "OSError: disk full",
        ),
        # unrelated: an earlier request's error is not the cause of the death
        (
            tb("KeyError: 'model'") + tb("MemoryError: out of memory above the limit"),
            "MemoryError: out of memory above the limit",
        ),
        ([], ""),
    ]
    for lines, cause in cases:
        assert root_cause(lines) == cause, lines
