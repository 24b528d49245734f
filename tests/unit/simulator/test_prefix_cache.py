"""The simulator's prefix cache, as vLLM keeps one: chained 16-token blocks, LRU eviction of free
blocks, prefill only for what is not cached, and the counters a router reads."""

from __future__ import annotations

import pytest

from pipeline.simulator import Engine, EngineConfig, Sequence
from pipeline.simulator.metrics import EngineMetrics
from pipeline.simulator.prefix_cache import BLOCK_CHARS, BLOCK_TOKENS, PrefixCache, block_hashes
from pipeline.simulator.text import count_prompt_tokens


def _seq(name: str, prompt: str, max_tokens: int = 2, at: float = 0.0) -> Sequence:
    return Sequence(name, count_prompt_tokens(prompt), max_tokens, at, blocks=block_hashes(prompt))


def test_blocks_are_full_sixteen_token_blocks_whose_hashes_chain():
    text = "a" * BLOCK_CHARS * 3 + "tail"
    blocks = block_hashes(text)
    assert len(blocks) == 3  # the partial tail block is not cached
    # The same block after a different prefix is a different block.
    assert block_hashes("b" * BLOCK_CHARS + "a" * BLOCK_CHARS)[1] != blocks[1]
    assert block_hashes(text[: BLOCK_CHARS * 2]) == blocks[:2]


def test_a_second_turn_reuses_the_first_turns_blocks_and_pays_prefill_only_for_the_rest():
    cfg = EngineConfig(max_num_seqs=4, ttft_ms=0, ms_per_token=1, batch_slowdown=0, prefill_ms_per_token=1)
    engine = Engine(cfg)
    first = "system: be brief\n" + "user: " + "x" * 1000 + "\n"
    engine.submit(one := _seq("t1", first))
    step = engine.step(0.0)
    assert one.cached_tokens == 0 and step.duration_s == pytest.approx((1 + one.prompt_tokens) / 1000)
    engine.run_until_idle(engine.finish_step(step).ends_at)
    second = first + "assistant: ok\nuser: more\n"
    engine.submit(two := _seq("t2", second))
    step = engine.step(10.0)
    expect_cached = (count_prompt_tokens(first) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert two.cached_tokens == expect_cached
    assert step.duration_s == pytest.approx((1 + two.prompt_tokens - expect_cached) / 1000)


def test_a_prompt_wholly_cached_still_computes_its_last_block():
    engine = Engine(EngineConfig(ttft_ms=0))
    text = "z" * BLOCK_CHARS * 2
    engine.submit(_seq("a", text))
    engine.run_until_idle()
    engine.submit(again := _seq("b", text))
    engine.run_until_idle(1.0)
    assert again.cached_tokens == BLOCK_TOKENS


def test_free_blocks_are_evicted_least_recently_used_first_and_held_ones_never():
    cache = PrefixCache(capacity_blocks=4)
    a, b = (1, 2), (3, 4)
    cache.acquire(a, 40)
    cache.release(a)
    cache.acquire(b, 40)  # b is held by a running request
    cache.trim(room_blocks=1)
    assert 2 in cache and 1 not in cache  # 1 and 2 were freed together, 1 first in line
    assert 3 in cache and 4 in cache  # held: kept whatever the room
    cache.release(b)
    cache.trim(room_blocks=2)
    assert cache.match(b) == 2 and cache.match(a) == 0


def test_the_kv_reading_counts_only_running_requests_unless_asked_to_count_cached_blocks():
    text = "q" * BLOCK_CHARS * 8
    for counts_cached, idle_reading in ((False, 0.0), (True, 8 * BLOCK_TOKENS / 256)):
        engine = Engine(EngineConfig(kv_cache_tokens=256, max_model_len=256, kv_usage_counts_cached=counts_cached))
        engine.submit(_seq("r", text))
        engine.run_until_idle()
        assert engine.idle and engine.kv_cache_usage == pytest.approx(idle_reading)


def test_the_metrics_count_queried_and_hit_tokens_under_vllms_names():
    engine = Engine(EngineConfig(ttft_ms=0))
    metrics = EngineMetrics(engine, "sim-small")
    text = "w" * BLOCK_CHARS * 4 + "end"
    for name in ("a", "b"):
        engine.submit(_seq(name, text))
        engine.run_until_idle()
    body = metrics.render().decode()
    queries = 2 * count_prompt_tokens(text)
    assert f'vllm:prefix_cache_queries_total{{model_name="sim-small"}} {float(queries)}' in body
    assert f'vllm:prefix_cache_hits_total{{model_name="sim-small"}} {float(4 * BLOCK_TOKENS)}' in body


def test_prefix_caching_off_prefills_everything():
    engine = Engine(EngineConfig(prefix_caching=False))
    text = "p" * BLOCK_CHARS * 4
    for name in ("a", "b"):
        engine.submit(seq := _seq(name, text))
        engine.run_until_idle()
        assert seq.cached_tokens == 0
