"""A tiny HTTP proxy in front of a real model server that answers its first calls with scripted errors."""

from __future__ import annotations

import json
import time

import aiohttp
from aiohttp import web

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class FaultProxy:
    """``script``: (status, headers) for the first POSTs, in order; later ones go to ``upstream``.

    ``calls`` records (monotonic time, status answered) for every POST.
    """

    def __init__(self, upstream_root: str, script: list[tuple[int, dict[str, str]]]):
        self.upstream = upstream_root.rstrip("/")
        self.script = list(script)
        self.calls: list[tuple[float, int]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> "FaultProxy":
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST":
            index = len(self.calls)
            if index < len(self.script):
                status, headers = self.script[index]
                self.calls.append((time.monotonic(), status))
                return web.Response(status=status, headers=headers, content_type="application/json",
                                    text=json.dumps({"error": {"message": f"injected {status}", "code": status}}))
        async with self._session.request(request.method, self.upstream + request.rel_url.path_qs, data=body,
                                         headers={"Content-Type": request.headers.get("Content-Type",
                                                                                      "application/json")}) as up:
            if request.method == "POST":
                self.calls.append((time.monotonic(), up.status))
            resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in _HOP_HEADERS})
            await resp.prepare(request)
            async for part in up.content.iter_any():
                await resp.write(part)
            await resp.write_eof()
            return resp
