"""`corectl run-batch -i in.jsonl -o out.jsonl`: OpenAI's batch file format, as `vllm run-batch`.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | ..., "body"}`;
each output line `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.
The lines run through the HTTP server's own application (routes, validation, errors) served in this
process over ASGI, with the engine in this process too, so a line behaves exactly as the same
request sent to `corectl serve`. Lines run concurrently; results are appended as they finish, so a
run that stops can be started again on the same output file and skips the custom_ids already there.
A bad line (not JSON, another method or URL, a 4xx) gets its error line; the batch goes on.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from pathlib import Path

import anyio
import httpx
from corectl import envs
from corectl.errors import ConfigError

from ..http.logs import configure_logging
from .engine_args import add_engine_args, config_from_args

logger = logging.getLogger("corectl.server")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Lines in flight at once: enough to fill the engine's batch, few enough to keep memory flat.
_CONCURRENCY_PER_SEQ = 2


def register(sub) -> None:
    parser = sub.add_parser("run-batch", help="run an OpenAI batch file (JSON lines) through the engine",
                            description="Run an OpenAI batch file: each line a request, each result a line.")
    parser.add_argument("-i", "--input-file", required=True, metavar="PATH_OR_URL",
                        help="the batch: a local JSONL file or an http(s) URL")
    parser.add_argument("-o", "--output-file", required=True, metavar="PATH",
                        help="where results go, one line each; lines whose custom_id is already there are skipped")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model id(s) the lines' `model` may name (default: as `serve`)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser, model_positional=True)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..http.state import ServeSettings, default_served_name

    configure_logging("auto", envs.log_level())
    config = config_from_args(args)
    lines = read_input(args.input_file)
    output = Path(args.output_file)
    done = finished_ids(output)
    settings = ServeSettings(engine=config, served_model_names=args.served_model_name or [default_served_name(config)],
                             engine_in_process=True)
    todo = [line for line in lines if _custom_id(line) not in done]
    if len(todo) < len(lines):
        logger.info("%d of %d lines already in %s: skipped", len(lines) - len(todo), len(lines), output)
    counts = anyio.run(_run_lines, settings, todo, output, not args.no_progress)
    logger.info("batch done: %d succeeded, %d failed, written to %s", counts[0], counts[1], output)
    return 0


def read_input(source: str) -> list[str]:
    """The batch's non-blank lines, from a file or an http(s) URL."""
    if source.startswith(("http://", "https://")):
        try:
            response = httpx.get(source, timeout=60, follow_redirects=True)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ConfigError("input_file", f"cannot fetch {source}: {exc}") from None
        text = response.text
    else:
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ConfigError("input_file", f"cannot read {source}: {exc.strerror}") from None
    return [line for line in text.splitlines() if line.strip()]


def finished_ids(output: Path) -> set[str]:
    """The custom_ids an earlier run already wrote (a torn last line is ignored, and rerun)."""
    if not output.exists():
        return set()
    ids = set()
    for line in output.read_text().splitlines():
        try:
            custom_id = json.loads(line).get("custom_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(custom_id, str):
            ids.add(custom_id)
    return ids


def _custom_id(line: str) -> str | None:
    try:
        custom_id = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) else None


async def _run_lines(settings, lines: list[str], output: Path, progress: bool) -> tuple[int, int]:
    from tqdm import tqdm

    from ..http.app import create_app
    from ..http.state import ServerState

    app = create_app(ServerState(settings))
    counts = [0, 0]
    limit = anyio.Semaphore(max(1, settings.engine.max_num_seqs * _CONCURRENCY_PER_SEQ))
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a") as sink, tqdm(total=len(lines), desc="run-batch", unit="req", disable=not progress,
                                         file=sys.stderr) as bar:
        async with app.lifespan(), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                     base_url="http://run-batch", timeout=None) as client:

            async def one(line: str) -> None:
                async with limit:
                    result = await run_line(client, line)
                ok = result["error"] is None
                counts[0 if ok else 1] += 1
                sink.write(json.dumps(result) + "\n")
                sink.flush()
                bar.update()

            async with anyio.create_task_group() as tg:
                for line in lines:
                    tg.start_soon(one, line)
    return counts[0], counts[1]


async def run_line(client: httpx.AsyncClient, line: str) -> dict:
    """One input line's output line."""
    try:
        request = json.loads(line)
    except ValueError as exc:
        return _error_line(None, f"the line is not JSON: {exc}")
    if not isinstance(request, dict):
        return _error_line(None, "the line must be a JSON object with custom_id, method, url and body")
    custom_id = request.get("custom_id")
    problem = _check_request(request)
    if problem is not None:
        return _error_line(custom_id, problem)
    response = await client.post(request["url"], json=request["body"])
    body = response.json()
    error = None if response.is_success else body.get("error", body)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": response.status_code, "request_id": response.headers.get("x-request-id"),
                         "body": body},
            "error": error}


def _check_request(request: dict) -> str | None:
    if not isinstance(request.get("custom_id"), str):
        return "custom_id must be a string"
    if request.get("method", "POST") != "POST":
        return f"method must be POST, not {request.get('method')!r}"
    if request.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}, not {request.get('url')!r}"
    body = request.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object (the request's body)"
    if body.get("stream"):
        return "stream is not available in a batch: each line's result is written whole"
    return None


def _error_line(custom_id, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": None, "body": None},
            "error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_request_error"}}
