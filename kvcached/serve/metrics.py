"""``/metrics``: the router's Prometheus text exposition, per model.

Requests, errors, requests in flight, a TTFT histogram (seconds from the
request's arrival to the engine's first byte), sleeps and wakes with their
durations, starts, restarts, deaths, and the state as a labelled gauge
(``kvcached_serve_state{model, state} 1`` for the current one) and a code
(:data:`~kvcached.serve.state.STATE_CODES`). With gateway readings
(:mod:`.gateway`), the gauges cluster routers read, per served name, and
whether each is awake and routable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcached.control.metrics import escape_label, format_value
from kvcached.serve.gateway import GatewayReading
from kvcached.serve.model import TTFT_BUCKETS, ModelRuntime
from kvcached.serve.state import STATE_CODES, STATES

#: (name, kind, help, what of a model) of the per-model counter and gauge families.
_SIMPLE = (
    (
        "kvcached_serve_requests_total",
        "counter",
        "Requests routed to the model.",
        lambda m: m.counters.requests,
    ),
    (
        "kvcached_serve_errors_total",
        "counter",
        "Requests answered with a status >= 400 or broken off.",
        lambda m: m.counters.errors,
    ),
    (
        "kvcached_serve_in_flight",
        "gauge",
        "Requests routed and not yet answered.",
        lambda m: m.in_flight,
    ),
    (
        "kvcached_serve_sleeps_total",
        "counter",
        "Times the model was put to sleep.",
        lambda m: m.counters.sleeps,
    ),
    (
        "kvcached_serve_sleep_seconds_total",
        "counter",
        "Seconds spent putting it to sleep.",
        lambda m: m.counters.sleep_seconds,
    ),
    (
        "kvcached_serve_wakes_total",
        "counter",
        "Times the model was woken.",
        lambda m: m.counters.wakes,
    ),
    (
        "kvcached_serve_wake_seconds_total",
        "counter",
        "Seconds spent waking it.",
        lambda m: m.counters.wake_seconds,
    ),
    (
        "kvcached_serve_starts_total",
        "counter",
        "Engine processes started.",
        lambda m: m.counters.starts,
    ),
    (
        "kvcached_serve_restarts_total",
        "counter",
        "Restarts after an engine died.",
        lambda m: m.counters.restarts,
    ),
    (
        "kvcached_serve_engine_deaths_total",
        "counter",
        "Engine processes that died.",
        lambda m: m.counters.deaths,
    ),
    (
        "kvcached_serve_state_code",
        "gauge",
        "The model's state: " + ", ".join(f"{c}={s}" for s, c in STATE_CODES.items()) + ".",
        lambda m: STATE_CODES[m.state],
    ),
)


def render_metrics(
    models: Sequence[ModelRuntime], gateway: Mapping[str, GatewayReading] | None = None
) -> str:
    out: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")

    def line(name: str, value: float, **labels: str) -> None:
        text = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{text}}} {format_value(value)}")

    for name, kind, help_text, get in _SIMPLE:
        family(name, kind, help_text)
        for m in models:
            line(name, get(m), model=m.name)
    family("kvcached_serve_state", "gauge", "1 for the model's current state, 0 for the others.")
    for m in models:
        for s in STATES:
            line("kvcached_serve_state", 1 if m.state == s else 0, model=m.name, state=s)
    name = "kvcached_serve_ttft_seconds"
    family(
        name,
        "histogram",
        "Seconds from a request's arrival to its first byte from the engine (successful requests).",
    )
    for m in models:
        c = m.counters
        for bound, count in zip(TTFT_BUCKETS, c.ttft_buckets, strict=True):
            line(name + "_bucket", count, model=m.name, le=format_value(bound))
        line(name + "_bucket", c.ttft_count, model=m.name, le="+Inf")
        line(name + "_sum", c.ttft_sum, model=m.name)
        line(name + "_count", c.ttft_count, model=m.name)
    if gateway:
        _gateway_families(models, gateway, family, line)
    return "\n".join(out) + "\n"


#: (name, kind, help, what of a reading) of the per-model gateway families.
_GATEWAY = (
    ("vllm:num_requests_running", "gauge", "Requests running in the model's engine.",
     lambda r: r.running),
    ("vllm:num_requests_waiting", "gauge",
     "Requests waiting in the model's engine, and those serve holds while it starts or wakes.",
     lambda r: r.waiting),
    ("vllm:kv_cache_usage_perc", "gauge",
     "Physical KV memory in use over what the model could hold now (1 = full): "
     "mapped / (mapped + what its limit and its GPU's ledger still let it map).",
     lambda r: r.usage_perc),
    ("kvcached_serve_kv_used_bytes", "gauge", "KV memory the model's instance has mapped.",
     lambda r: r.used_bytes),
    ("kvcached_serve_kv_mappable_bytes", "gauge",
     "KV memory it could still map now (its limit's room and the ledger's headroom).",
     lambda r: r.mappable_bytes),
    ("kvcached_serve_kv_limit_bytes", "gauge", "Its instance limit (absent: none).",
     lambda r: r.limit_bytes),
    ("kvcached_serve_kv_headroom_bytes", "gauge", "The least ledger headroom on its GPUs.",
     lambda r: r.headroom_bytes),
    ("kvcached_serve_awake", "gauge",
     "1 while the model is ready (its engine serves now); 0 while it sleeps, wakes, starts, "
     "is stopped or failed.",
     lambda r: int(r.awake)),
    ("kvcached_serve_routable", "gauge",
     "1 while a request for the model is served (serve wakes or starts it first if need be); "
     "0 while it is failed (its requests get 503).",
     lambda r: int(r.routable)),
)  # fmt: skip


def _gateway_families(models, gateway, family, line) -> None:  # noqa: ANN001
    for name, kind, help_text, get in _GATEWAY:
        family(name, kind, help_text)
        for m in models:
            reading = gateway.get(m.name)
            value = None if reading is None else get(reading)
            if value is None:
                continue
            for served in m.config.served_names:
                line(name, value, model_name=served)
