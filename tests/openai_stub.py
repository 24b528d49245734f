"""A tiny OpenAI-compatible chat-completions server on loopback, scripted per test."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    """``script`` is a list of (status, body_or_None, delay_s, headers) answered in order; the last repeats."""

    def __init__(self, script=None):
        self.script = list(script or [(200, None, 0.0, {})])
        self.calls: list[dict] = []
        self.auth: list[str | None] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                stub.calls.append(body)
                stub.auth.append(self.headers.get("authorization"))
                status, payload, delay, headers = stub.script[min(len(stub.calls) - 1, len(stub.script) - 1)]
                if delay:
                    time.sleep(delay)
                if payload is None:
                    payload = {"id": "cmpl-1", "object": "chat.completion", "model": body.get("model"),
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": f"echo: {body['messages'][0]['content']}"}}],
                               "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
