"""How a setting's raw value (TOML or an environment variable) becomes its typed value."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Mapping

from pipeline.errors import ConfigError
from pipeline.models import Priority

BAND_NAMES = ", ".join(Priority.__members__)


def read_secret_file(key: str, path: str) -> str:
    """The secret in the file setting ``key`` names, stripped; a ConfigError naming the setting
    (not the path, which may be a mounted secret's) when it cannot be read."""
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError(key, f"cannot read it: {exc.strerror}") from None


def positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be > 0, got {value!r}")


def non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(key, f"must be >= 0, got {value!r}")


def is_http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def parse_routes(spec: str) -> dict[str, list[str]]:
    """``"big=http://a:8000/v1,http://b:8000/v1; small=http://c:8000/v1; *=http://d/v1"``: each
    model (``*``: any other) and its servers' base URLs; ValueError says what is wrong."""
    routes: dict[str, list[str]] = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        model, sep, urls = part.partition("=")
        if not sep or not model.strip():
            raise ValueError(f"route {part.strip()!r} is not MODEL=URL[,URL...]")
        routes.setdefault(model.strip(), []).extend(u.strip() for u in urls.split(",") if u.strip())
    if not routes:
        raise ValueError("a routing table needs at least one route")
    for model, urls in routes.items():
        if not urls:
            raise ValueError(f"route {model!r} has no server")
        for url in urls:
            if not is_http_url(url):
                raise ValueError(f"route {model!r}: {url!r} is not an http:// or https:// URL")
    return routes


def check_band(key: str, band: str) -> None:
    if band not in Priority.__members__:
        raise ConfigError(key, f"unknown band {band!r} (known: {BAND_NAMES})")


def set_field(target: Any, key_path: str, key: str, value: Any, *, from_env: bool) -> None:
    fields = {f.name: f for f in dataclasses.fields(target)}
    if key not in fields:
        raise ConfigError(key_path, f"unknown setting (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(type(target))
    setattr(target, key, coerce(key_path, hints[key], value, from_env))


def coerce(key_path: str, hint: Any, value: Any, from_env: bool) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
        if origin is list:
            if from_env:
                return [item.strip() for item in str(value).split(",") if item.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError("expected a list of strings")
            return list(value)
        if origin is dict:
            if from_env:
                # "k=v,k2=v2" in the environment
                pairs = [item.split("=", 1) for item in str(value).split(",") if item.strip()]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError("expected k=v,k2=v2")
                return {k.strip(): v.strip() for k, v in pairs}
            if not isinstance(value, Mapping):
                raise ValueError("expected a table")
            return dict(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(key_path, f"{exc} (got {value!r})") from None
    raise ConfigError(key_path, f"unsupported setting type {hint!r}")
