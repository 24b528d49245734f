"""OpenAI's Responses API in ``llmq serve``, on the stored-responses topic (pipeline/responses/).

| endpoint                                  | what                                                        |
|-------------------------------------------|-------------------------------------------------------------|
| POST   /v1/responses                      | create: answered at the end, streamed, or (background) at once |
| GET    /v1/responses/{id}                 | retrieve; ``?stream=true&starting_after=N`` replays its events |
| POST   /v1/responses/{id}/cancel          | cancel a background response                                |
| DELETE /v1/responses/{id}                 | delete a stored response                                    |
| GET    /v1/responses/{id}/input_items     | its input items                                             |

Everything is scoped to the caller's tenant: another tenant's response is answered 404, as an
id that does not exist. Every response runs as an ordinary llmq request with ``stream`` set, so
its chunks are in the chunks topic for a later replay. A background response's record is written
before its request, and the task that waits for its answer writes the answer; when that process
goes away, any serve process finds the answer in the responses topic (pipeline/responses/recover.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from aiohttp import web

from pipeline.errors import EncodeError, KafkaOperationError, LlmqError, RequestTimeoutError
from pipeline.models import Priority, Request, Status, now_ms
from pipeline.openai_api.chat import CACHE_KEY_METADATA, parse_priority
from pipeline.openai_api.errors import ApiError, bad_request, for_response, reason_code
from pipeline.openai_api.responses import finish, input_items_page, model_messages, parse_create, render, with_ids
from pipeline.policy.service_tier import band_for, served_tier
from pipeline.policy.validation import validate_request
from pipeline.responses import record as R
from pipeline.responses.events import Events, sse
from pipeline.responses.recover import AnswerScanner
from pipeline.responses.replay import replay_chunks
from pipeline.responses.store import ResponseStore

log = logging.getLogger("pipeline.serve.responses")

_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DEADLINE_MARGIN_S = 2.0
#: Refusals that say "not now": a flex response is answered 429 resource_unavailable for them.
_LOAD = frozenset({"rate_limited", "queue_full", "quota_exceeded", "overloaded"})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", None, "response_id")


def _json(doc, status: int = 200, headers=None) -> web.Response:
    import json

    return web.Response(body=json.dumps(doc, separators=(",", ":")).encode(), status=status,
                        content_type="application/json", headers=headers)


class ResponsesApi:
    def __init__(self, server, store: ResponseStore, metrics):
        self.server = server
        self.store = store
        self.settings = server.settings
        self.cfg = server.settings.responses
        self.owned: dict[str, asyncio.Task] = {}
        self.scanner = AnswerScanner(server.settings)
        self._recovering: asyncio.Task | None = None
        self.ended = metrics.responses
        self.resumes = metrics.stream_resumes
        metrics.count_pending(lambda: len(self.store.pending()))

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/responses", self.create)
        r.add_get("/v1/responses/{response_id}", self.retrieve)
        r.add_delete("/v1/responses/{response_id}", self.delete)
        r.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        r.add_get("/v1/responses/{response_id}/input_items", self.input_items)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app) -> None:
        self._recovering = asyncio.ensure_future(self._recover_loop())

    async def _stop(self, app) -> None:
        # Background responses go on in the pipeline: their answers are found by whichever
        # serve process looks next (this one after a restart, or another).
        tasks = [t for t in [self._recovering, *self.owned.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- create ---------------------------------------------------------------------------------

    def _owned(self, http: web.Request) -> R.StoredResponse:
        caller = self.server.auth.caller(http.headers)
        ident = http.match_info["response_id"]
        rec = self.store.get(ident, caller.tenant)
        if rec is None:
            raise _not_found(ident)
        return rec

    def _timeout_ms(self, http: web.Request, background: bool) -> int:
        cfg = self.server.cfg
        given = http.headers.get("x-llmq-timeout-ms")
        if not given:
            return self.cfg.background_timeout_ms if background else cfg.default_timeout_ms
        try:
            timeout_ms = int(given)
        except ValueError:
            raise bad_request("x-llmq-timeout-ms must be an integer", "x-llmq-timeout-ms") from None
        top = max(cfg.max_timeout_ms, self.cfg.background_timeout_ms if background else 0)
        if not 0 < timeout_ms <= top:
            raise bad_request(f"x-llmq-timeout-ms must be 1-{top}", "x-llmq-timeout-ms")
        return timeout_ms

    async def create(self, http: web.Request) -> web.StreamResponse:
        server = self.server
        caller = server.auth.caller(http.headers)
        p = parse_create(await server.body(http))
        model = server.model_for(caller, p.model)
        chain: list[R.StoredResponse] = []
        if p.previous_response_id:
            chain = self.store.chain(p.previous_response_id, caller.tenant, self.cfg.max_chain)
            if chain is None:
                raise ApiError(404, f"Previous response with id '{p.previous_response_id}' not found.",
                               "invalid_request_error", "previous_response_not_found", "previous_response_id")
            if len(chain) > self.cfg.max_chain:
                raise bad_request(f"the conversation is longer than {self.cfg.max_chain} responses "
                                  "(responses.max_chain)", "previous_response_id")
            if not chain[-1].terminal:
                raise bad_request("the previous response has not ended yet", "previous_response_id")
        asked = http.headers.get("x-llmq-priority")
        base = parse_priority(asked, "x-llmq-priority") if asked else (
            self.cfg.band() if p.background else Priority.NORMAL)
        band, base = band_for(p.service_tier, base, caller.priority)
        rid = R.new_response_id()
        timeout_ms = self._timeout_ms(http, p.background)
        metadata = dict(p.metadata)
        # The routing hint the workers place requests by (pipeline/worker/backends/affinity.py):
        # the caller's prompt_cache_key, else the conversation's first response, since its
        # earlier turns are this turn's prefix in a server's cache.
        metadata[CACHE_KEY_METADATA] = p.prompt_cache_key or (chain[0].id if chain else rid)
        flex = p.service_tier == "flex"
        try:
            req = Request.new(caller.tenant, None, priority=band, model=model,
                              max_tokens=p.max_output_tokens or server.cfg.default_max_tokens, timeout_ms=timeout_ms,
                              user_tier=caller.record.tier, notify_queued=flex, stream=True,
                              messages=model_messages(chain, p.input, p.instructions), temperature=p.temperature,
                              top_p=p.top_p, user=p.user, metadata=metadata)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        req = server.client.addressed(req)
        problem = validate_request(req, now_ms(), self.settings.topics.prefix)
        if problem is not None:
            raise bad_request(problem)
        rec = R.StoredResponse(rid, caller.tenant, int(time.time()), model, R.QUEUED, with_ids(rid, p.input),
                               p.instructions, p.max_output_tokens, p.temperature, p.top_p, dict(p.metadata), p.store,
                               p.background, p.previous_response_id, p.prompt_cache_key, p.service_tier, None,
                               base.value, band.value, req.request_id, req.reply_partition,
                               deadline_ms=req.deadline_ms, updated_ms=now_ms())
        server.enter()
        try:
            if p.background:
                return await self._background(http, rec, req, p.stream, flex)
            stream = await self._open(req, flex)
            if p.stream:
                return await self._stream_live(http, rec, stream)
            try:
                final = await self._own(rec, stream)
            except RequestTimeoutError:
                raise ApiError(504, f"expired: no answer within the deadline ({req.timeout_ms} ms)", "timeout",
                               "expired") from None
            if final.status in (R.FAILED, R.CANCELLED):
                error = for_response(await stream.response())
                if error is not None:
                    raise error
            return _json(render(final), headers=server.reply_headers(req))
        finally:
            server.leave()

    async def _open(self, req: Request, flex: bool):
        """Submit ``req`` as a stream; a flex request the pipeline cannot start in time is
        withdrawn and answered 429 resource_unavailable."""
        server, client = self.server, self.server.client
        word = asyncio.wrap_future(client.engine.correlator.first_word(req.request_id)) if flex else None
        limit = server.submit_timeout_s(req)
        try:
            stream = await client.open_stream(req, timeout=req.timeout_ms / 1000 + _DEADLINE_MARGIN_S,
                                              submit_timeout=limit)
        except EncodeError as exc:
            raise bad_request(exc.refusal) from None
        except KafkaOperationError:
            raise server.not_taken(req, limit) from None
        if word is None:
            return stream
        try:
            said = await asyncio.wait_for(word, self.cfg.flex_word_wait_ms / 1000)
        except asyncio.TimeoutError:
            return stream
        late = said.status is Status.QUEUED and (said.eta_ms or 0) > self.cfg.flex_wait_ms
        refused = said.status is Status.REJECTED and reason_code(said.reason) in _LOAD
        if late or refused:
            stream.close()
            server.cancel(req.request_id, "flex: cannot start within responses.flex_wait_ms")
            wait_s = max(1, -(-(said.eta_ms or said.retry_after_ms or 1000) // 1000))
            raise ApiError(429, "resource_unavailable: the flex tier cannot serve this request in time "
                                f"({'queue ETA ' + str(said.eta_ms) + ' ms' if late else said.reason}); retry later "
                                "or use the default tier", "rate_limit_error", "resource_unavailable",
                           retry_after_s=wait_s)
        return stream

    async def _background(self, http, rec: R.StoredResponse, req: Request, stream_it: bool, flex: bool):
        loop = asyncio.get_running_loop()
        part = req.reply_partition or 0
        try:
            rec.answers_from = await loop.run_in_executor(None, self.store.end_offset, self.settings.topics.responses,
                                                          part)
            rec.chunks_from = await loop.run_in_executor(None, self.store.end_offset, self.settings.topics.chunks,
                                                         part)
            await self.store.put(rec)
        except KafkaOperationError:
            raise ApiError(503, "the response could not be stored in Kafka now; retry", "server_error",
                           "kafka_unavailable", retry_after_s=2) from None
        try:
            stream = await self._open(req, flex)
        except ApiError:
            await self.store.delete(rec.id)
            raise
        task = self.owned[rec.id] = asyncio.ensure_future(self._own(rec, stream))
        task.add_done_callback(lambda _t, rid=rec.id: self.owned.pop(rid, None))
        if stream_it:
            return await self._stream_replay(http, rec, -1)
        return _json(render(rec), headers=self.server.reply_headers(req))

    async def _own(self, rec: R.StoredResponse, stream, on_chunk=None, on_idle=None) -> R.StoredResponse:
        """Wait for ``rec``'s answer on ``stream`` and store it (when ``store``). ``on_chunk`` /
        ``on_idle``: the live stream's writers (chunks, keep-alives)."""
        heartbeat = self.server.cfg.stream_heartbeat_s
        marked = False
        try:
            while True:
                if self.server.stopped.done() and not rec.background:
                    raise LlmqError("the server stopped")
                chunk = await stream.next(heartbeat)
                if chunk is None:
                    if stream.ended:
                        break
                    if on_idle is not None:
                        await on_idle()
                    continue
                if rec.background and not marked:
                    marked = True
                    asyncio.ensure_future(self.store.put(replace(rec, status=R.IN_PROGRESS, updated_ms=now_ms())))
                if on_chunk is not None:
                    await on_chunk(chunk)
            resp = await stream.response()
        except RequestTimeoutError:
            if not rec.background:
                raise
            final = replace(rec, status=R.FAILED, updated_ms=now_ms(),
                            error={"code": "expired", "message": "no answer within the deadline"})
            return await self._store(final)
        except asyncio.CancelledError:
            if not rec.background:
                self.server.cancel(rec.request_id, "the caller hung up")
            raise
        finally:
            stream.close()
        tier = served_tier(rec.service_tier, Priority(rec.base_band), Priority(rec.band))
        return await self._store(finish(rec, resp, tier, now_ms()))

    async def _store(self, final: R.StoredResponse) -> R.StoredResponse:
        current = self.store.get(final.id)
        if current is not None and current.terminal:
            return current  # cancelled meanwhile, or finished by another process
        if final.store:
            try:
                await self.store.put(final)
            except KafkaOperationError:
                log.warning("response %s: its answer could not be stored; another process will look for it", final.id)
        self.ended.labels(final.status, final.served_tier or "default").inc()
        return final

    # -- streams ----------------------------------------------------------------------------------

    async def _stream_live(self, http, rec: R.StoredResponse, stream) -> web.StreamResponse:
        """A foreground stream: the events from the chunks as they come. The first events wait
        for the first chunk, so a refusal still gets its own status (as chat streams do)."""
        events = Events(rec)
        out = web.StreamResponse(headers=_HEADERS)
        first = await stream.next(self.server.cfg.stream_heartbeat_s)
        if first is None and stream.ended:
            error = for_response(await stream.response())
            if error is not None:
                stream.close()
                raise error
        await out.prepare(http)
        for event in events.opening():
            await out.write(sse(event))

        async def on_chunk(chunk):
            event = events.delta(chunk.delta)
            if event is not None:
                await out.write(sse(event))

        async def on_idle():
            await out.write(b": keep-alive\n\n")

        if first is not None:
            await on_chunk(first)
        try:
            final = await self._own(rec, stream, on_chunk, on_idle)
        except (RequestTimeoutError, LlmqError):
            final = replace(rec, status=R.FAILED, error={"code": "expired", "message": "no answer within the deadline"})
        for event in events.closing(final):
            await out.write(sse(event))
        await out.write_eof()
        return out

    async def _stream_replay(self, http, rec: R.StoredResponse, starting_after: int) -> web.StreamResponse:
        """A background response's events, rebuilt from its chunks in the chunks topic: while it
        runs and after it ended, from ``starting_after`` on."""
        events = Events(rec)
        out = web.StreamResponse(headers=_HEADERS)
        await out.prepare(http)

        async def emit(batch):
            for event in batch:
                if event is not None and event["sequence_number"] > starting_after:
                    await out.write(sse(event))

        await emit(events.opening())

        def ended() -> bool:
            now = self.store.get(rec.id)
            return now is None or now.terminal

        left = max(1.0, (rec.deadline_ms - now_ms()) / 1000 + 30)
        async for chunk in replay_chunks(self.settings, rec, ended, left):
            await emit([events.delta(chunk.delta)])
        deadline = time.monotonic() + left
        final = self.store.get(rec.id)
        while (final is None or not final.terminal) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            final = self.store.get(rec.id)
        if final is not None and final.terminal:
            await emit(events.closing(final))
        await out.write_eof()
        return out

    # -- the other endpoints ------------------------------------------------------------------------

    async def retrieve(self, http: web.Request) -> web.StreamResponse:
        rec = self._owned(http)
        if http.query.get("stream", "false").lower() != "true":
            return _json(render(rec))
        if not rec.background:
            raise bad_request("only a background response can be streamed again (it was created without background)",
                              "stream")
        try:
            after = int(http.query.get("starting_after", "-1"))
        except ValueError:
            raise bad_request("starting_after must be an integer", "starting_after") from None
        if "starting_after" in http.query:
            self.resumes.inc()
        return await self._stream_replay(http, rec, after)

    async def cancel(self, http: web.Request) -> web.Response:
        rec = self._owned(http)
        if not rec.background:
            raise bad_request("only a background response can be cancelled", "response_id")
        if rec.terminal:
            return _json(render(rec))
        self.server.cancel(rec.request_id, "cancelled by the caller (POST /v1/responses/{id}/cancel)")
        done = replace(rec, status=R.CANCELLED, cancel_asked=True, updated_ms=now_ms(), served_tier=rec.served_tier)
        await self.store.put(done)
        self.ended.labels(done.status, done.served_tier or "default").inc()
        return _json(render(done))

    async def delete(self, http: web.Request) -> web.Response:
        rec = self._owned(http)
        if not rec.terminal:
            self.server.cancel(rec.request_id, "the response was deleted")
        await self.store.delete(rec.id)
        return _json({"id": rec.id, "object": "response", "deleted": True})

    async def input_items(self, http: web.Request) -> web.Response:
        rec = self._owned(http)
        order = http.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        try:
            limit = int(http.query.get("limit", "20"))
        except ValueError:
            raise bad_request("limit must be an integer", "limit") from None
        if not 1 <= limit <= 100:
            raise bad_request("limit must be 1-100", "limit")
        if http.query.get("include"):
            raise bad_request("include is not supported by llmq", "include", "unsupported_parameter")
        return _json(input_items_page(rec, order=order, after=http.query.get("after"), limit=limit))

    # -- answers of responses whose process went away -----------------------------------------------

    async def _recover_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.cfg.recover_interval_s)
            try:
                await self._recover_once(loop)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (the next round tries again)
                log.warning("looking for the answers of pending responses failed", exc_info=True)

    async def _recover_once(self, loop) -> None:
        horizon = now_ms() - int(self.cfg.recover_after_s * 1000)
        by_partition: dict[int, list[R.StoredResponse]] = {}
        for rec in self.store.pending():
            if rec.id not in self.owned and rec.updated_ms <= horizon:
                by_partition.setdefault(rec.reply_partition or 0, []).append(rec)
        for partition, recs in by_partition.items():
            wanted = {r.request_id: r.answers_from for r in recs}
            found = await loop.run_in_executor(None, self.scanner.scan, partition, wanted)
            for rec in recs:
                resp = found.get(rec.request_id)
                if resp is not None:
                    tier = served_tier(rec.service_tier, Priority(rec.base_band),
                                       Priority(rec.band))
                    await self._store(finish(rec, resp, tier, now_ms()))
                elif now_ms() > rec.deadline_ms + 60_000:
                    await self._store(replace(rec, status=R.FAILED, updated_ms=now_ms(), error={
                        "code": "expired", "message": "no answer within the deadline"}))
