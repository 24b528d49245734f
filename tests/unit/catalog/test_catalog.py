"""The model catalog's questions: what is listed, what runs when none is named, what is refused."""

from __future__ import annotations

import pytest

from pipeline.catalog.catalog import ModelCatalog, PoolModels
from pipeline.config import ModelSettings
from pipeline.errors import ConfigError

NOW = 1_000_000_000


def _catalog(*pools: PoolModels, **settings) -> ModelCatalog:
    return ModelCatalog(ModelSettings(**settings), {p.pool: p for p in pools})


def _pool(name="p", models=("qwen",), default="qwen", any_model=False, aliases=None, at=NOW) -> PoolModels:
    return PoolModels(name, tuple(models), default, any_model, aliases or {}, at)


def test_a_record_round_trips_and_a_broken_one_is_a_config_error():
    pool = _pool(aliases={"gpt": "qwen"})
    assert PoolModels.from_json(pool.to_json()) == pool
    with pytest.raises(ConfigError):
        PoolModels.from_json(b"{not json")
    with pytest.raises(ConfigError):
        PoolModels.from_json(b'{"models": []}')  # no pool


def test_served_names_and_aliases_of_served_names_are_listed_once_in_order():
    c = _catalog(_pool("a", ("qwen", "llama")), _pool("b", ("llama", "phi")),
                 aliases={"gpt-4o-mini": "qwen", "nobody": "gone"})
    assert c.names(NOW) == ["qwen", "llama", "phi", "gpt-4o-mini"]


def test_a_model_nobody_serves_is_refused_with_the_served_names():
    c = _catalog(_pool(models=("qwen",)))
    assert c.refusal("qwen", NOW) is None
    reason = c.refusal("gpt-4o", NOW)
    assert reason.startswith("model_not_found: ") and "'gpt-4o'" in reason and "qwen" in reason


def test_an_alias_is_served_by_its_target():
    c = _catalog(_pool(models=("qwen",)), aliases={"gpt-4o-mini": "qwen"})
    assert c.resolve("gpt-4o-mini", NOW) == "qwen" and c.refusal("gpt-4o-mini", NOW) is None
    # a pool's own aliases count too; this process's configuration wins over them
    d = _catalog(_pool(models=("qwen", "llama"), aliases={"chat": "qwen"}), aliases={"chat": "llama"})
    assert d.resolve("chat", NOW) == "llama"


def test_nothing_is_refused_while_the_catalog_cannot_tell():
    assert _catalog().refusal("anything", NOW) is None  # no pool has published
    assert _catalog(_pool(models=("sim-small",), any_model=True)).refusal("anything", NOW) is None
    assert _catalog(_pool(), refuse_unknown=False).refusal("anything", NOW) is None
    stale = _pool(at=NOW - 301_000)  # past models.ttl_s (300 s): its workers are gone
    assert _catalog(stale).refusal("anything", NOW) is None and not _catalog(stale).known(NOW)


def test_the_default_is_the_configured_one_else_a_pools_own():
    assert _catalog(_pool(default="qwen")).default(NOW) == "qwen"
    assert _catalog(_pool(default="qwen"), default="llama").default(NOW) == "llama"
    assert _catalog().default(NOW) == ""
    # pools in name order: every process picks the same default
    assert _catalog(_pool("b", default="phi"), _pool("a", default="qwen")).default(NOW) == "qwen"


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="ttl_s"):
        ModelSettings(refresh_s=60, ttl_s=30).validate()
    with pytest.raises(ConfigError, match="aliases"):
        ModelSettings(aliases={"x": ""}).validate()
