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
from corectl.engine.dp import EngineProcessInit, start_engines
from corectl.engine.transport import EngineTransport
from corectl.generation_config import generation_defaults
from litestar import Litestar, Request
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import SerializationException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin

from .chat import ChatController
from .classify import ClassifyController
from .completions import CompletionsController
from .dashboard import DashboardController
from .embeddings import EmbeddingsController
from .errors import EXCEPTION_HANDLERS, APIError
from .invocations import InvocationsController
from .logs import configure_logging
from .lora_routes import LoRAAdapterController
from .metrics import ServerMetrics
from .ops import LoadController, ModelsController, OpsController, TokenizerController
from .request_id import request_id_middleware
from .responses_api import ResponsesController
from .scoring import ScoringController
from .sleep_routes import SleepController
from .state import ServerState
from .tracing import RequestTracer

logger = logging.getLogger("corectl.server")

_HEALTH_POLL_S = 0.5
# After the engine fails the server stays up this long, answering 503, so that health probes and
# load balancers see the failure rather than only a refused connection; then it exits.
_FAILURE_GRACE_S = 2.0


def create_app(server: ServerState) -> Litestar:
    settings = server.settings
    cors = None
    if settings.allowed_origins:
        cors = CORSConfig(allow_origins=settings.allowed_origins, allow_methods=settings.cors_methods,
                          allow_headers=settings.cors_headers, allow_credentials=settings.cors_credentials)
    tracer = _tracer(server)
    return Litestar(
        route_handlers=[CompletionsController, ChatController, EmbeddingsController, ModelsController,
                        TokenizerController, LoadController, OpsController, DashboardController,
                        LoRAAdapterController, ResponsesController, SleepController, ScoringController,
                        ClassifyController, InvocationsController],
        dependencies={"server": Provide(_provide_server, sync_to_thread=False)},
        lifespan=[_engine_lifespan],
        middleware=[request_id_middleware] + ([] if tracer is None else [tracer.middleware]),
        on_shutdown=[] if tracer is None else [tracer.shutdown],
        exception_handlers=EXCEPTION_HANDLERS,
        cors_config=cors,
        request_class=_JSONRequest,
        before_request=_require_json_body,
        request_max_body_size=settings.max_request_body,
        openapi_config=OpenAPIConfig(title="corectl", version=corectl.__version__, path="/docs",
                                     render_plugins=[SwaggerRenderPlugin(path="/")]) if settings.api_docs else None,
        state=State({"server": server}),
        logging_config=None,
    )


def _provide_server(state: State) -> ServerState:
    return state.server


def _tracer(server: ServerState) -> RequestTracer | None:
    """The server's request tracer (tests hand one in), else one exporting to --otlp-traces-endpoint."""
    if server.tracer is None and server.settings.otlp_traces_endpoint:
        server.tracer = RequestTracer.export_to(server.settings.otlp_traces_endpoint)
    return server.tracer


class _JSONRequest(Request):
    """Litestar's request, with every body-decoding failure a 400 that says the body is at fault
    (msgspec leaves invalid UTF-8 and deep nesting to Python's exceptions)."""

    async def json(self):
        try:
            return await super().json()
        except SerializationException as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc.detail}") from None
        except UnicodeDecodeError as exc:
            raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON") from None
        except RecursionError:
            raise APIError(400, "the request body nests arrays or objects too deeply") from None


async def _require_json_body(request: Request) -> None:
    """Routes that read a body take JSON only. A web page may POST text/plain, form or untyped bodies
    to any origin without a CORS preflight; refusing them keeps a server without an API key from
    generating for whatever page its users visit (vLLM refuses them too)."""
    if "data" not in request.route_handler.parsed_fn_signature.parameters:
        return
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() == "application/json":
        return
    got = f"not {content_type[:100]!r}" if content_type else "and this request has none"
    raise APIError(415, f"the request body must be sent with Content-Type: application/json, {got}")


def _cache_config(info, engine) -> dict[str, str]:
    """vLLM's cache_config_info labels."""
    return {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_kv_blocks),
            "cache_dtype": str(engine.kv_cache_dtype), "enable_prefix_caching": str(engine.enable_prefix_caching),
            "gpu_memory_utilization": str(engine.gpu_memory_utilization)}


@contextlib.asynccontextmanager
async def _engine_lifespan(app: Litestar) -> AsyncIterator[None]:
    server: ServerState = app.state.server
    try:
        async with anyio.create_task_group() as tg:
            transport = await _start_engine(server, tg)
            async with EngineClient.serving(transport, server.settings.engine, tg) as client:
                # Before the client is set: a bad adapter is a startup error (exit 2, its message).
                await _register_lora_modules(server, client)
                server.client = client
                engine = server.settings.engine
                server.metrics = ServerMetrics(server.model_name, client.info.max_model_len, lambda: client.engine_stats,
                                               engine.max_loras if engine.enable_lora else None,
                                               server.settings.metrics_prefix, _cache_config(client.info, engine))
                client.observe_steps(server.metrics.count_generated)
                server.sampling_defaults = generation_defaults(server.settings.generation_config, client.info.model_dir,
                                                               server.settings.generation_overrides)
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
    """The engine core, or one per data-parallel engine behind one transport (`corectl.engine.dp`)."""
    settings = server.settings
    if settings.engine_in_process:
        from corectl.engine.actor import InProcessEngine

        return await start_engines(settings.engine, tg, lambda config, index: InProcessEngine.start(config, tg))
    from corectl.engine.remote import RemoteEngine

    if server.engine_links is not None:  # engines the launcher started (--api-server-count)
        links = server.engine_links
        return await start_engines(settings.engine, tg, lambda config, index: RemoteEngine.attach(
            links[index], tg, hang_timeout=settings.engine_hang_timeout))
    return await start_engines(settings.engine, tg, lambda config, index: RemoteEngine.start(
        config, tg, hang_timeout=settings.engine_hang_timeout, process_init=engine_process_init(settings, index)))


def engine_process_init(settings, index: int) -> EngineProcessInit:
    """What runs first in engine `index`'s process: its devices, then logging like this process's."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    setup_logging = functools.partial(configure_logging, settings.log_format, level)
    return EngineProcessInit(index, settings.engine, setup_logging)


async def _register_lora_modules(server: ServerState, client: EngineClient) -> None:
    """The `--lora-modules` adapters, each checked before the server takes requests."""
    for module in server.settings.lora.modules:
        await server.loras.add(client, module.name, module.path, module.base_model_name)


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
    info, settings = server.engine.info, server.settings
    engines = settings.engine.data_parallel_size
    where = ("in process" if settings.engine_in_process else
             "in its own process" if engines == 1 else "in their own processes")
    logger.info(
        "serving %s (%s) on %s (%s), %s, KV cache %d tokens (%.1f requests at max_model_len %d), "
        "%s %s; %s", ", ".join(settings.served_model_names), info.architecture, info.platform,
        info.device, info.dtype, info.kv_capacity_tokens, info.kv_capacity_tokens / info.max_model_len,
        info.max_model_len, "engine" if engines == 1 else f"{engines} data-parallel engines", where,
        f"API at {settings.url}/v1" + (f", docs at {settings.url}/docs" if settings.api_docs else ""),
    )


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
