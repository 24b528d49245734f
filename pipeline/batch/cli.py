"""``llmq batch``: OpenAI's Batch API on ``llmq serve``, from the command line, over HTTP.

``submit`` uploads a JSONL file (``POST /v1/files``) and creates a batch on it (``POST
/v1/batches``); ``--wait`` follows it to its end and saves its result files. ``status``,
``cancel`` and ``results`` act on a batch by id. Nothing here talks to Kafka: serve does.

Exit status: 0 done (``submit --wait``: the batch completed; ``cancel --wait``: it was
cancelled), 1 serve unreachable, 2 usage error, 3 serve answered with an error or the batch
ended otherwise, 130 interrupted while waiting (the batch keeps running). The API key is sent
only in the Authorization header and never printed, even when serve quotes it back.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from pipeline.batch import record as R
from pipeline.errors import LlmqError
from pipeline.progress import Progress
from pipeline.tenants.keys import read_key_file

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV, KEY_FILE_ENV = "LLMQ_SERVE_URL", "LLMQ_API_KEY_FILE"
EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
#: Seconds between two looks at a batch being waited for.
POLL_S = 1.0
#: How long a wait rides out serve being unreachable or answering 5xx (a restart, a rolling
#: deploy) before giving up on it; the batch itself is in Kafka and survives that.
POLL_PATIENCE_S = 30.0
_TIMEOUT_S = 30.0
_PIECE = 256 * 1024


class Usage(Exception):
    """A mistake on the command line (exit status 2)."""


class Unreachable(Exception):
    """No HTTP answer from serve (exit status 1)."""


class Refused(Exception):
    """serve said no, or the batch is not where the command needs it (exit status 3)."""


class ServeError(Refused):
    """serve answered with an error: its HTTP status and OpenAI's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


# -- the HTTP side ---------------------------------------------------------------------------------


def form_around_file(fields: dict[str, str], file_field: str, filename: str, boundary: str) -> tuple[bytes, bytes]:
    """The bytes of a multipart/form-data body before and after one file's content.

    Split so that the file can be streamed between them instead of read into memory. A random
    boundary is used unchecked against the content, as HTTP clients do: a collision is as
    likely as guessing a UUID.
    """
    head = b""
    for name, value in fields.items():
        head += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{_quoted(name)}\"\r\n\r\n"
                 f"{value}\r\n").encode()
    head += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{_quoted(file_field)}\"; "
             f"filename=\"{_quoted(filename)}\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
    return head, f"\r\n--{boundary}--\r\n".encode()


def _quoted(text: str) -> str:
    # What browsers do (the HTML form spec): a quote or line break in a name would end the header.
    return text.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


class Serve:
    """``llmq serve`` at ``url``, as the holder of ``key``."""

    def __init__(self, url: str, key: str, timeout_s: float = _TIMEOUT_S):
        self.url = url.rstrip("/")
        self._key = key
        self.timeout_s = timeout_s

    def json(self, method: str, path: str, doc: dict | None = None) -> dict[str, Any]:
        data = None if doc is None else json.dumps(doc).encode()
        with self._open(method, path, data, {"Content-Type": "application/json"} if data else {}) as resp:
            return json.loads(resp.read())

    def upload(self, path: Path) -> dict[str, Any]:
        boundary = uuid.uuid4().hex
        head, tail = form_around_file({"purpose": "batch"}, "file", path.name, boundary)
        size = path.stat().st_size

        def body() -> Iterator[bytes]:
            yield head
            with open(path, "rb") as f:
                while piece := f.read(_PIECE):
                    yield piece
            yield tail

        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}",
                   "Content-Length": str(len(head) + size + len(tail))}
        with self._open("POST", "/v1/files", body(), headers) as resp:
            return json.loads(resp.read())

    def copy_file(self, file_id: str, out: BinaryIO) -> int:
        """Write a file's content to ``out``; its number of lines."""
        lines = 0
        with self._open("GET", f"/v1/files/{_segment(file_id)}/content") as resp:
            while piece := self._read(resp):
                out.write(piece)
                lines += piece.count(b"\n")
        return lines

    def _read(self, resp) -> bytes:
        try:
            return resp.read(_PIECE)
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{self.url} stopped answering mid-download: {exc}") from None

    def _open(self, method: str, path: str, data=None, headers: dict | None = None):
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self._key}", **(headers or {})})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise ServeError(exc.code, self._redact(_error_message(exc))) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"cannot reach {self.url}: {self._redact(str(getattr(exc, 'reason', exc)))}") from None

    def _redact(self, text: str) -> str:
        # OpenAI's own "Incorrect API key provided: ..." quotes the key; a server may too.
        return text.replace(self._key, "<the key>")


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return str(exc.reason)


def _segment(ident: str) -> str:
    # An id goes into the path as one segment, whatever it holds ("../files" included).
    return urllib.parse.quote(ident, safe="")


def _connect(args) -> Serve:
    url = args.via or os.environ.get(URL_ENV) or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise Usage(f"--via {url!r} is not an http:// or https:// URL")
    key_file = args.key_file or os.environ.get(KEY_FILE_ENV)
    if not key_file:
        raise Usage(f"--key-file FILE (or ${KEY_FILE_ENV}) is required: the file holding the API key")
    try:
        return Serve(url, read_key_file(key_file))
    except LlmqError as exc:
        raise Usage(str(exc)) from None


# -- argument types --------------------------------------------------------------------------------


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def window(text: str) -> str:
    try:
        R.window_seconds(text, sys.maxsize)  # serve checks its own longest window
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 24h, 90m or 3600s") from None
    return text


# -- the commands ----------------------------------------------------------------------------------


def _command(name: str):
    """Turn a command's exceptions into its message on stderr and its exit status."""

    def wrap(fn):
        def run(args) -> int:
            try:
                return fn(args)
            except Usage as exc:
                code, message = EXIT_USAGE, str(exc)
            except Unreachable as exc:
                code, message = EXIT_UNREACHABLE, str(exc)
            except Refused as exc:
                code, message = EXIT_REFUSED, str(exc)
            print(f"llmq batch {name}: {message}", file=sys.stderr)
            return code

        return functools.wraps(fn)(run)

    return wrap


@_command("submit")
def submit(args) -> int:
    """Upload FILE, create a batch on it; with --wait, follow it and save its results."""
    if (args.output or args.errors) and not args.wait:
        raise Usage("--output and --errors need --wait (or use `llmq batch results BATCH_ID` later)")
    path = Path(args.file)
    if not path.is_file():
        raise Usage(f"no such file: {args.file}")
    serve = _connect(args)
    metadata = dict(args.metadata or [])
    if args.priority:
        metadata["priority"] = args.priority.upper()
    uploaded = serve.upload(path)
    batch = serve.json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": args.endpoint,
                                               "completion_window": args.window, "metadata": metadata})
    if not args.json:
        print(batch["id"], flush=True)
    if not args.wait:
        if args.json:
            print(json.dumps(batch))
        return EXIT_OK
    batch = _wait(serve, batch)
    if batch is None:
        return EXIT_INTERRUPTED
    _save(serve, batch["output_file_id"], args.output)
    _save(serve, batch["error_file_id"], args.errors)
    _report_end(batch, args.json)
    return EXIT_OK if batch["status"] == R.COMPLETED else EXIT_REFUSED


@_command("status")
def status(args) -> int:
    """Print a batch's status, request counts, file ids and timestamps."""
    batch = _connect(args).json("GET", f"/v1/batches/{_segment(args.batch_id)}")
    if args.json:
        print(json.dumps(batch))
    else:
        print(describe(batch))
    return EXIT_OK


@_command("cancel")
def cancel(args) -> int:
    """Ask serve to cancel a batch; with --wait, follow it to its end."""
    serve = _connect(args)
    batch = serve.json("POST", f"/v1/batches/{_segment(args.batch_id)}/cancel")
    if args.wait:
        batch = _wait(serve, batch)
        if batch is None:
            return EXIT_INTERRUPTED
        _report_end(batch, args.json)
        # 3 tells a script the cancel came too late: the batch ended some other way first.
        return EXIT_OK if batch["status"] == R.CANCELLED else EXIT_REFUSED
    print(json.dumps(batch) if args.json else f"{batch['id']}: {batch['status']}")
    return EXIT_OK


@_command("results")
def results(args) -> int:
    """Download an ended batch's output (to --output or stdout) and error files."""
    serve = _connect(args)
    batch = serve.json("GET", f"/v1/batches/{_segment(args.batch_id)}")
    if batch["status"] not in R.TERMINAL:
        raise Refused(f"{batch['id']} is {batch['status']}; its result files are written when it ends "
                      f"(follow it with `llmq batch status {batch['id']}`)")
    if args.output:
        _save(serve, batch["output_file_id"], args.output)
    elif batch["output_file_id"]:
        sys.stdout.flush()
        stdout = getattr(sys.stdout, "buffer", sys.stdout)
        serve.copy_file(batch["output_file_id"], stdout)
        stdout.flush()
    if args.errors:
        _save(serve, batch["error_file_id"], args.errors)
    elif batch["error_file_id"]:
        print(f"{batch['request_counts']['failed']} failed line(s) in {batch['error_file_id']}: --errors FILE "
              "saves them", file=sys.stderr)
    _print_problems(batch)
    return EXIT_OK


# -- waiting, saving, printing ---------------------------------------------------------------------


def _wait(serve: Serve, batch: dict) -> dict | None:
    """The batch once it has ended; None when interrupted (Ctrl-C), which only stops the waiting."""
    try:
        return _follow(serve, batch)
    except KeyboardInterrupt:
        print(f"stopped waiting; {batch['id']} keeps running on serve. See it with: "
              f"llmq batch status {batch['id']} --via {serve.url}", file=sys.stderr)
        return None
    except (Unreachable, ServeError):
        print(f"stopped waiting for {batch['id']}, which keeps running if serve does", file=sys.stderr)
        raise


def _follow(serve: Serve, batch: dict) -> dict:
    bar = None
    try:
        while True:
            bar = _advance(bar, batch)
            if batch["status"] in R.TERMINAL:
                return batch
            time.sleep(POLL_S)
            batch = _look(serve, batch["id"])
    finally:
        if bar is not None:
            bar.close()


def _look(serve: Serve, batch_id: str) -> dict:
    deadline = time.monotonic() + POLL_PATIENCE_S
    while True:
        try:
            return serve.json("GET", f"/v1/batches/{_segment(batch_id)}")
        except (Unreachable, ServeError) as exc:
            lasting = isinstance(exc, ServeError) and exc.status < 500
            if lasting or time.monotonic() > deadline:
                raise
            time.sleep(POLL_S)


def _advance(bar: Progress | None, batch: dict) -> Progress:
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    if bar is None:
        bar = Progress(total, "answered", stream=sys.stderr)
    bar.total = max(1, total)
    bar.advance(max(0, done - bar.done))
    return bar


def _save(serve: Serve, file_id: str | None, dest: str | None) -> None:
    """Write a result file to ``dest``: empty when the batch has none (no line of that kind), so
    that a file left by an earlier run is never taken for this one's."""
    if not dest:
        return
    part = Path(f"{dest}.part")
    try:
        with open(part, "wb") as out:
            lines = serve.copy_file(file_id, out) if file_id else 0
        os.replace(part, dest)  # an interrupted download leaves no complete-looking file
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise Usage(f"cannot write {dest}: {exc.strerror}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    print(f"wrote {lines} line(s) to {dest}", file=sys.stderr)


def summary(batch: dict) -> str:
    counts = batch["request_counts"]
    return (f"{batch['id']} {batch['status']}: {counts['completed']} completed, {counts['failed']} failed of "
            f"{counts['total']}; output {batch['output_file_id'] or 'none'}, errors {batch['error_file_id'] or 'none'}")


def _report_end(batch: dict, as_json: bool) -> None:
    print(json.dumps(batch) if as_json else summary(batch))
    _print_problems(batch)


def _print_problems(batch: dict) -> None:
    for problem in (batch.get("errors") or {}).get("data") or []:
        print(f"{batch['id']}: {problem.get('message')}", file=sys.stderr)


_TIMES = [("created", "created_at"), ("in progress", "in_progress_at"), ("finalizing", "finalizing_at"),
          ("completed", "completed_at"), ("failed", "failed_at"), ("expired", "expired_at"),
          ("cancelling", "cancelling_at"), ("cancelled", "cancelled_at"), ("expires", "expires_at")]


def describe(batch: dict) -> str:
    """``llmq batch status``'s text: one fact a line."""
    counts = batch["request_counts"]
    metadata = ", ".join(f"{k}={v}" for k, v in (batch.get("metadata") or {}).items())
    rows = [("requests", f"{counts['completed'] + counts['failed']} of {counts['total']} answered: "
                         f"{counts['completed']} completed, {counts['failed']} failed"),
            ("endpoint", f"{batch['endpoint']} (window {batch['completion_window']})"),
            ("input", batch["input_file_id"]), ("output", batch["output_file_id"] or "-"),
            ("errors", batch["error_file_id"] or "-"), ("metadata", metadata or "-")]
    rows += [(name, _when(batch[key])) for name, key in _TIMES if batch.get(key)]
    rows += [("problem", p.get("message")) for p in (batch.get("errors") or {}).get("data") or []]
    return "\n".join([f"{batch['id']}: {batch['status']}"] + [f"  {name + ':':<13}{value}" for name, value in rows])


def _when(epoch_s: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch_s))
