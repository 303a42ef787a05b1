"""`corectl bench serve`: load an OpenAI-compatible server (ours or any other) and report latencies.

Prompts are random token ids decoded to text of the requested token length (vLLM's random dataset),
or with `--prompt-token-ids` the random token ids themselves (no tokenizer needed: for servers whose
model has none, such as a shape preset), sent as streamed requests with `stream_options.include_usage`
so output tokens are counted by the server; arrivals are all at once (`--request-rate inf`) or
Poisson, optionally capped by `--max-concurrency`.

The load generator must not be the bottleneck: connections are pooled to the concurrency, chunks
are split by hand and decoded by msgspec into the few fields that are timed, `--num-clients` spreads
the requests over several processes, and the report gives each client's CPU share.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor

import anyio
import httpx
import msgspec

from .report import RequestResult, format_report, save_result, summarize

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# --structured-output json: records of bounded fields in an array of any length.
JSON_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 24},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


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
    p.add_argument("--dataset", choices=["random", "prefix_repetition"], default="random",
                   help="prefix_repetition (vLLM's; with --prompt-token-ids): each prompt is one of --num-prefixes "
                        "shared prefixes of --prefix-len tokens, in turn, then --input-len tokens of its own")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix_repetition: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=8, help="prefix_repetition: shared prefixes")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--num-clients", type=int, default=1,
                   help="client processes sharing the requests, concurrency and rate (default 1); add some when "
                        "the report says a client was busy nearly all the time")
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos so every request runs to length")
    p.add_argument("--structured-output", choices=["none", "json"], default="none",
                   help="json: every request sends a response_format JSON schema (a list of records without a "
                        "length bound, so a request usually runs to --output-len), to measure constrained "
                        "decoding against the same run without it (default: none)")
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
    if args.dataset == "prefix_repetition" and not (args.prompt_token_ids and args.prefix_len > 0
                                                    and args.num_prefixes > 0):
        raise ConfigError("dataset", "prefix_repetition needs --prompt-token-ids and positive --prefix-len and "
                                     "--num-prefixes")
    if args.prompt_token_ids and args.endpoint != "/v1/completions":
        raise ConfigError("endpoint", "--prompt-token-ids needs /v1/completions: chat messages are text")
    if args.vocab_size < 1:
        raise ConfigError("vocab_size", f"must be at least 1, got {args.vocab_size}")
    if not 1 <= args.num_clients <= (args.max_concurrency or args.num_prompts):
        raise ConfigError("num_clients", f"must be from 1 to the concurrency (or prompts), got {args.num_clients}")
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    if args.prompt_token_ids:
        requests = random_token_id_requests(args)
    else:
        requests = random_requests(_load_tokenizer(args.tokenizer), args)
    results, duration, client_cpu = _run_clients(args, requests)
    summary = summarize(results, duration, percentiles, client_cpu)
    print(format_report(summary, percentiles))
    if args.save_result:
        config = {"base_url": args.base_url, "endpoint": args.endpoint, "model": args.model,
                  "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                  "range_ratio": args.range_ratio, "request_rate": str(args.request_rate),
                  "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "seed": args.seed,
                  "prompt_token_ids": args.prompt_token_ids, "num_clients": args.num_clients,
                  "structured_output": args.structured_output}
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
    prefixes = [[rng.randrange(args.vocab_size) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)] if args.dataset == "prefix_repetition" else [[]]
    out = []
    for index in range(args.num_prompts):
        target = _length(rng, args.input_len, args.range_ratio)
        output_len = _length(rng, args.output_len, args.range_ratio)
        prefix = prefixes[index % len(prefixes)]
        out.append((prefix + [rng.randrange(args.vocab_size) for _ in range(target)], len(prefix) + target,
                    output_len))
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


def _run_clients(args, requests) -> tuple[list[RequestResult], float, list[float]]:
    """Every request's result in order, the wall time from the first start to the last end, and each
    client's CPU share. Client k sends requests k, k+N, ... at 1/N of the rate and concurrency."""
    n = args.num_clients
    limit = args.max_concurrency or len(requests)
    model = args.model or _first_model(args)
    # Clients start together once every process is up (spawning one takes about a second).
    start_at = time.time() + (2.0 if n > 1 else 0.0)
    jobs = [(args, model, k, requests[k::n], limit // n + (k < limit % n), args.request_rate / n, start_at)
            for k in range(n)]
    if n == 1:
        outcomes = [_client(*jobs[0])]
    else:
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = list(pool.map(_client, *zip(*jobs)))
    results: list[RequestResult] = [None] * len(requests)  # type: ignore[list-item]
    for k, (share, _, _, _) in enumerate(outcomes):
        results[k::n] = share
    duration = max(end for _, _, end, _ in outcomes) - min(begin for _, begin, _, _ in outcomes)
    return results, duration, [cpu for *_, cpu in outcomes]


def _client(args, model: str, index: int, requests, limit: int, rate: float, start_at: float):
    """Client `index` (a process, or the caller itself): (results, start, end, CPU seconds per wall second)."""
    return anyio.run(_benchmark, args, model, index, requests, limit, rate, start_at)


async def _benchmark(args, model: str, index: int, requests, limit: int, rate: float, start_at: float):
    # The pool holds a connection per request in flight, so no request waits for one.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(6 * 3600.0, connect=300.0, pool=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=_headers(args), limits=limits,
                                 timeout=timeout) as client:
        rng = random.Random(args.seed + index)  # independent arrivals: their sum is Poisson at the full rate
        gate = anyio.Semaphore(limit)
        results = [RequestResult(prompt_len=n) for _, n, _ in requests]
        await anyio.sleep(max(0.0, start_at - time.time()))
        start, cpu = time.time(), time.process_time()
        async with anyio.create_task_group() as tg:
            for i, (prompt, _, output_len) in enumerate(requests):
                body = _body(args, model, prompt, output_len)
                tg.start_soon(_send_gated, client, args.endpoint, body, results[i], gate)
                if math.isfinite(rate) and i + 1 < len(requests):
                    await anyio.sleep(rng.expovariate(rate))
        end = time.time()
        return results, start, end, (time.process_time() - cpu) / max(end - start, 1e-9)


def _headers(args) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _first_model(args) -> str:
    response = httpx.get(args.base_url + "/v1/models", headers=_headers(args), timeout=30.0)
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
    if args.structured_output == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "records", "schema": JSON_SCHEMA}}
    return body


async def _send_gated(client, endpoint, body, result: RequestResult, gate: anyio.Semaphore) -> None:
    async with gate:
        await send_request(client, endpoint, body, result)


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Error(msgspec.Struct):
    message: str | None = None


class _Chunk(msgspec.Struct):
    """The fields of a stream chunk that the benchmark reads; msgspec skips the rest unparsed."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | None = None

    def has_output(self) -> bool:
        """Whether the chunk carries generated text, or token ids (vLLM's return_token_ids)."""
        if not self.choices:
            return False
        choice = self.choices[0]
        if choice.delta is not None:
            return bool(choice.delta.content)
        return bool(choice.text or choice.token_ids)


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def send_request(client: httpx.AsyncClient, endpoint: str, body: dict, result: RequestResult) -> None:
    """Send one streamed request, timing it the way vLLM's benchmark does. Any failure is recorded in
    `result.error` with its reason; none escapes to stop the other requests."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return
            chunks = await _read_stream(response, result, start)
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = not result.error and chunks > 0
        if not result.error and not chunks:
            result.error = "the response carried no text or token ids"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> int:
    """Read server-sent events, timing each chunk with output; returns how many there were."""
    chunks, last, pending = 0, start, b""
    async for data in response.aiter_bytes():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            chunk = _decode_chunk(payload)
            if chunk.error is not None:
                result.error = f"error event: {chunk.error.message}"
                return chunks
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
            if chunk.has_output():
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
    return chunks
