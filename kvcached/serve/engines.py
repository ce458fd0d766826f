"""What serve knows about each engine kind, in one table.

One :class:`EngineKind` per ``engine:`` value of the config: how its server is
launched (module, flags), what its environment needs, its own sleep API, where
it answers health and metrics and which of its metrics show requests it
serves without the router. Adding an engine is adding a row here; nothing
else in serve branches on the engine's name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

#: One HTTP call: (method, path with query, JSON body or None).
Call = tuple[str, str, "dict[str, object] | None"]


@dataclass(frozen=True)
class EngineKind:
    """One engine kind's launch recipe and HTTP surface."""

    name: str
    #: ``python -m <module>`` serves it; "" for ``command`` (the user's argv)
    module: str = ""
    #: the flag that names the model path or id
    model_flag: str = ""
    #: added when the model sleeps at the ``weights`` level (the sleep API exists only then)
    weights_flag: str = ""
    #: environment the ``weights`` level needs
    weights_env: Mapping[str, str] = field(default_factory=dict)
    #: the engine's own sleep and wake calls (``{level}``: ``sleep.weights_level``); None: none
    weights_sleep: Call | None = None
    weights_wake: Call | None = None
    #: the wake after a sleep that discarded the weights (vLLM's level 2), in order; empty:
    #: ``weights_wake`` serves every level
    weights_reload: tuple[Call, ...] = ()
    #: an engine argument (flag, value) with which ``weights_reload`` cannot work
    reload_refused_by: tuple[str, str] | None = None
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    #: gauges whose sum above zero means requests run or wait in the engine
    busy_gauges: tuple[str, ...] = ()
    #: counters that move when the engine takes a request (from any client)
    request_counters: tuple[str, ...] = ()

    @property
    def watches_activity(self) -> bool:
        return bool(self.busy_gauges or self.request_counters)

    def launch(self, python: str, model: str, name: str, host: str, port: str) -> list[str]:
        """The engine's own launch argv (before the user's ``args``)."""
        assert self.module, f"engine {self.name} has no launch module: it needs a command"
        return [
            python,
            "-m",
            self.module,
            self.model_flag,
            model,
            "--served-model-name",
            name,
            "--host",
            host,
            "--port",
            port,
        ]

    def sleep_call(self, level: int) -> Call:
        if self.weights_sleep is None:
            raise ValueError(f"engine={self.name!r} has no weights sleep API: vllm or sglang")
        method, path, body = self.weights_sleep
        return method, path.replace("{level}", str(int(level))), body

    def wake_calls(self, level: int) -> tuple[Call, ...]:
        """The calls that wake it from a ``weights`` sleep at ``level``, in order."""
        if self.weights_wake is None:
            raise ValueError(f"engine={self.name!r} has no weights sleep API: vllm or sglang")
        if level >= 2 and self.weights_reload:
            return self.weights_reload
        return (self.weights_wake,)


ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind(
        name="vllm",
        module="vllm.entrypoints.openai.api_server",
        model_flag="--model",
        weights_flag="--enable-sleep-mode",
        # vLLM serves /sleep and /wake_up only in dev mode
        weights_env={"VLLM_SERVER_DEV_MODE": "1"},
        # vLLM reads the level from the query string (a JSON body is ignored: level 1)
        weights_sleep=("POST", "/sleep?level={level}", None),
        weights_wake=("POST", "/wake_up", None),
        # Level 2 discarded the weights: map their memory alone (the scheduler stays
        # paused, so no request runs on garbage), load them again from the model's
        # files, then map the KV cache, which resumes scheduling. vLLM's documented
        # sequence (docs/features/sleep_mode.md); 0.26 has every call.
        weights_reload=(
            ("POST", "/wake_up?tags=weights", None),
            ("POST", "/collective_rpc", {"method": "reload_weights"}),
            ("POST", "/wake_up?tags=kv_cache", None),
        ),
        # reload_weights asks the model loader for the files' weights; the dummy loader has none
        reload_refused_by=("--load-format", "dummy"),
        busy_gauges=("vllm:num_requests_running", "vllm:num_requests_waiting"),
        request_counters=("vllm:request_success_total", "vllm:prompt_tokens_total"),
    ),
    "sglang": EngineKind(
        name="sglang",
        module="sglang.launch_server",
        model_flag="--model-path",
        weights_flag="--enable-memory-saver",
        weights_sleep=("POST", "/release_memory_occupation", {}),
        weights_wake=("POST", "/resume_memory_occupation", {}),
        busy_gauges=("sglang:num_running_reqs", "sglang:num_queue_reqs"),
        request_counters=("sglang:prompt_tokens_total", "sglang:num_requests_total"),
    ),
    "command": EngineKind(name="command"),
}


def engine_kind(name: str) -> EngineKind:
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(
            f"engine={name!r} is not a known engine: {', '.join(ENGINE_KINDS)}"
        ) from None


def read_gauges(text: str, names: Collection[str]) -> dict[str, float]:
    """The sum of each of ``names``' samples in a Prometheus text exposition,
    for the names that have any (labelled samples of one name add up)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[name] = out.get(name, 0.0) + value
    return out


def read_activity(text: str, kind: EngineKind) -> tuple[float, float] | None:
    """(requests running or waiting, sum of the request counters) from a
    Prometheus exposition; None when it has none of ``kind``'s metrics."""
    seen = read_gauges(text, (*kind.busy_gauges, *kind.request_counters))
    if not seen:
        return None
    busy = sum(seen.get(name, 0.0) for name in kind.busy_gauges)
    return busy, sum(seen.get(name, 0.0) for name in kind.request_counters)
