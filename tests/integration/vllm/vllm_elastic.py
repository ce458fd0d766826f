"""The seed PR's elastic and limit cases on two kvcached vLLM CPU servers.

Two servers, A then B, share one small host device (``KVCACHED_HOST_DEVICE``,
``KVCACHED_HOST_CAPACITY``) and one ledger directory, and are started without
``KVCACHED_IPC_NAME``, so each must name itself (``vllm-<pid>``). Their KV
usage is read from the ledger (each instance's charged bytes), sampled every
0.1 s while loads run.

Elastic phases: (1) A gets its load; (2) A's prefix cache is reset; (3) B gets
its load and its prefix cache is reset; (4) both get their loads at the same
time, B's first (with longer outputs) and A's once B holds half the free
memory (more than the device holds: requests wait or are preempted, none fails).
Three greedy probes per server run before and after. Both apply the page ops
a step does not use beside it (always, since #34).

Limit phases, on B (A idle beside it), driven and read through ``kvctl``
(``kvctl limit``, ``kvctl list --json``): fill its prefix cache; lower its
limit to its idle usage plus a quarter of what the fill added; wait for usage
to be within it with no requests; 100 short and 4 long requests under the
lower limit (the ledger sampled every 0.1 s meanwhile); restore the limit and
fill again with new prompts.

One :class:`ElasticRecord` holds everything the checks need.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvharness.vllm_server import Completion, ServerError, ServerOptions, StopResult, VllmServer
from tests.integration.vllm.vllm_cases import token_prompt
from tests.integration.vllm.vllm_log import find_error_signatures, kvcached_lines

HOST_DEVICE = 37  # a host device of these servers alone
CAPACITY_MIB = 96
#: The ledger keeps total x (1 - this) free as its safety margin; the host
#: backend's pages are 4 MiB here, and a grant not yet mapped when a
#: calibration samples is counted twice until the next one.
UTILIZATION = 0.8
LOAD_REQUESTS = 32
LOAD_PROMPT = 3500
LOAD_OUTPUT = 64
#: Phases (1) and (3), one load alone, must fill most of the free memory, so every
#: request must still be decoding when the last one's prefill ends. At 64 output
#: tokens that was a race (vLLM's CPU step takes 2,048 tokens, 32 x 3,500 are ~55
#: steps of it, the first request done after ~66), and CI once saw A peak at half
#: the free memory (never reproduced here). 256 decode steps outlast it by 4x;
#: 32 x (3,000 + 256) tokens stay below the free memory, so nothing is preempted.
FILL_PROMPT = 3000
FILL_OUTPUT = 256
#: B's output per request in phase (4): B must still hold its memory while A's
#: prefill grows (CI once saw no miss when B's 64-token decode ended first, with
#: A's load started once B held half the free memory); 512 decode steps outlast
#: A's prefill several times over and fit the 4,096-token context with the prompt.
CONTENDED_B_OUTPUT = 512
PROBE_TOKENS = 32
LIMIT_FILL = 24
LIMIT_FILL_PROMPT = 1500
LIMIT_WAIT_S = 5.0
CONTENDED_HEAD_START_MAX_S = 120.0


def elastic_options(ledger_dir: Path) -> ServerOptions:
    return ServerOptions(
        kvcached=True,
        max_num_seqs=LOAD_REQUESTS,
        extra_env={
            "KVCACHED_LEDGER_DIR": str(ledger_dir),
            "KVCACHED_HOST_DEVICE": str(HOST_DEVICE),
            "KVCACHED_HOST_CAPACITY": f"{CAPACITY_MIB}M",
            "KVCACHED_GPU_UTILIZATION": str(UTILIZATION),
            "KVCACHED_MIN_RESERVED_PAGES": "1",
            "KVCACHED_MAX_RESERVED_PAGES": "2",
        },
    )


@dataclass
class ServerRecord:
    name: str = ""  # the instance name the server chose
    pid: int = 0
    ready_s: float | None = None
    start_error: str | None = None
    probes_before: list[list[int]] = field(default_factory=list)
    probes_after: list[list[int]] = field(default_factory=list)
    alive: bool | None = None
    stop: StopResult | None = None
    error_signatures: list[str] = field(default_factory=list)
    kvcached_lines: list[str] = field(default_factory=list)


@dataclass
class ElasticRecord:
    a: ServerRecord = field(default_factory=ServerRecord)
    b: ServerRecord = field(default_factory=ServerRecord)
    budget: int = 0
    a_idle: int = 0
    a_peak: int = 0
    free_at_a_peak: int = 0
    a_after_reset: int = 0
    a_after_load: int = 0  # before the reset
    #: ledger reads while phases (1) and (3) ran, and every read that failed
    a_load_samples: int = 0
    b_load_samples: int = 0
    sampler_errors: list[str] = field(default_factory=list)
    b_idle: int = 0
    b_peak: int = 0
    a_requests: list[Completion] = field(default_factory=list)
    b_requests: list[Completion] = field(default_factory=list)
    contended: list[Completion] = field(default_factory=list)
    contended_peak: int = 0
    #: allocation misses per instance before phase (4), and during it
    misses_before_contended: dict[str, int] = field(default_factory=dict)
    contended_misses: dict[str, int] = field(default_factory=dict)
    #: seconds from B's contended load to B holding half the free memory (None: never)
    contended_head_start_s: float | None = None
    resets: list[bool] = field(default_factory=list)
    # limit phases (on B)
    limit_idle: int = 0
    limit_filled: int = 0
    limit_fill_ok: bool | None = None
    limit: int = 0
    limit_status: list[str] = field(default_factory=list)
    limit_released_s: float | None = None
    limit_load: list[Completion] = field(default_factory=list)
    limit_peak_under_load: int = 0
    limit_regrown: int = 0
    limit_refill_ok: bool | None = None
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class UsageSampler:
    """Samples each instance's charged bytes from the ledger every 0.1 s.
    A read that fails is counted in ``errors`` and sampling goes on (a sampler
    thread that died would leave a phase's peak at its last sample)."""

    def __init__(self, ledger_dir: Path) -> None:
        self.ledger_dir = str(ledger_dir)
        self.peaks: dict[str, int] = {}
        self.totals_at_peak: dict[str, int] = {}
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> tuple[dict[str, int], int]:
        """``({instance: charged}, budget)`` now."""
        from kvcached.control.limits import ledger_snapshots

        usage: dict[str, int] = {}
        budget = 0
        for snap in ledger_snapshots(self.ledger_dir):
            budget = snap.header.budget
            for inst in snap.instances:
                usage[inst.name] = usage.get(inst.name, 0) + inst.charged
        return usage, budget

    def __enter__(self) -> UsageSampler:
        self.peaks, self.totals_at_peak = {}, {}
        self.samples = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(0.1)

    def sample(self) -> None:
        try:
            usage, _ = self.read()
        except Exception as exc:  # noqa: BLE001 - recorded; the checks show it
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        self.samples += 1
        total = sum(usage.values())
        for name, used in usage.items():
            if used > self.peaks.get(name, -1):
                self.peaks[name] = used
                self.totals_at_peak[name] = total

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sample()


def misses() -> dict[str, int]:
    """Allocation misses per instance, from the snapshots the engines publish."""
    from kvcached.control.snapshot import read_snapshots

    out: dict[str, int] = {}
    for snap in read_snapshots():
        if not snap.alive:
            continue
        for pool in snap.data.get("pools", []):
            out[snap.instance] = out.get(snap.instance, 0) + int(pool.get("misses", 0))
    return out


def load_prompts(seed: int, length: int = LOAD_PROMPT) -> list[list[int]]:
    return [token_prompt(seed + i, length) for i in range(LOAD_REQUESTS)]


PROBES = [token_prompt(8000 + i, 40 + 20 * i) for i in range(3)]


def probe(server: VllmServer) -> list[list[int]]:
    return [c.token_ids for c in server.complete_all(PROBES, PROBE_TOKENS, concurrent=False)]


def run_elastic_case(
    model_dir: Path,
    workdir: Path,
    ledger_dir: Path,
    set_limit: Callable[[str, int | None], str],
    usage: Callable[[str], int],
) -> ElasticRecord:
    """Run every elastic and limit phase; never raises for a server failure
    (recorded in ``error``). ``set_limit(name, bytes or None)`` lowers or
    restores an instance's limit and returns its status; ``usage(name)`` is
    its KV usage now (both ``kvctl``, in the tests)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ledger_dir.mkdir(parents=True, exist_ok=True)
    rec = ElasticRecord()
    options = elastic_options(ledger_dir)
    a = VllmServer(model_dir, workdir / "elastic-a.log", options)
    # B without VLLM_CPU_KVCACHE_SPACE: vLLM would size its cache from the node's
    # free memory (and refuse to start when others use it); kvcached makes the
    # virtual size the host device's capacity.
    b = VllmServer(
        model_dir,
        workdir / "elastic-b.log",
        dataclasses.replace(
            options,
            kv_cache_gib=None,
            # B's next step always waits for the page ops beside the one before
            # (the order before 3636916): the setting reaches the planner.
            extra_env={**options.extra_env, "KVCACHED_BESIDE_STEPS": "1"},
        ),
    )
    sampler = UsageSampler(ledger_dir)
    try:
        a.start()
        time.sleep(2.0)  # A first, then B
        b.start()
        for server, r in ((a, rec.a), (b, rec.b)):
            try:
                r.ready_s = server.wait_ready(400)
            except ServerError as exc:
                r.start_error = str(exc)
                raise
            r.pid = server.proc.pid if server.proc else 0
            r.probes_before = probe(server)
        charged, rec.budget = sampler.read()
        rec.a.name, rec.b.name = f"vllm-{rec.a.pid}", f"vllm-{rec.b.pid}"
        rec.a_idle, rec.b_idle = charged.get(rec.a.name, 0), charged.get(rec.b.name, 0)
        with sampler:  # (1) A's load
            rec.a_requests = a.complete_all(
                load_prompts(100_000, FILL_PROMPT), FILL_OUTPUT, ignore_eos=True
            )
        rec.a_peak = sampler.peaks.get(rec.a.name, 0)
        rec.a_load_samples = sampler.samples
        rec.a_after_load = sampler.read()[0].get(rec.a.name, 0)
        rec.free_at_a_peak = rec.budget - sampler.totals_at_peak.get(rec.a.name, 0)
        rec.resets.append(a.reset_prefix_cache())  # (2)
        time.sleep(0.5)
        rec.a_after_reset = sampler.read()[0].get(rec.a.name, 0)
        with sampler:  # (3) B's load
            rec.b_requests = b.complete_all(
                load_prompts(200_000, FILL_PROMPT), FILL_OUTPUT, ignore_eos=True
            )
        rec.b_peak = sampler.peaks.get(rec.b.name, 0)
        rec.b_load_samples = sampler.samples
        rec.resets.append(b.reset_prefix_cache())
        rec.misses_before_contended = misses()
        with sampler:  # (4) both at once
            run_contended(a, b, rec, sampler)
        rec.contended_peak = max(sampler.totals_at_peak.values(), default=0)
        rec.contended_misses = {
            name: n - rec.misses_before_contended.get(name, 0) for name, n in misses().items()
        }
        rec.resets.append(a.reset_prefix_cache())
        rec.resets.append(b.reset_prefix_cache())
        run_limit_phases(b, rec, sampler, set_limit, usage)
        for server, r in ((a, rec.a), (b, rec.b)):
            r.probes_after = probe(server)
            r.alive = server.alive()
    except ServerError as exc:
        rec.error = str(exc)
    finally:
        rec.sampler_errors = sampler.errors
        for server, r in ((a, rec.a), (b, rec.b)):
            if server.proc is not None:
                r.stop = server.stop()
            r.error_signatures = find_error_signatures(server.log_text(before_stop=True))
            r.kvcached_lines = kvcached_lines(server.log_text())
        (workdir / "elastic.json").write_text(json.dumps(rec.to_json(), indent=1, default=str))
    return rec


def run_contended(a: VllmServer, b: VllmServer, rec: ElasticRecord, sampler: UsageSampler) -> None:
    """Phase (4): B's load first, A's once B holds half of the memory the two
    idle instances leave free. Each load alone needs more than that half
    (``test_a_filled_memory``), so A's comes on top of B's: started at the
    same moment, one engine could finish most of its load before the other's
    grew (CI once saw no miss at all that way), and B decodes
    :data:`CONTENDED_B_OUTPUT` tokens a request, so it still holds that memory
    while A's prefill grows (with 64, B once finished first: no miss again)."""
    results: dict[str, list[Completion]] = {}

    def load(server: VllmServer, key: str, seed: int, output: int) -> None:
        results[key] = server.complete_all(load_prompts(seed), output, ignore_eos=True)

    b_load = threading.Thread(target=load, args=(b, "b", 400_000, CONTENDED_B_OUTPUT))
    start = time.monotonic()
    b_load.start()
    half = rec.b_idle + (rec.budget - rec.a_idle - rec.b_idle) // 2
    while b_load.is_alive() and time.monotonic() - start < CONTENDED_HEAD_START_MAX_S:
        if sampler.read()[0].get(rec.b.name, 0) >= half:
            rec.contended_head_start_s = time.monotonic() - start
            break
        time.sleep(0.05)
    load(a, "a", 300_000, LOAD_OUTPUT)
    b_load.join()
    rec.contended = results.get("a", []) + results.get("b", [])


def run_limit_phases(
    server: VllmServer,
    rec: ElasticRecord,
    sampler: UsageSampler,
    set_limit: Callable[[str, int | None], str],
    usage: Callable[[str], int],
) -> None:
    name = rec.b.name
    rec.limit_idle = usage(name)
    fill = [token_prompt(500_000 + i, LIMIT_FILL_PROMPT) for i in range(LIMIT_FILL)]
    done = [
        c
        for i in range(0, LIMIT_FILL, 8)
        for c in server.complete_all(fill[i : i + 8], 1, concurrent=True)
    ]
    rec.limit_fill_ok = all(c.ok for c in done)
    rec.limit_filled = usage(name)
    rec.limit = rec.limit_idle + (rec.limit_filled - rec.limit_idle) // 4
    rec.limit_status.append(set_limit(name, rec.limit))
    start = time.monotonic()
    while time.monotonic() - start < 30:
        if usage(name) <= rec.limit:
            rec.limit_released_s = time.monotonic() - start
            break
        time.sleep(0.1)
    with sampler:
        short = [token_prompt(600_000 + i, 150) for i in range(100)]
        for i in range(0, len(short), 8):
            rec.limit_load += server.complete_all(short[i : i + 8], 16, concurrent=True)
        for i in range(4):
            rec.limit_load.append(server.complete(token_prompt(700_000 + i, 1200), 16))
    rec.limit_peak_under_load = sampler.peaks.get(name, 0)
    rec.limit_status.append(set_limit(name, None))
    refill = [token_prompt(800_000 + i, LIMIT_FILL_PROMPT) for i in range(LIMIT_FILL)]
    done = [
        c
        for i in range(0, LIMIT_FILL, 8)
        for c in server.complete_all(refill[i : i + 8], 1, concurrent=True)
    ]
    rec.limit_refill_ok = all(c.ok for c in done)
    rec.limit_regrown = usage(name)
