"""`corectl proxy`: one OpenAI endpoint in front of prefill and decode instances.

    corectl serve MODEL --port 8100 \
        --kv-transfer-config '{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}'
    corectl serve MODEL --port 8200 \
        --kv-transfer-config '{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_consumer"}'
    corectl proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""
from __future__ import annotations

import argparse
import logging
from urllib.parse import urlparse

from corectl.errors import ConfigError


def register(sub) -> None:
    parser = sub.add_parser("proxy", help="serve one OpenAI endpoint over prefill and decode instances "
                                          "(disaggregated prefill/decode)",
                            description="Send each request's prompt to a prefill instance, then to a decode "
                                        "instance that continues from the transferred KV blocks.")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill instances (corectl serve --kv-transfer-config ... kv_producer), taken in turn")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode instances (kv_consumer), taken in turn")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="seconds an instance may take to answer (default: 600)")
    parser.add_argument("--max-prefill-queue", type=int, default=None, metavar="N",
                        help="conditional disaggregation: a prompt arriving while every prefill instance has N "
                             "prompts in flight goes to a decode instance whole, which computes it "
                             "(default: every prompt waits for a prefill instance)")
    parser.add_argument("--max-local-prefills", type=int, default=None, metavar="M",
                        help="with --max-prefill-queue: at most M prompts computed by decode instances at once "
                             "(until their first token); past both bounds a prompt queues at a prefill instance "
                             "(default: no bound)")
    parser.set_defaults(handler=run)


def _check_urls(option: str, urls: list[str]) -> None:
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(option, f"{url!r} is not an http(s) URL such as http://127.0.0.1:8100")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..proxy.app import create_proxy_app

    _check_urls("prefill", args.prefill)
    _check_urls("decode", args.decode)
    if not args.timeout > 0:
        raise ConfigError("timeout", f"must be a positive number of seconds, got {args.timeout}")
    if args.max_prefill_queue is not None and args.max_prefill_queue < 1:
        raise ConfigError("max_prefill_queue", f"must be at least 1, got {args.max_prefill_queue}")
    if args.max_local_prefills is not None:
        if args.max_prefill_queue is None:
            raise ConfigError("max_local_prefills", "bounds the prompts that --max-prefill-queue sends to decode "
                                                    "instances; give --max-prefill-queue too")
        if args.max_local_prefills < 1:
            raise ConfigError("max_local_prefills", f"must be at least 1, got {args.max_local_prefills}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_proxy_app(args.prefill, args.decode, args.timeout, args.max_prefill_queue,
                                 args.max_local_prefills),
                host=args.host, port=args.port,
                log_config=None, access_log=False)
    return 0
