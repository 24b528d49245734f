"""``llmq serve`` as a process: start, serve, and stop gracefully on SIGTERM.

Start: the tenant registry and the model catalog (each read to its end), the one client (its reply listener assigned to
this process's reply partitions), the Batch API's index of files and batches and the driver of
the batches this process owns (``batch.enabled``), the stored responses (``responses.enabled``),
then the HTTP listener. Stop (SIGTERM or SIGINT):

1. the listening socket closes and ``/healthz`` says 503, so a load balancer moves on; a request
   that still arrives on an open connection is answered 503 (``Retry-After: 1``);
2. requests in flight get up to ``serve.shutdown_grace_s`` to be answered;
3. whatever still waits then is answered 503, its request cancelled in the pipeline;
4. connections close, the batch driver leaves its group (another process takes its batches
   over at once; lines already sent stay in the pipeline), the client flushes, the registry stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from pipeline.serve.app import Server, build_app

log = logging.getLogger("pipeline.serve")


async def serve(settings, *, ready=None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or a SIGTERM/SIGINT); ``ready(host, port)`` once listening."""
    from pipeline.catalog.store import ModelStore
    from pipeline.client import AsyncLlmqClient
    from pipeline.serve.app import RegistrySecrets
    from pipeline.tenants.registry import TenantRegistry

    cfg = settings.serve
    loop = asyncio.get_running_loop()
    registry = TenantRegistry(settings)
    await loop.run_in_executor(None, registry.start)
    models = ModelStore(settings)
    await loop.run_in_executor(None, models.start)
    client = store = driver = responses = None
    try:
        client = await loop.run_in_executor(None, lambda: AsyncLlmqClient(
            settings, reply_partitions=cfg.reply_partition_list(), signing_secret=RegistrySecrets(registry),
            producer_config={"linger.ms": cfg.producer_linger_ms}))
        if settings.batch.enabled:
            store, driver = await loop.run_in_executor(None, _start_batches, settings, registry)
        if settings.responses.enabled:
            from pipeline.responses.store import ResponseStore

            responses = ResponseStore(settings)
            await loop.run_in_executor(None, responses.start)
        server = Server(settings, registry, client, models)
        runner = web.AppRunner(build_app(server, store, responses), handler_cancellation=True, shutdown_timeout=1.0,
                               access_log=logging.getLogger("pipeline.serve.access") if cfg.access_log else None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True, backlog=1024)
        await site.start()
        port = runner.addresses[0][1] if cfg.port == 0 else cfg.port
        log.info("llmq serve on http://%s:%d, reply partitions %s of %s", cfg.host, port,
                 ",".join(map(str, client.reply_partitions)), settings.topics.responses)
        if ready is not None:
            ready(cfg.host, port)
        stop = stop or asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        await stop.wait()
        await _drain(server, site, cfg.shutdown_grace_s)
        await runner.cleanup()
    finally:
        if driver is not None:
            await loop.run_in_executor(None, driver.stop)
        if store is not None:
            await loop.run_in_executor(None, store.stop)
        if responses is not None:
            await loop.run_in_executor(None, responses.stop)
        if client is not None:
            await client.close()
        models.stop()
        registry.stop()


def _start_batches(settings, registry):
    from pipeline.batch.driver import BatchDriver
    from pipeline.batch.store import BatchStore
    from pipeline.client import LlmqClient
    from pipeline.serve.app import RegistrySecrets

    store = BatchStore(settings)
    store.start()
    sender = LlmqClient(settings, listen=False, signing_secret=RegistrySecrets(registry))
    driver = BatchDriver(settings, store, registry, sender)
    driver.start()
    return store, driver


async def _drain(server: Server, site: web.TCPSite, grace_s: float) -> None:
    server.draining = True
    await site.stop()
    if server.inflight:
        log.info("stopping: %d requests in flight, up to %.0f s to finish", server.inflight, grace_s)
        try:
            await asyncio.wait_for(server.idle.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("stopping: %d requests still in flight after %.0f s; answering them 503", server.inflight,
                        grace_s)
    if not server.stopped.done():
        server.stopped.set_result(None)
    from pipeline.serve.sse import Stopped

    for stream in list(server.streams):
        stream.abort(Stopped())
    try:
        # The 503s and the cancellations get a moment to go out.
        await asyncio.wait_for(server.idle.wait(), 2.0)
    except asyncio.TimeoutError:
        pass


def run(settings) -> int:
    asyncio.run(serve(settings))
    return 0
