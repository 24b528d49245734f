"""Prefix affinity (pure): the placement every worker computes alike, the index of what each server
was sent, the load bound, waiting for a busy server that holds the prefix, and corrections."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest

from pipeline.worker.backends.affinity import CACHE_KEY, AffinityConfig, PrefixAffinity, prompt_key

SERVERS = ["http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1", "http://d:8000/v1"]
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}


def _chat(conversation: int, turns: int, model: str = "m", request_id: str = "", **extra):
    messages = [SYSTEM, {"role": "user", "content": f"conversation {conversation}: " + "tell me more " * 30}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t} " * 40}, {"role": "user", "content": f"next {t}"}]
    return SimpleNamespace(model=model, messages=messages, prompt=None, request_id=request_id, **extra)


def _loads(values=None):
    values = values or {}
    return (lambda s: values.get(s, 0.0))


def _free(values=None):
    values = values or {}
    return (lambda s: values.get(s, 4))


def test_every_turn_of_a_conversation_has_the_same_anchor_and_a_growing_shared_prefix():
    cfg = AffinityConfig()
    keys = [prompt_key(_chat(7, t), cfg) for t in (1, 2, 3)]
    assert len({k.anchor for k in keys}) == 1
    assert keys[1].blocks[: len(keys[0].blocks)] == keys[0].blocks
    assert keys[2].blocks[: len(keys[1].blocks)] == keys[1].blocks
    assert not keys[0].continued and keys[1].continued
    assert prompt_key(_chat(8, 1), cfg).anchor != keys[0].anchor
    # A server's cache is per model: the same prompt under another model shares nothing.
    assert prompt_key(_chat(7, 1, model="other"), cfg).blocks[0] != keys[0].blocks[0]


def test_two_workers_place_every_conversation_alike_with_nothing_shared():
    one, two = PrefixAffinity(), PrefixAffinity()
    cfg = one.config
    for c in range(50):
        key = prompt_key(_chat(c, 1), cfg)
        a = one.choose(key, SERVERS, _loads(), _free(), 0.0)
        b = two.choose(key, list(reversed(SERVERS)), _loads(), _free(), 0.0)
        assert a.server == b.server and a.reason == "home"


def test_one_off_prompts_spread_evenly():
    aff = PrefixAffinity()
    counts = Counter(aff.choose(prompt_key(SimpleNamespace(model="m", prompt=f"one-off {i} " * 20, messages=None),
                                           aff.config), SERVERS, _loads(), _free(), 0.0).server
                     for i in range(4000))
    assert max(counts.values()) / (4000 / 4) < 1.1


def test_a_later_turn_follows_its_prefix_to_where_it_spilled():
    aff = PrefixAffinity()
    first = prompt_key(_chat(3, 1), aff.config)
    home = aff.choose(first, SERVERS, _loads(), _free(), 0.0).server
    # Home has no free slot: the first turn spills, and the index remembers where it went.
    spilled = aff.choose(first, SERVERS, _loads(), _free({home: 0}), 0.0)
    assert spilled.server != home and spilled.reason == "spill"
    aff.record(spilled.server, first, 0.0)
    second = aff.choose(prompt_key(_chat(3, 2), aff.config), SERVERS, _loads(), _free(), 1.0)
    assert second.server == spilled.server and second.reason == "prefix"
    assert second.matched == len(first.blocks)


def test_no_server_goes_over_its_bounded_share_even_for_one_hot_prefix():
    aff = PrefixAffinity(AffinityConfig(epsilon=0.25, bound_floor=1))
    load = dict.fromkeys(SERVERS, 0.0)
    key = prompt_key(_chat(1, 3), aff.config)
    for i in range(200):
        choice = aff.choose(key, SERVERS, load.__getitem__, _free(), float(i), request_id="")
        load[choice.server] += 1
        aff.record(choice.server, key, float(i))
        total = sum(load.values())
        assert max(load.values()) <= math.ceil(1.25 * total / 4)


def test_a_conversation_waits_a_little_for_the_busy_server_holding_it_then_goes_elsewhere():
    aff = PrefixAffinity(AffinityConfig(wait_s=0.25))
    first = prompt_key(_chat(5, 1), aff.config)
    home = aff.choose(first, SERVERS, _loads(), _free(), 0.0).server
    aff.record(home, first, 0.0)
    later = prompt_key(_chat(5, 2), aff.config)
    busy, loads = _free({home: 0}), _loads(dict.fromkeys(SERVERS, 8.0))
    waiting = aff.choose(later, SERVERS, loads, busy, 1.0, request_id="r1")
    assert waiting.server is None and waiting.reason == "deferred"
    assert aff.choose(later, SERVERS, loads, busy, 1.1, request_id="r1").server is None
    moved = aff.choose(later, SERVERS, loads, busy, 1.3, request_id="r1")
    assert moved.server not in (None, home)
    # A one-off prompt never waits.
    one_off = prompt_key(SimpleNamespace(model="m", prompt="hello " * 100, messages=None), aff.config)
    top = aff.choose(one_off, SERVERS, _loads(), _free(), 2.0).server
    assert aff.choose(one_off, SERVERS, _loads(), _free({top: 0}), 2.0, request_id="r2").server not in (None, top)


def test_a_prompt_cache_key_places_prompts_that_share_no_text_together():
    aff = PrefixAffinity()
    picks = {aff.choose(prompt_key(SimpleNamespace(model="m", prompt=f"different {i}", messages=None,
                                                   metadata={CACHE_KEY: "user-42"}), aff.config),
                        SERVERS, _loads(), _free(), 0.0).server for i in range(20)}
    assert len(picks) == 1


def test_the_index_is_bounded_and_ages_out():
    aff = PrefixAffinity(AffinityConfig(index_blocks=50, ttl_s=10.0))
    for c in range(20):
        aff.record(SERVERS[0], prompt_key(_chat(c, 3), aff.config), float(c))
    assert aff.indexed(SERVERS[0]) <= 50
    key = prompt_key(_chat(19, 3), aff.config)
    assert aff.match(SERVERS[0], key.blocks, 19.0)[0] > 0
    assert aff.match(SERVERS[0], key.blocks, 40.0)[0] == 0  # older than ttl_s


def test_a_server_reporting_less_cached_than_expected_corrects_the_index():
    aff = PrefixAffinity()
    old = prompt_key(_chat(1, 2), aff.config)
    aff.record(SERVERS[0], old, 0.0)
    aff.record(SERVERS[0], prompt_key(_chat(2, 2), aff.config), 5.0)
    later = prompt_key(_chat(1, 3), aff.config)
    choice = aff.choose(later, SERVERS, _loads(), _free(), 6.0)
    assert choice.server == SERVERS[0] and choice.matched == len(old.blocks)
    # It had evicted conversation 1: nothing cached. Entries that old go; newer ones stay.
    assert aff.correct(SERVERS[0], later, choice, cached_tokens=0, prompt_tokens=later.chars // 4)
    other = prompt_key(_chat(2, 2), aff.config).blocks
    shared = next(i for i, (x, y) in enumerate(zip(old.blocks, other)) if x != y)  # the system prompt's
    assert aff.match(SERVERS[0], old.blocks, 6.0)[0] == shared < len(old.blocks)
    assert aff.match(SERVERS[0], prompt_key(_chat(2, 2), aff.config).blocks, 6.0)[0] > 0
    # As much cached as expected: nothing to correct.
    assert not aff.correct(SERVERS[0], later, choice, cached_tokens=later.chars // 4, prompt_tokens=later.chars // 4)


def test_at_low_load_a_server_may_hold_a_few_calls_more_than_its_share():
    aff = PrefixAffinity(AffinityConfig(bound_floor=4))
    key = prompt_key(_chat(9, 2), aff.config)
    home = aff.choose(key, SERVERS, _loads(), _free(), 0.0).server
    assert aff.choose(key, SERVERS, _loads({home: 3}), _free(), 0.0).server == home
    assert aff.choose(key, SERVERS, _loads({home: 4}), _free(), 0.0).server != home


def test_a_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        AffinityConfig(epsilon=0)
    with pytest.raises(ValueError):
        AffinityConfig(block_chars=4)


def test_a_shared_system_prompt_does_not_draw_new_conversations_to_one_server():
    aff = PrefixAffinity()
    first = prompt_key(_chat(0, 1), aff.config)
    aff.record(SERVERS[0], first, 0.0)
    picks = Counter()
    for c in range(1, 400):
        key = prompt_key(_chat(c, 1), aff.config)
        assert key.shared > 0 and aff.match(SERVERS[0], key.blocks, 1.0)[0] >= key.shared
        picks[aff.choose(key, SERVERS, _loads(), _free(), 1.0).server] += 1
    assert max(picks.values()) / (399 / 4) < 1.2


def test_a_full_server_at_its_bound_is_still_waited_for_since_its_load_drops_before_it_takes_more():
    aff = PrefixAffinity(AffinityConfig(bound_floor=1, epsilon=0.25))
    first = prompt_key(_chat(11, 1), aff.config)
    home = aff.choose(first, SERVERS, _loads(), _free(), 0.0).server
    aff.record(home, first, 0.0)
    # Home full (4 of 4 slots) with 10 calls in all: one more would be over ceil(1.25 * 11 / 4) = 4.
    loads = {s: 2.0 for s in SERVERS}
    loads[home] = 4.0
    waiting = aff.choose(prompt_key(_chat(11, 2), aff.config), SERVERS, loads.__getitem__, _free({home: 0}), 1.0,
                         request_id="r")
    assert waiting.server is None and waiting.reason == "deferred"
    # Over the bound even once a call ends: it does not wait.
    loads[home] = 6.0
    moved = aff.choose(prompt_key(_chat(11, 2), aff.config), SERVERS, loads.__getitem__, _free({home: 0}), 1.0,
                       request_id="r2")
    assert moved.server not in (None, home)
