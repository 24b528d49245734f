"""The simulator's HTTP server, on a local socket: a client that hangs up mid-stream is aborted
quietly, as vLLM aborts closed connections. (A traceback per hang-up once filled the unread
stdout pipe of a benchmark's simulator process until it froze; SimulatorProcess now drains it.)"""

from __future__ import annotations

import logging
import time

import httpx

from pipeline.simulator import EngineConfig, SimulatorConfig, ThreadedSimulator


def test_a_client_hanging_up_mid_stream_is_aborted_and_nothing_is_logged(caplog):
    config = SimulatorConfig(engine=EngineConfig(ms_per_token=20.0, ttft_ms=0.0))
    with caplog.at_level(logging.WARNING), ThreadedSimulator(config) as sim:
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
                "stream": True}
        with httpx.stream("POST", f"{sim.base_url}/chat/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # the first token: hang up
        deadline = time.monotonic() + 5
        while (sim.server.disconnects == 0 or not sim.server.engine.idle) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sim.server.disconnects == 1
        assert sim.server.engine.idle  # its sequence left the batch
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
