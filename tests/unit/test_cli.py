"""`llmq`'s option parsing, --version, --json output and the Maven fetch's progress (no broker)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline import cli
from pipeline.broker import MavenProgress


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_version_prints_the_package_version():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"llmq {cli.version()}"
    assert out.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize("argv", [
    ["worker", "--config", "x.toml", "--bootstrap", "b:1", "--log-level", "debug"],
    ["--config", "x.toml", "--bootstrap", "b:1", "--log-level", "DEBUG", "worker"],
    ["--config", "x.toml", "worker", "--bootstrap", "b:1", "--log-level", "debug"],
])
def test_global_options_are_read_before_or_after_the_command(argv):
    args = parse(*argv)
    assert (args.config, args.bootstrap, args.log_level) == ("x.toml", "b:1", "DEBUG")
    assert args.func is cli.cmd_worker


def test_global_options_after_a_nested_command_and_their_defaults():
    args = parse("dlq", "replay", "--dry-run", "--config", "y.toml")
    assert args.config == "y.toml" and args.bootstrap is None and args.log_level == "INFO"
    assert args.action == "replay" and args.dry_run
    # given twice, the one nearer the command's own options wins
    assert parse("--config", "a.toml", "topics", "create", "--config", "b.toml").config == "b.toml"


def test_a_bad_log_level_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        parse("worker", "--log-level", "loud")
    assert info.value.code == 2
    assert "DEBUG, INFO, WARNING, ERROR" in capsys.readouterr().err


def test_dlq_filters_parse_times_and_reasons():
    args = parse("dlq", "list", "--reason", "malformed,truncated", "--reason", "bad_magic",
                 "--since", "2026-01-31T14:00", "--until", "1800000000000")
    flt = cli.dlq_filter(args)
    assert flt.reasons == {"malformed", "truncated", "bad_magic"}
    assert flt.since_ms == 1769868000000 and flt.until_ms == 1800000000000


def test_a_time_that_is_not_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        parse("dlq", "replay", "--since", "yesterday")
    assert info.value.code == 2
    assert "is not a time" in capsys.readouterr().err


def test_every_command_explains_itself_in_its_help(capsys):
    for command in ("broker", "topics", "worker", "gateway", "submit", "acls", "lag", "lag-exporter", "dlq",
                    "cancel", "demo"):
        with pytest.raises(SystemExit):
            parse(command, "--help")
        text = capsys.readouterr().out
        assert "global options (before or after the command)" in text, command
        description = text.split("\n\n")[1]
        assert len(description) > 40, (command, description)


def test_topics_create_json_is_one_document_with_the_report(monkeypatch, capsys):
    from pipeline import topics

    def fake_create(settings, strict=True):
        return topics.TopicReport(created=["llm.dlq"], existing=["llm.responses"],
                                  mismatched=[("llm.requests.low", 6, 3)])

    monkeypatch.setattr(topics, "create_pipeline_topics", fake_create)
    code = cli.main(["topics", "create", "--json"])
    captured = capsys.readouterr()
    assert code == 2
    doc = json.loads(captured.out)
    assert doc == {"ok": False, "created": ["llm.dlq"], "existing": ["llm.responses"],
                   "mismatched": [{"topic": "llm.requests.low", "configured_partitions": 6,
                                   "broker_partitions": 3}]}
    assert "MISMATCH" in captured.err


def test_broker_status_json_of_a_broker_that_is_not_running(tmp_path, capsys):
    code = cli.main(["broker", "status", "--json", "--port", "1", "--data-dir", str(tmp_path / "none")])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert doc["state"] == "not running" and doc["answering"] is False and doc["pid"] is None
    assert doc["bootstrap"] == "127.0.0.1:1"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_maven_progress_counts_downloads_and_copied_jars_a_line_every_few_seconds():
    said, clock = [], Clock()
    counter = MavenProgress(said.append, every_s=5.0, clock=clock)
    counter.line("[INFO] Scanning for projects...\n")
    for i in range(30):
        clock.now += 0.5
        counter.line(f"[INFO] Downloading from central: https://repo/x/a{i}/1/a{i}-1.pom\n")
        counter.line(f"[INFO] Downloaded from central: https://repo/x/a{i}/1/a{i}-1.pom (2 kB at 9 kB/s)\n")
        counter.line(f"[INFO] Downloaded from central: https://repo/x/a{i}/1/a{i}-1.jar (20 kB at 9 kB/s)\n")
    for i in range(45):
        counter.line(f"[INFO] Copying a{i}-1.jar to /somewhere/a{i}-1.jar\n")
    counter.done()
    assert 2 <= len(said) <= 4  # 15 s of output: every 5 s, then the total
    assert said[0].startswith("  Maven: ") and "files downloaded" in said[0]
    assert said[-1] == "  Maven: 45 jars copied, 60 files downloaded"
    assert counter.downloaded_jars == 30
    assert len(counter.tail) == 20 and counter.tail[-1].endswith("a44-1.jar")


def test_maven_progress_of_a_fetch_from_its_cache():
    said = []
    counter = MavenProgress(said.append)
    counter.line("[INFO] Copying kafka_2.13-4.4.0.jar to /x/kafka_2.13-4.4.0.jar")
    counter.done()
    assert said == ["  Maven: 1 jar copied (all from Maven's cache)"]


def test_topics_help_names_every_kind_of_topic_it_creates(capsys):
    from pipeline.config import Settings
    from pipeline.topics import pipeline_topics

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["topics", "--help"])
    # argparse wraps at hyphens too: "dead-" and "letter" may land on two lines
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    roles = {s.role for s in pipeline_topics(Settings())}
    words = {"requests": "request", "admitted": "dispatch", "responses": "response", "dead letters": "dead-letter",
             "cancellations": "cancellation", "streamed chunks": "streamed-chunk",
             "completion receipts": "completion-receipt", "batch files": "batch-file", "batches": "batch",
             "model catalog": "model-catalog", "stored responses": "stored-response"}
    assert roles <= set(words), f"a kind of topic the help does not know: {roles - set(words)}"
    for role in roles:
        assert words[role] in text, f"`llmq topics --help` does not name the {role} topics"
