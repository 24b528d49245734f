"""Install the pinned ``llama-cpp-python[server]`` (and ``gguf``) into the running venv.

Run as ``python -m tests.llama.install`` (what ``make llama`` does). The wheel is looked
for in ``$LLMQ_CACHE_DIR/wheels`` (default ``~/.cache/llmq/wheels``); when it is not
there it is built once with ``pip wheel`` and kept, which takes minutes on two cores, so
progress is printed while it runs and the full build log is kept beside the wheel.

The build flags keep the library portable (no ``-march=native``: the cache may be copied
to another machine) and small (no BLAS, no examples, tests, tools or server binaries:
only the shared libraries the Python bindings load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

LLAMA_VERSION = "0.3.36"
GGUF_VERSION = "0.19.0"
WHEEL_PREFIX = f"llama_cpp_python-{LLAMA_VERSION}-"
CMAKE_ARGS = " ".join([
    "-DGGML_NATIVE=OFF", "-DGGML_BLAS=OFF", "-DGGML_OPENMP=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
])
HEARTBEAT_S = 30.0


class InstallError(RuntimeError):
    """The wheel could not be built or installed; the message says where the log is."""


def cache_dir() -> Path:
    return Path(os.environ.get("LLMQ_CACHE_DIR") or Path.home() / ".cache" / "llmq").expanduser()


def wheel_dir() -> Path:
    return cache_dir() / "wheels"


def cached_wheel() -> Path | None:
    found = sorted(wheel_dir().glob(f"{WHEEL_PREFIX}*.whl")) if wheel_dir().is_dir() else []
    return found[-1] if found else None


def installed() -> bool:
    """True when this interpreter already has both pinned packages."""
    try:
        return metadata.version("llama-cpp-python") == LLAMA_VERSION and metadata.version("gguf") == GGUF_VERSION \
            and _has_server_extras()
    except metadata.PackageNotFoundError:
        return False


def _has_server_extras() -> bool:
    for dist in ("fastapi", "uvicorn", "sse-starlette", "starlette-context", "pydantic-settings"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            return False
    return True


def build_wheel(progress=print) -> Path:
    """Build the wheel into the cache (atomically: a half-built wheel is never left there)."""
    target = wheel_dir()
    target.mkdir(parents=True, exist_ok=True)
    log_path = target / f"llama-cpp-python-{LLAMA_VERSION}-build.log"
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, FORCE_CMAKE="1",
               CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2)))
    progress(f"building llama-cpp-python {LLAMA_VERSION} (once; several minutes on two cores), "
             f"log in {log_path}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target, prefix=".build-") as tmp, open(log_path, "w") as log:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--wheel-dir", tmp,
               f"llama-cpp-python=={LLAMA_VERSION}"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def heartbeat():
            while not done.wait(HEARTBEAT_S):
                progress(f"  ... still building ({time.monotonic() - started:.0f} s)")

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            rc = proc.wait()
        finally:
            done.set()
        if rc != 0:
            raise InstallError(f"building llama-cpp-python failed (exit {rc}); see {log_path}")
        built = sorted(Path(tmp).glob(f"{WHEEL_PREFIX}*.whl"))
        if not built:
            raise InstallError(f"pip reported success but left no wheel; see {log_path}")
        final = target / built[-1].name
        os.replace(built[-1], final)
    progress(f"built {final.name} in {time.monotonic() - started:.0f} s")
    return final


def install(wheel: Path, progress=print) -> None:
    progress(f"installing llama-cpp-python[server]=={LLAMA_VERSION} and gguf=={GGUF_VERSION} from {wheel.parent}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--find-links", str(wheel.parent),
           f"llama-cpp-python[server]=={LLAMA_VERSION}", f"gguf=={GGUF_VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise InstallError(f"pip install failed (exit {result.returncode}):\n{result.stderr[-2000:]}")


def ensure(*, allow_build: bool = True, progress=print) -> None:
    """Make the pinned server importable here, building its wheel only when allowed and absent."""
    if installed():
        return
    wheel = cached_wheel()
    if wheel is None:
        if not allow_build:
            raise InstallError(f"llama-cpp-python {LLAMA_VERSION} is not installed and no wheel is cached in "
                               f"{wheel_dir()}; run `make llama` (python -m tests.llama.install) first")
        wheel = build_wheel(progress)
    install(wheel, progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.llama.install", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuild", action="store_true", help="build the wheel again even when one is cached")
    args = parser.parse_args(argv)
    if shutil.which("cmake") is None and cached_wheel() is None:
        # pip installs cmake and ninja from PyPI into the isolated build env, so a missing
        # system cmake is fine; it is worth saying because the next minutes are the build.
        print("no system cmake: pip brings its own into the build environment")
    try:
        if args.rebuild:
            install(build_wheel(), print)
        else:
            ensure()
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"llama-cpp-python {LLAMA_VERSION} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
