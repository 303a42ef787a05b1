"""What the running server knows: its settings, the engine client, metrics and its own health."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from corectl.config import EngineConfig
from corectl.engine.client import EngineClient
from corectl.engine.intake import NO_TOKENIZER
from corectl.lora.request import LoRARequest
from corectl.tokenizer import Tokenizer

from .errors import APIError
from .lora import LoRARegistry, LoRASettings
from .media.intake import MediaIntake
from .media.settings import MediaSettings
from .metrics import ServerMetrics
from .parsers import reasoning_parser_class, tool_parser_class
from .response_store import ResponseStore

logger = logging.getLogger("corectl.server")


@dataclass
class ServeSettings:
    """`corectl serve` options that are not engine options.

    engine_hang_timeout: seconds the engine process may stay silent while it owes a step before it
    is declared hung. shutdown_timeout: seconds running requests get to finish after SIGTERM.
    otlp_traces_endpoint: where request spans are exported over OTLP (None: no tracing).
    embed_chunking: /v1/embeddings splits an input longer than the context into chunks and averages
    their vectors, instead of refusing it.
    enable_auto_tool_choice: `tool_choice` "auto" is served, with `tool_call_parser` (a registered
    tool parser's name) finding the calls. reasoning_parser: splits reasoning from content (a
    registered reasoning parser's name; None: the output is all content).
    lora: the adapters served by name and who may add more (`lora.py`; with --enable-lora).
    responses_store_max_entries, responses_store_max_bytes: bounds of the /v1/responses store
    (`response_store.py`; 0 entries: none kept).
    vLLM's serving flags (`corectl.server.cli.vllm_flags`): HTTPS key and certificate, the ASGI
    root_path, whether each request gets a log line, the /metrics prefix, the most logprobs a
    request may ask for, and where sampling defaults come from (generation_config: auto, vllm or a
    folder).
    """

    engine: EngineConfig
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    log_format: str = "auto"
    log_prompts: bool = False
    max_request_body: int = 10 * 1024 * 1024
    engine_in_process: bool = False
    engine_hang_timeout: float = 60.0
    shutdown_timeout: float = 30.0
    otlp_traces_endpoint: str | None = None
    embed_chunking: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    lora: LoRASettings = field(default_factory=LoRASettings)
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 * 1024 * 1024
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # vLLM's --ssl-ca-certs and --ssl-cert-reqs (client certificates).
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # CORS beyond the origins: vLLM's --allow-credentials, --allowed-methods, --allowed-headers.
    cors_credentials: bool = False
    cors_methods: list[str] = field(default_factory=lambda: ["*"])
    cors_headers: list[str] = field(default_factory=lambda: ["*"])
    # Request log lines: vLLM's --max-log-len (characters or ids of each prompt and output) and
    # --enable-log-outputs; the /docs page and schema unless --disable-fastapi-docs.
    max_log_len: int | None = None
    log_outputs: bool = False
    api_docs: bool = True
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info (the chat template included).
    tokenizer_info: bool = False
    root_path: str = ""
    uvicorn_log_level: str | None = None
    # vLLM's --enable-force-include-usage, --enable-prompt-tokens-details, --response-role.
    force_include_usage: bool = False
    prompt_tokens_details: bool = False
    response_role: str = "assistant"
    # vLLM's --chat-template-content-format (corectl.chat_content.CONTENT_FORMATS).
    chat_template_content_format: str = "auto"
    return_tokens_as_token_ids: bool = False
    log_requests: bool = True
    metrics_prefix: str = "vllm:"
    max_logprobs: int = 20
    generation_config: str = "auto"
    generation_overrides: dict[str, Any] = field(default_factory=dict)
    # What image parts may make the server fetch and decode (corectl.server.http.media).
    media: MediaSettings = field(default_factory=MediaSettings)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{host}:{self.port}"


def default_served_name(config: EngineConfig) -> str:
    """The model id clients send: the model as given, a file's stem, or the default model's stem."""
    from corectl.loaders.default_model import default_model

    spec = config.model or default_model()
    path = Path(spec).expanduser()
    return path.stem if path.is_file() else spec


class ServerState:
    """Shared by every route handler (through dependency injection) and by the lifespan."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.client: EngineClient | None = None
        self.metrics: ServerMetrics | None = None
        self.tracer = None  # a tracing.RequestTracer when spans are exported
        self.draining = False
        self.failure: str | None = None  # why the engine stopped serving, once it has
        self.startup_error: BaseException | None = None
        self.exit_code = 0
        self._in_flight = 0
        self.started_at = time.time()
        # Sampling defaults for the fields a request leaves unset (corectl.generation_config), once the engine is up.
        self.sampling_defaults: dict = {}
        self.media = MediaIntake(settings.media, settings.engine.mm_processor_kwargs)
        self.tool_parser = None if settings.tool_call_parser is None else tool_parser_class(settings.tool_call_parser)
        self.reasoning_parser = (None if settings.reasoning_parser is None
                                 else reasoning_parser_class(settings.reasoning_parser))
        self.loras = (LoRARegistry(settings.lora, settings.served_model_names, settings.engine.download_dir)
                      if settings.engine.enable_lora else None)
        self.responses = ResponseStore(settings.responses_store_max_entries, settings.responses_store_max_bytes)
        # With --api-server-count: this API process's number, and its connections to the engines
        # the launcher started (`corectl.engine.remote.EngineLink`, one per data-parallel engine).
        self.api_server_index: int | None = None
        self.engine_links: list | None = None
        # Set by whoever runs the HTTP server: asks it to stop (after the engine died).
        self.request_exit: Callable[[], None] = lambda: None

    @property
    def in_flight(self) -> int:
        """HTTP requests being served (the load `/load` and the dashboard report); `begin_request`
        and `end_request` are its one writer."""
        return self._in_flight

    def begin_request(self) -> None:
        self._in_flight += 1

    def end_request(self) -> None:
        self._in_flight -= 1

    @property
    def engine(self) -> EngineClient:
        if self.client is None:
            raise APIError(503, "the engine is not running")
        return self.client

    def healthy(self) -> tuple[bool, str]:
        if self.failure is not None:
            return False, self.failure
        if self.client is None or not self.client.is_alive:
            return False, "the engine is not running"
        if self.draining:
            return False, "the server is shutting down"
        return True, "ok"

    def check_model(self, model: str | None, adapters: bool = False) -> None:
        """A 404 unless `model` is a served name (or, where `adapters` may be named, a LoRA adapter's:
        the tokenizer routes); a route that would run the base model for an adapter's name says so."""
        if model is None or model in self.settings.served_model_names:
            return
        if self.loras is None or self.loras.get(model) is None:
            raise self._unknown_model(model)
        if not adapters:
            raise APIError(400, f"`{model}` is a LoRA adapter, which this route does not apply; name the base "
                           f"model ({self.model_name})", "model")

    async def adapter_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a generation request's `model` names (None: the base model); an unknown
        name is tried on the enabled resolvers, then a 404."""
        if model is None or model in self.settings.served_model_names:
            return None
        lora = None if self.loras is None else (self.loras.get(model) or await self.loras.resolve(self.engine, model))
        if lora is None:
            raise self._unknown_model(model)
        return lora

    def _unknown_model(self, model: str) -> APIError:
        adapters = [] if self.loras is None else [lora.lora_name for lora in self.loras.adapters()]
        served = ", ".join(self.settings.served_model_names + adapters)
        return APIError(404, f"The model `{model}` does not exist; this server serves {served}", "model",
                        "model_not_found")

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.settings.engine.scheduling_policy != "priority":
            raise APIError(400, "priority only applies with --scheduling-policy priority", "priority")

    def require_tokenizer(self, param: str, consequence: str) -> Tokenizer:
        """The tokenizer, or a 400 naming `param` when the model runs without one (`consequence`
        says what that rules out and what to send instead)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, f"{NO_TOKENIZER}, so {consequence}", param)
        return tokenizer

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance")
        if self.client is not None and self.client.sleep_mode.requested:
            raise APIError(503, "the engine is asleep (sleep mode); POST /wake_up first")

    def engine_failed(self, reason: str) -> None:
        """Mark the server failed: /health answers 503 and the process will exit with status 1."""
        if self.failure is None:
            self.failure = reason
            self.exit_code = 1
            logger.error("engine failed, shutting down: %s", reason)
