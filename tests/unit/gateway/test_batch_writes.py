"""The gateway's per-batch table access: reads see the batch's own writes, each key is read
once and written once per batch, and the direct table path writes what Faust would."""

from __future__ import annotations

from types import SimpleNamespace

import faust

from pipeline.gateway.app import _Batch, _Direct, _Outstanding, _View, _WindowedCounts


class RecordingTable:
    """The accessor interface (get, set with the changelog partition) over a dict, recording writes."""

    def __init__(self):
        self.data, self.reads, self.writes = {}, [], []

    def get(self, key):
        self.reads.append(key)
        return self.data.get(key)

    def set(self, key, value, partition):
        self.writes.append((key, value, partition))
        self.data[key] = value


def _batch():
    gateway = SimpleNamespace(_clock_s=100.0)
    return _Batch(gateway), gateway


def test_reads_see_the_batch_and_each_key_is_read_and_written_once_with_its_last_partition():
    batch, _ = _batch()
    table = RecordingTable()
    counts = _View(table, batch)
    for partition in (1, 2, 3):
        batch.partition = partition
        counts.add("acme")
    assert counts.get("acme") == 3 and table.writes == []
    assert table.reads == ["acme"]
    batch.flush()
    assert table.writes == [("acme", 3, 3)]  # the changelog partition of the last record that touched it
    assert counts.dirty == {} and counts.values == {}
    assert counts.get("acme") == 3 and table.reads == ["acme", "acme"]  # the next batch reads it again


def test_window_writes_use_the_clock_of_their_decision():
    batch, gateway = _batch()
    seen_clocks = []

    class Window:
        def get(self, who):
            return None

        def set(self, who, value, partition):
            seen_clocks.append((who, value, partition, gateway._clock_s))

    counts = _WindowedCounts({"per_second": Window()}, batch)
    batch.partition = 4
    gateway._clock_s = 41.5
    counts[("per_second", "acme", 41000)] = [1, 10]
    assert counts.get(("per_second", "acme", 41000)) == [1, 10]
    assert counts.get(("per_second", "acme", 42000)) is None  # the next window: its own key
    gateway._clock_s = 42.2  # the batch ends in the next second
    batch.flush()
    assert seen_clocks == [("acme", [1, 10], 4, 41.5)]
    assert gateway._clock_s == 42.2


def test_outstanding_is_admitted_minus_finished_and_never_negative():
    batch, _ = _batch()
    admitted, finished = _View(RecordingTable(), batch), _View(RecordingTable(), batch)
    out = _Outstanding(admitted, finished)
    batch.partition = 0
    out["acme\x1fNORMAL"] = out["acme\x1fNORMAL"] + 1
    out["acme\x1fNORMAL"] = out["acme\x1fNORMAL"] + 1
    finished["acme\x1fNORMAL"] = 5
    assert out["acme\x1fNORMAL"] == 0
    assert admitted.get("acme\x1fNORMAL") == 2


def test_adding_to_outstanding_counts_one_more_admitted_even_after_more_finished_than_seen():
    # After a restart the completions table can be ahead of the admissions it has replayed:
    # one more admission is still one more admitted, as ``out[key] = out[key] + 1`` counts it.
    batch, _ = _batch()
    admitted, finished = _View(RecordingTable(), batch), _View(RecordingTable(), batch)
    out = _Outstanding(admitted, finished)
    batch.partition = 0
    finished["acme\x1fNORMAL"] = 3
    out.add("acme\x1fNORMAL")
    out["beta\x1fNORMAL"] = out["beta\x1fNORMAL"] + 1
    out.add("beta\x1fNORMAL")
    assert admitted.get("acme\x1fNORMAL") == 1 and out["acme\x1fNORMAL"] == 0
    assert admitted.get("beta\x1fNORMAL") == 2 and out["beta\x1fNORMAL"] == 2


class RecordingOutputs:
    def __init__(self):
        self.sent = []

    def produce(self, topic, value, key, headers=None, partition=None, bulk=False):
        assert bulk  # changelog records may wait to be sent together
        self.sent.append((topic, key, value, partition))


def _direct(make_table):
    app = faust.App("direct-test", broker="kafka://127.0.0.1:1", store="memory://")
    gateway = SimpleNamespace(_clock_s=41.5, _outputs=RecordingOutputs())
    table = make_table(app, gateway)
    return _Direct(table, gateway), getattr(table, "table", table), gateway


def test_direct_writes_go_to_the_store_and_the_changelog_encoded_as_faust_encodes_them():
    direct, table, gateway = _direct(lambda app, g: app.Table("admitted", default=int, partitions=4))
    assert direct.get("acme") == 0
    direct.set("acme", 7, 3)
    assert direct.get("acme") == 7 and table.data["acme"] == 7
    topic = table.changelog_topic
    assert gateway._outputs.sent == [(topic.get_topic_name(), topic.prepare_key("acme", table.key_serializer)[0],
                                      topic.prepare_value(7, table.value_serializer)[0], 3)]


def test_direct_windowed_writes_use_the_window_of_the_gateway_clock_and_register_expiry():
    direct, table, gateway = _direct(lambda app, g: app.Table("rate", default=lambda: None, partitions=4)
                                     .tumbling(1.0, expires=2.0).relative_to(lambda event=None: g._clock_s))
    direct.set("acme", [1, 10], 1)
    window = table.window.current(41.5)
    assert table.data[("acme", window)] == [1, 10]
    assert direct.get("acme") == [1, 10]
    gateway._clock_s = 42.1
    assert direct.get("acme") is None  # the next window
    assert ("acme", window) in table._partition_timestamp_keys[(1, window[1])]
    assert gateway._outputs.sent[0][1] == table.changelog_topic.prepare_key(("acme", window), table.key_serializer)[0]


def test_counter_values_and_remembered_keys_are_the_bytes_faust_would_write():
    direct, table, gateway = _direct(lambda app, g: app.Table("rate", default=lambda: None, partitions=4)
                                     .tumbling(1.0, expires=2.0).relative_to(lambda event=None: g._clock_s))
    topic = table.changelog_topic
    values = [[1, 10], [0, 0], [7, 2**40], 5, -3, None, [["id-1", "t:0:5"]], [("id-\u00e9\u2028\"", "t:1:2"), ("x", "y")],
              [], {"a": 1}, True]
    for value in values:
        direct.set("tenant \"q\" é", value, 2)  # the key is encoded once, then remembered
    window = table.window.current(41.5)
    want_key = topic.prepare_key(("tenant \"q\" é", window), table.key_serializer)[0]
    assert [sent[1] for sent in gateway._outputs.sent] == [want_key] * len(values)
    assert [sent[2] for sent in gateway._outputs.sent] == [topic.prepare_value(v, table.value_serializer)[0]
                                                           for v in values]
