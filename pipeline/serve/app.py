"""The HTTP endpoints of ``llmq serve`` and what they share (one :class:`Server` per process).

| endpoint                    | what                                                                    |
|-----------------------------|-------------------------------------------------------------------------|
| POST /v1/chat/completions   | a chat request; answered when its answer comes (or its deadline passes) |
| POST /v1/completions        | the same for a prompt                                                   |
|   with "stream": true       | Server-Sent Events from the streamed chunks, ``data: [DONE]`` last      |
| GET  /v1/models             | the models the pools serve (the catalog) that the caller's tenant may use |
| POST /v1/requests           | 202 + id at once (default band BACKGROUND): for batch work              |
| GET  /v1/requests/{id}      | its status (queued: position, ETA) and, once there, its answer          |
| GET  /healthz               | 200 serving, 503 draining or not connected                              |
| GET  /readyz                | the same judgement, for readiness probes                                |
| GET  /metrics               | Prometheus: requests by route and status, latency, in flight, streams   |
| /v1/files, /v1/batches      | OpenAI's Batch API (pipeline/serve/batch_api.py)                        |
| /v1/responses               | OpenAI's Responses API (pipeline/serve/responses_api.py)                |

The tenant is the caller's API key's (pipeline/serve/auth.py); the band is ``x-llmq-priority``
or ``metadata.priority`` (NORMAL by default, BACKGROUND for /v1/requests), capped at what the
tenant's record allows; the deadline is ``x-llmq-timeout-ms`` (``serve.default_timeout_ms``,
at most ``serve.max_timeout_ms``). The tier is the registry's: nothing in a body sets it. Every
request names this process's reply partition, and its answer is read by the process's one
reply listener (the SDK's :class:`~pipeline.client.AsyncLlmqClient`).

A caller that hangs up has its request cancelled (workers stop working on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Mapping

from aiohttp import web

from pipeline.catalog.catalog import ModelCatalog
from pipeline.errors import EncodeError, KafkaOperationError, LlmqError, RequestTimeoutError
from pipeline.models import Priority, Request, Response, Status, now_ms
from pipeline.openai_api.chat import CHAT, COMPLETION, Parsed, models_list, parse_body, parse_priority, render
from pipeline.openai_api.errors import ApiError, bad_request, for_response
from pipeline.policy.validation import validate_request
from pipeline.serve.auth import Authenticator, Caller
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.results import ResultStore
from pipeline.serve.sse import stream_answer

log = logging.getLogger("pipeline.serve")

#: Past the request's deadline, how long serve still waits for the pipeline's own EXPIRED.
_DEADLINE_MARGIN_S = 2.0
_JSON = "application/json"


class ShuttingDown(LlmqError):
    """The process stopped before the answer came (answered 503; the request is cancelled)."""


class RegistrySecrets(Mapping):
    """Tenant → signing secret, for the client to sign the requests of tenants that require it."""

    def __init__(self, registry):
        self.registry = registry

    def get(self, tenant, default=None):
        record = self.registry.get(tenant)
        if record is None or not record.require_signature:
            return default
        return self.registry.secret(record) or default

    def __getitem__(self, tenant):
        value = self.get(tenant)
        if value is None:
            raise KeyError(tenant)
        return value

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class Server:
    """What the handlers share: settings, registry, the one client, in-flight bookkeeping."""

    def __init__(self, settings, registry, client, models=None):
        """``models``: what says which models the pools serve (a ModelStore); None: nothing known."""
        self.settings = settings
        self.cfg = settings.serve
        self.registry = registry
        self.model_store = models
        self.client = client
        self.auth = Authenticator(registry)
        self.results = ResultStore(self.cfg.result_ttl_s, self.cfg.result_max, client.forget)
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        #: Resolved when the grace period is over: whoever still waits answers 503.
        self.stopped: asyncio.Future = asyncio.get_running_loop().create_future()
        self.streams: set = set()

    # -- shared steps ----------------------------------------------------------------------

    def enter(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another", "server_error", "shutting_down",
                           retry_after_s=1)
        if self.inflight >= self.cfg.max_inflight:
            raise ApiError(429, f"overloaded: {self.inflight} requests in flight on this server", "rate_limit_error",
                           "overloaded", retry_after_s=1)
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    async def body(self, http: web.Request) -> dict:
        try:
            raw = await http.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the body exceeds {self.cfg.max_body_bytes} bytes", "invalid_request_error",
                           "body_too_large") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise bad_request("the body is not valid JSON") from None

    def request(self, caller: Caller, parsed: Parsed, headers: Mapping[str, str], default: Priority, *,
                notify_queued: bool = False) -> Request:
        """The Request to write for ``parsed``: the caller's tenant and tier, its band capped."""
        asked = headers.get("x-llmq-priority")
        priority = parse_priority(asked, "x-llmq-priority") if asked else parsed.priority or default
        parsed.model = self.model_for(caller, parsed.model)
        timeout_ms = self.cfg.default_timeout_ms
        given = headers.get("x-llmq-timeout-ms")
        if given:
            try:
                timeout_ms = int(given)
            except ValueError:
                raise bad_request("x-llmq-timeout-ms must be an integer", "x-llmq-timeout-ms") from None
            if not 0 < timeout_ms <= self.cfg.max_timeout_ms:
                raise bad_request(f"x-llmq-timeout-ms must be 1-{self.cfg.max_timeout_ms}", "x-llmq-timeout-ms")
        fields = dict(parsed.fields)
        prompt = fields.pop("prompt")
        try:
            req = Request.new(caller.tenant, prompt, priority=caller.priority(priority), model=parsed.model,
                              timeout_ms=timeout_ms, user_tier=caller.record.tier, notify_queued=notify_queued,
                              allow_degrade=headers.get("x-llmq-allow-degrade", "").lower() in ("1", "true"),
                              stream=parsed.stream, **fields)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        req = self.client.addressed(req)
        problem = validate_request(req, now_ms(), self.settings.topics.prefix)
        if problem is not None:
            raise bad_request(problem)
        return req

    async def wait(self, req: Request) -> Response:
        """The terminal response; 504 past the deadline, 503 when the process stops first."""
        fut = asyncio.wrap_future(self.client.response_future(req.request_id))
        try:
            started = asyncio.get_running_loop().time()
            await self._send(req, wait_queued=0)
            # The deadline runs from the call, so a slow write shortens the wait.
            timeout = max(0.0, req.timeout_ms / 1000 + _DEADLINE_MARGIN_S - (asyncio.get_running_loop().time() - started))
            done, _ = await asyncio.wait((fut, self.stopped), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if fut in done:
                return fut.result()
            self.cancel(req.request_id, "no answer before the deadline" if not done else "the server stopped")
            if done:
                raise ShuttingDown("the server stopped before the answer came")
            raise RequestTimeoutError(req.request_id, timeout)
        except asyncio.CancelledError:
            self.cancel(req.request_id, "the caller hung up")
            raise
        finally:
            self.client.forget(req.request_id)

    async def _send(self, req: Request, wait_queued: float):
        """Submit ``req``; one the codec refuses (a field over its size cap) is a 400 naming the
        limit, and one Kafka does not take in time (serve.submit_timeout_ms, or the deadline) is
        withdrawn (cancelled: librdkafka may still deliver it later) and answered 503."""
        limit = self.submit_timeout_s(req)
        try:
            return await self.client.submit(req, timeout=limit, wait_queued=wait_queued)
        except EncodeError as exc:
            raise bad_request(exc.refusal) from None
        except KafkaOperationError:
            raise self.not_taken(req, limit) from None

    def submit_timeout_s(self, req: Request) -> float:
        return min(self.cfg.submit_timeout_ms, max(req.timeout_ms, 1)) / 1000

    def not_taken(self, req: Request, limit: float) -> ApiError:
        """A request Kafka did not take in time: withdrawn (librdkafka may still deliver it)."""
        self.cancel(req.request_id, "not written to Kafka in time; the caller was told to retry")
        return ApiError(503, f"Kafka did not take the request within {limit:g} s (a partition leader moving, or "
                             "the cluster down); it was withdrawn: retry", "server_error", "kafka_unavailable",
                        retry_after_s=2)

    def cancel(self, request_id: str, reason: str) -> None:
        """Publish a cancellation and do not wait for it (best effort)."""
        try:
            asyncio.ensure_future(self.client.cancel(request_id, reason)).add_done_callback(_quiet)
        except Exception:  # noqa: BLE001 (a failed cancellation only costs a wasted answer)
            log.debug("cancelling %s failed", request_id, exc_info=True)

    def reply_headers(self, req: Request, resp: Response | None = None) -> dict[str, str]:
        out = {"x-llmq-request-id": req.request_id, "x-llmq-reply-partition": str(req.reply_partition)}
        if resp is not None and resp.served_priority is not None:
            out["x-llmq-served-priority"] = resp.served_priority.value
        return out

    # -- endpoints -------------------------------------------------------------------------

    async def chat(self, http: web.Request) -> web.StreamResponse:
        return await self._complete(http, CHAT)

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._complete(http, COMPLETION)

    async def _complete(self, http: web.Request, kind: str) -> web.StreamResponse:
        caller = self.auth.caller(http.headers)
        parsed = parse_body(await self.body(http), kind, self.cfg.default_max_tokens)
        req = self.request(caller, parsed, http.headers, Priority.NORMAL)
        self.enter()
        try:
            if parsed.stream:
                return await stream_answer(self, http, req, parsed)
            try:
                resp = await self.wait(req)
            except RequestTimeoutError:
                raise ApiError(504, f"expired: no answer within the deadline ({req.timeout_ms} ms)", "timeout",
                               "expired") from None
            except ShuttingDown as exc:
                raise ApiError(503, str(exc), "server_error", "shutting_down", retry_after_s=1) from None
            error = for_response(resp)
            if error is not None:
                raise error
            return _json(render(kind, resp, parsed.model), headers=self.reply_headers(req, resp))
        finally:
            self.leave()

    def catalog(self) -> ModelCatalog:
        return self.model_store.catalog() if self.model_store is not None else ModelCatalog(self.settings.models)

    def listed(self, caller: Caller) -> list[str]:
        """The models this caller may use that the pools serve (the tenant's own list, while the
        catalog knows nothing yet)."""
        catalog, now = self.catalog(), now_ms()
        names = catalog.names(now) if catalog.known(now) else []
        allowed = list(caller.record.models)
        if allowed:
            return [n for n in names if n in allowed] if names else allowed
        return names

    def model_for(self, caller: Caller, asked: str) -> str:
        """The model a request of ``caller`` runs on: ``asked``, or the default when it names none;
        404 when no pool serves it, 403 when the tenant may not use it."""
        catalog, now = self.catalog(), now_ms()
        model = asked or catalog.default(now)
        refusal = catalog.refusal(model, now)
        if refusal is not None:
            raise ApiError(404, refusal.partition(": ")[2], "invalid_request_error", "model_not_found", "model")
        if model or asked:
            caller.check_model(model)
        return model

    async def models(self, http: web.Request) -> web.Response:
        caller = self.auth.caller(http.headers)
        return _json(models_list(self.listed(caller)))

    async def model(self, http: web.Request) -> web.Response:
        caller = self.auth.caller(http.headers)
        name = http.match_info["model"]
        if name not in self.listed(caller):
            raise ApiError(404, f"model {name!r} does not exist or this API key may not use it",
                           "invalid_request_error", "model_not_found", "model")
        return _json(models_list([name])["data"][0])

    async def submit(self, http: web.Request) -> web.Response:
        caller = self.auth.caller(http.headers)
        body = await self.body(http)
        kind = CHAT if isinstance(body, dict) and "messages" in body else COMPLETION
        parsed = parse_body(body, kind, self.cfg.default_max_tokens)
        if parsed.stream:
            raise bad_request("stream is not available for /v1/requests (poll GET /v1/requests/{id})", "stream")
        req = self.request(caller, parsed, http.headers, Priority.BACKGROUND, notify_queued=True)
        self.enter()
        try:
            future = self.client.response_future(req.request_id)
            sub = await self._send(req, wait_queued=self.cfg.accept_wait_ms / 1000)
        except BaseException:
            self.client.forget(req.request_id)
            raise
        finally:
            self.leave()
        self.results.add(req.request_id, caller.tenant, kind, parsed.model, req.priority.value, future)
        word = sub.response
        if word is not None and word.status.is_terminal:
            error = for_response(word)
            if error is not None:
                raise error
        return _json(self._status(req.request_id, req.priority.value, word, None, kind, parsed.model), status=202,
                     headers=self.reply_headers(req, word))

    async def status(self, http: web.Request) -> web.Response:
        caller = self.auth.caller(http.headers)
        entry = self.results.get(http.match_info["request_id"], caller.tenant)
        if entry is None:
            raise ApiError(404, "no such request here (ids are kept by the serve process that accepted them, "
                                f"for {self.cfg.result_ttl_s:.0f} s)", "invalid_request_error", "request_not_found")
        resp = entry.response()
        queued = None if resp is not None else self.client.queued(entry.request_id)
        if entry.error() is not None:
            raise ApiError(503, "the reply listener failed; the answer is lost here", "server_error", "listener_failed")
        return _json(self._status(entry.request_id, entry.priority, resp, queued, entry.kind, entry.model))

    def _status(self, request_id: str, priority: str, resp: Response | None, queued: Response | None, kind: str,
                model: str) -> dict:
        if resp is not None and resp.status is Status.QUEUED:
            resp, queued = None, resp
        doc: dict = {"id": request_id, "object": "llmq.request", "priority": priority,
                     "status": "queued" if queued is not None else "submitted" if resp is None
                     else resp.status.value.lower()}
        if queued is not None:
            doc.update(queue_position=queued.queue_position, eta_ms=queued.eta_ms,
                       served_priority=queued.served_priority.value if queued.served_priority else None)
        if resp is not None:
            if resp.served_priority is not None:
                doc["served_priority"] = resp.served_priority.value
            error = for_response(resp)
            if error is None:
                doc["response"] = render(kind, resp, model)
            else:
                doc["error"] = error.body()["error"]
        return doc

    def _not_serving(self) -> list[str]:
        reasons = []
        if self.draining:
            reasons.append("draining: shutting down")
        if not self.client.listening:
            reasons.append("listener: no reply listener")
        return reasons

    async def healthz(self, http: web.Request) -> web.Response:
        """Live: the reply listener runs. 503 while draining too, so that a load balancer that
        probes only /healthz moves on."""
        reasons = self._not_serving()
        doc = {"status": "ok" if not reasons else "draining" if self.draining else "no reply listener",
               "reply_partitions": self.client.reply_partitions, "inflight": self.inflight,
               "tenants": len(self.registry.records())}
        if reasons:
            doc["reasons"] = reasons
        return _json(doc, status=503 if reasons else 200)

    async def readyz(self, http: web.Request) -> web.Response:
        """Ready: serving (not draining) with the reply listener up."""
        reasons = self._not_serving()
        if reasons:
            return _json({"status": "not ready", "reasons": reasons}, status=503)
        return _json({"status": "ok", "reply_partitions": self.client.reply_partitions})


def _quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("a cancellation was not delivered: %s", fut.exception())


def _json(doc, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(doc, separators=(",", ":")).encode(), status=status,
                        content_type=_JSON, headers=headers)


def error_response(error: ApiError) -> web.Response:
    return web.Response(body=error.to_json(), status=error.status, content_type=_JSON, headers=error.headers())


@web.middleware
async def errors_middleware(http: web.Request, handler):
    try:
        return await handler(http)
    except ApiError as error:
        return error_response(error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        text = {404: "no such endpoint", 405: "method not allowed"}.get(exc.status, exc.reason)
        return error_response(ApiError(exc.status, f"{text}: {http.method} {http.path}", type_,
                                       exc.reason.lower().replace(" ", "_")))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 (one line, no traceback or paths to the caller)
        log.exception("%s %s failed", http.method, http.path)
        return error_response(ApiError(500, f"internal error ({type(exc).__name__})", "server_error",
                                       "internal_error"))


def build_app(server: Server, batches=None, responses=None) -> web.Application:
    """``batches``: the BatchStore behind /v1/files and /v1/batches; ``responses``: the
    ResponseStore behind /v1/responses (None: not served)."""
    metrics = ServeMetrics(server)
    # Outermost: what is counted is the status the caller got, errors turned into answers included.
    app = web.Application(middlewares=[metrics.middleware, errors_middleware], client_max_size=server.cfg.max_body_bytes)
    if batches is not None:
        from pipeline.serve.batch_api import BatchApi

        BatchApi(server, batches).routes(app)
    if responses is not None:
        from pipeline.serve.responses_api import ResponsesApi

        ResponsesApi(server, responses, metrics).routes(app)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model}", server.model)
    app.router.add_post("/v1/requests", server.submit)
    app.router.add_get("/v1/requests/{request_id}", server.status)
    app.router.add_get("/healthz", server.healthz)
    app.router.add_get("/readyz", server.readyz)
    app.router.add_get("/metrics", metrics.view)
    return app

