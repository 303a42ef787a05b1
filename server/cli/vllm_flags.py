"""The `vllm serve` flags launch scripts pass, taken by `corectl serve` unchanged.

Each is checked here, before the engine starts: a bad value is one line and exit status 2.
`--config FILE` (YAML, as vLLM's) is expanded into flags before parsing, so flags given on the
command line override it.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from corectl.errors import ConfigError
from corectl.generation_config import check_generation_config, check_generation_overrides
from corectl.sampling_params import MAX_LOGPROBS
from corectl.chat_content import CONTENT_FORMATS

from ..http.media.settings import MediaSettings

API_KEY_ENV = ("CORECTL_API_KEY", "VLLM_API_KEY")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="YAML file of flags (keys as the long flags' names); command-line flags override it")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM scripts; corectl runs only the architectures it implements")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="accepted for vLLM scripts: chunked prefill is always on")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="sampling defaults for fields a request leaves unset: 'auto' from the model's "
                            "generation_config.json, 'vllm' none (vLLM's own), or a folder holding one")
    group.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help="sampling defaults set over --generation-config's (its keys: temperature, top_p, "
                            "top_k, min_p, repetition_penalty, max_new_tokens)")
    group.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                       help=f"most logprobs a request may ask for per token (at most {MAX_LOGPROBS})")
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    group.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix a proxy serves this server under (ASGI root_path)")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="uvicorn's own log level (default: the server's)")
    group.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                       help="accepted for vLLM scripts: preempted requests are recomputed, never swapped to host "
                            "memory (as in vLLM V1)")
    group.add_argument("--response-role", default="assistant", metavar="ROLE",
                       help="the role of chat completions' messages")
    group.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N",
                       help="accepted for vLLM scripts: CUDA graphs here serve every context length")
    group.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                       help="how message content reaches the chat template: 'string' (text parts joined), "
                            "'openai' (the list of parts, for templates that loop over them) or 'auto' (a "
                            "string unless images need the list)")
    group.add_argument("--metrics-prefix", default="vllm:", choices=("vllm:", "corectl:"),
                       help="prefix of the /metrics series (default vllm:, vLLM's names)")
    for flag, help_text in _SWITCHES:
        group.add_argument(flag, action="store_true", help=help_text)
    _add_http_flags(group)
    for flag, help_text in _REFUSED_SWITCHES.items():
        group.add_argument(flag, action="store_true", help=help_text)
    for flag, (kind, value, help_text) in _PINNED.items():
        group.add_argument(flag, type=kind, default=value, help=f"{help_text} (only {value})")
    _add_media_flags(parser.add_argument_group("images (vision-language models)"))


def _add_http_flags(group) -> None:
    """vLLM's HTTP-side flags: CORS details, client certificates, the docs page, request log lines."""
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send credentials (with --allowed-origins)")
    group.add_argument("--allowed-methods", type=json.loads, default=["*"], metavar="JSON",
                       help='CORS: the methods allowed, a JSON list (default ["*"])')
    group.add_argument("--allowed-headers", type=json.loads, default=["*"], metavar="JSON",
                       help='CORS: the request headers allowed, a JSON list (default ["*"])')
    group.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                       help="HTTPS: CA certificates to verify client certificates against")
    group.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                       help="HTTPS: whether client certificates are needed (Python's ssl.CERT_*: 0 none, "
                            "1 optional, 2 required)")
    group.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="request log lines keep at most N characters (or token ids) of each prompt and output")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="request log lines carry the outputs' text too (with --log-prompts, the prompts')")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="serve no API docs page (/docs) and no OpenAPI schema")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info: the tokenizer's configuration and chat template")


# vLLM's on/off flags of the server.
_SWITCHES = (
    ("--disable-log-requests", "no log line per request"),
    ("--enable-log-requests", "a log line per request (newer vLLM's switch; corectl logs them unless disabled)"),
    ("--disable-log-stats", "accepted for vLLM scripts: corectl logs no periodic engine stats (they are in "
                            "/metrics and the dashboard)"),
    ("--enable-force-include-usage", "every stream ends with a usage chunk, as if it asked "
                                     "stream_options.include_usage"),
    ("--enable-prompt-tokens-details", "usage always gives prompt_tokens_details.cached_tokens (else only when "
                                       "some were cached)"),
    ("--return-tokens-as-token-ids", "logprobs name their tokens \"token_id:<id>\" (a request's "
                                     "return_tokens_as_token_ids decides for itself)"),
    ("--disable-frontend-multiprocessing", "vLLM's name for --engine-in-process: the engine runs in the server's "
                                           "process"),
    ("--disable-uvicorn-access-log", "accepted for vLLM scripts: uvicorn's access log is always off (each request "
                                     "has corectl's log line instead)"),
    ("--enable-request-id-headers", "accepted for vLLM scripts: responses always carry X-Request-Id"),
    ("--enable-server-load-tracking", "accepted for vLLM scripts: GET /load always reports the requests in flight"),
    ("--disable-cascade-attn", "accepted for vLLM scripts: corectl has no cascade attention"),
    ("--exclude-tools-when-tool-choice-none", "accepted for vLLM scripts: tool_choice 'none' always leaves the "
                                              "tools out of the prompt"),
    ("--trust-request-chat-template", "accepted for vLLM scripts: a request's chat_template always renders, in "
                                      "transformers' sandboxed Jinja environment"),
    ("--guided-decoding-disable-fallback", "accepted for vLLM scripts: the structured-outputs backend has no "
                                           "fallback to disable"),
)

# vLLM's switches for what corectl does not have: each refused with what to do instead.
_REFUSED_SWITCHES = {
    "--enable-expert-parallel": "expert parallelism is not built: MoE experts are split by tensor parallelism "
                                "(each rank holds a slice of every expert); drop the flag",
    "--enable-eplb": "expert load balancing needs expert parallelism, which is not built; drop the flag",
    "--disable-sliding-window": "sliding-window layers always attend within their window here; drop the flag",
    "--calculate-kv-scales": "FP8 KV caches use scales of 1.0 (no calibration); drop the flag",
    "--enable-prompt-embeds": "prompts are text or token ids here; embeddings as prompts are not taken",
}
# vLLM V0's scheduler flags, still in launch scripts: taken at the one value that means what corectl
# does, refused at any other.
_PINNED = {
    "--preemption-mode": (str, "recompute", "how preempted requests resume: recomputed"),
    "--num-scheduler-steps": (int, 1, "steps scheduled at a time: one (async scheduling overlaps them)"),
    "--num-lookahead-slots": (int, 0, "KV slots reserved ahead (speculation allocates its own)"),
    "--scheduler-delay-factor": (float, 0.0, "delay before scheduling a prompt"),
}


def _add_media_flags(group) -> None:
    media = MediaSettings()
    group.add_argument("--limit-mm-per-prompt", type=json.loads, default={"image": media.max_images},
                       metavar="JSON", help=f"most items per prompt by modality, vLLM's form (default "
                                            f"'{{\"image\": {media.max_images}}}')")
    group.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                       help="hosts (and their subdomains) image URLs may name; none: http(s) image URLs are "
                            "refused (data: URLs always work)")
    group.add_argument("--allow-any-media-domain", action="store_true",
                       help="let image URLs name any host (public addresses only, unless the next flag)")
    group.add_argument("--allow-private-media-addresses", action="store_true",
                       help="let image URLs reach loopback, private and link-local addresses")
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let file:///... image URLs read files under DIR (and only there; trusted clients only)")
    group.add_argument("--media-fetch-timeout", type=float, default=media.fetch_timeout, metavar="SECONDS",
                       help="longest fetch of one image URL, redirects included")
    group.add_argument("--max-image-bytes", type=int, default=media.max_bytes, metavar="N",
                       help="largest image file fetched or sent as a data URL")
    group.add_argument("--max-image-pixels", type=int, default=media.max_pixels, metavar="N",
                       help="largest image (width x height), checked from its header before decoding")


def _media_settings(args: argparse.Namespace) -> MediaSettings:
    limits = args.limit_mm_per_prompt
    if not isinstance(limits, dict) or set(limits) - {"image"} or not all(
            isinstance(n, int) and n >= 0 for n in limits.values()):
        raise ConfigError("limit_mm_per_prompt", f"must be a JSON object like '{{\"image\": 4}}' (images are the "
                          f"only modality), got {limits!r}")
    for name in ("media_fetch_timeout", "max_image_bytes", "max_image_pixels"):
        if getattr(args, name) <= 0:
            raise ConfigError(name, f"must be positive, got {getattr(args, name)}")
    local = args.allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise ConfigError("allowed_local_media_path", f"{local!r} is not a directory")
    return MediaSettings(max_images=limits.get("image", MediaSettings.max_images),
                         allowed_domains=tuple(d.lower().lstrip(".") for d in args.allowed_media_domains),
                         allow_any_domain=args.allow_any_media_domain,
                         allow_private=args.allow_private_media_addresses, max_bytes=args.max_image_bytes,
                         max_pixels=args.max_image_pixels, fetch_timeout=args.media_fetch_timeout,
                         local_media_path=None if local is None else str(Path(local).resolve()))


def check_vllm_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The server settings these flags make; raises ConfigError naming the flag at fault."""
    if args.enable_chunked_prefill is False:
        raise ConfigError("enable_chunked_prefill", "chunked prefill is always on in corectl; drop "
                          "--no-enable-chunked-prefill")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ConfigError("max_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {args.max_logprobs}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("ssl_certfile", "HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(name, f"{path!r} is not a file")
    source = check_generation_config(args.generation_config)
    overrides = check_generation_overrides(args.override_generation_config)
    if args.root_path and not args.root_path.startswith("/"):
        raise ConfigError("root_path", f"must start with '/', got {args.root_path!r}")
    if not args.response_role.strip():
        raise ConfigError("response_role", "must not be empty")
    if args.enable_log_requests and args.disable_log_requests:
        raise ConfigError("enable_log_requests", "--enable-log-requests and --disable-log-requests contradict")
    for name in ("swap_space", "max_seq_len_to_capture", "max_log_len"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ConfigError(name, f"must not be negative, got {getattr(args, name)}")
    _check_unbuilt(args)
    return dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, root_path=args.root_path,
                uvicorn_log_level=args.uvicorn_log_level, force_include_usage=args.enable_force_include_usage,
                prompt_tokens_details=args.enable_prompt_tokens_details, response_role=args.response_role,
                chat_template_content_format=args.chat_template_content_format,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                log_requests=not args.disable_log_requests, metrics_prefix=args.metrics_prefix,
                max_logprobs=args.max_logprobs, generation_config=source, generation_overrides=overrides,
                media=_media_settings(args), **_http_settings(args))


def _check_unbuilt(args: argparse.Namespace) -> None:
    for flag, message in _REFUSED_SWITCHES.items():
        if getattr(args, _field(flag)):
            raise ConfigError(_field(flag), message)
    for flag, (_, value, _) in _PINNED.items():
        given = getattr(args, _field(flag))
        if given != value:
            raise ConfigError(_field(flag), f"only {value!r} here, got {given!r}")


def _field(flag: str) -> str:
    """The argparse destination (and option name) of a flag."""
    return flag.removeprefix("--").replace("-", "_")


def _http_settings(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("allowed_methods", "allowed_headers"):
        value = getattr(args, name)
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(name, f'must be a JSON list of strings, like ["*"], got {value!r}')
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ConfigError("ssl_cert_reqs", f"must be 0 (none), 1 (optional) or 2 (required), got {args.ssl_cert_reqs}")
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ConfigError("ssl_cert_reqs", "verifying client certificates needs the CAs that sign them: --ssl-ca-certs")
    if args.ssl_ca_certs is not None and args.ssl_certfile is None:
        raise ConfigError("ssl_ca_certs", "client certificates need HTTPS: give --ssl-keyfile and --ssl-certfile")
    return dict(cors_credentials=args.allow_credentials, cors_methods=args.allowed_methods,
                cors_headers=args.allowed_headers, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                max_log_len=args.max_log_len, log_outputs=args.enable_log_outputs,
                api_docs=not args.disable_fastapi_docs, tokenizer_info=args.enable_tokenizer_info_endpoint)


def allowed_origins(text: str) -> list[str]:
    """--allowed-origins: comma-separated origins, or vLLM's JSON list of them."""
    if text.lstrip().startswith("["):
        try:
            origins = json.loads(text)
        except ValueError:
            origins = None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ConfigError("allowed_origins", f"must be a JSON list of origins, got {text!r}")
        return [o.strip() for o in origins if o.strip()]
    return [o.strip() for o in text.split(",") if o.strip()]


def api_keys_from_env() -> list[str]:
    """The API key from the environment when no --api-key is given (CORECTL_API_KEY, then vLLM's)."""
    return next(([os.environ[name]] for name in API_KEY_ENV if os.environ.get(name)), [])


def expand_config_file(argv: list[str]) -> list[str]:
    """`serve ... --config FILE ...` with FILE's flags put right after `serve`, so the command line's
    own flags, parsed later, win."""
    if "serve" not in argv:
        return argv
    at = argv.index("serve")
    rest = argv[at + 1:]
    path = _config_path(rest)
    if path is None:
        return argv
    return argv[:at + 1] + _flags_from_yaml(path) + rest


def _config_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--config":
            if i + 1 >= len(args):
                raise ConfigError("config", "--config needs a YAML file")
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _flags_from_yaml(path: str) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path!r} is not valid YAML: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path!r} must hold a mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
