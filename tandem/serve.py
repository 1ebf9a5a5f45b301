"""`tandem serve`: load the config and the model, run the server until SIGTERM / SIGINT.

On the first signal the server drains: the engine finishes the generation it runs (its client
gets the whole answer), refuses everything else with 503, and then the site closes and every
actor stops. A second signal stops at once (the running generation is cancelled at its next
token). An actor that fails stops the server too; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web

from tandem.actors import Actor
from tandem.actors.loop import install_uvloop
from tandem.config import Config, load_config
from tandem.devices import engine_device
from tandem.models.graphs import engine_graphs
from tandem.logs import configure_logging
from tandem.models import load_model
from tandem.torch_thread import one_openmp_thread_here, torch_thread
from tandem.models.base import ModelError
from tandem.server.app import DRAIN_TIMEOUT_S, build_app, drain
from tandem.server.connections import GuardedRunner
from tandem.server.state import STATE

log = structlog.get_logger("tandem.serve")

SHUTDOWN_TIMEOUT_S = 10.0  # for handlers still writing once the engine has drained


def serve_main(args: argparse.Namespace) -> int:
    """The entry point of `tandem serve`; ``args`` from a parser given add_config_flags."""
    config = load_config(cli_args=args)
    configure_logging(config.log_level)
    device = engine_device(config)  # a missing GPU is a ConfigError here, before the load
    engine_graphs(config, device)  # cuda_graphs on without CUDA too
    try:
        # On the torch thread, before anything else opens an OpenMP region: the engine then
        # runs on the thread whose worker team is the fast one (tandem/torch_thread.py).
        loaded = torch_thread().submit(load_model, config.server.model, config.models_dir(),
                                       config.engine.dtype, device,
                                       config.engine.cuda_graphs).result()
    except (ModelError, OSError) as e:
        log.error("model_load_failed", model=config.server.model, error=type(e).__name__,
                  reason=str(e))
        return 2
    uvloop = install_uvloop()
    log.info("model_loaded", model=loaded.name, path=str(loaded.path), uvloop=uvloop)
    return asyncio.run(serve(config, loaded))


async def serve(config: Config, loaded, *, engine: Actor | None = None,
                ready: asyncio.Future[int] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set (by a signal, or by the caller) or an actor fails.
    ``ready`` gets the bound port once the site listens; ``engine`` replaces the engine actor
    (tests)."""
    loop = asyncio.get_running_loop()
    # The handlers' worker threads (asyncio.to_thread: the chat template, an image's
    # preprocessing) run torch ops too: their OpenMP regions stay on their own thread, so the
    # engine's team stays the process's only one (tandem/torch_thread.py)
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="tandem-worker",
                                                 initializer=one_openmp_thread_here))
    stop = stop if stop is not None else asyncio.Event()
    app = build_app(config, loaded, engine=engine,
                    engine_executor=torch_thread() if engine is None else None)
    state = app[STATE]
    # Header deadline and connection cap (tandem/server/connections.py).
    runner = GuardedRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()  # starts the actors
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        log.info("signal_received", signal=signal.Signals(signum).name, count=signals)
        if signals == 1:
            stop.set()
        else:
            state.supervisor.request_stop()  # the second one: stop now

    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread (tests), or no signals on this platform
    try:
        site = web.TCPSite(runner, config.server.host, config.server.port)
        await site.start()
        port = _bound_port(site, config.server.port)
        log.info("server_started", host=config.server.host, port=port, model=loaded.name)
        freeze_startup_heap()
        if ready is not None and not ready.done():
            ready.set_result(port)
        stopped = asyncio.create_task(state.supervisor.wait())
        stop_wait = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([stopped, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        if not stopped.done():
            log.info("server_draining")
            drain_task = asyncio.create_task(drain(state.engine, DRAIN_TIMEOUT_S))
            await asyncio.wait([drain_task, stopped], return_when=asyncio.FIRST_COMPLETED)
            drain_task.cancel()
        stopped.cancel()
    finally:
        gc.unfreeze()
        for signum in installed:
            loop.remove_signal_handler(signum)
        await runner.cleanup()  # closes the site, waits for handlers, stops the actors
    failed = state.supervisor.failed
    log.info("server_stopped", failed=failed)
    return 1 if failed else 0


def freeze_startup_heap() -> None:
    """Move what the start built (the model's modules, the tokenizer, the templates, the
    actors: some 200,000 objects) out of the cyclic collector's reach. A full collection
    otherwise walks them all: on this host it held the GIL for about 100 ms, a stall of every
    running stream (the engine thread's steps need the GIL between their ops). CPython's
    gc.freeze, as servers with a large start heap use it (Instagram's, vLLM's); what is
    frozen is never freed, so only the start's heap, once a collection has run."""
    gc.collect()
    gc.freeze()
    log.info("gc_frozen", objects=gc.get_freeze_count())


def _bound_port(site: web.TCPSite, configured: int) -> int:
    server = site._server  # aiohttp exposes the listening sockets only here
    sockets = getattr(server, "sockets", None) or []
    for sock in sockets:
        return sock.getsockname()[1]
    return configured
