"""The OpenAI-compatible router: one aiohttp app in front of every model's engine.

* ``GET /v1/models`` (OpenAI's list schema; aliases are listed too, with
  ``root`` naming the model), ``GET /v1/models/{model}``;
* ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``: routed
  by the body's ``model`` (a name or an alias; an alias is rewritten to the
  name the engine serves). The engine's status, headers and body pass through
  unchanged, chunk by chunk as they arrive (SSE streams are never buffered);
* an unknown model is a 404 and a body that is not a JSON object a 400, both in
  OpenAI's error schema; an engine that cannot be reached is a 502, one that
  cannot wake in time a 503 with ``Retry-After``;
* ``/health`` (the router is alive), ``/ready`` (every model that should be up
  is), ``/metrics`` (Prometheus text), ``/is_sleeping?model=``,
  ``/v1/models/{model}/state`` and ``/v1/models/{model}/metrics`` (the
  engine's own) for cluster routers; ``POST
  /admin/models/{model}/sleep|wake`` to act by hand.

With an API key configured every route but the probes (``/health``,
``/ready``, and ``/metrics`` with ``public_metrics: true``) wants
``Authorization: Bearer <key>``. Whatever goes wrong in a handler is answered
in OpenAI's error schema, never aiohttp's plain-text 500.

The router knows serve only through :class:`Front` (the models, by name),
so it does not import :mod:`kvcached.serve.app`, which imports it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from kvcached.log import get_logger
from kvcached.serve.config import ServeConfig
from kvcached.serve.gateway import readings as gateway_readings
from kvcached.serve.metrics import render_metrics
from kvcached.serve.model import ModelRuntime, ModelUnavailable
from kvcached.serve.state import SLEEPING, STOPPED, WAKING

log = get_logger("kvcached.serve")

ROUTED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself.
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
CREATED = int(time.time())


def openai_error(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def unavailable(exc: ModelUnavailable) -> web.Response:
    """503 for a model that cannot be made ready now, with when to try again."""
    return openai_error(
        503,
        str(exc),
        "server_error",
        "model_unavailable",
        headers={"Retry-After": str(exc.retry_after)},
    )


class Front(Protocol):
    """What the router needs of serve (:class:`~kvcached.serve.app.Serve` is one)."""

    config: ServeConfig
    models: Sequence[ModelRuntime]

    def find(self, name: str) -> ModelRuntime | None: ...

    def is_up(self, m: ModelRuntime) -> bool: ...


#: Routes open without the API key: the probes an orchestrator calls.
OPEN_ROUTES = ("/health", "/ready")


class Router:
    """The aiohttp application in front of one serve's models."""

    def __init__(self, serve: Front) -> None:
        self.serve = serve
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(
            middlewares=[self._errors, self._auth], client_max_size=64 * 1024 * 1024
        )
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ready", self.ready),
                web.get("/metrics", self.metrics),
                web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model}", self.get_model),
                web.get("/v1/models/{model}/state", self.model_state),
                web.get("/v1/models/{model}/metrics", self.engine_metrics),
                web.get("/is_sleeping", self.is_sleeping),
                web.post("/admin/models/{model}/sleep", self.admin_sleep),
                web.post("/admin/models/{model}/wake", self.admin_wake),
                *[web.post(path, self.proxy) for path in ROUTED],
            ]
        )
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, _app: web.Application) -> None:
        # No total timeout: a long stream is not an error. No decompression:
        # bytes pass through as the engine sent them.
        self.session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
        )

    async def _close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:  # noqa: ANN401
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return openai_error(exc.status, f"{request.method} {request.path}: {exc.reason}", kind)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("kvcached serve: %s %s failed", request.method, request.path)
            return openai_error(
                500,
                f"kvcached serve could not handle {request.method} {request.path}: {exc!r}",
                "server_error",
                "internal_error",
            )

    def _needs_key(self, path: str) -> bool:
        if path in OPEN_ROUTES:
            return False
        return not (path == "/metrics" and self.serve.config.public_metrics)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:  # noqa: ANN401
        key = self.serve.config.api_key
        if key and self._needs_key(request.path):
            got = request.headers.get("Authorization", "")
            if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip(), key)):
                return openai_error(
                    401,
                    "a valid API key is needed: Authorization: Bearer <key>",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        return await handler(request)

    def _find(self, name: str) -> ModelRuntime | None:
        return self.serve.find(name)

    def _unknown(self, name: object) -> web.Response:
        served = ", ".join(n for m in self.serve.models for n in m.config.served_names)
        return openai_error(
            404,
            f"The model {name!r} does not exist; served here: {served}",
            "invalid_request_error",
            "model_not_found",
            "model",
        )

    # -- probes -----------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        states = {m.name: m.state for m in self.serve.models}
        waiting = [m.name for m in self.serve.models if not self.serve.is_up(m)]
        status = 200 if not waiting else 503
        failed = [m.name for m in self.serve.models if m.given_up]
        return web.json_response(
            {"ready": not waiting, "models": states, "waiting_for": waiting, "failed": failed},
            status=status,
        )

    async def metrics(self, _request: web.Request) -> web.Response:
        gauges = await gateway_readings(self.serve.models)
        return web.Response(
            text=render_metrics(self.serve.models, gauges),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    def _model_entries(self, m: ModelRuntime) -> list[dict[str, Any]]:
        return [
            {"id": n, "object": "model", "created": CREATED, "owned_by": "kvcached", "root": m.name}
            for n in m.config.served_names
        ]

    async def list_models(self, _request: web.Request) -> web.Response:
        data = [e for m in self.serve.models for e in self._model_entries(m)]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        m = self._find(name)
        if m is None:
            return self._unknown(name)
        return web.json_response(next(e for e in self._model_entries(m) if e["id"] == name))

    async def model_state(self, request: web.Request) -> web.Response:
        m = self._find(request.match_info["model"])
        if m is None:
            return self._unknown(request.match_info["model"])
        return web.json_response(m.describe())

    async def engine_metrics(self, request: web.Request) -> web.Response:
        """The engine's own ``/metrics`` (vLLM's ``vllm:*`` gauges that cluster
        routers read), fetched as is; empty while no engine process runs."""
        m = self._find(request.match_info["model"])
        if m is None:
            return self._unknown(request.match_info["model"])
        if m.process is None or not m.record.port:
            return web.Response(text="", content_type="text/plain")
        assert self.session is not None, "the router's client session opens at app startup"
        try:
            async with self.session.get(
                m.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)
            ) as r:
                body = await r.read()
                return web.Response(
                    body=body, status=r.status, content_type="text/plain", charset="utf-8"
                )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return openai_error(
                502,
                f"model {m.name!r}: its engine's /metrics could not be read ({exc!r})",
                "server_error",
                "engine_unreachable",
            )

    async def is_sleeping(self, request: web.Request) -> web.Response:
        name = request.query.get("model", "")
        m = self._find(name)
        if m is None:
            return self._unknown(name)
        return web.json_response(
            {"is_sleeping": m.state in (SLEEPING, STOPPED, WAKING), "state": m.state}
        )

    async def admin_sleep(self, request: web.Request) -> web.Response:
        m = self._find(request.match_info["model"])
        if m is None:
            return self._unknown(request.match_info["model"])
        done = await m.sleep(reason="asked through /admin")
        return web.json_response({"slept": done, **m.describe()}, status=200 if done else 409)

    async def admin_wake(self, request: web.Request) -> web.Response:
        m = self._find(request.match_info["model"])
        if m is None:
            return self._unknown(request.match_info["model"])
        try:
            await m.ensure_ready()
        except ModelUnavailable as exc:
            return unavailable(exc)
        return web.json_response(m.describe())

    # -- the proxy --------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return openai_error(
                400, f"the request body is not JSON: {exc}", "invalid_request_error", "invalid_json"
            )
        if not isinstance(doc, dict):
            return openai_error(
                400,
                "the request body must be a JSON object",
                "invalid_request_error",
                "invalid_json",
            )
        name = doc.get("model")
        if not isinstance(name, str):
            return openai_error(
                400,
                'the request needs "model": one of the names in GET /v1/models',
                "invalid_request_error",
                "missing_model",
                "model",
            )
        m = self._find(name)
        if m is None:
            return self._unknown(name)
        if name != m.name:  # an alias: the engine serves the model's own name
            doc["model"] = m.name
            body = json.dumps(doc).encode()
        began = time.monotonic()
        m.begin()
        try:
            try:
                await m.ensure_ready()
            except ModelUnavailable as exc:
                m.record_error()
                return unavailable(exc)
            return await self._forward(request, m, body, began)
        finally:
            m.end()

    async def _forward(
        self, request: web.Request, m: ModelRuntime, body: bytes, began: float
    ) -> web.StreamResponse:
        assert self.session is not None, "the router's client session opens at app startup"
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and k.lower() != "authorization"
        }
        url = m.base_url + request.path_qs
        try:
            upstream_cm = self.session.post(url, data=body, headers=headers)
            upstream = await upstream_cm.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            m.record_error()
            return openai_error(
                502,
                f"model {m.name!r}: its engine at {m.base_url} could not be reached ({exc!r})",
                "server_error",
                "engine_unreachable",
            )
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            if upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            first = True
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
                if first:
                    first = False
                    if upstream.status == 200:
                        m.record_first_byte(time.monotonic() - began)
            await resp.write_eof()
            if upstream.status >= 400:
                m.record_error()
            return resp
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionResetError) as exc:
            m.record_error()
            log.warning("model %s: a response broke off: %r", m.name, exc)
            raise
        finally:
            await upstream_cm.__aexit__(None, None, None)
