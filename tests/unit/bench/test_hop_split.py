"""end_to_end_latency's split of each request's way into hops (no broker)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace


def _response(rid: str, created: int, admitted: int, started: int) -> SimpleNamespace:
    # what hop_split reads of a pipeline.models.Response
    return SimpleNamespace(request_id=rid, created_at=created, admitted_at=admitted, started_at=started)


def test_each_hop_runs_between_two_moments_the_scenario_sees(bench_run):
    gateway_bench = importlib.import_module("gateway_bench")
    got = [(1040, _response("a", 1000, 1012, 1020), 1030),   # arrival, response, its append
           (2050, _response("b", 2000, 2010, 2025), 2040)]
    appended = {"request": {"a": 1002, "b": 2003}, "dispatch": {"a": 1015, "b": 2014}}
    hops = gateway_bench.hop_split(got, appended)
    assert list(hops) == ["client_produce", "gateway_fetch", "gateway_produce", "worker_fetch", "worker_answer",
                          "reader_fetch"]
    assert hops["client_produce"] == {"p50": 3, "p99": 3}
    assert hops["gateway_fetch"] == {"p50": 10, "p99": 10}
    assert hops["gateway_produce"] == {"p50": 4, "p99": 4}
    assert hops["worker_fetch"] == {"p50": 11, "p99": 11}
    assert hops["worker_answer"] == {"p50": 15, "p99": 15}
    assert hops["reader_fetch"] == {"p50": 10, "p99": 10}


def test_a_request_the_split_cannot_place_is_left_out_of_it(bench_run):
    gateway_bench = importlib.import_module("gateway_bench")
    got = [(1040, _response("a", 1000, 1012, 1020), 1030), (1040, _response("never-dispatched", 1000, 0, 0), 1030)]
    hops = gateway_bench.hop_split(got, {"request": {"a": 1002}, "dispatch": {"a": 1015}})
    assert hops["client_produce"] == {"p50": 2, "p99": 2}
    assert gateway_bench.hop_split([], {}) == {}
