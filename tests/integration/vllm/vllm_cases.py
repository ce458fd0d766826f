"""The basic correctness case of the seed PR (#487), run against one server.

A case starts a server, runs its phases, stops it, and returns a
:class:`CaseRecord` holding everything the checks need. The checks are separate
pytest tests over the record, so one server start serves them all, and a
kvcached case is the same case with ``ServerOptions(kvcached=True)`` compared
with the native record (tokens and cached_tokens per request).

Phases, in order:

* ``gen_seq``: 9 prompts (6 short; 300, 900 and 1800 tokens), greedy, 64 output
  tokens, one request at a time;
* ``gen_conc``: the same 9 prompts, all at once;
* the prefix cache is reset, then ``reset_probe`` sends the 1800-token prompt
  again (it must find nothing cached);
* ``apc_0``, ``apc_1``, ``apc_2``: 4 questions about one shared 1300-token
  document, greedy, 32 output tokens, one request at a time;
* ``apc_conc``: the same 4 questions, all at once;
* the server is stopped with SIGINT to its process group (SIGKILL after 90 s).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvharness.vllm_server import Completion, ServerError, ServerOptions, StopResult, VllmServer
from tests.integration.vllm.vllm_log import find_error_signatures, kvcached_lines

GEN_MAX_TOKENS = 64
APC_MAX_TOKENS = 32
SHORT_PROMPT_LENGTHS = (3, 6, 9, 14, 21, 31)
LONG_PROMPT_LENGTHS = (300, 900, 1800)
APC_DOCUMENT_TOKENS = 1300
APC_QUESTION_LENGTHS = (12, 17, 23, 29)
GEN_PHASES = ("gen_seq", "gen_conc")
APC_ROUNDS = ("apc_0", "apc_1", "apc_2")
APC_PHASES = (*APC_ROUNDS, "apc_conc")


def token_prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids drawn from one seed, avoiding the special ids 0-2."""
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


GEN_PROMPTS: tuple[list[int], ...] = tuple(
    token_prompt(1000 + i, n) for i, n in enumerate(SHORT_PROMPT_LENGTHS + LONG_PROMPT_LENGTHS)
)
APC_DOCUMENT = token_prompt(2000, APC_DOCUMENT_TOKENS)
APC_PROMPTS: tuple[list[int], ...] = tuple(
    APC_DOCUMENT + token_prompt(3000 + i, n) for i, n in enumerate(APC_QUESTION_LENGTHS)
)


@dataclass
class CaseRecord:
    """What one run of the basic case saw. ``None`` means the step never ran
    (the server did not start, or died before it)."""

    name: str
    options: ServerOptions
    log_path: Path
    ready_s: float | None = None
    start_error: str | None = None
    phases: dict[str, list[Completion]] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    reset_ok: bool | None = None
    alive_after_load: bool | None = None
    stop: StopResult | None = None
    error_signatures: list[str] = field(default_factory=list)
    kvcached_lines: list[str] = field(default_factory=list)

    def phase(self, name: str) -> list[Completion]:
        """The completions of one phase; fails loudly if it never ran."""
        if name not in self.phases:
            raise AssertionError(
                f"{self.name}: phase {name} did not run "
                f"({self.start_error or 'the case ended before it'}); log {self.log_path}"
            )
        return self.phases[name]

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["options"] = {k: v for k, v in asdict(self.options).items() if k != "extra_env"}
        data["log_path"] = str(self.log_path)
        return data


def run_basic_case(
    name: str,
    model_dir: Path,
    workdir: Path,
    options: ServerOptions,
    ready_timeout_s: float = 300.0,
) -> CaseRecord:
    """Start a server, run every phase, stop it; never raises for a server
    failure (that is recorded). Writes ``<workdir>/<name>.json`` beside the log."""
    workdir.mkdir(parents=True, exist_ok=True)
    record = CaseRecord(name, options, workdir / f"{name}.log")
    server = VllmServer(model_dir, record.log_path, options)
    try:
        server.start()
        record.ready_s = server.wait_ready(ready_timeout_s)
        _run_phases(server, record)
        record.alive_after_load = server.alive()
    except ServerError as exc:
        record.start_error = str(exc)
    finally:
        if server.proc is not None:
            record.stop = server.stop()
        record.error_signatures = find_error_signatures(server.log_text(before_stop=True))
        record.kvcached_lines = kvcached_lines(server.log_text())
        (workdir / f"{name}.json").write_text(json.dumps(record.to_json(), indent=1))
    return record


def _run_phases(server: VllmServer, record: CaseRecord) -> None:
    def timed(
        phase: str, prompts: tuple[list[int], ...], max_tokens: int, concurrent: bool
    ) -> None:
        start = time.monotonic()
        record.phases[phase] = server.complete_all(prompts, max_tokens, concurrent=concurrent)
        record.phase_seconds[phase] = time.monotonic() - start

    timed("gen_seq", GEN_PROMPTS, GEN_MAX_TOKENS, concurrent=False)
    timed("gen_conc", GEN_PROMPTS, GEN_MAX_TOKENS, concurrent=True)
    record.reset_ok = server.reset_prefix_cache()
    timed("reset_probe", (GEN_PROMPTS[-1],), 1, concurrent=False)
    for phase in APC_ROUNDS:
        timed(phase, APC_PROMPTS, APC_MAX_TOKENS, concurrent=False)
    timed("apc_conc", APC_PROMPTS, APC_MAX_TOKENS, concurrent=True)


def same_tokens(a: list[Completion], b: list[Completion]) -> list[bool]:
    """Per request: did both runs give the same tokens (and both succeed)?"""
    return [x.ok and y.ok and x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)]


def cached_tokens(completions: list[Completion]) -> list[int | None]:
    return [c.cached_tokens for c in completions]
