"""pipeline.chunks.ChunkOrder: a request's chunks in seq order, repeats dropped (what a
client's reader needs from the best-effort chunk stream)."""

from __future__ import annotations

from pipeline.config import Settings
from pipeline.models import Chunk
from pipeline.chunks import ChunkOrder, chunk_partition
from pipeline.partitioning import tenant_partition


def c(seq: int, delta: str = "x", finish: str | None = None) -> Chunk:
    return Chunk(request_id="r", tenant_id="t", seq=seq, delta=delta, finish_reason=finish, emitted_at=0)


def seqs(chunks) -> list[int]:
    return [x.seq for x in chunks]


def test_chunks_in_order_pass_through():
    order = ChunkOrder()
    assert seqs(order.add(c(0))) == [0] and seqs(order.add(c(1))) == [1]
    assert seqs(order.add(c(2, finish="stop"))) == [2] and order.finished


def test_a_second_run_from_seq_0_repeats_nothing_and_continues_where_the_first_stopped():
    order = ChunkOrder()
    got = []
    for seq in (0, 1, 2, 0, 1, 2, 3, 4):  # the first run died after 2; the rerun streams again
        got += order.add(c(seq))
    assert seqs(got) == [0, 1, 2, 3, 4]


def test_an_early_chunk_waits_for_the_gap_and_rest_gives_it_if_the_gap_never_fills():
    order = ChunkOrder()
    assert seqs(order.add(c(0))) == [0]
    assert order.add(c(2)) == [] and order.add(c(3)) == []
    assert seqs(order.add(c(1))) == [1, 2, 3]
    assert order.add(c(5, finish="length")) == []
    assert seqs(order.rest()) == [5] and order.finished


def test_nothing_after_the_finishing_chunk():
    order = ChunkOrder()
    order.add(c(1, finish="stop"))
    assert seqs(order.add(c(0))) == [0, 1]
    assert order.add(c(2)) == [] and order.add(c(1)) == []


def test_the_reader_and_the_worker_agree_on_the_partition():
    s = Settings.load(env={})
    n = s.topics.chunk_partitions
    assert chunk_partition(n, "tenant-a") == tenant_partition(b"tenant-a", n)
    assert chunk_partition(n, "tenant-a", 2) == 2
    assert chunk_partition(n, "tenant-a", n) == tenant_partition(b"tenant-a", n)  # out of range: the tenant's
