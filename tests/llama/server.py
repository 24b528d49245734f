"""Start and stop a real ``llama_cpp.server`` process on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL_ALIAS = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One server process serving one GGUF under ``alias``.

    The flags are chosen for tests on a small shared machine: a 2048-token context (room
    for streams long enough to cancel half-way), one thread, no mlock, and
    ``--interrupt_requests False`` so a second request waits for the first instead of
    cutting its stream short (the server runs one generation at a time).
    """

    def __init__(self, model: Path, log_path: Path, *, port: int | None = None, alias: str = MODEL_ALIAS,
                 n_ctx: int = 2048, n_threads: int = 1):
        self.model = Path(model)
        self.alias = alias
        self.port = port or free_port()
        self.log_path = Path(log_path)
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--model_alias", self.alias,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx),
                "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads),
                "--use_mlock", "False", "--interrupt_requests", "False", "--verbose", "False"]

    def start(self, timeout_s: float = 60.0) -> "LlamaServer":
        self._log = open(self.log_path, "ab")
        # PYTHONUNBUFFERED: the server's "disconnected" lines must reach the log as they happen.
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama server exited with {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"llama server did not answer /v1/models within {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye on open connections."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
