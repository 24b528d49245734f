"""``llmq batch`` against a small imitation of serve's Files and Batches endpoints (no broker)."""

from __future__ import annotations

import asyncio
import contextlib
import email.parser
import email.policy
import itertools
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from pipeline import cli
from pipeline.batch import cli as batch_cli

KEY = "acme-batch-key-0123456789"


class FakeServe:
    """Just enough of serve: each look at a batch answers ``step`` more lines (those whose
    custom_id holds "bad" fail) until it ends ``outcome``; a cancel ends it at the next look.
    Its error file holds only the answered lines that failed."""

    def __init__(self, outcome: str = "completed", step: int = 3):
        self.outcome, self.step = outcome, step
        self.files: dict[str, tuple[str, bytes]] = {}
        self.batches: dict[str, dict] = {}
        self.uploads: list[dict] = []
        self.ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches/{id}", self.get)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)
        return app

    @web.middleware
    async def auth(self, http, handler):
        given = http.headers.get("Authorization", "")
        if given != f"Bearer {KEY}":
            # as OpenAI does: the wrong key quoted back
            return _error(401, f"Incorrect API key provided: {given.removeprefix('Bearer ')}")
        return await handler(http)

    async def upload(self, http):
        reader, form = await http.multipart(), {}
        while (part := await reader.next()) is not None:
            form[part.name] = (part.filename, part.headers.get("Content-Type"), await part.read())
        self.uploads.append(form)
        file_id = f"file-in-{next(self.ids)}"
        self.files[file_id] = (form["file"][0], form["file"][2])
        return web.json_response({"id": file_id, "object": "file", "purpose": form["purpose"][2].decode()})

    async def content(self, http):
        file_id = http.match_info["id"]
        if file_id not in self.files:
            return _error(404, f"No such file: {file_id}")
        return web.Response(body=self.files[file_id][1])

    async def create(self, http):
        body = await http.json()
        data = self.files[body["input_file_id"]][1]
        lines = [json.loads(x) for x in data.splitlines() if x.strip()]
        batch = {"id": f"batch_{next(self.ids)}", "object": "batch", "endpoint": body["endpoint"],
                 "input_file_id": body["input_file_id"], "completion_window": body["completion_window"],
                 "status": "validating", "output_file_id": None, "error_file_id": None, "errors": None,
                 "created_at": 1_767_225_600, "in_progress_at": None, "expires_at": 1_767_312_000,
                 "completed_at": None, "cancelled_at": None, "metadata": body["metadata"] or None,
                 "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "_lines": lines}
        self.batches[batch["id"]] = batch
        return web.json_response(_view(batch))

    async def get(self, http):
        batch = self.batches.get(http.match_info["id"])
        if batch is None:
            return _error(404, f"No such batch: {http.match_info['id']}")
        self._advance(batch)
        return web.json_response(_view(batch))

    async def cancel(self, http):
        batch = self.batches[http.match_info["id"]]
        batch["status"] = "cancelling"
        return web.json_response(_view(batch))

    def _advance(self, batch: dict) -> None:
        counts, lines = batch["request_counts"], batch["_lines"]
        done = counts["completed"] + counts["failed"]
        if batch["status"] in ("completed", "cancelled", "expired", "failed"):
            return
        if batch["status"] == "cancelling" or (self.outcome == "cancelled" and done >= self.step):
            return self._finish(batch, "cancelled", done)
        for line in lines[done:done + self.step]:
            counts["failed" if "bad" in line["custom_id"] else "completed"] += 1
        batch["status"], batch["in_progress_at"] = "in_progress", 1_767_225_601
        if counts["completed"] + counts["failed"] == len(lines):
            self._finish(batch, self.outcome, len(lines))

    def _finish(self, batch: dict, status: str, answered: int) -> None:
        batch["status"], batch[f"{status}_at"] = status, 1_767_225_700
        rows = batch["_lines"][:answered]
        for kind, kept in (("output", [x for x in rows if "bad" not in x["custom_id"]]),
                           ("error", [x for x in rows if "bad" in x["custom_id"]])):
            if kept:
                file_id = f"file-{batch['id']}-{kind}"
                self.files[file_id] = (kind, b"".join(json.dumps({"custom_id": x["custom_id"], "kind": kind})
                                                      .encode() + b"\n" for x in kept))
                batch[f"{kind}_file_id"] = file_id


def _view(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if not k.startswith("_")}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": None}}, status=status)


@contextlib.contextmanager
def serving(fake: FakeServe):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(fake.app())

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(batch_cli, "POLL_S", 0.01)
    monkeypatch.setattr(batch_cli, "POLL_PATIENCE_S", 0.2)
    monkeypatch.delenv(batch_cli.URL_ENV, raising=False)
    monkeypatch.delenv(batch_cli.KEY_FILE_ENV, raising=False)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "acme.key"
    path.write_text(KEY + "\n")
    return path


@pytest.fixture
def input_file(tmp_path):
    path = tmp_path / "in.jsonl"
    rows = [{"custom_id": f"req-{i}" if i != 4 else "bad-4", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim-small", "messages": [{"role": "user", "content": f"q {i}"}]}} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def llmq(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["batch", *argv])
    out, err = capsys.readouterr()
    assert KEY not in out + err
    return code, out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_multipart_body_reads_back_as_the_file_and_its_purpose():
    head, tail = batch_cli.form_around_file({"purpose": "batch"}, "file", 'my "in"\r\n.jsonl', "b0undary")
    data = b'{"custom_id": "a"}\r\n{"custom_id": "b"}\n'
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: multipart/form-data; boundary=b0undary\r\n\r\n" + head + data + tail)
    parts = {p.get_param("name", header="content-disposition"): p for p in message.iter_parts()}
    assert set(parts) == {"purpose", "file"}
    assert parts["purpose"].get_content() == "batch"
    assert parts["file"].get_filename() == "my %22in%22%0D%0A.jsonl"  # the header stays one header
    assert parts["file"].get_payload(decode=True) == data
    assert head.startswith(b"--b0undary\r\n") and tail == b"\r\n--b0undary--\r\n"


def test_submit_wait_shows_progress_writes_both_files_and_exits_0(capsys, tmp_path, key_file, input_file):
    fake = FakeServe()
    out_path, err_path = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    with serving(fake) as url:
        code, out, err = llmq(capsys, "submit", str(input_file), "--via", url, "--key-file", str(key_file),
                              "--wait", "--output", str(out_path), "--errors", str(err_path),
                              "--metadata", "job=nightly", "team=ml", "--priority", "LOW")
    assert code == 0, err
    batch_id, line = out.splitlines()
    assert batch_id.startswith("batch_")
    assert line == (f"{batch_id} completed: 9 completed, 1 failed of 10; output file-{batch_id}-output, "
                    f"errors file-{batch_id}-error")
    assert "answered 10/10" in err and "wrote 9 line(s)" in err
    upload = fake.uploads[0]
    assert upload["purpose"][2] == b"batch" and upload["file"][0] == "in.jsonl"
    assert upload["file"][2] == input_file.read_bytes()
    assert fake.batches[batch_id]["metadata"] == {"job": "nightly", "team": "ml", "priority": "LOW"}
    assert fake.batches[batch_id]["endpoint"] == "/v1/chat/completions"
    written = [json.loads(x)["custom_id"] for x in out_path.read_text().splitlines()]
    assert written == [f"req-{i}" for i in range(10) if i != 4]
    assert [json.loads(x)["custom_id"] for x in err_path.read_text().splitlines()] == ["bad-4"]
    assert not list(tmp_path.glob("*.part"))


def test_a_batch_that_ends_cancelled_exits_3_and_a_missing_result_file_is_saved_empty(capsys, tmp_path, key_file,
                                                                                       input_file):
    err_path = tmp_path / "err.jsonl"
    err_path.write_text("left by an earlier run\n")
    with serving(FakeServe(outcome="cancelled", step=2)) as url:
        code, out, err = llmq(capsys, "submit", str(input_file), "--via", url, "--key-file", str(key_file),
                              "--wait", "--errors", str(err_path), "--json")
    doc = json.loads(out)  # --json: one document, the final batch
    assert code == 3 and doc["status"] == "cancelled", err
    assert doc["request_counts"]["completed"] < 10
    assert doc["error_file_id"] is None and err_path.read_text() == ""


def test_cancel_waits_for_the_end_and_exits_0_once_cancelled(capsys, key_file, input_file):
    fake = FakeServe(step=1)
    with serving(fake) as url:
        serve = ["--via", url, "--key-file", str(key_file)]
        code, out, _ = llmq(capsys, "submit", str(input_file), *serve)
        batch_id = out.strip()
        assert code == 0 and fake.batches[batch_id]["status"] == "validating"
        assert llmq(capsys, "cancel", batch_id, *serve)[:2] == (0, f"{batch_id}: cancelling\n")
        code, out, _ = llmq(capsys, "cancel", batch_id, *serve, "--wait")
    assert code == 0 and out.startswith(f"{batch_id} cancelled: 0 completed, 0 failed of 10")


def test_status_and_results_show_the_batch_and_its_output(capsys, tmp_path, key_file, input_file):
    with serving(FakeServe(step=100)) as url:
        serve = ["--via", url, "--key-file", str(key_file)]
        batch_id = llmq(capsys, "submit", str(input_file), *serve, "--metadata", "job=x")[1].strip()
        code, out, _ = llmq(capsys, "status", batch_id, *serve)
        assert code == 0
        assert out.splitlines()[0] == f"{batch_id}: completed"
        assert "10 of 10 answered: 9 completed, 1 failed" in out and f"file-{batch_id}-output" in out
        assert "job=x" in out and "2026-01-01 00:00:00 UTC" in out and "expires:" in out
        assert json.loads(llmq(capsys, "status", batch_id, *serve, "--json")[1])["id"] == batch_id
        code, out, err = llmq(capsys, "results", batch_id, *serve)
        assert code == 0 and [json.loads(x)["custom_id"] for x in out.splitlines()][:2] == ["req-0", "req-1"]
        assert f"1 failed line(s) in file-{batch_id}-error" in err
        code, out, _ = llmq(capsys, "results", batch_id, *serve, "--errors", str(tmp_path / "e.jsonl"))
        assert code == 0 and len(out.splitlines()) == 9
        assert json.loads((tmp_path / "e.jsonl").read_text())["custom_id"] == "bad-4"


def test_results_of_a_running_batch_exit_3(capsys, key_file, input_file):
    fake = FakeServe(step=1)
    with serving(fake) as url:
        serve = ["--via", url, "--key-file", str(key_file)]
        batch_id = llmq(capsys, "submit", str(input_file), *serve)[1].strip()
        code, out, err = llmq(capsys, "results", batch_id, *serve)
    assert code == 3 and out == "" and "in_progress" in err and f"llmq batch status {batch_id}" in err


def test_an_unreachable_serve_exits_1_naming_the_url(capsys, key_file, input_file):
    url = f"http://127.0.0.1:{_free_port()}"
    for argv in (["status", "batch_x"], ["submit", str(input_file), "--wait"], ["results", "batch_x"]):
        code, _, err = llmq(capsys, *argv, "--via", url, "--key-file", str(key_file))
        assert code == 1 and f"cannot reach {url}" in err, err


def test_serve_gone_for_good_while_waiting_says_the_batch_keeps_running(capsys):
    class Gone:
        def json(self, method, path):
            raise batch_cli.Unreachable("cannot reach http://serve")

    running = {"id": "batch_x", "status": "in_progress", "request_counts": {"total": 4, "completed": 1, "failed": 0}}
    with pytest.raises(batch_cli.Unreachable):
        batch_cli._wait(Gone(), running)
    err = capsys.readouterr().err
    assert "answered 1/4" in err and "stopped waiting for batch_x, which keeps running" in err


def test_a_wrong_key_is_refused_with_openai_s_message_and_never_echoed(capsys, tmp_path, input_file):
    wrong = "wrong-key-but-long-enough-0000"
    (tmp_path / "wrong.key").write_text(wrong)
    with serving(FakeServe()) as url:
        code, out, err = llmq(capsys, "submit", str(input_file), "--via", url, "--key-file",
                              str(tmp_path / "wrong.key"))
    assert code == 3 and out == ""
    assert "llmq batch submit: HTTP 401: Incorrect API key provided: <the key>" in err
    assert wrong not in out + err


def test_an_unknown_batch_prints_the_404_message(capsys, key_file):
    with serving(FakeServe()) as url:
        code, _, err = llmq(capsys, "status", "batch_nope", "--via", url, "--key-file", str(key_file))
    assert code == 3 and "HTTP 404: No such batch: batch_nope" in err


def test_ctrl_c_while_waiting_stops_waiting_and_says_how_to_check(capsys, monkeypatch, key_file, input_file):
    def interrupted(_):
        raise KeyboardInterrupt

    with serving(FakeServe(step=1)) as url:
        monkeypatch.setattr(batch_cli.time, "sleep", interrupted)
        code, out, err = llmq(capsys, "submit", str(input_file), "--via", url, "--key-file", str(key_file),
                              "--wait")
        monkeypatch.undo()
    batch_id = out.strip()
    assert code == 130 and batch_id.startswith("batch_")
    assert f"{batch_id} keeps running" in err and f"llmq batch status {batch_id} --via {url}" in err


def test_via_and_key_file_default_to_the_environment(capsys, monkeypatch, key_file, input_file):
    with serving(FakeServe(step=100)) as url:
        monkeypatch.setenv(batch_cli.URL_ENV, url)
        monkeypatch.setenv(batch_cli.KEY_FILE_ENV, str(key_file))
        code, out, _ = llmq(capsys, "submit", str(input_file), "--wait")
    assert code == 0 and out.splitlines()[1].startswith("batch_") and " completed: " in out


@pytest.mark.parametrize("argv, says", [
    (["submit", "IN"], "--key-file FILE (or $LLMQ_API_KEY_FILE) is required"),
    (["submit", "IN", "--key-file", "no-such.key"], "cannot read key file 'no-such.key'"),
    (["submit", "no-such.jsonl", "--key-file", "KEY"], "no such file: no-such.jsonl"),
    (["submit", "IN", "--key-file", "KEY", "--output", "o.jsonl"], "--output and --errors need --wait"),
    (["status", "b", "--key-file", "KEY", "--via", "127.0.0.1:8080"], "is not an http:// or https:// URL"),
])
def test_usage_errors_exit_2_before_any_request(capsys, key_file, input_file, argv, says):
    argv = [str(input_file) if a == "IN" else str(key_file) if a == "KEY" else a for a in argv]
    code, _, err = llmq(capsys, *argv)
    assert code == 2 and says in err, err


@pytest.mark.parametrize("argv, says", [
    (["submit", "f", "--metadata", "novalue"], "'novalue' is not KEY=VALUE"),
    (["submit", "f", "--window", "tomorrow"], "'tomorrow' is not a duration"),
    (["submit", "f", "--priority", "high"], "invalid choice: 'high'"),
    (["submit", "f", "--endpoint", "/v1/embeddings"], "invalid choice"),
    (["status"], "BATCH_ID"),
])
def test_bad_arguments_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["batch", *argv])
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_arguments_parse_to_what_the_commands_read():
    args = cli.build_parser().parse_args(["batch", "submit", "in.jsonl", "--metadata", "a=1", "b=x=y",
                                          "--metadata", "c=", "--priority", "Background", "--window", "90m"])
    assert args.func is cli.cmd_batch and args.action == "submit"
    assert args.metadata == [("a", "1"), ("b", "x=y"), ("c", "")]
    assert (args.priority, args.window, args.endpoint, args.wait) == ("background", "90m", "/v1/chat/completions",
                                                                      False)


def test_polling_rides_out_a_short_outage(monkeypatch):
    answers = [batch_cli.Unreachable("down"), batch_cli.ServeError(503, "shutting down"), {"id": "b"}]

    class Flaky:
        def json(self, method, path):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    assert batch_cli._look(Flaky(), "b") == {"id": "b"}
    answers[:] = [batch_cli.ServeError(404, "gone")]
    with pytest.raises(batch_cli.ServeError):
        batch_cli._look(Flaky(), "b")
    monkeypatch.setattr(batch_cli, "POLL_PATIENCE_S", 0.0)
    answers[:] = [batch_cli.Unreachable("down")] * 2
    started = time.monotonic()
    with pytest.raises(batch_cli.Unreachable):
        batch_cli._look(Flaky(), "b")
    assert time.monotonic() - started < 1
