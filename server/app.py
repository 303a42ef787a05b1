"""The Litestar application: routes, dependency injection, errors, CORS, docs, and the lifespan that
owns the engine client (the engine process starts with the app and stops with it)."""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator

import anyio
import corectl
from corectl.engine.client import EngineClient
from corectl.engine.transport import EngineTransport
from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin

from .chat import ChatController
from .completions import CompletionsController
from .errors import EXCEPTION_HANDLERS
from .logs import configure_logging
from .metrics import ServerMetrics
from .ops import LoadController, ModelsController, OpsController, TokenizerController
from .state import ServerState

logger = logging.getLogger("corectl.server")

_HEALTH_POLL_S = 0.5
# After the engine fails the server stays up this long, answering 503, so that health probes and
# load balancers see the failure rather than only a refused connection; then it exits.
_FAILURE_GRACE_S = 2.0


def create_app(server: ServerState) -> Litestar:
    settings = server.settings
    cors = None
    if settings.allowed_origins:
        cors = CORSConfig(allow_origins=settings.allowed_origins, allow_methods=["*"], allow_headers=["*"])
    return Litestar(
        route_handlers=[CompletionsController, ChatController, ModelsController, TokenizerController,
                        LoadController, OpsController],
        dependencies={"server": Provide(_provide_server, sync_to_thread=False)},
        lifespan=[_engine_lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        cors_config=cors,
        request_max_body_size=settings.max_request_body,
        openapi_config=OpenAPIConfig(title="corectl", version=corectl.__version__, path="/docs",
                                     render_plugins=[SwaggerRenderPlugin(path="/")]),
        state=State({"server": server}),
        logging_config=None,
    )


def _provide_server(state: State) -> ServerState:
    return state.server


@contextlib.asynccontextmanager
async def _engine_lifespan(app: Litestar) -> AsyncIterator[None]:
    server: ServerState = app.state.server
    try:
        async with anyio.create_task_group() as tg:
            transport = await _start_engine(server, tg)
            async with EngineClient.serving(transport, server.settings.engine, tg) as client:
                server.client = client
                server.metrics = ServerMetrics(server.model_name, client.info.max_model_len, lambda: client.stats)
                _log_ready(server)
                stop = anyio.Event()
                tg.start_soon(_watch_engine, server, client, stop)
                try:
                    yield
                finally:
                    stop.set()
                    logger.info("stopping the engine")
    except BaseException as exc:
        root = _root_cause(exc)
        if server.client is None:
            server.startup_error = root
        if root is exc:
            raise
        raise root from None


async def _start_engine(server: ServerState, tg) -> EngineTransport:
    settings = server.settings
    if settings.engine_in_process:
        from corectl.engine.actor import InProcessEngine

        return await InProcessEngine.start(settings.engine, tg)
    from corectl.engine.remote import RemoteEngine

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return await RemoteEngine.start(settings.engine, tg, hang_timeout=settings.engine_hang_timeout,
                                    process_init=functools.partial(configure_logging, settings.log_format, level))


async def _watch_engine(server: ServerState, client: EngineClient, stop: anyio.Event) -> None:
    """A dead or hung engine makes /health fail and the server exit non-zero (a supervisor restarts it)."""
    while not stop.is_set():
        if not client.is_alive:
            server.engine_failed("the engine stopped serving; the log above says why")
            with anyio.move_on_after(_FAILURE_GRACE_S):
                await stop.wait()
            server.request_exit()
            return
        with anyio.move_on_after(_HEALTH_POLL_S):
            await stop.wait()


def _log_ready(server: ServerState) -> None:
    info = server.engine.info
    logger.info(
        "serving %s (%s) on %s (%s), %s, KV cache %d tokens (%.1f requests at max_model_len %d), "
        "engine %s; %s", ", ".join(server.settings.served_model_names), info.architecture, info.platform,
        info.device, info.dtype, info.kv_capacity_tokens, info.kv_capacity_tokens / info.max_model_len,
        info.max_model_len, "in process" if server.settings.engine_in_process else "in its own process",
        f"API at {server.settings.url}/v1, docs at {server.settings.url}/docs",
    )


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
