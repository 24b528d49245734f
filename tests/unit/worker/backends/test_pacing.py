"""The pacing controller's dynamics, on a fake clock (no sockets, no sleeping)."""

from __future__ import annotations

import asyncio
import heapq
import itertools

import pytest

from pipeline.worker.backends.pacing import AimdLimit, PacingConfig, PacingGate, ServerLoad, ServerPacer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_limit_grows_by_about_one_per_limits_worth_of_fast_first_tokens():
    aimd = AimdLimit(PacingConfig(initial_limit=4))
    for _ in range(4):
        aimd.first_token(0.1, started_at=0.0, at_limit=True)
    assert aimd.limit == pytest.approx(5.0, abs=0.2)


def test_the_limit_does_not_grow_while_it_is_not_what_holds_calls_back():
    aimd = AimdLimit(PacingConfig(initial_limit=4))
    for _ in range(50):
        aimd.first_token(0.1, started_at=0.0, at_limit=False)
    assert aimd.limit == 4


def test_a_slow_first_token_cuts_the_limit_once_per_round():
    aimd = AimdLimit(PacingConfig(initial_limit=10, decrease=0.5))
    aimd.first_token(0.1, started_at=0.0, at_limit=True)  # the floor
    aimd.first_token(0.5, started_at=1.0, at_limit=True)  # > 2x the floor
    assert aimd.limit == pytest.approx(10.1 * 0.5, rel=0.02)
    aimd.first_token(0.5, started_at=0.5, at_limit=True)  # started before the cut: already paid for
    assert aimd.limit == pytest.approx(10.1 * 0.5, rel=0.02)
    aimd.first_token(0.5, started_at=2.0, at_limit=True)  # a new round
    assert aimd.limit == pytest.approx(10.1 * 0.25, rel=0.02)


def test_the_limit_never_leaves_its_bounds():
    aimd = AimdLimit(PacingConfig(initial_limit=2, min_limit=1, max_limit=3))
    for i in range(100):
        aimd.first_token(0.1, started_at=float(i), at_limit=True)
    assert aimd.limit == 3
    for i in range(100, 200):
        aimd.cut(float(i))
    assert aimd.limit == 1


def test_a_moderately_slower_first_token_holds_the_limit():
    aimd = AimdLimit(PacingConfig(initial_limit=6))
    aimd.first_token(0.1, started_at=0.0, at_limit=True)
    before = aimd.limit
    aimd.first_token(0.17, started_at=1.0, at_limit=True)  # between 1.5x and 2x the floor
    assert aimd.limit == before


def _closed_loop(pacer: ServerPacer, clock: Clock, slots: int, service_s: float, prefill_s: float,
                 duration_s: float, metrics_every_s: float | None = None):
    """A backlogged client in front of a FIFO server with ``slots``; returns samples (limit, waiting)."""
    seq = itertools.count()
    events: list = []
    busy, queue, samples = 0, [], []

    def serve(slot, now):
        nonlocal busy
        busy += 1
        heapq.heappush(events, (now + prefill_s, next(seq), "first", slot))
        heapq.heappush(events, (now + service_s, next(seq), "done", slot))

    next_metrics = 0.0
    while clock.now < duration_s:
        while pacer.available(clock.now) > 0:
            slot = pacer.start(clock.now)
            if busy < slots:
                serve(slot, clock.now)
            else:
                queue.append(slot)
        samples.append((clock.now, pacer.limit(clock.now), len(queue), busy))
        t, _, kind, slot = heapq.heappop(events)
        if metrics_every_s is not None and next_metrics <= t:
            clock.now = next_metrics
            pacer.observe_load(ServerLoad(busy, len(queue), None, clock.now))
            next_metrics += metrics_every_s
            heapq.heappush(events, (t, next(seq), kind, slot))
            continue
        clock.now = t
        if kind == "first":
            pacer.aimd.first_token(t - slot.started_at, slot.started_at, slot.at_limit)
        else:
            busy -= 1
            pacer.finish(slot)
            if queue:
                serve(queue.pop(0), t)
    return [s for s in samples if s[0] > duration_s / 2]  # the steady state


def test_aimd_keeps_the_server_full_with_its_queue_short():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=1, max_limit=64), clock)
    steady = _closed_loop(pacer, clock, slots=8, service_s=1.0, prefill_s=0.05, duration_s=300)
    limits = [limit for _, limit, _, _ in steady]
    waiting = [w for _, _, w, _ in steady]
    busy = [b for _, _, _, b in steady]
    # It probes one or two past the slots, then a queued call's slow first token cuts it back.
    assert max(limits) <= 8 + 2 and min(limits) >= int(0.7 * 8) - 1
    assert sum(waiting) / len(waiting) < 1.0
    assert sum(busy) / len(busy) > 0.75 * 8


def test_with_metrics_the_limit_tracks_free_slots_and_nothing_waits_long():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=2, max_limit=64), clock)
    steady = _closed_loop(pacer, clock, slots=12, service_s=0.5, prefill_s=0.02, duration_s=60,
                          metrics_every_s=0.05)
    waiting = [w for _, _, w, _ in steady]
    busy = [b for _, _, _, b in steady]
    assert pacer.capacity in (12, 13)  # learned: exact while someone waits, probed one above otherwise
    assert max(waiting) <= 1
    assert sum(busy) / len(busy) > 0.9 * 12


def test_metrics_size_the_limit_to_running_plus_free_slots():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=4), clock)
    for _ in range(3):
        pacer.start(clock.now)
    clock.now = 0.1
    # 3 of ours and 5 of other clients' running, 2 waiting, twice: the server has 8 slots
    pacer.observe_load(ServerLoad(running=8, waiting=2, kv_usage=0.5, at=clock.now))
    pacer.observe_load(ServerLoad(running=8, waiting=2, kv_usage=0.5, at=clock.now))
    assert pacer.capacity == 8 and pacer.mode == "metrics" and pacer.others == 7
    assert pacer.available() == 0
    pacer.observe_load(ServerLoad(running=5, waiting=0, kv_usage=0.5, at=clock.now))  # others: 2 left
    assert pacer.limit() == 6 and pacer.available() == 3
    clock.now += 0.01
    pacer.start(clock.now)  # counted at once, without waiting for a sample
    assert pacer.available() == 2


def test_calls_on_their_way_when_a_sample_is_taken_do_not_count_twice():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=4), clock)
    pacer.start(0.0)
    pacer.start(0.0)
    clock.now = 0.05
    # The sample was taken at 0.04 when both were in flight but only one had reached the server.
    pacer.observe_load(ServerLoad(running=1, waiting=0, kv_usage=None, at=0.04))
    assert pacer.others == 0 and pacer.available() == 2


def test_a_full_kv_cache_starts_nothing_more():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=8), clock)
    pacer.observe_load(ServerLoad(running=2, waiting=0, kv_usage=0.97, at=0.0))
    assert pacer.available() == 0


def test_a_full_server_nobody_waits_for_is_probed_one_slot_above():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=4), clock)
    pacer.observe_load(ServerLoad(running=4, waiting=0, kv_usage=None, at=0.0))
    assert pacer.capacity == 5
    pacer.observe_load(ServerLoad(running=5, waiting=1, kv_usage=None, at=0.0))
    assert pacer.capacity == 5


def test_capacity_is_learned_from_requests_waiting_at_two_samples_in_a_row():
    pacer = ServerPacer(PacingConfig(initial_limit=8), Clock())
    pacer.observe_load(ServerLoad(running=0, waiting=3, kv_usage=None, at=0.0))  # not yet scheduled
    assert pacer.capacity == 8
    pacer.observe_load(ServerLoad(running=6, waiting=2, kv_usage=None, at=0.05))  # still waiting: full
    assert pacer.capacity == 6


def test_a_stale_sample_hands_over_to_the_ttft_limit():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=3, metrics_stale_s=0.2), clock)
    pacer.observe_load(ServerLoad(running=0, waiting=0, kv_usage=0.0, at=0.0))
    pacer.capacity = 40
    assert pacer.limit() == 40
    clock.now = 0.25
    assert pacer.mode == "ttft" and pacer.limit() == 3
    pacer.observe_load(None)  # the server has no metrics at all
    assert pacer.limit() == 3


def test_ttft_pacing_takes_over_from_the_limit_the_metrics_last_gave():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=16, metrics_stale_s=0.2), clock)
    pacer.capacity = 16
    pacer.observe_load(ServerLoad(running=16, waiting=1, kv_usage=0.0, at=0.0))
    pacer.observe_load(ServerLoad(running=16, waiting=1, kv_usage=0.0, at=0.05))  # 16 slots, all ours
    for i in range(200):  # fast first tokens at the limit: TTFT pacing alone would have grown meanwhile
        pacer.aimd.first_token(0.02, 0.05, at_limit=True)
    pacer.observe_load(ServerLoad(running=16, waiting=0, kv_usage=0.0, at=0.1))
    clock.now = 0.5  # the metrics go stale (a busy host): no burst past what the server could take
    assert pacer.mode == "ttft" and pacer.limit() <= 17


def test_a_fixed_gate_never_adapts():
    pacer = ServerPacer(PacingConfig(adaptive=False, initial_limit=5, max_limit=5), Clock())
    pacer.aimd.cut(0.0)
    assert pacer.limit() == 5 and pacer.mode == "fixed"


def test_the_gate_waits_for_a_released_slot_and_gives_up_at_its_timeout():
    async def go():
        gate = PacingGate(PacingConfig(adaptive=False, initial_limit=1, max_limit=1))
        first = await gate.acquire(lambda: "s", 1.0)
        assert gate.available("s") == 0
        waiter = asyncio.create_task(gate.acquire(lambda: "s", 2.0))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        gate.release(first)
        second = await asyncio.wait_for(waiter, 1.0)
        assert second.server == "s" and gate.in_flight("s") == 1
        with pytest.raises(TimeoutError):
            await gate.acquire(lambda: "s", 0.05)
        gate.release(second)
        gate.release(second)  # twice is once
        assert gate.in_flight("s") == 0

    asyncio.run(go())


def test_an_overload_answer_cuts_the_limit():
    gate = PacingGate(PacingConfig(initial_limit=10, decrease=0.5))
    slot = gate.try_acquire("s")
    gate.overloaded(slot)
    assert gate.limit("s") == 5


def test_a_call_that_ends_after_the_sample_frees_its_slot_at_once():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=4), clock)
    slots = [pacer.start(clock.now) for _ in range(4)]
    clock.now = 0.1
    pacer.observe_load(ServerLoad(running=4, waiting=0, kv_usage=None, at=0.1))  # probes to 5
    assert pacer.available() == 1
    pacer.finish(slots[0])
    assert pacer.available() == 2  # not waiting for the next sample to see the free slot


def test_requests_waiting_for_the_next_step_while_slots_are_free_do_not_shrink_capacity():
    # Streams arriving every few ms: at most samples one has come since the server's last step.
    pacer = ServerPacer(PacingConfig(initial_limit=4, max_limit=256), Clock())
    for i, running in enumerate(range(4, 30)):  # the server has room: every probe is taken
        pacer.observe_load(ServerLoad(running=running, waiting=0, kv_usage=None, at=i * 0.05))
        pacer.observe_load(ServerLoad(running=running - 2, waiting=1, kv_usage=None, at=i * 0.05 + 0.01))
        pacer.observe_load(ServerLoad(running=running - 1, waiting=2, kv_usage=None, at=i * 0.05 + 0.02))
    assert pacer.capacity >= 30  # never below what ran (29), probed above it


def test_a_big_server_is_found_in_a_few_samples_and_a_full_one_gets_one_more_at_most():
    pacer = ServerPacer(PacingConfig(initial_limit=4, max_limit=256), Clock())
    samples = 0
    while pacer.capacity < 100:  # a 256-slot server takes every probe
        pacer.observe_load(ServerLoad(running=pacer.capacity, waiting=0, kv_usage=None, at=samples * 0.05))
        samples += 1
    assert samples <= 10  # 4, 5, 7, 10, 15, 22, 33, 49, 73, 109
    full = ServerPacer(PacingConfig(initial_limit=16, max_limit=256), Clock())
    for i in range(40):  # 16 slots: the probe waits, two samples say so, back to 16, probe one again
        over = full.capacity - 16
        full.observe_load(ServerLoad(running=16, waiting=over, kv_usage=None, at=i * 0.05))
        assert full.capacity <= 17


def test_a_server_that_restarted_smaller_is_learned_again():
    config = PacingConfig(initial_limit=4, max_limit=64)
    pacer = ServerPacer(config, Clock())
    pacer.observe_load(ServerLoad(running=16, waiting=1, kv_usage=None, at=0.0))
    pacer.observe_load(ServerLoad(running=16, waiting=1, kv_usage=None, at=0.05))
    assert pacer.capacity == 16
    samples = int(config.shrink_after_s / config.metrics_interval_s)
    for i in range(samples):  # now 8 slots: 8 run and the rest wait, for seconds
        pacer.observe_load(ServerLoad(running=8, waiting=4, kv_usage=None, at=0.1 + i * 0.05))
    assert pacer.capacity == 8


def test_a_full_kv_reading_does_not_keep_an_idle_server_idle_and_is_counted():
    clock = Clock()
    pacer = ServerPacer(PacingConfig(initial_limit=8), clock)
    # A server that counts its cached free blocks as used: full, with nothing running or waiting.
    pacer.observe_load(ServerLoad(running=0, waiting=0, kv_usage=1.0, at=0.0))
    assert pacer.available() > 0 and pacer.kv_contradictions == 1
    pacer.start(0.0)
    pacer.start(0.0)
    clock.now = 0.05
    # Still full while running what llmq sent: not trusted until it reads below the threshold.
    pacer.observe_load(ServerLoad(running=2, waiting=0, kv_usage=1.0, at=0.04))
    assert pacer.available() > 0 and pacer.kv_contradictions == 1
    pacer.observe_load(ServerLoad(running=2, waiting=0, kv_usage=0.5, at=0.05))
    pacer.observe_load(ServerLoad(running=2, waiting=0, kv_usage=0.97, at=0.06))
    assert pacer.available() == 0  # a believable reading again: a full cache starts nothing more
