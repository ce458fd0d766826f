"""The seeded request trace of the multi-model benchmark (``multi_model.py``).

Per model the arrival rate ramps like upstream's intermittent-peak trace: from
0 up to the peak at ``slope`` req/s per second, held for ``hold_s``, down to
``low`` at the same slope, then ``low`` until the trace ends. Model ``m``
starts its ramp ``m * stagger`` seconds in. By default the stagger is the ramp
up plus ``overlap`` of the hold: the next model climbs while the previous one
is still at its peak, so peaks partly overlap. ``model_delay_s`` sets it
instead; :func:`upstream_delay` is upstream's ``MODEL_DELAY = PEAK/4 + 2*PEAK``
(its ramp: 0 -> PEAK -> 1 req/s at +-1 req/s per second, no hold), under which
one model peaks at a time while the models before it run at the low rate. Arrivals are a Poisson process of
that rate (thinning), each request with a prompt length drawn from
``prompt_min..prompt_max`` and its own prompt seed; the prompt's token ids are
derived from that seed (:func:`prompt_tokens`), so a trace file replays
exactly without storing prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Token ids of the tiny models are 3..VOCAB-1 (0-2 are special).
VOCAB = 512


@dataclass(frozen=True)
class TraceSpec:
    """The shape of one trace: one peak level for every model."""

    peak: float  #: req/s each model reaches
    low: float = 0.25  #: req/s after a model's peak
    slope: float = 0.5  #: req/s per second, up and down
    hold_s: float = 8.0  #: seconds at the peak
    overlap: float = 0.5  #: share of the hold the next model's ramp overlaps
    tail_s: float = 6.0  #: seconds after the last model reaches ``low``
    models: int = 3
    prompt_min: int = 192
    prompt_max: int = 320
    max_tokens: int = 128
    #: seconds between two models' ramps (None: ramp up + ``overlap`` of the hold)
    model_delay_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("peak", "slope"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TraceSpec.{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.low <= self.peak:
            raise ValueError(f"TraceSpec.low={self.low} must be within 0..peak ({self.peak})")
        if self.hold_s < 0 or self.tail_s < 0 or not 0 <= self.overlap <= 1:
            raise ValueError("TraceSpec: hold_s and tail_s must be >= 0 and overlap in 0..1")
        if self.models < 1 or not 1 <= self.prompt_min <= self.prompt_max or self.max_tokens < 1:
            raise ValueError(
                "TraceSpec: models >= 1, 1 <= prompt_min <= prompt_max, max_tokens >= 1"
            )
        if self.model_delay_s is not None and self.model_delay_s < 0:
            raise ValueError(f"TraceSpec.model_delay_s={self.model_delay_s} must be >= 0")

    @property
    def up_s(self) -> float:
        return self.peak / self.slope

    @property
    def down_s(self) -> float:
        return (self.peak - self.low) / self.slope

    @property
    def stagger_s(self) -> float:
        if self.model_delay_s is not None:
            return self.model_delay_s
        return self.up_s + self.overlap * self.hold_s

    @property
    def duration_s(self) -> float:
        return (
            (self.models - 1) * self.stagger_s + self.up_s + self.hold_s + self.down_s + self.tail_s
        )

    def rate(self, model: int, t: float) -> float:
        """Arrival rate (req/s) of ``model`` at ``t`` seconds into the trace."""
        x = t - model * self.stagger_s
        if x < 0:
            return 0.0
        if x < self.up_s:
            return self.slope * x
        x -= self.up_s
        if x < self.hold_s:
            return self.peak
        x -= self.hold_s
        if x < self.down_s:
            return self.peak - self.slope * x
        return self.low


def upstream_delay(peak: float) -> float:
    """Upstream's ``MODEL_DELAY = RAMP_UP_DURATION/4 + RAMP_UP_DURATION*2`` at a
    slope of 1 req/s per second (ramp up = ``peak`` seconds). Upstream's shell
    divides whole numbers, so a peak that is a multiple of 4 gives its value exactly."""
    return peak / 4 + 2 * peak


def make_trace(spec: TraceSpec, seed: int) -> list[dict[str, Any]]:
    """Every request of one trace, in time order: ``t`` (s), ``model``,
    ``prompt_seed``, ``prompt_len``, ``max_tokens``."""
    rng = random.Random(seed)
    requests: list[dict[str, Any]] = []
    for model in range(spec.models):
        t = 0.0
        while True:  # thinning of a Poisson process of rate <= peak
            t += rng.expovariate(spec.peak)
            if t >= spec.duration_s:
                break
            if rng.random() * spec.peak < spec.rate(model, t):
                requests.append(trace_request(rng, t, model, spec))
    requests.sort(key=lambda r: (r["t"], r["model"]))
    return requests


def trace_request(rng: random.Random, t: float, model: int, spec: Any) -> dict[str, Any]:  # noqa: ANN401
    """One request of a trace at ``t``: its prompt's seed and length drawn from ``rng``
    (in that order) within ``spec``'s ``prompt_min..prompt_max``."""
    return {
        "t": round(t, 4),
        "model": model,
        "prompt_seed": rng.randrange(1 << 31),
        "prompt_len": rng.randint(spec.prompt_min, spec.prompt_max),
        "max_tokens": spec.max_tokens,
    }


def prompt_tokens(prompt_seed: int, length: int) -> list[int]:
    """The token ids of a trace request's prompt (unique per seed)."""
    rng = random.Random(prompt_seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def write_traces(
    path: Path, specs: list[TraceSpec], seed: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write one trace per spec (the seed of peak ``i`` is ``seed + i``) to
    ``path`` and return the document (with ``extra``'s keys, e.g. a provenance
    block, beside ``seed`` and ``traces``)."""
    doc = {
        **(extra or {}),
        "seed": seed,
        "traces": [
            {
                "spec": asdict(spec),
                "seed": seed + i,
                "duration_s": spec.duration_s,
                "requests": make_trace(spec, seed + i),
            }
            for i, spec in enumerate(specs)
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    return doc


def read_traces(path: Path) -> dict[str, Any]:
    """A trace file written by :func:`write_traces`, checked for its keys."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "traces" not in doc or "seed" not in doc:
        raise ValueError(
            f"trace file {path}: expected an object with 'seed' and 'traces' "
            "(written by multi_model.py)"
        )
    for i, trace in enumerate(doc["traces"]):
        missing = {"spec", "seed", "requests"} - set(trace)
        if missing:
            raise ValueError(f"trace file {path}: trace {i} lacks {sorted(missing)}")
    return doc


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
