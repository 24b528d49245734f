"""``"stream": true``: an answer as Server-Sent Events, OpenAI's way.

The events start only once the first chunk is there (or ``serve.stream_heartbeat_s`` passed
without one): a request the pipeline refuses still gets its own status (429 with Retry-After,
504, ...) and an OpenAI error body, not a 200 stream with an error in it. Then:

* chat: a first event with ``delta: {role: assistant}``, one event per chunk's text, an event
  with the ``finish_reason``; completions: one ``text_completion`` event per chunk;
* with ``stream_options: {include_usage: true}``, an event with ``choices: []`` and the usage;
* ``data: [DONE]``.

While nothing comes, a comment line (``: keep-alive``) every ``serve.stream_heartbeat_s`` keeps
proxies from closing the stream. An error after the events started (the deadline passes, the
process stops) is one ``data: {"error": ...}`` event before ``[DONE]``. A caller that hangs up has
its request cancelled.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from pipeline.errors import EncodeError, KafkaOperationError, LlmqError, RequestTimeoutError
from pipeline.models import Request
from pipeline.openai_api.chat import CHAT, DONE, Parsed, chunk_event, chunk_events, sse, usage_event
from pipeline.openai_api.errors import ApiError, bad_request, for_response

_DEADLINE_MARGIN_S = 2.0
_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Stopped(LlmqError):
    """The process stopped (its grace period ended) before the stream did."""


async def stream_answer(server, http: web.Request, req: Request, parsed: Parsed) -> web.StreamResponse:
    client, heartbeat = server.client, server.cfg.stream_heartbeat_s
    try:
        stream = await client.open_stream(req, timeout=req.timeout_ms / 1000 + _DEADLINE_MARGIN_S,
                                          submit_timeout=server.submit_timeout_s(req))
    except EncodeError as exc:  # a field over its size cap: nothing was sent
        raise bad_request(exc.refusal) from None
    except KafkaOperationError:
        raise server.not_taken(req, server.submit_timeout_s(req)) from None
    server.streams.add(stream)
    out: web.StreamResponse | None = None
    try:
        first = await _next(server, stream, heartbeat)
        if first is None and stream.ended:
            error = for_response(await stream.response())
            if error is not None:
                raise error
        out = web.StreamResponse(headers={**_HEADERS, **server.reply_headers(req)})
        await out.prepare(http)
        kind, model, created = parsed.kind, parsed.model, int(time.time())
        if kind == CHAT:
            await out.write(sse(chunk_event(kind, req.request_id, model, created, role=True)))
        chunk = first
        while True:
            if chunk is not None:
                for event in chunk_events(kind, chunk, model, created):
                    await out.write(sse(event))
            elif stream.ended:
                break
            else:
                await out.write(b": keep-alive\n\n")
            chunk = await _next(server, stream, heartbeat)
        resp = await stream.response()
        error = for_response(resp)
        if error is not None:
            await out.write(sse(error.body()))
        elif parsed.include_usage:
            await out.write(sse(usage_event(kind, resp, model, created)))
        await out.write(DONE)
        await out.write_eof()
        return out
    except (RequestTimeoutError, Stopped) as exc:
        stopped = isinstance(exc, Stopped)
        server.cancel(req.request_id, "the server stopped" if stopped else "no answer before the deadline")
        error = (ApiError(503, "the server stopped before the answer came", "server_error", "shutting_down",
                          retry_after_s=1) if stopped else
                 ApiError(504, f"expired: no answer within the deadline ({req.timeout_ms} ms)", "timeout", "expired"))
        if out is None:
            raise error from None
        await out.write(sse(error.body()))
        await out.write(DONE)
        await out.write_eof()
        return out
    except (asyncio.CancelledError, ConnectionResetError):
        server.cancel(req.request_id, "the caller hung up")
        raise
    finally:
        stream.close()
        server.streams.discard(stream)


async def _next(server, stream, timeout: float):
    """The stream's next chunk within ``timeout`` (None: nothing yet, or the end). When the
    grace period ends the server aborts every open stream with :class:`Stopped`."""
    if server.stopped.done():
        raise Stopped()
    return await stream.next(timeout)
