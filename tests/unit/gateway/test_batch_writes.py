"""The gateway's per-batch table writes: reads see the batch's own writes, each key is written once."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.gateway import app as gateway_app
from pipeline.gateway.app import _Batch, _Counts, _Outstanding, _WindowedCounts


class RecordingTable(dict):
    def __init__(self):
        super().__init__()
        self.writes = []

    def __setitem__(self, key, value):
        self.writes.append((key, value))
        super().__setitem__(key, value)


def _batch(monkeypatch):
    current = []
    monkeypatch.setattr(gateway_app, "_as_current", current.append)
    gateway = SimpleNamespace(_clock_s=100.0)
    return _Batch(gateway), gateway, current


def test_reads_see_the_batch_and_each_key_is_written_once_with_its_event(monkeypatch):
    batch, gateway, current = _batch(monkeypatch)
    table = RecordingTable()
    counts = _Counts(table, batch)
    for event in ("e1", "e2", "e3"):
        batch.event = event
        counts.add("acme")
    assert counts.get("acme") == 3 and table.writes == []
    batch.flush()
    assert table.writes == [("acme", 3)]
    assert current == ["e3"]  # the changelog partition of the last event that touched it
    assert batch.dirty == {}


def test_window_writes_use_the_clock_of_their_decision(monkeypatch):
    batch, gateway, _ = _batch(monkeypatch)
    seen_clocks = []

    class Window(dict):
        def __getitem__(self, who):
            return SimpleNamespace(value=lambda: None)

        def __setitem__(self, who, value):
            seen_clocks.append((who, value, gateway._clock_s))

    counts = _WindowedCounts({"per_second": Window()}, batch)
    batch.event = "e"
    gateway._clock_s = 41.5
    counts["per_second\x1facme\x1f41000"] = [1, 10]
    assert counts.get("per_second\x1facme\x1f41000") == [1, 10]
    gateway._clock_s = 42.2  # the batch ends in the next second
    batch.flush()
    assert seen_clocks == [("acme", [1, 10], 41.5)]
    assert gateway._clock_s == 42.2


def test_outstanding_is_admitted_minus_finished_and_never_negative(monkeypatch):
    batch, _, _ = _batch(monkeypatch)
    admitted, finished = _Counts(RecordingTable(), batch), _Counts(RecordingTable(), batch)
    out = _Outstanding(admitted, finished)
    batch.event = "e"
    out["acme\x1fNORMAL"] = out["acme\x1fNORMAL"] + 1
    out["acme\x1fNORMAL"] = out["acme\x1fNORMAL"] + 1
    finished["acme\x1fNORMAL"] = 5
    assert out["acme\x1fNORMAL"] == 0
    assert admitted.get("acme\x1fNORMAL") == 2
