"""Per-model gauges for cluster routers, read when ``/metrics`` is scraped.

Gateways pick a server from three vLLM gauges: the Gateway API inference
extension's endpoint picker (``--kv-cache-usage-percentage-metric``,
``--total-queued-requests-metric``, ``--total-running-requests-metric``),
llm-d's inference scheduler (the same picker) and production-stack's router.
Behind serve every model is its own series, labelled ``model_name`` as vLLM
labels them:

* ``vllm:num_requests_running``: the engine's own gauge (0 while no engine runs);
* ``vllm:num_requests_waiting``: the engine's own, plus the requests serve holds
  while the model starts or wakes;
* ``vllm:kv_cache_usage_perc``: *physical* KV use over what the instance could
  hold now, ``used / (used + mappable)``, where ``mappable`` is what it could
  still map: the least of its limit's room and its GPU ledger's headroom. vLLM's
  own gauge under kvcached counts blocks of the virtual cache, which other
  engines' memory does not shrink, so it overstates the room left. A model
  that is not awake (sleeping, waking, starting, stopped, failed) can map
  nothing until it is woken, so it reads 1: a picker then prefers an awake
  replica and wakes a sleeping one only when the awake ones queue more;
* ``kvcached_serve_awake`` (1: ready, its engine serves now) and
  ``kvcached_serve_routable`` (1: a request is served, waking or starting the
  model first if need be; 0: failed, its requests get ``503``).

The bytes behind the ratio are exposed too (``kvcached_serve_kv_*_bytes``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvcached.serve.engines import read_gauges
from kvcached.serve.state import FAILED, READY

#: A scrape waits at most this long for an engine's own /metrics.
ENGINE_SCRAPE_S = 1.0


@dataclass
class GatewayReading:
    """One model's gauges at one scrape (``None``: not known now)."""

    running: float = 0.0
    waiting: float = 0.0
    awake: bool = True  #: ready: its engine serves now, no wake first
    routable: bool = True  #: not failed: a request is served (after a wake or start)
    used_bytes: int | None = None
    limit_bytes: int | None = None
    headroom_bytes: int | None = None

    @property
    def mappable_bytes(self) -> int | None:
        """What the instance could still map now: its limit's room and the ledger's
        headroom; nothing while it is not awake (it maps only once woken)."""
        if self.used_bytes is None or self.headroom_bytes is None:
            return None
        if not self.awake:
            return 0
        room = max(0, self.headroom_bytes)
        if self.limit_bytes is not None:
            room = min(room, max(0, self.limit_bytes - self.used_bytes))
        return room

    @property
    def usage_perc(self) -> float | None:
        if not self.awake:
            return 1.0  # known without a ledger read: it can map nothing until woken
        mappable = self.mappable_bytes
        if mappable is None or self.used_bytes is None:
            return None
        total = self.used_bytes + mappable
        return self.used_bytes / total if total > 0 else 1.0


def kv_view(names: Sequence[str]) -> dict[str, tuple[int, int | None, int]]:
    """Per instance in ``names``: (bytes mapped, its limit, the least ledger
    headroom over its GPUs), from the snapshots and ledgers ``kvctl`` reads
    (blocking: run it in an executor)."""
    from kvcached.control.view import gather
    from kvcached.serve.sleep import configured_ledger_dir

    rows, gpus = gather(names=list(names), problems=[], configured_dir=configured_ledger_dir())
    headroom = {g.gpu: g.headroom_bytes for g in gpus}
    out: dict[str, tuple[int, int | None, int]] = {}
    for r in rows:
        if r.gpu not in headroom:
            continue
        used, limit, room = out.get(r.name, (0, None, 1 << 62))
        if r.limit_bytes is not None:
            limit = (limit or 0) + r.limit_bytes
        out[r.name] = (used + r.used_bytes, limit, min(room, headroom[r.gpu]))
    return out


async def readings(models: Sequence[Any]) -> dict[str, GatewayReading]:
    """Every model's :class:`GatewayReading`: its engine's gauges (ready models,
    fetched concurrently) and its instance's KV bytes."""
    out = {
        m.name: GatewayReading(
            waiting=float(m.held_requests), awake=m.state == READY, routable=m.state != FAILED
        )
        for m in models
    }

    async def engine(m: Any) -> None:
        running, waiting = m.kind.busy_gauges or ("", "")
        if not running or not m.engine_reachable:
            return
        try:
            async with m.client().get(
                m.base_url + m.kind.metrics_path,
                timeout=aiohttp.ClientTimeout(total=ENGINE_SCRAPE_S),
            ) as resp:
                if resp.status != 200:
                    return
                gauges = read_gauges(await resp.text(), (running, waiting))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        out[m.name].running = gauges.get(running, 0.0)
        out[m.name].waiting += gauges.get(waiting, 0.0)

    loop = asyncio.get_running_loop()
    view = loop.run_in_executor(None, kv_view, [m.name for m in models])
    await asyncio.gather(*(engine(m) for m in models))
    try:
        seen = await view
    except Exception:  # no ledger readable now: the byte gauges are left out
        seen = {}
    for name, (used, limit, room) in seen.items():
        r = out[name]
        r.used_bytes, r.limit_bytes, r.headroom_bytes = used, limit, room
    return out
