"""The simulator's OpenAI-compatible HTTP server (aiohttp), driving an :class:`Engine` in real time.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (whole answers, or
server-sent events ``data: {chunk}`` ending in ``data: [DONE]``, with a last usage chunk
when ``stream_options.include_usage`` is set), ``GET /v1/models``, ``GET /metrics``
(vLLM's names) and ``GET /health``. Usage carries ``prompt_tokens_details.cached_tokens``, the
prompt tokens the prefix cache held (:mod:`prefix_cache`). Errors are OpenAI-style ``{"error": {...}}`` bodies:
404 for a model it does not serve, 400 for a malformed body or a request longer than
``max_model_len``. A client that disconnects is aborted and leaves the batch at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from pipeline.simulator.engine import Engine, EngineConfig, Sequence
from pipeline.simulator.metrics import CONTENT_TYPE, EngineMetrics
from pipeline.simulator.prefix_cache import block_hashes
from pipeline.simulator.text import answer_seed, count_prompt_tokens, token_text


@dataclass(frozen=True)
class SimulatorConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: The names it answers to (vLLM's --served-model-name); the first labels its metrics.
    served_model_names: tuple[str, ...] = ("sim-small",)
    #: Natural answer length: answers stop ("stop") after this many tokens, or at max_tokens
    #: ("length") when that comes first. None: every answer runs to max_tokens.
    output_tokens: int | None = None


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class _Driver:
    """Runs the engine's steps back to back in real time and hands tokens to waiting handlers."""

    def __init__(self, engine: Engine, metrics: EngineMetrics):
        self.engine = engine
        self.metrics = metrics
        self.listeners: dict[Sequence, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="simulator-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def submit(self, seq: Sequence) -> asyncio.Queue:
        self.engine.submit(seq)
        queue: asyncio.Queue = asyncio.Queue()
        self.listeners[seq] = queue
        self._wake.set()
        return queue

    def abort(self, seq: Sequence) -> None:
        self.engine.abort(seq)
        self.listeners.pop(seq, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_end = None
        while True:
            if self.engine.idle:
                self._wake.clear()
                await self._wake.wait()
                last_end = None
            now = loop.time()
            # Steps follow each other back to back: start where the last one ended unless the
            # event loop fell well behind, so sleep overheads do not add up over a long answer.
            if last_end is not None and 0 <= now - last_end < 0.05:
                now = last_end
            result = self.engine.step(now)
            if result is None:
                last_end = None
                continue
            delay = result.ends_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.engine.finish_step(result)
            last_end = result.ends_at
            for seq, index in result.tokens:
                queue = self.listeners.get(seq)
                if queue is not None:
                    queue.put_nowait(index)
            for seq in result.finished:
                self.metrics.finished(seq)
                queue = self.listeners.pop(seq, None)
                if queue is not None:
                    queue.put_nowait(None)


def _prompt_of_chat(body: dict) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest(400, "'messages' must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _BadRequest(400, "every message needs a 'role' and a 'content'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise _BadRequest(400, "a message's 'content' must be a string or a list of text parts")
        parts.append(f"{m['role']}: {content}\n")
    return "".join(parts)


def _prompt_of_completion(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _BadRequest(400, "'prompt' must be a string")
    return prompt


class SimulatorServer:
    """``async with SimulatorServer(config) as sim:`` serves on ``sim.base_url`` until the block ends."""

    def __init__(self, config: SimulatorConfig = SimulatorConfig(), host: str = "127.0.0.1", port: int = 0):
        if not config.served_model_names:
            raise ValueError("the simulator needs at least one served model name")
        self.config = config
        self.host = host
        self.port = port
        self.engine = Engine(config.engine)
        self.metrics = EngineMetrics(self.engine, config.served_model_names[0])
        self._driver: _Driver | None = None
        self._runner: web.AppRunner | None = None
        self.requests_seen = 0
        self.disconnects = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> "SimulatorServer":
        self._driver = _Driver(self.engine, self.metrics)
        self._driver.start()
        # handler_cancellation: a client that hangs up mid-answer cancels its handler, which
        # aborts its sequence, as vLLM aborts the requests of closed connections.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._driver is not None:
            await self._driver.stop()
            self._driver = None

    async def __aenter__(self) -> "SimulatorServer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- handlers ------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "llmq-simulator",
             "max_model_len": self.config.engine.max_model_len} for name in self.config.served_model_names]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    def _parse(self, body: object, chat: bool) -> tuple[str, str, int, int, str, bool, bool]:
        if not isinstance(body, dict):
            raise _BadRequest(400, "the body must be a JSON object")
        model = body.get("model")
        if model not in self.config.served_model_names:
            raise _BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
        prompt = _prompt_of_chat(body) if chat else _prompt_of_completion(body)
        prompt_tokens = count_prompt_tokens(prompt)
        limit = self.config.engine.max_model_len
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = max(1, limit - prompt_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _BadRequest(400, "'max_tokens' must be a positive integer")
        if prompt_tokens + max_tokens > limit:
            raise _BadRequest(400, f"This model's maximum context length is {limit} tokens; the request has "
                                   f"{prompt_tokens} prompt tokens and asks for {max_tokens} more.")
        natural = self.config.output_tokens
        n = max_tokens if natural is None else min(max_tokens, natural)
        finish = "stop" if natural is not None and natural <= max_tokens else "length"
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        return model, prompt, prompt_tokens, n, finish, stream, include_usage

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.requests_seen += 1
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _BadRequest(400, "the body is not valid JSON") from None
            model, prompt, prompt_tokens, n, finish, stream, include_usage = self._parse(body, chat)
        except _BadRequest as exc:
            return _error(exc.status, exc.message, exc.kind)
        loop = asyncio.get_running_loop()
        blocks = block_hashes(prompt) if self.config.engine.prefix_caching else ()
        seq = Sequence(uuid.uuid4().hex, prompt_tokens, n, loop.time(), blocks=blocks)
        queue = self._driver.submit(seq)
        seed = answer_seed(model, prompt)
        ident = ("chatcmpl-" if chat else "cmpl-") + seq.request_id
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        try:
            if not stream:
                text = []
                while (index := await queue.get()) is not None:
                    text.append(token_text(seed, index))
                usage["prompt_tokens_details"]["cached_tokens"] = seq.cached_tokens
                choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                           "finish_reason": finish} if chat else
                          {"index": 0, "text": "".join(text), "finish_reason": finish})
                return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                          "created": int(time.time()), "model": model, "choices": [choice],
                                          "usage": usage})
            return await self._stream(request, queue, seq, seed, ident, model, chat, finish, usage, include_usage)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            self._driver.abort(seq)  # a no-op for a finished sequence

    async def _stream(self, request, queue, seq, seed, ident, model, chat, finish, usage, include_usage):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> bytes:
            payload = {"id": ident, "object": kind, "created": created, "model": model, "choices": choices}
            payload.update(extra)
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        try:
            if chat:  # OpenAI's first chunk carries the role
                await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]))
            while (index := await queue.get()) is not None:
                last = index + 1 == seq.max_tokens
                text = token_text(seed, index)
                choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
                choice["finish_reason"] = finish if last else None
                extra = {"usage": None} if include_usage else {}
                await resp.write(chunk([choice], **extra))
            if include_usage:
                usage["prompt_tokens_details"]["cached_tokens"] = seq.cached_tokens
                await resp.write(chunk([], usage=usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            # The client hung up mid-stream (a caller that wanted only the first token): as
            # vLLM does, the sequence is aborted (by the caller's finally), and nothing is logged.
            self.disconnects += 1
        return resp


class ThreadedSimulator:
    """A simulator on its own event loop in a daemon thread, for synchronous callers (benchmarks, tests)."""

    def __init__(self, config: SimulatorConfig = SimulatorConfig(), host: str = "127.0.0.1", port: int = 0):
        self.server = SimulatorServer(config, host, port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="simulator", daemon=True)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def __enter__(self) -> "ThreadedSimulator":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
