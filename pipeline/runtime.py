"""Process-wide settings of a long-running llmq service (the gateway, a worker)."""

from __future__ import annotations

import gc
import importlib
import logging
import time

log = logging.getLogger(__name__)


def freeze_long_lived(service: str) -> int:
    """Take what exists once a service is ready out of the cyclic collector's reach.

    Modules, the app, its clients and the state restored at start live as long as the process,
    yet every full collection traverses them again. On a busy gateway such a collection was
    long enough to show as the CRITICAL band's p99 (BENCHMARKS.md). Collected first, so no
    garbage is kept;
    ``gc.freeze`` leaves reference counting untouched: a frozen object is still freed when
    nothing refers to it, only a cycle among frozen objects is never collected.
    """
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d long-lived objects left out of garbage collection (%.0f ms)",
             service, frozen, (time.perf_counter() - t0) * 1000)
    return frozen


def optional_extension(module: str, abi: int, without: str):
    """The C extension ``module`` if it was built (``pip install`` builds it where a C compiler
    is) and is the build this code expects (its ``ABI``); else None, and a stale build is
    logged with what runs ``without`` it."""
    try:
        ext = importlib.import_module(module)
    except ImportError:  # pragma: no cover - no compiler
        return None
    if getattr(ext, "ABI", None) != abi:  # pragma: no cover - a stale build
        log.warning("%s is a stale build (ABI %s, expected %s); %s. Rebuild it: pip install -e .",
                    module, getattr(ext, "ABI", None), abi, without)
        return None
    return ext
