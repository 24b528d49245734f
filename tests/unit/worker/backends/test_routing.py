"""The routing table: which server a model's next call goes to."""

from __future__ import annotations

import pytest

from pipeline.errors import BackendError
from pipeline.worker.backends.routing import RoutingTable, UnknownModelError


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_one_base_url_serves_every_model():
    table = RoutingTable.single("http://127.0.0.1:8000/v1/")
    assert table.pick("anything").base_url == "http://127.0.0.1:8000/v1"
    assert table.pick("else") is table.servers[0]


def test_an_unknown_model_is_a_non_retriable_error_naming_the_configured_ones():
    table = RoutingTable({"big": ["http://a/v1"], "small": "http://b/v1"})
    with pytest.raises(UnknownModelError, match="unknown model 'huge'.*big, small") as info:
        table.servers_for("huge")
    assert isinstance(info.value, BackendError) and not info.value.retriable


def test_the_degraded_model_goes_to_its_own_servers():
    table = RoutingTable.parse("big=http://a/v1,http://b/v1; small=http://c/v1")
    assert {table.pick("big").base_url for _ in range(4)} == {"http://a/v1", "http://b/v1"}
    assert {table.pick("small").base_url for _ in range(4)} == {"http://c/v1"}


def test_calls_spread_to_the_least_loaded_server_ties_taking_turns():
    table = RoutingTable({"m": ["http://a/v1", "http://b/v1", "http://c/v1"]})
    a, b, c = table.servers
    load = {a: 3, b: 1, c: 1}
    picks = [table.pick("m", key=lambda s: load[s]) for _ in range(4)]
    assert a not in picks and {b, c} == set(picks)


def test_a_call_fails_over_to_a_server_it_has_not_tried():
    table = RoutingTable({"m": ["http://a/v1", "http://b/v1"]})
    a, b = table.servers
    assert table.pick("m", exclude={a}) is b
    assert table.pick("m", exclude={a, b}) is None


def test_an_unreachable_server_is_avoided_for_a_cooldown_that_grows_while_it_keeps_failing():
    clock = Clock()
    table = RoutingTable({"m": ["http://a/v1", "http://b/v1"]}, cooldown_s=1.0, clock=clock)
    a, b = table.servers
    table.mark_failed(a)
    assert all(table.pick("m") is b for _ in range(4))
    clock.now += 1.1
    assert a in {table.pick("m") for _ in range(4)}
    table.mark_failed(a)
    table.mark_failed(a)
    assert a.down_until == pytest.approx(clock.now + 4.0)
    table.mark_ok(a)
    assert table.is_up(a)


def test_when_every_server_is_down_the_first_back_is_still_tried():
    clock = Clock()
    table = RoutingTable({"m": ["http://a/v1", "http://b/v1"]}, cooldown_s=1.0, clock=clock)
    a, b = table.servers
    table.mark_failed(a)
    clock.now += 0.5
    table.mark_failed(b)
    assert table.pick("m") is a


def test_retry_after_holds_a_server_without_counting_a_failure():
    clock = Clock()
    table = RoutingTable({"m": ["http://a/v1", "http://b/v1"]}, clock=clock)
    a, b = table.servers
    table.hold(a, 2.0)
    assert table.pick("m") is b and a.consecutive_failures == 0


def test_a_server_shared_by_two_models_is_one_server():
    table = RoutingTable({"big": ["http://a/v1"], "alias": ["http://a/v1/"]})
    assert len(table.servers) == 1 and table.servers[0].models == ["big", "alias"]
    assert table.servers[0].root_url == "http://a"


@pytest.mark.parametrize("spec", ["", "big", "=http://a/v1", "big=ftp://a"])
def test_malformed_tables_are_refused(spec):
    with pytest.raises(ValueError):
        RoutingTable.parse(spec)


def test_aliases_route_to_the_name_the_servers_know():
    table = RoutingTable({"qwen": ["http://a/v1"], "*": ["http://b/v1"]}, aliases={"gpt-4o-mini": "qwen"})
    assert table.served_name("gpt-4o-mini") == "qwen" and table.served_name("other") == "other"
    assert [s.base_url for s in table.servers_for("gpt-4o-mini")] == ["http://a/v1"]


def test_the_servers_lists_narrow_the_catch_all_route():
    table = RoutingTable.single("http://a/v1")
    assert table.servers_for("anything") and table.open_ended  # not read yet: any name may go
    table.servers[0].served = ("qwen",)
    assert table.servers_for("qwen") and not table.open_ended
    with pytest.raises(UnknownModelError):
        table.servers_for("gpt-4o")
    assert table.listed() == ["qwen"]


def test_of_two_catch_all_servers_only_those_that_list_the_model_or_have_not_said_serve_it():
    table = RoutingTable({"*": ["http://a/v1", "http://b/v1", "http://c/v1"]})
    a, b, c = table.servers
    a.served, b.served = ("qwen",), ("llama",)
    assert table.servers_for("llama") == [b, c]


def test_the_default_model_is_the_configured_one_else_the_first_listed_else_the_first_route():
    assert RoutingTable.single("http://a/v1", default="phi").default_model() == "phi"
    table = RoutingTable({"big": ["http://a/v1"], "*": ["http://b/v1"]})
    assert table.default_model() == "big"
    big, catch_all = table.servers
    big.served, catch_all.served = ("big",), ("qwen", "llama")
    assert table.default_model() == "qwen"
