"""The fault harness's soak (``bench/chaos.py --soak MINUTES``): its schedule, its bounds and the
logs it keeps of a failing mode (no cluster)."""

from __future__ import annotations

import argparse
import collections
import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

from chaos_faults import CLUSTER_FAULTS, MAX_SOAK_MINUTES, SOAK_START_S, WORKER_FAULTS, soak_plan  # noqa: E402

KINDS = CLUSTER_FAULTS + WORKER_FAULTS


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("bench_chaos_under_test", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_soak_has_one_fault_a_minute_inside_its_minute_in_order():
    minutes = 30
    plan = soak_plan(random.Random(8), minutes, KINDS)
    assert len(plan) == minutes
    at_s = [fraction * minutes * 60 for fraction, _ in plan]
    for minute, t in enumerate(at_s):
        assert minute * 60 + SOAK_START_S[0] <= t <= minute * 60 + SOAK_START_S[1]
    assert at_s == sorted(at_s) and 0 < plan[0][0] and plan[-1][0] < 1


def test_every_kind_comes_once_in_each_round_of_the_soak():
    plan = soak_plan(random.Random(1008510256), 3 * len(KINDS) + 2, KINDS)
    kinds = [kind for _, kind in plan]
    for start in range(0, 3 * len(KINDS), len(KINDS)):
        assert sorted(kinds[start:start + len(KINDS)]) == sorted(KINDS)
    assert set(kinds[3 * len(KINDS):]) <= set(KINDS)
    counts = collections.Counter(kinds)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_the_same_seed_gives_the_same_soak_and_another_seed_another():
    assert soak_plan(random.Random(8), 20, KINDS) == soak_plan(random.Random(8), 20, KINDS)
    assert soak_plan(random.Random(8), 20, KINDS) != soak_plan(random.Random(9), 20, KINDS)


def test_a_soak_is_bounded(chaos):
    for minutes in (0, -1, MAX_SOAK_MINUTES + 1):
        with pytest.raises(ValueError):
            soak_plan(random.Random(0), minutes, KINDS)
        with pytest.raises(argparse.ArgumentTypeError):
            chaos.soak_minutes(str(minutes))
    assert chaos.soak_minutes("2") == 2 and len(soak_plan(random.Random(0), MAX_SOAK_MINUTES, KINDS)) == MAX_SOAK_MINUTES


def test_the_logs_of_a_failing_mode_are_kept_and_only_that_modes(chaos, tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    for name in ("at-least-once-gateway-0", "at-least-once-w0", "exactly-once-w0"):
        (logs / name).mkdir(parents=True)
        (logs / name / "process.log").write_text(f"{name} said something\n")
    (logs / "at-least-once-tenants.toml").write_text("[t]\n")
    monkeypatch.setenv("LLMQ_CHAOS_KEEP_LOGS", str(tmp_path / "kept"))
    dest = chaos.keep_logs(logs, "at-least-once", seed=8)
    assert dest == tmp_path / "kept"
    assert sorted(p.name for p in dest.iterdir()) == ["at-least-once-gateway-0", "at-least-once-tenants.toml",
                                                      "at-least-once-w0"]
    assert (dest / "at-least-once-w0" / "process.log").read_text() == "at-least-once-w0 said something\n"
    monkeypatch.delenv("LLMQ_CHAOS_KEEP_LOGS")
    monkeypatch.setattr(chaos.tempfile, "gettempdir", lambda: str(tmp_path))
    assert chaos.keep_logs(logs, "exactly-once", seed=8) == tmp_path / "llmq-chaos-failed-8"
