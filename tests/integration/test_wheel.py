"""The wheel as a user installs it: built from this checkout, installed in a fresh venv, and run
from an empty directory with that venv's `llmq` only.

One broker (`llmq broker up`), the topics, a tenant with a generated key, a gateway, a worker with
`--backend openai` in front of the project's simulator serving ONE model name (every other name
is a 404, as vLLM answers), and `llmq serve`; then one request through each entry point: the SDK
(in the fresh venv's python), `llmq submit` over Kafka, `llmq submit --via` serve, and the official
`openai` client against serve. No model is named anywhere: a request without one gets the model
the server serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.broker import LocalBroker, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: What a wheel is built from (everything else in the checkout stays out of the build)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "pipeline", "schemas")
#: The one model name the OpenAI-compatible server answers to
SERVED_MODEL = "wheel-served-model"
TENANT = "wheel-tenant"
#: Settings and interpreter variables of the test's own environment that would leak into the venv
_NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")


def _run(argv: list, *, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)
    assert proc.returncode == 0, f"{argv[:4]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _copy_sources(dest: Path) -> None:
    """The checkout's files (tracked, or new and not ignored), not build/ or stale byte code:
    an in-tree build would write build/ into the checkout and carry files deleted since."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *SOURCES], cwd=REPO_ROOT,
                            capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            src = REPO_ROOT / name
            if name and src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
        return
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")
    for name in SOURCES:  # not a git checkout (an unpacked archive)
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wheel")


@pytest.fixture(scope="module")
def wheel(work) -> Path:
    source, dist = work / "source", work / "dist"
    source.mkdir()
    _copy_sources(source)
    # pip's own build isolation fetches the build backend pyproject.toml names; the checkout's
    # pip is the one installed already (no `build` package needed)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", dist, source])
    (built,) = dist.glob("llmq_kafka-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(work, wheel) -> Path:
    """A fresh venv holding the wheel, its dependencies and the openai client (pip's cache reused)."""
    root = work / "venv"
    _run([sys.executable, "-m", "venv", root])
    _run([root / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, "openai"], timeout=600)
    return root


def _venv_env(venv: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _NOT_INHERITED and (not k.startswith("LLMQ_") or k == "LLMQ_CACHE_DIR")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PYTHONNOUSERSITE="1", **extra)
    return env


class Processes:
    """The stack's long-running processes, each in a process group of its own, so that stopping
    one (SIGTERM, then SIGKILL) takes whatever it started with it, even when a test failed."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.running: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(self, name: str, argv: list, *, env: dict, cwd: Path) -> subprocess.Popen:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(a) for a in argv], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.running[name] = (proc, log_path)
        return proc

    def log(self, name: str) -> str:
        return self.running[name][1].read_text(errors="replace")

    def wait_for(self, name: str, ready, timeout: float = 90.0) -> None:
        proc, _ = self.running[name]
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode} at start:\n{self.log(name)[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not ready in {timeout:.0f} s:\n{self.log(name)[-4000:]}")
            time.sleep(0.2)

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every group (newest first), wait, SIGKILL what is left; their exit codes."""
        for proc, _ in reversed(self.running.values()):
            _signal_group(proc, signal.SIGTERM)
        codes = {}
        for name, (proc, _) in reversed(self.running.items()):
            try:
                codes[name] = proc.wait(45)
            except subprocess.TimeoutExpired:
                codes[name] = None
            _signal_group(proc, signal.SIGKILL)  # children it left behind, if any
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        return codes


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _listed_models(serve_url: str, key_file: Path) -> list[str]:
    try:
        got = httpx.get(f"{serve_url}/v1/models", timeout=2,
                        headers={"Authorization": f"Bearer {key_file.read_text().strip()}"})
    except httpx.HTTPError:
        return []
    return [m["id"] for m in got.json()["data"]] if got.status_code == 200 else []


@pytest.fixture(scope="module")
def stack(work, venv):
    """Broker, topics, tenant, simulator, gateway, worker and serve, all from the fresh venv's
    commands, each run from the empty directory `run/`; stopped, and the broker taken down, however
    the tests end."""
    run, home, logs = work / "run", work / "home", work / "logs"
    for d in (run, home, logs):
        d.mkdir()
    llmq, python = venv / "bin" / "llmq", venv / "bin" / "python"
    kafka_port, data_dir = free_port(), work / "kafka"
    bootstrap = f"127.0.0.1:{kafka_port}"
    env = _venv_env(venv, LLMQ_BOOTSTRAP=bootstrap, LLMQ_BROKER__HEAP="512m")
    key_file = home / "tenant.key"
    procs = Processes(logs)
    broker_started = False
    try:
        _run([llmq, "broker", "up", "--port", kafka_port, "--data-dir", data_dir], env=env, cwd=run)
        broker_started = True
        _run([llmq, "topics", "create"], env=env, cwd=run)
        _run([llmq, "tenants", "set", TENANT, "--tier", "standard", "--generate-key", key_file],
             env=env, cwd=run)

        sim_port, gateway_port, serve_port = free_port(), free_port(), free_port()
        sim_url, serve_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{serve_port}"
        procs.start("simulator", [python, "-m", "pipeline.simulator", "--port", sim_port,
                                  "--served-model-name", SERVED_MODEL], env=env, cwd=run)
        procs.wait_for("simulator", lambda: _answers(f"{sim_url}/v1/models"))
        procs.start("gateway", [llmq, "gateway", "--web-port", gateway_port], env=env, cwd=run)
        procs.start("worker", [llmq, "worker", "--backend", "openai", "--openai-base-url", f"{sim_url}/v1",
                               "--source", "dispatch", "--metrics-port", "0"], env=env, cwd=run)
        procs.start("serve", [llmq, "serve", "--port", serve_port], env=env, cwd=run)
        procs.wait_for("gateway", lambda: "Worker]: Ready" in procs.log("gateway"))
        procs.wait_for("worker", lambda: "assigned" in procs.log("worker"))
        procs.wait_for("serve", lambda: _answers(f"{serve_url}/healthz"))
        # the worker publishes what its server serves; until the front door has read it, a request
        # without a model has none to go to
        procs.wait_for("worker", lambda: SERVED_MODEL in _listed_models(serve_url, key_file))
        yield {"env": env, "run": run, "llmq": llmq, "python": python, "key_file": key_file,
               "serve_url": serve_url, "sim_url": sim_url, "procs": procs}
    finally:
        codes = procs.stop_all()
        if broker_started:
            down = subprocess.run([str(llmq), "broker", "down", "--port", str(kafka_port), "--data-dir",
                                   str(data_dir)], env=env, cwd=run, capture_output=True, text=True, timeout=120)
            assert down.returncode == 0, down.stdout + down.stderr
        assert LocalBroker(1, data_dir.resolve()).stray_pids() == [], "a Kafka process outlived broker down"
    for name, code in codes.items():
        assert code == 0, f"{name} did not stop cleanly on SIGTERM (exit {code}):\n{procs.log(name)[-3000:]}"


def test_the_wheel_carries_every_module_and_the_schemas(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    modules = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "pipeline").rglob("*.py")}
    assert modules - names == set()
    schemas = {f"pipeline/_schemas/{p.relative_to(REPO_ROOT / 'schemas').as_posix()}"
               for p in (REPO_ROOT / "schemas").rglob("*.avsc")}
    assert schemas and schemas - names == set()
    assert not [n for n in names if n.startswith(("schemas/", "tests/", "bench/", "deploy/"))]


def test_the_commands_run_the_fresh_venvs_code_not_the_checkouts(stack, venv):
    # from the empty directory, as the processes run: the package and its schemas are the venv's
    probe = _run([stack["python"], "-c", "import pipeline, json; "
                  "from pipeline.serde.schema_store import SchemaStore; "
                  "print(json.dumps([pipeline.__file__, str(SchemaStore.default_directory())]))"],
                 env=stack["env"], cwd=tempfile.mkdtemp(dir=stack["run"].parent))
    package, schemas = json.loads(probe.stdout)
    site = (venv / "lib").resolve()
    assert Path(package).resolve().is_relative_to(site) and Path(schemas).resolve().is_relative_to(site)
    assert not Path(package).resolve().is_relative_to(REPO_ROOT)
    assert shutil.which("llmq", path=stack["env"]["PATH"]) == str(stack["llmq"])


def test_the_sdk_in_the_fresh_venv_gets_a_completed_answer(stack):
    script = (
        "import json\n"
        "from pipeline.client import LlmqClient\n"
        "from pipeline.models import Request\n"
        "with LlmqClient.from_settings() as client:\n"
        f"    response = client.submit_and_wait(Request.new({TENANT!r}, 'hello from the SDK'), timeout=60)\n"
        "print(json.dumps({'status': response.status.value, 'output': response.output, 'reason': response.reason,\n"
        "                  'model': response.model}))\n"
    )
    out = _run([stack["python"], "-c", script], env=stack["env"], cwd=stack["run"], timeout=120)
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["status"] == "COMPLETED", answer
    assert answer["output"] and answer["model"] == SERVED_MODEL  # no model named: the one served


def test_llmq_submit_over_kafka_is_completed(stack):
    out = _run([stack["llmq"], "submit", "--tenant", TENANT, "--json", "--timeout", "60",
                "hello over Kafka"], env=stack["env"], cwd=stack["run"], timeout=120)
    response = json.loads(out.stdout.strip().splitlines()[-1])
    assert response["status"] == "COMPLETED", response
    assert response["output"] and response["model"] == SERVED_MODEL


def test_llmq_submit_via_serve_is_completed(stack):
    out = _run([stack["llmq"], "submit", "--via", stack["serve_url"], "--key-file", stack["key_file"], "--timeout",
                "60", "hello through serve"], env=stack["env"], cwd=stack["run"], timeout=120)
    assert out.stdout.startswith("COMPLETED: ") and len(out.stdout) > len("COMPLETED: \n"), out.stdout


def test_the_openai_client_gets_an_answer_from_the_model_serve_lists(stack):
    client = openai.OpenAI(base_url=f"{stack['serve_url']}/v1", api_key=stack["key_file"].read_text().strip(),
                           max_retries=0, timeout=60)
    listed = [m.id for m in client.models.list()]
    assert SERVED_MODEL in listed, listed
    model = listed[0]
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello, openai"}],
                                          max_tokens=16)
    assert resp.object == "chat.completion" and resp.model == model
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.choices[0].message.content
