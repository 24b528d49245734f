"""OpenAI's Files and Batches endpoints in ``llmq serve``, on the files and batches topics.

| endpoint                          | what                                                         |
|-----------------------------------|--------------------------------------------------------------|
| POST   /v1/files                  | upload (multipart: ``file``, ``purpose=batch``), JSONL       |
| GET    /v1/files[/{id}]           | list / one file's object                                     |
| GET    /v1/files/{id}/content     | its bytes (an input, or a batch's output or error file)      |
| DELETE /v1/files/{id}             | delete (not while a running batch reads it)                  |
| POST   /v1/batches                | ``input_file_id``, ``endpoint``, ``completion_window``       |
| GET    /v1/batches[/{id}]         | list / one batch: status, request_counts, result file ids    |
| POST   /v1/batches/{id}/cancel    | stop the lines not started; ends ``cancelled``               |

Everything is scoped to the caller's tenant: another tenant's file or batch is answered 404,
as an id that does not exist. Any serve process answers for any batch (each reads the whole
topics); the batch runs on whichever process owns it (pipeline/batch/driver.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from aiohttp import web

from pipeline.batch import record as R
from pipeline.batch.store import BatchStore
from pipeline.errors import LlmqError
from pipeline.models import Priority
from pipeline.openai_api.errors import ApiError, bad_request

_BATCH_BANDS = (Priority.LOW, Priority.BACKGROUND)
_READ_PIECE = 256 * 1024


def _not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {what}: {ident}", "invalid_request_error", f"{what}_not_found" if what == "batch"
                    else "file_not_found")


def _page(http: web.Request, items: list, view) -> dict:
    try:
        limit = int(http.query.get("limit", "20"))
    except ValueError:
        raise bad_request("limit must be an integer", "limit") from None
    if not 1 <= limit <= 10_000:
        raise bad_request("limit must be 1-10000", "limit")
    after = http.query.get("after")
    if after:
        ids = [i.id for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    data = [view(i) for i in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


class BatchApi:
    def __init__(self, server, store: BatchStore):
        self.server = server
        self.store = store
        self.cfg = server.settings.batch

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/files", self.upload)
        r.add_get("/v1/files", self.list_files)
        r.add_get("/v1/files/{file_id}", self.get_file)
        r.add_get("/v1/files/{file_id}/content", self.content)
        r.add_delete("/v1/files/{file_id}", self.delete_file)
        r.add_post("/v1/batches", self.create)
        r.add_get("/v1/batches", self.list_batches)
        r.add_get("/v1/batches/{batch_id}", self.get_batch)
        r.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    async def _io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- files ---------------------------------------------------------------------------------

    async def upload(self, http: web.Request) -> web.Response:
        caller = self.server.auth.caller(http.headers)
        if not http.content_type.startswith("multipart/"):
            raise bad_request("upload the file as multipart/form-data with the fields file and purpose")
        reader = await http.multipart()
        purpose, filename, data = None, None, bytearray()
        while (part := await reader.next()) is not None:
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                while piece := await part.read_chunk(_READ_PIECE):
                    data += piece
                    if len(data) > self.cfg.max_file_bytes:
                        raise ApiError(413, f"the file exceeds {self.cfg.max_file_bytes} bytes (batch.max_file_bytes)",
                                       "invalid_request_error", "file_too_large", "file")
        if purpose != "batch":
            raise bad_request("purpose must be batch (the only purpose llmq serves)", "purpose")
        if filename is None:
            raise bad_request("file is required", "file")
        data = bytes(data)
        lines = sum(1 for raw in data.split(b"\n") if raw.strip())
        if lines == 0:
            raise bad_request("the file has no lines", "file")
        if lines > self.cfg.max_file_lines:
            raise bad_request(f"the file has {lines} lines, over {self.cfg.max_file_lines} (batch.max_file_lines)",
                              "file")
        rec = R.FileRecord(R.new_file_id(), caller.tenant, filename, purpose, len(data), int(time.time()), 0, lines)
        await self._io(self.store.put_file, rec, self.store.chunks_of(data))
        return _json(rec.view())

    def _owned(self, http: web.Request, what: str):
        """The caller's file or batch named in the path; another tenant's is as unknown as none."""
        caller = self.server.auth.caller(http.headers)
        ident = http.match_info[f"{what}_id"]
        rec = (self.store.file if what == "file" else self.store.batch)(ident, caller.tenant)
        if rec is None:
            raise _not_found(what, ident)
        return rec

    def _file(self, http: web.Request) -> R.FileRecord:
        return self._owned(http, "file")

    async def list_files(self, http: web.Request) -> web.Response:
        caller = self.server.auth.caller(http.headers)
        files = self.store.list_files(caller.tenant, http.query.get("purpose"))
        return _json(_page(http, files, R.FileRecord.view))

    async def get_file(self, http: web.Request) -> web.Response:
        return _json(self._file(http).view())

    async def content(self, http: web.Request) -> web.Response:
        rec = self._file(http)
        try:
            data = await self._io(self.store.read_file, rec.id)
        except LlmqError:
            raise ApiError(503, "the file's contents cannot be read from Kafka now; retry", "server_error",
                           "file_unavailable", retry_after_s=5) from None
        # The name is the uploader's: only plain characters go into a header.
        name = re.sub(r"[^A-Za-z0-9._-]", "_", rec.filename)[:128] or "file.jsonl"
        return web.Response(body=data, content_type="application/octet-stream",
                            headers={"Content-Disposition": f'attachment; filename="{name}"'})

    async def delete_file(self, http: web.Request) -> web.Response:
        rec = self._file(http)
        running = [b.id for b in self.store.list_batches(rec.tenant)
                   if b.input_file_id == rec.id and not b.terminal]
        if running:
            raise ApiError(409, f"batch {running[0]} is still reading this file; cancel it or let it finish first",
                           "invalid_request_error", "file_in_use")
        await self._io(self.store.delete_file, rec.id)
        return _json({"id": rec.id, "object": "file", "deleted": True})

    # -- batches -------------------------------------------------------------------------------

    async def create(self, http: web.Request) -> web.Response:
        caller = self.server.auth.caller(http.headers)
        body = await self.server.body(http)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in R.ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(R.ENDPOINTS)}", "endpoint")
        window = body.get("completion_window", "24h")
        try:
            seconds = R.window_seconds(window, self.cfg.max_completion_window_s)
        except ValueError as exc:
            raise bad_request(str(exc), "completion_window") from None
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or self.store.file(file_id, caller.tenant) is None:
            raise _not_found("file", str(file_id))
        if self.store.file(file_id).purpose != "batch":
            raise bad_request("the input file's purpose must be batch", "input_file_id")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()):
            raise bad_request("metadata must be at most 16 string pairs (keys up to 64, values up to 512 characters)",
                              "metadata")
        band = self.cfg.band()
        asked = metadata.get("priority")
        if asked is not None:
            try:
                band = Priority.parse(asked)
            except ValueError:
                band = None
            if band not in _BATCH_BANDS:
                raise bad_request("metadata.priority of a batch must be LOW or BACKGROUND", "metadata")
        band = max(band, caller.priority(band), key=lambda p: p.rank)  # capped by the tenant's record
        now = int(time.time())
        rec = R.BatchRecord(R.new_batch_id(), caller.tenant, file_id, endpoint, window, now, now + seconds,
                            band.value, dict(metadata), total=self.store.file(file_id).lines)
        await self._io(self.store.put_batch, rec)
        return _json(rec.view())

    def _batch(self, http: web.Request) -> R.BatchRecord:
        return self._owned(http, "batch")

    async def get_batch(self, http: web.Request) -> web.Response:
        rec = self._batch(http)
        return _json(rec.view(self.store.cancel_asked(rec.id)))

    async def list_batches(self, http: web.Request) -> web.Response:
        caller = self.server.auth.caller(http.headers)
        batches = self.store.list_batches(caller.tenant)
        return _json(_page(http, batches, lambda b: b.view(self.store.cancel_asked(b.id))))

    async def cancel(self, http: web.Request) -> web.Response:
        rec = self._batch(http)
        if rec.terminal:
            if rec.status == R.CANCELLED:
                return _json(rec.view())
            raise ApiError(409, f"the batch is {rec.status}; only a running batch can be cancelled",
                           "invalid_request_error", "batch_not_cancellable")
        asked = self.store.cancel_asked(rec.id)
        if asked is None:
            asked = int(time.time())
            await self._io(self.store.ask_cancel, rec.id, asked)
        return _json(rec.view(asked))


def _json(doc, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(doc, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")
