"""`corectl bench serve`: load an OpenAI-compatible server (ours or any other) and report latencies.

Prompts are random token ids decoded to text of the requested token length (vLLM's random dataset),
or with `--prompt-token-ids` the random token ids themselves (no tokenizer needed: for servers whose
model has none, such as a shape preset), sent as streamed requests with `stream_options.include_usage`
so output tokens are counted by the server; arrivals are all at once (`--request-rate inf`) or
Poisson, optionally capped by `--max-concurrency`.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

import anyio
import httpx

from .bench_report import RequestResult, format_report, save_result, summarize

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def register(sub) -> None:
    p = sub.add_parser("serve", help="online benchmark of an OpenAI-compatible server",
                       description="Send streamed requests to a running server and report TTFT, TPOT, ITL, E2EL.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, without /v1")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    p.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory used to build prompts (default: the default model's)")
    p.add_argument("--prompt-token-ids", action="store_true",
                   help="send prompts as token-id lists (completions only); needed when the server's model "
                        "has no tokenizer, and needs no tokenizer here")
    p.add_argument("--vocab-size", type=int, default=256,
                   help="with --prompt-token-ids: ids are drawn from [0, N) (default 256, within any vocabulary)")
    p.add_argument("--dataset", choices=["random"], default="random")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos so every request runs to length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="99", help="comma-separated percentiles to report (default: 99)")
    p.add_argument("--save-result", default=None, metavar="FILE", help="write the results as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from corectl.errors import ConfigError

    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ConfigError(name, f"must be at least 1, got {getattr(args, name)}")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ConfigError("range_ratio", f"must be in [0, 1), got {args.range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("max_concurrency", f"must be at least 1, got {args.max_concurrency}")
    if args.prompt_token_ids and args.endpoint != "/v1/completions":
        raise ConfigError("endpoint", "--prompt-token-ids needs /v1/completions: chat messages are text")
    if args.vocab_size < 1:
        raise ConfigError("vocab_size", f"must be at least 1, got {args.vocab_size}")
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    if args.prompt_token_ids:
        requests = random_token_id_requests(args)
    else:
        requests = random_requests(_load_tokenizer(args.tokenizer), args)
    results, duration = anyio.run(_benchmark, args, requests)
    summary = summarize(results, duration, percentiles)
    print(format_report(summary, percentiles))
    if args.save_result:
        config = {"base_url": args.base_url, "endpoint": args.endpoint, "model": args.model,
                  "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                  "range_ratio": args.range_ratio, "request_rate": str(args.request_rate),
                  "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "seed": args.seed,
                  "prompt_token_ids": args.prompt_token_ids}
        save_result(args.save_result, summary, config, results)
    return 0 if summary["completed"] else 1


def _load_tokenizer(path: str | None):
    from corectl.config import EngineConfig
    from corectl.loaders import resolve_model_source
    from corectl.tokenizer import Tokenizer

    return Tokenizer.from_dir(path or resolve_model_source(EngineConfig()).tokenizer_dir)


def _length(rng: random.Random, base: int, ratio: float) -> int:
    return rng.randint(max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio))))


def random_token_id_requests(args) -> list[tuple[list[int], int, int]]:
    """(prompt token ids, prompt tokens, output tokens) per request, ids uniform in [0, vocab_size) (seeded)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        target = _length(rng, args.input_len, args.range_ratio)
        output_len = _length(rng, args.output_len, args.range_ratio)
        out.append(([rng.randrange(args.vocab_size) for _ in range(target)], target, output_len))
    return out


def random_requests(tokenizer, args) -> list[tuple[str, int, int]]:
    """(prompt text, prompt tokens, output tokens) per request, from random token ids (seeded)."""
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(tokenizer.vocab_size) if t not in special]
    out = []
    for _ in range(args.num_prompts):
        target = _length(rng, args.input_len, args.range_ratio)
        output_len = _length(rng, args.output_len, args.range_ratio)
        ids = [rng.choice(vocab) for _ in range(target)]
        # Decoded text re-encodes to a slightly different length: pad or cut until it matches.
        for _ in range(10):
            text = tokenizer.decode(ids)
            actual = tokenizer.encode(text, add_special_tokens=False)
            if len(actual) == target:
                break
            ids = actual[:target] + [rng.choice(vocab) for _ in range(target - len(actual))]
        out.append((text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    return out


async def _benchmark(args, requests) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(6 * 3600.0, connect=30.0)) as client:
        model = args.model or await _first_model(client)
        rng = random.Random(args.seed)
        gate = anyio.Semaphore(limit)
        results = [RequestResult(prompt_len=n) for _, n, _ in requests]
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, (prompt, _, output_len) in enumerate(requests):
                body = _body(args, model, prompt, output_len)
                tg.start_soon(_send_gated, client, args.endpoint, body, results[i], gate)
                if math.isfinite(args.request_rate) and i + 1 < len(requests):
                    await anyio.sleep(rng.expovariate(args.request_rate))
        return results, time.perf_counter() - start


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _body(args, model: str, prompt: str | list[int], output_len: int) -> dict:
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.prompt_token_ids:
        # A model without a tokenizer streams no text: the chunks' token ids show each token's arrival.
        body["return_token_ids"] = True
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _send_gated(client, endpoint, body, result: RequestResult, gate: anyio.Semaphore) -> None:
    async with gate:
        await send_request(client, endpoint, body, result)


async def send_request(client: httpx.AsyncClient, endpoint: str, body: dict, result: RequestResult) -> None:
    """Send one streamed request, timing it the way vLLM's benchmark does."""
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"].get("message"))
                    return
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if _chunk_has_output(data):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "the response carried no text or token ids"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


def _chunk_has_output(data: dict) -> bool:
    """Whether a chunk carries generated text, or token ids (vLLM's return_token_ids)."""
    choices = data.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if "delta" in choice:
        return bool(choice["delta"].get("content"))
    return bool(choice.get("text") or choice.get("token_ids"))
