"""Helpers of the serve tests: configs over the fake engine, a client, polling."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvcached.serve.config import ServeConfig, parse_config

FAKE = str(Path(__file__).with_name("fake_engine.py"))


def fake_model(name: str, log: Path, **keys: Any) -> dict[str, Any]:  # noqa: ANN401
    """A model entry served by the fake engine (``extra``: its options)."""
    extra = keys.pop("extra", [])
    entry: dict[str, Any] = {
        "name": name,
        "engine": "command",
        "command": [sys.executable, FAKE, "{port}", str(log), *extra],
        "startup_timeout": 60,
        "stop_timeout": 10,
    }
    entry.update(keys)
    return entry


def config(tmp_path: Path, models: list[dict[str, Any]], **top: Any) -> ServeConfig:  # noqa: ANN401
    doc = {"port": 0, "state_dir": str(tmp_path / "state"), "idle_check_s": 0.05, "models": models}
    doc.update(top)
    return parse_config(doc)


def calls(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


async def until(
    check: Callable[[], Any],
    timeout_s: float = 60.0,  # noqa: ANN401
    what: str = "condition",
) -> Any:  # noqa: ANN401
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.05)


class Client:
    """An aiohttp client of one router."""

    def __init__(self, port: int, api_key: str | None = None) -> None:
        self.base = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(headers=headers)

    async def get(self, path: str) -> tuple[int, Any]:  # noqa: ANN401
        async with self.session.get(self.base + path) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def post(
        self,
        path: str,
        body: Any = None,
        raw: bytes | None = None,  # noqa: ANN401
    ) -> tuple[int, Any, dict[str, str]]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post(
            self.base + path, data=data, headers={"Content-Type": "application/json"}
        ) as r:
            text = await r.text()
            try:
                doc = json.loads(text)
            except ValueError:
                doc = text
            return r.status, doc, dict(r.headers)

    async def state(self, model: str) -> dict[str, Any]:
        return (await self.get(f"/v1/models/{model}/state"))[1]

    async def close(self) -> None:
        await self.session.close()


def run(coro: Awaitable[Any]) -> Any:  # noqa: ANN401
    return asyncio.run(asyncio.wait_for(coro, 240))  # type: ignore[arg-type]
