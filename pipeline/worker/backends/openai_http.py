"""An OpenAI-compatible chat-completions backend (vLLM, llama.cpp server, TGI, OpenAI, ...).

One pooled HTTP/1.1 client per worker (aiohttp: its pool hands out a free connection in constant
time, where httpcore's scans every pooled connection, polling each socket, on every request,
encode/httpcore#924, a cost that grows with the hundreds of calls a worker keeps in flight
against a vLLM server). A call goes to a server of its model chosen by
the routing table (:mod:`routing`), by prefix cache and load (:mod:`cache_routing`), once the
server's pacer (:mod:`pacing`) has a slot for it, and is streamed (``stream: true`` with ``stream_options.include_usage``) so the
time to first token paces the server and a cancelled call closes its connection, which
is how a server learns to stop generating. A server that answers a stream request
with one JSON body is read as such.

Failures: 429 and 5xx answers, timeouts, connection errors and streams cut short are
retried, first on another server of the model (at once), then with exponential backoff
and jitter, honouring ``Retry-After``, and never past the request's deadline; every
other 4xx, or the last failed attempt, raises :class:`BackendError` (``retriable`` says
whether the failure was transient). A streamed call is retried only until its first
chunk is out: after that a retry would repeat text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import aiohttp

from pipeline.errors import BackendError
from pipeline.models import Request
from pipeline.observability.metrics import RoutingSeries
from pipeline.worker.backends.affinity import AffinityConfig, Choice, PromptKey
from pipeline.worker.backends.base import Completion, Piece, Usage
from pipeline.worker.backends.cache_routing import CacheRouter
from pipeline.worker.backends.openai_wire import (SseParser, StreamAssembler, WireError, chat_body,
                                                  completion_from_json, error_reason, prompt_token_estimate,
                                                  retry_after_s)
from pipeline.worker.backends.pacing import PacingConfig, PacingGate, Slot
from pipeline.worker.backends.routing import RoutingTable, Server
from pipeline.worker.backends.server_metrics import MetricsPoller

log = logging.getLogger(__name__)

_RETRIABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_OVERLOAD_STATUS = {429, 503}
_MAX_ERROR_BODY = 4096
_MAX_JSON_BODY = 32 * 1024 * 1024


@dataclass
class _Failure(Exception):
    reason: str
    retriable: bool
    server: Server | None = None
    unreachable: bool = False
    overloaded: bool = False
    retry_after: float | None = None
    #: A 200 stream that ended before its first event: servers do that when the request
    #: fails after the headers went out (llama-cpp-python on a too long prompt).
    empty_stream: bool = False

    def __str__(self) -> str:
        return self.reason


@dataclass
class _Call:
    """One request's way through its attempts."""

    request: Request
    stream: bool  # whether to ask for a stream when the server reports usage in streams
    deadline: float  # monotonic
    #: Ask for a whole answer: the last attempt's stream was empty, and the error that
    #: emptied it is only told in a whole answer.
    plain: bool = False
    always_stream: bool = False  # stream() streams even from servers that leave usage out
    attempts: int = 0
    #: A slot the worker reserved for the first attempt (see OpenAIBackend.reserve).
    reserved: Slot | None = None
    ends: float = 0.0  # monotonic end of the current attempt
    body: dict[str, Any] = field(default_factory=dict)  # the current attempt's
    tried: set = field(default_factory=set)
    key: PromptKey | None = None  # its prompt's blocks and anchor (prefix affinity), made once
    choice: Choice | None = None  # the last choice of server made for it


async def _drain(reads, deadline: float, limit: int = 1 << 16) -> None:
    """Read what is left of a finished stream's body (its last, empty, chunk): a connection
    closed with its response unread cannot be reused, and a new one per call costs a TCP
    handshake and the event loop a good part of a millisecond."""
    left = limit
    try:
        async with asyncio.timeout_at(deadline):
            async for data in reads:
                left -= len(data)
                if left < 0:
                    return
    except (TimeoutError, aiohttp.ClientError):
        pass


#: What a pooled keep-alive connection the server had closed raises on its next request.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str | None = None, api_key: str = "", *, routes: RoutingTable | None = None,
                 timeout_s: float = 60.0, max_attempts: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 max_connections: int = 64, pacing: PacingConfig | None = PacingConfig(),
                 stream_completions: bool = True, prefer_real_usage: bool = True,
                 params: Mapping[str, Any] | None = None, connect_timeout_s: float = 5.0,
                 affinity: AffinityConfig | None = None, routing_metrics: RoutingSeries | None = None):
        """``affinity``: how calls choose a server by prefix cache (default on; see
        :mod:`affinity`); ``routing_metrics``: where the choices are counted (the process's)."""
        if routes is None:
            if not base_url:
                raise ValueError("OpenAIBackend needs a base_url or a routing table")
            routes = RoutingTable.single(base_url)
        self.routes = routes
        self.base_url = routes.servers[0].base_url
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stream_completions = stream_completions
        # A server whose streams carry no usage is asked for whole answers by complete(): its
        # usage is then real, but a cancelled whole answer may not stop its generation.
        self.prefer_real_usage = prefer_real_usage
        self.params = dict(params or {})
        self.gate = PacingGate(pacing or PacingConfig(adaptive=False, max_limit=max_connections,
                                                      initial_limit=max_connections))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None  # made in the loop that first calls
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._pollers: dict[Server, MetricsPoller] = {}
        self.router = CacheRouter(routes, self.gate, affinity, routing_metrics)

    @property
    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session belongs to the loop it was made in (a backend reused under a new
            # asyncio.run gets a new one).
            self._session_loop = loop
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=self._max_connections)
            # Deadlines are the calls' own (asyncio.timeout_at around each step), not the session's.
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector,
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    # -- the Backend protocol ---------------------------------------------------
    def complete_now(self, request: Request) -> Completion | None:
        return None

    async def complete(self, request: Request, reserved: Slot | None = None) -> Completion:
        """The whole answer. ``reserved``: a slot :meth:`reserve` took for this call, used by
        its first attempt (and released however the call ends)."""
        try:
            call = self._new_call(request, stream=self.stream_completions)
            call.reserved, reserved = reserved, None
            if call.reserved is not None:
                call.key = call.reserved.key
            try:
                while True:
                    try:
                        async with self._attempt(call) as (server, slot, resp, sent):
                            return await self._collect(call, server, slot, resp, sent)
                    except _Failure as failure:
                        await self._after_failure(call, failure)
            finally:
                self._release_reserved(call)
        finally:
            if reserved is not None:  # the call failed before it could take it over
                self.gate.release(reserved)

    async def stream(self, request: Request, reserved: Slot | None = None) -> AsyncIterator[Piece]:
        """The answer chunk by chunk; the last chunk has ``finish_reason`` and ``usage``.

        ``usage`` is the server's, or estimated (``usage.estimated``) from a server that
        reports none in streams. Cancelling the task that iterates (or closing the iterator, e.g. with
        ``contextlib.aclosing``) closes the HTTP response, and the server stops. ``reserved``:
        as for :meth:`complete`.
        """
        try:
            call = self._new_call(request, stream=True)
            call.reserved, reserved = reserved, None
            if call.reserved is not None:
                call.key = call.reserved.key
            call.always_stream = True
            yielded = 0
            try:
                while True:
                    try:
                        async with self._attempt(call) as (server, slot, resp, sent):
                            async for chunk in self._chunks(call, server, slot, resp, sent):
                                yielded += 1
                                yield chunk
                            return
                    except _Failure as failure:
                        if yielded:
                            raise BackendError(f"{failure} after {yielded} chunk{'s' if yielded > 1 else ''}; "
                                               "the answer is incomplete", retriable=failure.retriable) from None
                        await self._after_failure(call, failure)
            finally:
                self._release_reserved(call)
        finally:
            if reserved is not None:
                self.gate.release(reserved)

    async def close(self) -> None:
        for poller in self._pollers.values():
            await poller.stop()
        self._pollers.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # -- what a worker asks before taking work --------------------------------
    def capacity(self, model: str | None = None) -> int:
        """Calls that can start now without waiting, on ``model``'s servers (all servers if None)."""
        servers = self.routes.servers if model is None else self.routes.servers_for(model)
        return sum(self.gate.available(s) for s in servers if self.routes.is_up(s))

    def room(self) -> int:
        """Calls that can start now on any server (the worker's bound on what it takes)."""
        return self.capacity(None)

    def reserve(self, request: Request) -> Slot | None:
        """Take a slot for ``request``'s call now, on the server of its model chosen for it (by
        prefix cache within load bounds, :mod:`affinity`; else the one with the most room), or
        None when none has room or the request waits for the busy server holding its prefix
        (either way it is better off waiting in llmq's queues than in the gate or in the
        server's). Pass it to :meth:`complete`/:meth:`stream`, or give
        it back with :meth:`release`. Raises :class:`UnknownModelError` for a model with no
        route, before any HTTP call."""
        servers = self.routes.servers_for(request.model)
        if _loop_running():
            for server in servers:
                self._ensure_poller(server)
        return self.router.reserve(request)

    def release(self, reserved: Slot) -> None:
        """Give back a slot :meth:`reserve` took for a call that will not be made (idempotent)."""
        self.gate.release(reserved)

    def same_servers(self, model: str, other: str) -> bool:
        """Whether a call of ``other`` holds a slot ``model`` could use (they share a server)."""
        try:
            return not set(self.routes.servers_for(model)).isdisjoint(self.routes.servers_for(other))
        except BackendError:
            return False

    def default_model(self) -> str:
        """What a request that names no model runs on ("" until a server's list has been read)."""
        return self.routes.default_model()

    async def served_models(self, timeout_s: float = 5.0) -> tuple[list[str], str, bool]:
        """Read every server's ``GET /v1/models`` into the routing table; returns what requests
        may ask for, the default model, and whether names nobody listed may still be served (a
        server's list could not be read: it keeps the one it had, or none)."""
        for server in self.routes.servers:
            try:
                async with asyncio.timeout(timeout_s):
                    async with self._client.get(server.base_url + "/models") as resp:
                        if resp.status != 200:
                            raise WireError(f"HTTP {resp.status}")
                        data = json.loads(await _read_capped(resp, 1 << 22))
                ids = tuple(str(m["id"]) for m in data["data"] if isinstance(m, dict) and m.get("id"))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError,
                    WireError) as exc:
                if server.served is None:
                    log.info("cannot read the models %s serves (%s): any name may go to it", server,
                             type(exc).__name__ if not str(exc) else exc)
                continue
            if ids != server.served:
                log.info("%s serves %s", server, ", ".join(ids) or "no model")
            server.served = ids
        return self.routes.listed(), self.routes.default_model(), self.routes.open_ended

    def server_state(self) -> list[dict[str, Any]]:
        state = self.gate.state()
        return [{"base_url": s.base_url, "models": list(s.models), "up": self.routes.is_up(s),
                 **state.get(s, {"in_flight": 0, "limit": self.gate.limit(s), "mode": "unused"})}
                for s in self.routes.servers]

    # -- one attempt -----------------------------------------------------------
    def _new_call(self, request: Request, stream: bool) -> _Call:
        self.routes.servers_for(request.model)  # an unknown model fails here, before any HTTP call
        remaining = (request.created_at + request.timeout_ms) / 1000.0 - time.time()
        return _Call(request, stream, time.monotonic() + remaining)

    def _release_reserved(self, call: _Call) -> None:
        self.router.done(call.request)
        if call.reserved is not None:  # never reached an attempt (its deadline had passed)
            self.gate.release(call.reserved)
            call.reserved = None

    def _choose(self, call: _Call) -> Server | None:
        router = self.router
        if call.key is None and router.enabled:
            call.key = router.key(call.request)
        choice = router.choose(call.request, call.key, exclude=call.tried)
        call.choice = choice
        return choice.server if choice is not None else None

    def _ensure_poller(self, server: Server) -> None:
        cfg = self.gate.config
        if cfg.adaptive and server not in self._pollers:
            poller = MetricsPoller(self._client, server.root_url + "/metrics",
                                   lambda load, s=server: self._observed(s, load),
                                   interval_s=cfg.metrics_interval_s)
            self._pollers[server] = poller
            poller.start()

    def _observed(self, server: Server, load) -> None:
        self.gate.observe_load(server, load)
        self.router.observed(server, load)

    @asynccontextmanager
    async def _attempt(self, call: _Call):
        remaining = call.deadline - time.monotonic()
        if remaining <= 0:
            raise _Failure("the request's deadline passed before the model answered", retriable=False)
        for server in self.routes.servers_for(call.request.model):
            self._ensure_poller(server)
        slot, call.reserved = call.reserved, None
        if slot is None:
            try:
                slot = await self.gate.acquire(lambda: self._choose(call), remaining)
            except TimeoutError:
                raise _Failure("no model server had a free slot before the request's deadline",
                               retriable=False) from None
            choice = call.choice if call.choice is not None and call.choice.server is slot.server else \
                Choice(slot.server, "least_loaded")
            self.router.sent(slot, call.key, choice)
        server: Server = slot.server
        try:
            timeout = min(self.timeout_s, call.deadline - time.monotonic())
            if timeout <= 0:
                raise _Failure("the request's deadline passed before the model answered", retriable=False)
            ends = time.monotonic() + timeout
            stream = call.stream and not call.plain and (
                call.always_stream or not self.prefer_real_usage or server.stream_usage is not False)
            call.body = chat_body(call.request, stream=stream, defaults=self.params,
                                  model=self.routes.served_name(call.request.model))
            url = server.base_url + "/chat/completions"
            connect = aiohttp.ClientTimeout(total=None, connect=min(self.connect_timeout_s, timeout))
            sent = time.monotonic()
            try:
                async with asyncio.timeout_at(_loop_deadline(ends)):
                    try:
                        resp = await self._client.post(url, json=call.body, timeout=connect)
                    except _STALE_CONNECTION:
                        # A pooled keep-alive connection the server had closed: the pool has
                        # dropped it, and one more try opens a new one (a dead server refuses it).
                        resp = await self._client.post(url, json=call.body, timeout=connect)
            except TimeoutError:
                raise _Failure(f"timed out after {timeout:.1f}s", retriable=True, server=server) from None
            except aiohttp.ClientError as exc:
                raise _Failure(f"connection error: {type(exc).__name__}", retriable=True, server=server,
                               unreachable=True) from None
            try:
                if resp.status != 200:
                    raise await self._status_failure(server, resp, ends)
                call.ends = ends
                yield server, slot, resp, sent
            finally:
                if resp.content.at_eof():
                    resp.release()  # read to its end: the connection goes back to the pool
                else:
                    resp.close()  # cut short (cancelled, failed): closing it is what stops the server
        finally:
            self.gate.release(slot)

    async def _status_failure(self, server: Server, resp: aiohttp.ClientResponse, ends: float) -> _Failure:
        body = b""
        try:
            async with asyncio.timeout_at(_loop_deadline(min(ends, time.monotonic() + 5.0))):
                async for part in resp.content.iter_any():
                    body += part
                    if len(body) >= _MAX_ERROR_BODY:
                        break
        except (TimeoutError, aiohttp.ClientError):
            pass
        status = resp.status
        return _Failure(error_reason(status, body[:_MAX_ERROR_BODY]), retriable=status in _RETRIABLE_STATUS,
                        server=server, overloaded=status in _OVERLOAD_STATUS,
                        retry_after=retry_after_s(resp.headers.get("retry-after"), time.time()))

    async def _chunks(self, call: _Call, server: Server, slot: Slot, resp: aiohttp.ClientResponse,
                      sent: float) -> AsyncIterator[Piece]:
        loop_ends = _loop_deadline(call.ends)
        assembler = StreamAssembler(prompt_token_estimate(call.body))
        try:
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                async with asyncio.timeout_at(loop_ends):
                    raw = await _read_capped(resp, _MAX_JSON_BODY)
                try:
                    data = json.loads(raw)
                except ValueError:
                    raise WireError("unexpected response body (not JSON)") from None
                completion = completion_from_json(data, call.request)
                self.routes.mark_ok(server)
                self.router.answered(slot, data.get("usage") if isinstance(data, dict) else None)
                if completion.output:
                    yield Piece(0, completion.output)
                yield Piece(1 if completion.output else 0, "", completion.finish_reason,
                            _usage_of(completion))
                return
            parser = SseParser()
            reads = resp.content.iter_any()  # content-decoded (a proxy may gzip the stream)
            first = True
            while not assembler.done:
                # A deadline per read, not around the loop: it must not reach into the code
                # this generator yields to.
                async with asyncio.timeout_at(loop_ends):
                    data = await anext(reads, None)
                if data is None:
                    tail = parser.close()
                    events = [tail] if tail is not None else []
                else:
                    events = parser.feed(data)
                for event in events:
                    chunk = assembler.feed(event)
                    if chunk is not None:
                        if first:
                            first = False
                            self.gate.first_token(slot, time.monotonic() - sent)
                        yield chunk
                    if assembler.done:
                        break
                if data is None:
                    break
            if not assembler.complete:
                raise _Failure("the stream ended before the model finished", retriable=True, server=server,
                               empty_stream=assembler.events == 0)
            if data is not None:
                await _drain(reads, min(loop_ends, _loop_deadline(time.monotonic() + 1.0)))
            self.routes.mark_ok(server)
            server.stream_usage = assembler.usage is not None
            self.router.answered(slot, assembler.usage if isinstance(assembler.usage, Mapping) else None)
            yield assembler.finish()
        except TimeoutError:
            raise _Failure(f"timed out after {call.ends - sent:.1f}s", retriable=True, server=server) from None
        except aiohttp.ClientError as exc:
            raise _Failure(f"connection lost mid-answer: {type(exc).__name__}", retriable=True, server=server,
                           unreachable=True) from None
        except WireError as exc:
            raise _Failure(str(exc), retriable=exc.retriable, server=server) from None

    async def _collect(self, call: _Call, server: Server, slot: Slot, resp: aiohttp.ClientResponse,
                       sent: float) -> Completion:
        parts = []
        async for chunk in self._chunks(call, server, slot, resp, sent):
            if chunk.text:
                parts.append(chunk.text)
            if chunk.usage is not None:
                model = call.request.model
                return Completion("".join(parts), chunk.usage.prompt_tokens, chunk.usage.completion_tokens, model,
                                  finish_reason=chunk.finish_reason, usage_estimated=chunk.usage.estimated)
        raise _Failure("the stream ended before the model finished", retriable=True, server=server)

    async def _after_failure(self, call: _Call, failure: _Failure) -> None:
        """Decide what follows a failed attempt: raise, fail over at once, or back off."""
        call.attempts += 1
        call.plain = call.plain or failure.empty_stream
        server = failure.server
        if server is not None:
            call.tried.add(server)
            if failure.unreachable:
                self.routes.mark_failed(server)
                self.router.affinity.forget(server)  # back, it will have lost its cache
            elif failure.retry_after is not None:
                self.routes.hold(server, failure.retry_after)
        n = call.attempts
        suffix = f"(after {n} attempt{'s' if n > 1 else ''})"
        if not failure.retriable:
            raise BackendError(failure.reason if n == 1 else f"{failure.reason} {suffix}", retriable=False)
        if n >= self.max_attempts:
            raise BackendError(f"{failure.reason} {suffix}", retriable=True)
        remaining = call.deadline - time.monotonic()
        if remaining <= 0:
            raise BackendError(f"{failure.reason}; the request's deadline passed {suffix}", retriable=False)
        if failure.empty_stream and server is not None:
            call.tried.discard(server)  # ask the same server again at once, for a whole answer
            return
        if self.routes.pick(call.request.model, exclude=call.tried) is not None:
            return  # another server of the model has not been tried: go there now
        call.tried.clear()
        if failure.retry_after is not None:
            wait = failure.retry_after
        else:
            wait = self.backoff_s * 2 ** (n - 1) * (0.5 + random.random())
        wait = min(wait, self.max_backoff_s)
        if wait >= remaining:
            raise BackendError(f"{failure.reason}; waiting {wait:.1f}s to retry would pass the request's "
                               f"deadline {suffix}", retriable=False)
        await asyncio.sleep(wait)


def _usage_of(completion: Completion) -> Usage:
    return Usage(completion.prompt_tokens, completion.completion_tokens, completion.usage_estimated)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _loop_deadline(monotonic_deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock (the same clock, unless a test swaps it)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    body = bytearray()
    async for part in resp.content.iter_any():
        body += part
        if len(body) > limit:
            raise WireError(f"response body larger than {limit} bytes")
    return bytes(body)
