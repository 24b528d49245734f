"""The simulator as a server process of its own, for benchmarks and tests that need the model
server out of their own interpreter (its event loop and GIL then cost the measurement nothing)."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import threading

import httpx

from pipeline.broker import free_port

_GAUGE = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)


class SimulatorProcess:
    """``python -m pipeline.simulator`` on a free port; ``args`` are its command-line options."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.simulator", "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"the simulator did not start: {line.strip() or 'no output'}")
        # Read whatever it prints from now on: a pipe nobody reads fills up (64 KiB), and the
        # server then blocks in its next write, event loop and all, until it is killed.
        self.output: collections.deque[str] = collections.deque(maxlen=200)
        threading.Thread(target=self._drain, name="simulator-output", daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._http = httpx.Client(timeout=2)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def load(self) -> tuple[float, float]:
        """(running, waiting): ``vllm:num_requests_running``/``waiting`` on its /metrics now."""
        values = {"running": 0.0, "waiting": 0.0}
        for name, value in _GAUGE.findall(self._http.get(f"http://127.0.0.1:{self.port}/metrics").text):
            values[name] += float(value)
        return values["running"], values["waiting"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "_http"):
            self._http.close()

    def __enter__(self) -> SimulatorProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
