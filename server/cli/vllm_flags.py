"""The `vllm serve` flags launch scripts pass, taken by `corectl serve` unchanged.

Each is checked here, before the engine starts: a bad value is one line and exit status 2.
`--config FILE` (YAML, as vLLM's) is expanded into flags before parsing, so flags given on the
command line override it.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from corectl.errors import ConfigError
from corectl.generation_config import check_generation_config
from corectl.sampling_params import MAX_LOGPROBS

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
    group.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                       help=f"most logprobs a request may ask for per token (at most {MAX_LOGPROBS})")
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    group.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix a proxy serves this server under (ASGI root_path)")
    group.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    group.add_argument("--metrics-prefix", default="vllm:", choices=("vllm:", "corectl:"),
                       help="prefix of the /metrics series (default vllm:, vLLM's names)")


def check_vllm_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The server settings these flags make; raises ConfigError naming the flag at fault."""
    if args.enable_chunked_prefill is False:
        raise ConfigError("enable_chunked_prefill", "chunked prefill is always on in corectl; drop "
                          "--no-enable-chunked-prefill")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ConfigError("max_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {args.max_logprobs}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("ssl_certfile", "HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for name in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(name, f"{path!r} is not a file")
    source = check_generation_config(args.generation_config)
    if args.root_path and not args.root_path.startswith("/"):
        raise ConfigError("root_path", f"must start with '/', got {args.root_path!r}")
    return dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, root_path=args.root_path,
                log_requests=not args.disable_log_requests, metrics_prefix=args.metrics_prefix,
                max_logprobs=args.max_logprobs, generation_config=source)


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
            import json

            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
