"""`corectl serve --api-server-count N`: the engine process(es) once, then N API processes sharing them.

This process (the launcher) binds N listening sockets to the port (SO_REUSEPORT: the kernel spreads
new connections over them), starts every data-parallel engine with one connection per API process
(`corectl.engine.remote.SharedEngine`), and spawns N API processes; API process i gets socket i and
connection i of every engine. Each is a whole server (`api_process.serve_api`) whose engine transport is
attached to those connections. The launcher serves nothing itself; it supervises:

- SIGTERM or Ctrl-C: passed on to the API processes, which drain as one server does; once they are
  gone every engine has lost its connections and stops. Exit 0.
- An API process or an engine process that ends unasked takes the server down: the other API
  processes are told to stop, and the launcher exits with the status of the first that failed (1
  when it had none, or died by a signal), as a one-process server exits 1 when its engine dies.

/metrics: the API processes count requests in prometheus_client's multiprocess mode (a temporary
PROMETHEUS_MULTIPROC_DIR set here, before they start), so any of them reports the whole server.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile

import anyio
from corectl import envs
from corectl.engine.remote import EngineLink, SharedEngine

logger = logging.getLogger("corectl.server")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_POLL_S = 0.5
_PR_SET_NAME = 15


def serve_many(settings, socks: list[socket.socket]) -> int:
    """Run the engines and an API process per listening socket until stopped; returns the exit status."""
    count = len(socks)
    metrics_dir = tempfile.mkdtemp(prefix="corectl-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    engines: list[SharedEngine] = []
    try:
        engines = anyio.run(_launch_engines, settings, count)
        context = multiprocessing.get_context("spawn")
        servers = [context.Process(target=_api_process_main, name=f"corectl-api-{i}",
                                   args=(settings, socks[i], [engine.links[i] for engine in engines], i))
                   for i in range(count)]
        for server in servers:
            server.start()
        for sock in socks:
            sock.close()  # the API processes hold them now
        return _supervise(servers, engines)
    finally:
        for engine in engines:
            engine.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop(MULTIPROC_ENV, None)


async def _launch_engines(settings, count: int) -> list[SharedEngine]:
    """Every data-parallel engine, started at once; if one fails the others are stopped."""
    from corectl.engine.dp import engine_config

    from ..http.app import engine_process_init

    config = settings.engine
    engines: list[SharedEngine | None] = [None] * config.data_parallel_size
    errors: list[BaseException] = []

    async def launch(index: int) -> None:
        try:
            engines[index] = await SharedEngine.launch(engine_config(config, index), count,
                                                       engine_process_init(settings, index))
        except Exception as exc:  # noqa: BLE001 - the first is raised below, once
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for index in range(config.data_parallel_size):
            tg.start_soon(launch, index)
    if errors:
        for engine in engines:
            if engine is not None:
                await anyio.to_thread.run_sync(engine.stop, 0.0)
        raise errors[0]
    return engines  # type: ignore[return-value]


def _supervise(servers: list, engines: list[SharedEngine]) -> int:
    """Wait until every API process has ended; the first to end unasked (or an engine's end) stops the rest."""
    stop_asked: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stop_asked.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    watched = {server.sentinel: server for server in servers}
    watched.update({engine.process.sentinel: engine.process for engine in engines})
    status, stopping = 0, False
    try:
        while any(server.exitcode is None for server in servers):
            ended = multiprocessing.connection.wait(list(watched), timeout=_POLL_S)
            for sentinel in ended:
                process = watched.pop(sentinel)
                process.join(5.0)  # its end was seen before it was reaped: the exit code comes with the reaping
                if stopping:
                    continue  # the stop was asked for: every process is expected to end
                logger.error("%s ended (exit code %s): stopping the server", process.name, process.exitcode)
                status = status or (process.exitcode if (process.exitcode or 0) > 0 else 1)
            if (stop_asked or status) and not stopping:
                stopping = True
                for server in servers:
                    if server.exitcode is None:
                        os.kill(server.pid, signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _api_process_main(settings, sock: socket.socket, links: list[EngineLink], index: int) -> None:
    from ..http.logs import configure_logging
    from .api_process import serve_api

    _name_process(f"corectl-api-{index}")
    configure_logging(settings.log_format, envs.log_level())
    raise SystemExit(serve_api(settings, sock, links, index))


def _name_process(name: str) -> None:
    """The name `ps`, `top` and /proc/<pid>/comm show (Linux; elsewhere the name stays python)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
