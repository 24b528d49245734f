"""A scripted stand-in for the serve process's client (no broker) and the app around it."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from dataclasses import replace

from aiohttp.test_utils import TestClient, TestServer

from pipeline.catalog.catalog import ModelCatalog, PoolModels
from pipeline.client import AsyncReplyStream, Submitted
from pipeline.config import Settings
from pipeline.errors import KafkaOperationError
from pipeline.models import Chunk, Request, Response, Status, now_ms
from pipeline.serve.app import Server, build_app
from pipeline.tenants.keys import hash_key
from pipeline.tenants.registry import TenantRegistry

KEYS = {"acme": "acme-key-0000000000001", "beta": "beta-key-0000000000002", "off": "off-key-00000000000003"}


def completed(req: Request, output: str = "hello there", **kw) -> Response:
    kw.setdefault("prompt_tokens", 3)
    kw.setdefault("completion_tokens", 2)
    kw.setdefault("finish_reason", "stop")
    return Response.for_request(req, Status.COMPLETED, output=output, model=req.model,
                                served_priority=req.priority, **kw)


def chunks(req: Request, parts: list[str], finish: str = "stop") -> list[Chunk]:
    return [Chunk.for_request(req, i, p, finish_reason=finish if i == len(parts) - 1 else None)
            for i, p in enumerate(parts)]


class FakeClient:
    """Answers each submitted request with ``script(request)``: Responses (QUEUED or terminal) and
    Chunks, each optionally as (delay_s, item)."""

    def __init__(self, script, *, kafka_down: bool = False):
        self.script = script
        self.kafka_down = kafka_down  # no write is acknowledged: submit times out
        self.sent: list[Request] = []
        self.cancelled: list[tuple[str, str]] = []
        self.futures: dict[str, Future] = {}
        self.queued_events: dict[str, Response] = {}
        self.streams: dict[str, AsyncReplyStream] = {}
        self.reply_partitions = [0]
        self.listening = True

    def addressed(self, req: Request) -> Request:
        return req if req.reply_partition is not None else replace(req, reply_partition=0)

    def response_future(self, request_id: str) -> Future:
        return self.futures.setdefault(request_id, Future())

    def forget(self, request_id: str) -> None:
        self.futures.pop(request_id, None)
        self.streams.pop(request_id, None)

    def queued(self, request_id: str):
        return self.queued_events.get(request_id)

    async def cancel(self, request_id: str, reason: str) -> None:
        self.cancelled.append((request_id, reason))

    def _deliver(self, req: Request, item) -> None:
        stream = self.streams.get(req.request_id)
        if isinstance(item, Response) and not item.status.is_terminal:
            self.queued_events[req.request_id] = item
            return
        if isinstance(item, Response):
            fut = self.futures.get(req.request_id)
            if fut is not None and not fut.done():
                fut.set_result(item)
            self.queued_events.pop(req.request_id, None)
        if stream is not None:
            stream.push(item)

    async def submit(self, req: Request, timeout: float = 30.0, track: bool = True, wait_queued: float = 10.0):
        if self.kafka_down:
            await asyncio.sleep(timeout)
            raise KafkaOperationError(f"submit {req.request_id}", f"not acknowledged within {timeout}s")
        self.sent.append(req)
        self.response_future(req.request_id)
        loop = asyncio.get_running_loop()
        word = None
        for entry in self.script(req):
            delay, item = entry if isinstance(entry, tuple) else (0.0, entry)
            if delay:
                loop.call_later(delay, self._deliver, req, item)
                continue
            self._deliver(req, item)
            if word is None and isinstance(item, Response) and req.notify_queued and wait_queued:
                word = item
        return Submitted(req.request_id, "topic", 0, len(self.sent), word)

    async def open_stream(self, req: Request, timeout: float = 60.0, submit_timeout: float | None = None) -> AsyncReplyStream:
        req = self.addressed(replace(req, stream=True))
        stream = self.streams[req.request_id] = AsyncReplyStream(self, req, timeout)
        await self.submit(req, timeout=timeout if submit_timeout is None else submit_timeout, wait_queued=0)
        return stream

    async def result(self, request_id: str, timeout: float = 60.0) -> Response:
        return await asyncio.wait_for(asyncio.wrap_future(self.response_future(request_id)), timeout)


def settings(**serve) -> Settings:
    s = Settings.load(env={})
    s.tenants.records = {
        "acme": {"tier": "enterprise", "max_priority": "HIGH", "key_hashes": [hash_key(KEYS["acme"])]},
        "beta": {"tier": "free", "models": ["sim-small"], "key_hashes": [hash_key(KEYS["beta"])]},
        "off": {"enabled": False, "key_hashes": [hash_key(KEYS["off"])]},
    }
    s.serve.stream_heartbeat_s = 0.2
    for k, v in serve.items():
        setattr(s.serve, k, v)
    return s


class StaticModels:
    """A model store whose catalog holds one pool's list, published now."""

    def __init__(self, settings: Settings, served: tuple[str, ...], any_model: bool = False,
                 aliases: dict | None = None):
        pool = PoolModels("llmq-workers", served, served[0] if served else "", any_model, aliases or {}, now_ms())
        self._catalog = ModelCatalog(settings.models, {pool.pool: pool})

    def catalog(self) -> ModelCatalog:
        return self._catalog


@contextlib.asynccontextmanager
async def running(script, kafka_down: bool = False, served: tuple[str, ...] | None = ("sim-small", "sim-large"),
                  aliases: dict | None = None, **serve):
    """(http client, Server, FakeClient) for one test. ``served``: what the one pool of the model
    catalog serves (None: no pool has published)."""
    s = settings(**serve)
    fake = FakeClient(script, kafka_down=kafka_down)
    models = StaticModels(s, served, aliases=aliases) if served is not None else None
    server = Server(s, TenantRegistry(s), fake, models)
    async with TestClient(TestServer(build_app(server))) as http:
        yield http, server, fake


def auth(tenant: str = "acme", **headers) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}", **headers}
