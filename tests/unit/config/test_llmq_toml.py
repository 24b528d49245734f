"""deploy/llmq.toml is the complete annotated example: every settings field of every section, each
with its default, and nothing that is not a setting.

The check walks the dataclasses behind ``Settings`` (pipeline/config/), so a field added to any
section, or to a new section, fails here until the example file lists it. Secrets (string fields
with ``repr=False``) are the exception: they never sit in a settings file, so the example must name
them only through their environment variable, in a comment.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pipeline.config import Settings

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "llmq.toml"


def _sections(settings_type: type) -> dict[str, type]:
    hints = typing.get_type_hints(settings_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(settings_type)}


def undocumented(settings_type: type, data: Mapping[str, Any], text: str) -> list[str]:
    """What the example file ``data`` (its ``text`` for the comments) gets wrong about ``settings_type``:
    a section or field missing, one that is no setting, a secret written into the file or never named."""
    problems = []
    sections = _sections(settings_type)
    for name in sorted(set(data) - set(sections)):
        problems.append(f"[{name}] is no settings section")
    for name, section in sections.items():
        if name not in data:
            problems.append(f"[{name}] is missing")
            continue
        table = data[name]
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            # A password or an API key; [kafka.properties] is hidden from repr too, but is a table
            # of the file (it may carry secrets, not only be one).
            secret = not f.repr and hints[f.name] is str
            if secret:
                variable = f"LLMQ_{name.upper()}__{f.name.upper()}"
                if f.name in table:
                    problems.append(f"{name}.{f.name} is a secret: name {variable} in a comment instead")
                elif variable not in text:
                    problems.append(f"{name}.{f.name} (a secret) is not named: mention {variable}")
            elif f.name not in table:
                problems.append(f"{name}.{f.name} is missing")
        known = {f.name for f in dataclasses.fields(section)}
        for key in sorted(set(table) - known):
            problems.append(f"{name}.{key} is no setting of [{name}]")
    return problems


def _example() -> tuple[dict[str, Any], str]:
    text = EXAMPLE.read_text()
    return tomllib.loads(text), text


def test_the_example_lists_every_setting_of_every_section_and_nothing_else():
    data, text = _example()
    assert undocumented(Settings, data, text) == []


def test_the_example_holds_the_defaults_and_loads():
    # "every key with its default" (its first line): loading it changes nothing.
    assert Settings.load(EXAMPLE, env={}) == Settings.load(env={})


# -- the check bites -------------------------------------------------------------------------------


@dataclass
class _Widget:
    size: int = 1
    colour: str = "red"
    token: str = field(default="", repr=False)


@dataclass
class _Synthetic:
    widget: _Widget = field(default_factory=_Widget)


def test_a_field_added_without_its_line_is_found():
    text = "# token: LLMQ_WIDGET__TOKEN\n[widget]\nsize = 1\n"
    assert undocumented(_Synthetic, tomllib.loads(text), text) == ["widget.colour is missing"]


def test_a_line_that_is_no_setting_and_a_missing_section_are_found():
    text = "[widget]\nsize = 1\ncolour = 'red'\nshade = 2\ntoken = 'x'\n[gadget]\n"
    assert undocumented(_Synthetic, tomllib.loads(text), text) == [
        "[gadget] is no settings section",
        "widget.token is a secret: name LLMQ_WIDGET__TOKEN in a comment instead",
        "widget.shade is no setting of [widget]"]
    assert undocumented(_Synthetic, {}, "") == ["[widget] is missing"]


def test_the_real_example_trimmed_of_a_line_fails():
    data, text = _example()
    before = set(undocumented(Settings, data, text))
    data["worker"].pop("coordinator_stall_ms")
    del data["batch"]
    assert set(undocumented(Settings, data, text)) - before == {"worker.coordinator_stall_ms is missing",
                                                                 "[batch] is missing"}
