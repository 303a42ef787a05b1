"""`corectl serve`: the OpenAI-compatible HTTP server (uvicorn), the engine in its own process.

Exit status: 0 after a clean shutdown (SIGTERM or Ctrl-C: new connections are refused, running
requests get `--shutdown-timeout` seconds to finish), 1 when the engine died or hung while serving,
2 when the server could not start (the message says why).
"""
from __future__ import annotations

import argparse
import logging
import socket

from corectl import envs
from corectl.errors import ConfigError

from ..http.logs import LOG_FORMATS
from .api_process import serve_api
from .engine_args import add_engine_args, config_from_args
from .vllm_flags import add_vllm_flags, allowed_origins, api_keys_from_env, check_vllm_flags

logger = logging.getLogger("corectl.server")


# Online latency: a step's prefill chunk delays every running decode, so the server takes a smaller
# token budget than the offline engine. On the H100 (docs/performance.md, W5 at concurrency 64) 1024
# kept ITL p99 at 49 ms where 2048 gave 69 ms and 8192 189 ms, at the same output throughput.
SERVE_DEFAULTS = {"max_num_batched_tokens": 1024}


def register(sub) -> None:
    parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                            description="Serve a model over an OpenAI-compatible HTTP API.")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model id(s) clients send; the first is reported in responses "
                            "(default: the model argument, or the default model's file name)")
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on the API routes (repeatable)")
    group.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                       help="CORS origins: comma-separated, or vLLM's JSON list ('[\"*\"]'), '*' for any "
                            "(default: none, no CORS headers)")
    group.add_argument("--max-request-body", type=int, default=10 * 1024 * 1024, metavar="BYTES",
                       help="larger request bodies get 413 (default: 10 MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                       help="after SIGTERM, seconds running requests get to finish (default: 30)")
    group.add_argument("--engine-hang-timeout", type=float, default=60.0, metavar="S",
                       help="declare the engine hung after this many silent seconds with requests pending "
                            "(default: 60; one engine step must finish within it)")
    group.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                       help="N API processes (HTTP, tokenizing, detokenizing) sharing the port and the engine(s), "
                            "for when one process's CPU limits the token rate (default: 1)")
    group.add_argument("--engine-in-process", action="store_true",
                       help="run the engine in the server's process (debugging)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export one OpenTelemetry span per request over OTLP to URL (needs corectl[otel]; "
                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc, the default, or http/protobuf)")
    group.add_argument("--embed-chunking", action="store_true",
                       help="/v1/embeddings embeds an input longer than the context in chunks of max_model_len "
                            "tokens, averaged by token count (default: refuse it with context_length_exceeded)")
    group.add_argument("--responses-store-max-entries", type=int, default=1024, metavar="N",
                       help="/v1/responses keeps the last N responses in memory for previous_response_id and "
                            "GET /v1/responses/{id} (default: 1024; 0: keep none)")
    group.add_argument("--responses-store-max-bytes", type=int, default=64 * 1024 * 1024, metavar="BYTES",
                       help="bound on the kept responses' encoded size, least recently used out first "
                            "(default: 64 MiB)")

    group = parser.add_argument_group("tools and reasoning")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice 'auto' (the default when a request sends tools): the model "
                            "decides whether to call, and --tool-call-parser finds the calls in its text")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), llama3_json, "
                            "mistral, or a plugin's parser (see `corectl plugins`)")
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split the model's <think> reasoning into reasoning_content: qwen3, deepseek_r1, or "
                            "a plugin's parser")
    _add_lora_args(parser.add_argument_group("LoRA serving"))
    add_vllm_flags(parser)
    group = parser.add_argument_group("logging")
    group.add_argument("--log-format", choices=LOG_FORMATS, default="auto",
                       help="'human' lines, 'json' lines, or 'auto': human on a terminal (default: auto)")
    group.add_argument("--log-prompts", action="store_true", help="include prompts in the per-request log lines")
    add_engine_args(parser, model_positional=True, defaults=SERVE_DEFAULTS)
    parser.set_defaults(handler=run)


def _add_lora_args(group) -> None:
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="adapters served by name (the request's model): NAME=PATH or JSON "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; PATH is a folder or hub id")
    group.add_argument("--lora-allowed-roots", nargs="+", default=None, metavar="DIR",
                       help="folders run-time loads may read adapters from (default: the folders holding "
                            "the --lora-modules adapters)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                            "CORECTL_ALLOW_RUNTIME_LORA_UPDATING=1 or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
    group.add_argument("--lora-resolver", action="append", default=[], metavar="NAME",
                       help="resolve unknown model names to adapters: filesystem (needs --lora-resolver-root), "
                            "hub, or a plugin's (see `corectl plugins`); repeatable, tried in order")
    group.add_argument("--lora-resolver-root", default=None, metavar="DIR",
                       help="the filesystem resolver's folder: <DIR>/<name> holds adapter <name>")


def _lora_settings(args: argparse.Namespace, enable_lora: bool, served_model_names: list[str]):
    from ..http.lora import LoRAModule, LoRASettings

    modules = tuple(LoRAModule.parse(text) for text in args.lora_modules)
    if (modules or args.lora_resolver) and not enable_lora:
        raise ConfigError("enable_lora", "--lora-modules and --lora-resolver serve adapters: add --enable-lora")
    names = [m.name for m in modules]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ConfigError("lora_modules", f"the name {duplicate!r} is given twice")
    for module in modules:
        if module.name in served_model_names:
            raise ConfigError("lora_modules", f"the name {module.name!r} is the base model's "
                              "(--served-model-name); give the adapter another")
        if module.base_model_name is not None and module.base_model_name not in served_model_names:
            raise ConfigError("lora_modules", f"{module.name!r}'s base_model_name {module.base_model_name!r} is not "
                              f"a name this server serves the model under ({', '.join(served_model_names)})")
    roots = None if args.lora_allowed_roots is None else tuple(args.lora_allowed_roots)
    return LoRASettings(modules, roots, args.allow_runtime_lora_updating, tuple(args.lora_resolver),
                        args.lora_resolver_root)


def settings_from_args(args: argparse.Namespace):
    from ..http.state import ServeSettings, default_served_name

    config = config_from_args(args)
    compat = check_vllm_flags(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError("port", f"must be in [0, 65535], got {args.port}")
    if args.max_request_body < 1:
        raise ConfigError("max_request_body", f"must be a positive number of bytes, got {args.max_request_body}")
    if args.responses_store_max_entries < 0 or args.responses_store_max_bytes < 0:
        raise ConfigError("responses_store_max_entries", "the responses store bounds must not be negative")
    if args.shutdown_timeout < 0:
        raise ConfigError("shutdown_timeout", f"must be a non-negative number of seconds, got {args.shutdown_timeout}")
    if any(not key for key in args.api_key or []):
        raise ConfigError("api_key", "must not be empty")
    if args.otlp_traces_endpoint:
        from ..http.tracing import exporter_class

        exporter_class()  # a missing extra fails here, before the engine loads
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("tool_call_parser", "--enable-auto-tool-choice needs --tool-call-parser to say how "
                          "the model writes its calls")
    origins = allowed_origins(args.allowed_origins)
    if args.allow_credentials and (not origins or "*" in origins):
        raise ConfigError("allow_credentials", "credentialed CORS requests need the origins listed in "
                          "--allowed-origins (browsers refuse credentials with none or with '*')")
    served_model_names = args.served_model_name or [default_served_name(config)]
    return ServeSettings(
        engine=config, served_model_names=served_model_names,
        host=args.host, port=args.port, api_keys=args.api_key or api_keys_from_env(), allowed_origins=origins,
        log_format=args.log_format, log_prompts=args.log_prompts, max_request_body=args.max_request_body,
        engine_in_process=args.engine_in_process or args.disable_frontend_multiprocessing,
        engine_hang_timeout=args.engine_hang_timeout,
        shutdown_timeout=args.shutdown_timeout, otlp_traces_endpoint=args.otlp_traces_endpoint,
        embed_chunking=args.embed_chunking, responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, lora=_lora_settings(args, config.enable_lora, served_model_names),
        **compat,
    )


def run(args: argparse.Namespace) -> int:
    from ..http.logs import configure_logging

    configure_logging(args.log_format, envs.log_level())
    settings = settings_from_args(args)
    count = _api_server_count(args, settings)
    if count == 1:
        return serve(settings)
    from .api_servers import serve_many

    return serve_many(settings, _bind_ports(settings, count))


def _api_server_count(args: argparse.Namespace, settings) -> int:
    count = args.api_server_count
    if count < 1:
        raise ConfigError("api_server_count", f"must be at least 1, got {count}")
    if count > 1 and settings.engine_in_process:
        raise ConfigError("api_server_count", "API processes share an engine process: drop --engine-in-process")
    if count > 1 and settings.lora.updating_allowed:
        raise ConfigError("api_server_count", "adapters loaded at run time would reach one API process only: "
                          "serve them with --lora-modules or --lora-resolver instead")
    return count


def serve(settings) -> int:
    """Run the server until it is stopped; returns the process exit status."""
    return serve_api(settings, _bind_port(settings))


def _bind_port(settings) -> socket.socket:
    return _bind_ports(settings, 1)[0]


def _bind_ports(settings, count: int) -> list[socket.socket]:
    """`count` listening sockets on the port (before the engine starts, so a taken port fails in a
    second, not after loading). Several share it through SO_REUSEPORT, one per API process: the
    kernel spreads new connections over them evenly, where processes accepting on one socket
    would leave them to whichever wakes first."""
    first = _bind(settings, reuse_port=count > 1)
    settings.port = first.getsockname()[1]
    return [first] + [_bind(settings, reuse_port=True) for _ in range(count - 1)]


def _bind(settings, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    # Named TCP, asyncio turns Nagle off on each accepted connection, as for the sockets it binds itself
    # (it checks the protocol, which socket() leaves 0): with Nagle on, a response written in two parts
    # waited for the client's delayed ACK, 40 ms on every keep-alive request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((settings.host, settings.port))
        sock.listen()  # with SO_REUSEADDR a taken port passes bind() and fails only here
    except OSError as exc:
        sock.close()
        raise ConfigError("port", f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    return sock
