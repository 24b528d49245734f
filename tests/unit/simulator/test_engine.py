"""The simulator's scheduler model, driven by hand: no sockets, no sleeping."""

from __future__ import annotations

import pytest

from pipeline.simulator import Engine, EngineConfig, Sequence, answer_text
from pipeline.simulator.__main__ import config_from_args, parse_args


def _seq(name: str, max_tokens: int = 4, prompt: int = 8, at: float = 0.0) -> Sequence:
    return Sequence(name, prompt, max_tokens, at)


def test_at_most_max_num_seqs_run_and_the_rest_wait_first_come_first_served():
    engine = Engine(EngineConfig(max_num_seqs=2))
    seqs = [_seq(f"r{i}") for i in range(5)]
    for s in seqs:
        engine.submit(s)
    step = engine.step(0.0)
    assert [s.request_id for s in step.joined] == ["r0", "r1"]
    assert [s.request_id for s in engine.waiting] == ["r2", "r3", "r4"]
    engine.run_until_idle(step.ends_at) if engine.finish_step(step) else None
    joined_order = sorted(seqs, key=lambda s: (s.joined_at, s.request_id))
    assert [s.request_id for s in joined_order] == ["r0", "r1", "r2", "r3", "r4"]
    assert engine.max_running_seen == 2 and engine.idle


def test_a_request_joins_the_running_batch_at_the_next_step_when_a_slot_frees():
    engine = Engine(EngineConfig(max_num_seqs=2, ttft_ms=0, ms_per_token=10, batch_slowdown=0))
    short, long_, late = _seq("short", 1), _seq("long", 5), _seq("late", 2)
    engine.submit(short)
    engine.submit(long_)
    engine.submit(late)
    first = engine.finish_step(engine.step(0.0))  # short finishes after its one token
    assert short in first.finished and engine.num_running == 1
    second = engine.step(first.ends_at)
    assert second.joined == [late]  # joined without waiting for "long" to finish
    assert {s.request_id for s, _ in second.tokens} == {"long", "late"}
    engine.finish_step(second)
    assert late.first_token_at == pytest.approx(0.02) and long_.generated == 2


def test_step_time_grows_with_the_batch_and_joiners_pay_their_prefill():
    cfg = EngineConfig(max_num_seqs=8, ttft_ms=20, ms_per_token=5, batch_slowdown=0.1, prefill_ms_per_token=0.5)
    assert cfg.step_ms(1) == pytest.approx(5)
    assert cfg.step_ms(5) == pytest.approx(5 * 1.4)
    assert cfg.step_ms(3, [10, 0]) == pytest.approx(5 * 1.2 + (20 + 5) + 20)


def test_time_to_first_token_and_time_per_token_grow_with_the_running_batch():
    def measure(batch: int) -> tuple[float, float]:
        engine = Engine(EngineConfig(max_num_seqs=64, ttft_ms=20, ms_per_token=5, batch_slowdown=0.05))
        for i in range(batch - 1):
            engine.submit(_seq(f"bg{i}", 1000))
        t = engine.finish_step(engine.step(0.0)).ends_at if batch > 1 else 0.0  # the background batch runs
        probe = _seq("probe", 10, at=t)
        engine.submit(probe)
        while not probe.done:
            t = engine.finish_step(engine.step(t)).ends_at
        ttft = probe.first_token_at - probe.arrived_at
        tpot = (probe.finished_at - probe.first_token_at) / (probe.generated - 1)
        return ttft, tpot

    (ttft1, tpot1), (ttft16, tpot16) = measure(1), measure(16)
    assert tpot1 == pytest.approx(0.005)
    assert tpot16 == pytest.approx(0.005 * (1 + 0.05 * 15))
    assert ttft16 > ttft1 and tpot16 > tpot1


def test_a_request_that_does_not_fit_the_kv_cache_waits_and_so_do_those_behind_it():
    engine = Engine(EngineConfig(max_num_seqs=4, kv_cache_tokens=100, max_model_len=100))
    big, small = _seq("big", 80, prompt=10), _seq("small", 2, prompt=2)
    first, second = _seq("first", 20, prompt=10), small
    engine.submit(first)
    engine.submit(big)
    engine.submit(second)
    step = engine.step(0.0)
    assert step.joined == [first] and list(engine.waiting) == [big, small]
    assert engine.kv_cache_usage == pytest.approx(0.3)
    engine.run_until_idle(step.ends_at) if engine.finish_step(step) else None
    # small fitted at once but is behind big in the queue: it joined no earlier than big
    assert small.joined_at > 0 and big.joined_at <= small.joined_at and engine.kv_cache_usage == 0


def test_an_aborted_request_leaves_the_batch_and_frees_its_slot_at_once():
    engine = Engine(EngineConfig(max_num_seqs=1))
    a, b = _seq("a", 100), _seq("b", 2)
    engine.submit(a)
    engine.submit(b)
    step = engine.step(0.0)
    engine.abort(a)  # mid-step: its token of this step is never delivered
    done = engine.finish_step(step)
    assert done.tokens == [] and a.generated == 0
    assert engine.step(done.ends_at).joined == [b]
    waiting = _seq("w")
    engine.submit(waiting)
    engine.abort(waiting)
    assert waiting not in engine.waiting


def test_requests_longer_than_the_model_and_empty_ones_are_refused():
    engine = Engine(EngineConfig(max_model_len=64, kv_cache_tokens=64))
    with pytest.raises(ValueError, match="maximum context length of 64"):
        engine.submit(_seq("x", 60, prompt=10))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(_seq("y", 0))


def test_answers_are_deterministic_and_depend_on_model_and_prompt():
    assert answer_text("m", "hello", 5) == answer_text("m", "hello", 5)
    assert len(answer_text("m", "hello", 5).split()) == 5
    assert answer_text("m", "hello", 8) != answer_text("n", "hello", 8)
    assert answer_text("m", "hello", 3) == answer_text("m", "hello", 5)[:len(answer_text("m", "hello", 3))]


def test_the_cli_builds_the_engine_it_describes():
    cfg = config_from_args(parse_args(["--max-num-seqs", "3", "--ttft-ms", "7", "--ms-per-token", "2",
                                       "--served-model-name", "big", "small", "--max-model-len", "512"]))
    assert cfg.served_model_names == ("big", "small")
    assert (cfg.engine.max_num_seqs, cfg.engine.ttft_ms, cfg.engine.ms_per_token) == (3, 7, 2)
    assert cfg.engine.kv_cache_tokens == 3 * 512
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=0)
