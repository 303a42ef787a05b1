"""The live ops dashboard: `GET /dashboard`, a page shipped in the package (no build step, no CDN),
fed by `GET /dashboard/stats` and able to abort a request through `POST /dashboard/requests/{id}/abort`.

Authentication: a browser cannot attach a bearer token to a page load, so the page itself (static
files, no data) is open; everything it shows or does goes through the two JSON routes, which sit
behind the API key. The page asks for the key when a route answers 401, keeps it in the tab's
`sessionStorage` (gone when the tab closes) and sends it as `Authorization: Bearer`.

Cost: the engine publishes its snapshot (`EngineSnapshot`) at most a few times a second; this
module only reshapes what the API process already holds (`EngineClient.stats`, `.snapshot`,
`.activity`, `.live_requests`) when the page asks, about once a second.
"""
from __future__ import annotations

import functools
import time
from importlib import resources

import msgspec
from corectl.engine.live import ActivitySummary
from corectl.engine.messages import SchedulerStats
from litestar import Controller, Request, Response, get, post

from .auth import require_api_key
from .errors import APIError
from .state import ServerState

MAX_ROWS = 100
_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# Everything the page loads comes from this server: a CDN or inline script would be refused.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:", "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff"}
# Fetch metadata: browsers mark requests that another site's page makes.
_FOREIGN_SITES = ("cross-site", "same-site")


class StepsView(msgspec.Struct):
    """The engine's last steps (oldest first) and their limits; `age_s`: since the snapshot."""

    num_steps: int
    num_seqs: list[int]
    num_tokens: list[int]
    token_budget: int
    max_num_seqs: int
    age_s: float


class BlockMapView(msgspec.Struct):
    """KV blocks: totals, and per cell of `blocks_per_cell` blocks the used and cached counts."""

    num_blocks: int
    block_size: int
    used: int
    cached: int
    free: int
    blocks_per_cell: int
    cell_used: list[int]
    cell_cached: list[int]


class RequestRow(msgspec.Struct):
    id: str
    state: str
    prompt_tokens: int
    output_tokens: int
    age_s: float
    ttft_s: float | None


class AdapterRow(msgspec.Struct):
    """A served LoRA adapter; `state`: "running" or "waiting" while engine requests use it, else
    "idle"; `requests`: the requests this API process admitted for it since it started."""

    name: str
    id: int
    path: str
    base_model: str
    state: str
    requests: int


class DashboardStats(msgspec.Struct):
    """Engine gauges and lifetime counters (as in `/metrics`), the last steps and the block map
    (null before the engine's first snapshot), rolling windows, the oldest live requests, and the
    served LoRA adapters (null when the server runs without --enable-lora)."""

    model: str
    uptime_s: float
    server_load: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    steps: StepsView | None
    kv_blocks: BlockMapView | None
    activity: ActivitySummary
    num_requests: int
    requests: list[RequestRow]
    adapters: list[AdapterRow] | None = None


class AbortResponse(msgspec.Struct):
    id: str
    aborted: bool


class DashboardController(Controller):
    path = "/dashboard"
    tags = ["Operations"]

    @get("/", include_in_schema=False)
    async def page(self) -> Response:
        return _static("index.html", "text/html")  # Litestar adds the charset

    @get("/static/{name:str}", include_in_schema=False)
    async def static(self, name: str) -> Response:
        if name not in _STATIC:
            raise APIError(404, f"no dashboard file {name!r}")
        return _static(name, _STATIC[name])

    @get("/stats", guards=[require_api_key])
    async def stats(self, server: ServerState) -> DashboardStats:
        return dashboard_stats(server, time.monotonic())

    @post("/requests/{request_id:str}/abort", status_code=200, guards=[require_api_key])
    async def abort(self, request_id: str, request: Request, server: ServerState) -> AbortResponse:
        """Abort a live request: its client gets a `request_aborted` error (status 499) and its KV
        blocks are freed at the engine's next step."""
        if request.headers.get("sec-fetch-site") in _FOREIGN_SITES:
            raise APIError(403, "the dashboard's actions cannot be sent from another site's page")
        error = APIError(499, f"request {request_id} was aborted by an operator (from /dashboard)",
                         code="request_aborted")
        if not await server.engine.abort(request_id, error):
            raise APIError(404, f"no live request has the id {request_id!r}", "request_id")
        return AbortResponse(request_id, True)


@functools.cache
def _read(name: str) -> bytes:
    return (resources.files(__package__) / "dashboard_static" / name).read_bytes()


def _static(name: str, media_type: str) -> Response:
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


def dashboard_stats(server: ServerState, now: float) -> DashboardStats:
    client = server.engine
    stats, snapshot = client.stats, client.snapshot
    steps = blocks = None
    if snapshot is not None:
        steps = StepsView(snapshot.num_steps, snapshot.step_num_seqs, snapshot.step_num_tokens,
                          snapshot.token_budget, snapshot.max_num_seqs, now - snapshot.timestamp)
        kv = snapshot.blocks
        blocks = BlockMapView(kv.num_blocks, client.info.block_size, kv.num_used, kv.num_cached, kv.num_free,
                              kv.blocks_per_cell, kv.cell_used, kv.cell_cached)
    rows = [
        RequestRow(r.request_id, r.state, r.num_prompt_tokens, r.num_output_tokens, now - r.arrival_time,
                   None if r.first_token_time is None else r.first_token_time - r.arrival_time)
        for r in client.live_requests(MAX_ROWS)
    ]
    return DashboardStats(
        model=server.model_name, uptime_s=time.time() - server.started_at, server_load=server.in_flight,
        num_running=stats.num_running, num_waiting=stats.num_waiting, kv_cache_usage=stats.kv_cache_usage,
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions, steps=steps, kv_blocks=blocks,
        activity=client.activity.summary(now), num_requests=client.num_live_requests, requests=rows,
        adapters=None if server.loras is None else _adapter_rows(server, stats),
    )


def _adapter_rows(server: ServerState, stats: SchedulerStats) -> list[AdapterRow]:
    running, waiting = set(stats.running_lora_adapters), set(stats.waiting_lora_adapters)
    counts = {} if server.metrics is None else server.metrics.lora_request_counts()
    return [AdapterRow(lora.lora_name, lora.lora_int_id, lora.lora_path, lora.base_model_name or server.model_name,
                       "running" if lora.lora_name in running else "waiting" if lora.lora_name in waiting else "idle",
                       counts.get(lora.lora_name, 0))
            for lora in server.loras.adapters()]
